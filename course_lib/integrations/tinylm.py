"""A tiny causal transformer language model whose attention function is a constructor argument.

Chapter 07 trains it twice from the same seed — once with the course's Triton kernel
(``course_lib.flash_attention``), once with PyTorch's ``scaled_dot_product_attention`` — and
checks that the two loss curves agree: the end-to-end test of the forward *and* backward kernels.

Everything is deterministic given the seed: the initial weights (drawn under
``torch.random.fork_rng``, so the global RNG is left alone), the batches (drawn from a
``torch.Generator``) and the model (no dropout). The data set is character-level on a short text
written for this course (:data:`TEXT`).

Shapes: ``B`` batch, ``T`` sequence length (tokens), ``C`` model width, ``H`` heads,
``d = C / H`` head dim, ``V`` vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.platform import runtime

__all__ = ["TEXT", "CharDataset", "TinyLMConfig", "TinyLM", "sdpa_attention",
           "flash_attention_causal", "ATTENTIONS", "train", "loss_tolerance",
           "RunSize", "CPU_RUN", "GPU_RUN", "run_size", "LOSS_ATOL_INTERPRETER", "LOSS_ATOL_GPU"]

TEXT = """\
Attention lets every token look at every other token. For each query we score all the keys,
turn the scores into weights with a softmax, and take the weighted average of the values.
The textbook version writes the whole table of scores to memory, reads it back for the
softmax, writes the weights, and reads them again to multiply by the values. On a GPU the
arithmetic is cheap and the trips to memory are not, so the table is the bottleneck.
FlashAttention never writes the table. It walks over the keys one tile at a time, keeps a
running maximum and a running sum for each query, and rescales what it has accumulated
whenever the maximum grows. The answer is exact, not an approximation. For the backward pass
it keeps only one number per query, the log of the softmax denominator, and rebuilds each
tile of weights when it needs it: a little more arithmetic, far less memory traffic.
"""

# Loss agreement between the two attention functions, same seed (see chapter 07).
# Interpreter (CPU): both sides compute in float32 with exact dot products, so per-step losses
# differ by rounding only (measured: max |Δ| = 5e-7 over 20 steps at CPU_RUN's model size).
# GPU: IEEE fp32 dots on both sides, but different summation orders across many more steps and
# a larger model; differences grow with training, so the bound is looser.
LOSS_ATOL_INTERPRETER = 1e-4
LOSS_ATOL_GPU = 2e-3


def loss_tolerance(on_gpu: bool) -> float:
    """The stated bound on |loss_flash − loss_sdpa| per step for this mode."""
    return LOSS_ATOL_GPU if on_gpu else LOSS_ATOL_INTERPRETER


class CharDataset:
    """Character-level tokens of ``text`` and random (input, next-token) windows from it."""

    def __init__(self, text: str = TEXT):
        if not isinstance(text, str) or len(set(text)) < 2:
            raise ValueError("text must be a string with at least two distinct characters")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([self.index[c] for c in text], dtype=torch.long)  # (len(text),)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator):
        """``(x, y)``, both ``(B, T)`` long tensors on the CPU; ``y`` is ``x`` shifted by one.

        Windows start at random positions and wrap around the end of the text, so any
        ``seq_len`` works (the GPU run's context is longer than the text).
        """
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        n = len(self.tokens)
        starts = torch.randint(0, n, (batch_size,), generator=generator)  # (B,)
        offsets = torch.arange(seq_len + 1)  # (T + 1,)
        windows = self.tokens[(starts[:, None] + offsets[None, :]) % n]  # (B, T + 1)
        return windows[:, :-1], windows[:, 1:]


@dataclass(frozen=True)
class TinyLMConfig:
    """Model size. ``seq_len`` is the context length (positions the model knows)."""

    vocab_size: int
    seq_len: int = 32
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 2
    mlp_ratio: int = 4  # width of the MLP's hidden layer, as in GPT-2

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class RunSize:
    """A model size (the :class:`TinyLMConfig` fields other than the vocabulary) and a run length."""

    model: dict
    steps: int
    batch_size: int


# The runs chapter 07 makes. Interpreter: each Triton program costs ~0.1 s for forward+backward
# (measured, B·H = 4 programs per kernel here), so ~0.4 s a step and a few seconds in all.
# GPU: GPT-2-like heads (d = 64) and a 1024-token context, still only seconds on an H100.
CPU_RUN = RunSize(model=dict(seq_len=32, d_model=32, n_heads=2, n_layers=2), steps=10, batch_size=2)
GPU_RUN = RunSize(model=dict(seq_len=1024, d_model=256, n_heads=4, n_layers=4), steps=50,
                  batch_size=8)


def run_size(on_gpu: bool) -> RunSize:
    """The run chapter 07 makes in this mode."""
    return GPU_RUN if on_gpu else CPU_RUN

# An attention function maps q, k, v, each (B, H, T, d), to o (B, H, T, d), causally.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q, k, v):
    """PyTorch's fused attention, causal: the baseline."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def flash_attention_causal(q, k, v):
    """The course's Triton kernel (forward and backward), causal."""
    # Imported on use, so importing tinylm defines no kernel (TinyLM() has already chosen GPU or
    # interpreter by then).
    from course_lib.kernels.api import flash_attention  # = course_lib.flash_attention

    return flash_attention(q, k, v, causal=True)


ATTENTIONS = {"flash": flash_attention_causal, "sdpa": sdpa_attention}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyLMConfig, attention: AttentionFn):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.attention = attention

    def forward(self, x):  # x: (B, T, C)
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)  # each (B, T, C)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)  # (B, H, T, d)
                   for z in (q, k, v))
        o = self.attention(q, k, v)  # (B, H, T, d)
        return self.proj(o.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: TinyLMConfig, attention: AttentionFn):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config, attention)
        self.ln2 = nn.LayerNorm(config.d_model)
        hidden = config.mlp_ratio * config.d_model
        self.mlp = nn.Sequential(nn.Linear(config.d_model, hidden), nn.GELU(),
                                 nn.Linear(hidden, config.d_model))

    def forward(self, x):  # (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A GPT-style character model: token + position embeddings, blocks, a linear head.

    Args:
        config: the sizes.
        attention: ``f(q, k, v) -> o`` on ``(B, H, T, d)`` tensors, causal.
        seed: the initial weights depend on this seed only (the global RNG is not touched).
    """

    def __init__(self, config: TinyLMConfig, attention: AttentionFn, seed: int = 0):
        super().__init__()
        if not callable(attention):
            raise TypeError(f"attention must be a function f(q, k, v) -> o, got {type(attention).__name__}")
        self.config = config
        # Choose GPU or Triton interpreter now, before anything (torch.optim, for one) imports
        # triton: Triton's own helpers (tl.cdiv, tl.sum, ...) are decorated at `import triton`,
        # so the interpreter switch only takes effect if it is set before that import.
        runtime.current()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
            self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.head = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, idx):  # idx: (B, T) token ids -> logits (B, T, V)
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"idx has {t} tokens but the model's context is {self.config.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx, targets):
        """Mean cross-entropy of the next-token predictions."""
        logits = self(idx)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(model: TinyLM, steps: int, seed: int = 0, batch_size: int = 4, lr: float = 3e-3,
          dataset: CharDataset | None = None) -> list[float]:
    """Train ``model`` in place with AdamW for ``steps`` steps; return the loss of each step.

    The batches depend only on ``seed`` (a private ``torch.Generator``), so two models built with
    the same seed and trained with the same seed see identical data and start from identical
    weights: any difference in their losses comes from their attention functions.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    dataset = dataset or CharDataset()
    if dataset.vocab_size != model.config.vocab_size:
        raise ValueError(f"the dataset has {dataset.vocab_size} symbols but the model's "
                         f"vocab_size is {model.config.vocab_size}")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        x, y = dataset.batch(batch_size, model.config.seq_len, generator)
        loss = model.loss(x.to(device), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
