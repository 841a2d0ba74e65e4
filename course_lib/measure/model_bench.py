"""Chapter 12's small Llama: built, trained and measured with any attention implementation.

A Hugging Face ``LlamaForCausalLM`` from a config (random weights, nothing downloaded), trained
character by character on text the course ships (:data:`course_lib.integrations.tinylm.TEXT`) and text Python
itself carries (the Zen of Python, ``this.s``, stored rot13-encoded); its training speed (tokens/s)
and peak memory measured per attention implementation and context length; and the recorded H100
results of that measurement (``course_lib/data/benchmarks/h100_model.json``, written by
``tools/bench_model.py``), read and plotted so that CPU mode shows them too.

Shapes: ``B`` batch, ``T`` context length (tokens), ``V`` vocabulary.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from course_lib.platform import runtime
from course_lib.integrations import tinylm
from course_lib.measure.bench import RECORDED_DIR

__all__ = ["training_text", "LlamaSize", "CPU_SIZE", "GPU_SIZE", "BENCH_SIZE", "llama_size",
           "llama_config", "build_llama", "compile_backend", "train", "generate_text",
           "measure_training", "measure_grid", "RECORDED_FILE", "IMPLS", "validate", "recorded", "status",
           "table", "plot", "size_dict"]


def training_text() -> str:
    """The course's text (:data:`tinylm.TEXT`) and the Zen of Python: about 1,800 characters
    that need no download (``this.s`` is the Zen, rot13-encoded; importing ``this`` prints it,
    so the import's output is swallowed)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return tinylm.TEXT + "\n" + codecs.decode(this.s, "rot13") + "\n"


@dataclass(frozen=True)
class LlamaSize:
    """A Llama's size and a training run's length. ``heads`` query heads share ``kv_heads`` K/V
    heads (GQA); ``head_dim`` must be a power of two for chapter 06's teaching kernel."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int  # T, tokens per sequence
    batch: int
    steps: int


# CPU mode: every attention call runs in Triton's interpreter, so the model is tiny and the run
# short (one 32-row tile per sequence and head; six steps — the loss visibly falls, and each step
# costs about a second of the interpreter). GPU: a small model for a few hundred steps.
CPU_SIZE = LlamaSize(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, context=32, batch=2,
                     steps=6)
GPU_SIZE = LlamaSize(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, context=256,
                     batch=16, steps=300)
# The speed and memory measurement (tools/bench_model.py): d = 64 heads, GQA 16/8, 16k tokens a step.
BENCH_SIZE = LlamaSize(layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=64, context=1024,
                       batch=16, steps=10)
BENCH_TOKENS_PER_STEP = 16_384
BENCH_VOCAB = 8192
MLP_RATIO = 2  # intermediate = MLP_RATIO · hidden (tiny models; Llama's own is ~2.7)


def llama_size(on_gpu: bool) -> LlamaSize:
    """The run chapter 12 makes in this mode."""
    return GPU_SIZE if on_gpu else CPU_SIZE


def llama_config(vocab_size: int, size: LlamaSize):
    """A ``transformers.LlamaConfig`` of ``size`` (no dropout, positions up to the context, no
    special tokens: generation stops only at the length asked for)."""
    from transformers import LlamaConfig

    if size.heads % size.kv_heads:
        raise ValueError(f"heads ({size.heads}) must be a multiple of kv_heads ({size.kv_heads})")
    return LlamaConfig(vocab_size=vocab_size, hidden_size=size.hidden,
                       intermediate_size=MLP_RATIO * size.hidden,
                       num_hidden_layers=size.layers, num_attention_heads=size.heads,
                       num_key_value_heads=size.kv_heads, head_dim=size.head_dim,
                       max_position_embeddings=size.context, attention_dropout=0.0,
                       bos_token_id=None, eos_token_id=None)  # characters only: no special tokens


def build_llama(config, attn_implementation: str, seed: int = 0, device=None):
    """``LlamaForCausalLM(config)`` with weights drawn from ``seed`` only (the global RNG is left
    alone), using ``attn_implementation`` ("sdpa", "eager", or a name registered with
    :func:`course_lib.integrations.hf.register`)."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.set_attn_implementation(attn_implementation)
    return model.to(device or runtime.current().device)


def compile_backend() -> str:
    """The ``torch.compile`` backend chapter 12 uses: Inductor on a GPU; ``aot_eager`` in CPU mode
    — the same graph capture, fake tensors and forward/backward graphs, without generating and
    compiling C++ for every graph (minutes on a small CPU)."""
    return "inductor" if runtime.current().on_gpu else "aot_eager"


def train(model, dataset: tinylm.CharDataset, size: LlamaSize, seed: int = 0, lr: float = 3e-3,
          compile: bool = True) -> list[float]:
    """Train ``model`` in place for ``size.steps`` AdamW steps on windows of ``dataset``; return
    each step's loss. With ``compile``, the model runs under ``torch.compile(fullgraph=True)``
    (:func:`compile_backend`): one graph, or an error. The batches depend on ``seed`` only."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    step = torch.compile(model, fullgraph=True, backend=compile_backend()) if compile else model
    model.train()
    losses = []
    for _ in range(size.steps):
        x, _ = dataset.batch(size.batch, size.context, generator)  # (B, T)
        x = x.to(device)
        loss = step(input_ids=x, labels=x).loss  # the model shifts the labels by one
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def generate_text(model, dataset: tinylm.CharDataset, prompt: str, new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` by ``model.generate`` (KV cache on), decoded. The prompt
    and the new tokens must fit the context the model was built for."""
    limit = model.config.max_position_embeddings
    if len(prompt) + new_tokens > limit:
        raise ValueError(f"prompt ({len(prompt)} characters) + new_tokens ({new_tokens}) exceed the "
                         f"model's context of {limit} positions")
    ids = torch.tensor([[dataset.index[c] for c in prompt]],
                       device=next(model.parameters()).device)  # (1, len(prompt))
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, use_cache=True,
                             pad_token_id=0)  # (1, len(prompt) + new_tokens)
    return dataset.decode(out[0].tolist())


def measure_training(model, context: int, batch: int, steps: int, warmup: int,
                     compile: bool) -> dict:
    """Tokens per second and peak memory of ``steps`` training steps (after ``warmup`` steps,
    which include compiling) on random token ids, on a CUDA GPU. Timed by the wall clock between
    two ``torch.cuda.synchronize()`` calls.

    Returns:
        ``{"tokens_per_s", "peak_mib", "step_ms"}``; raises ``torch.cuda.OutOfMemoryError`` when
        the step does not fit.
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"measure_training times GPU training steps; the model is on {device}")
    generator = torch.Generator(device=device).manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = torch.compile(model, fullgraph=True) if compile else model
    vocab = model.config.vocab_size

    def step():
        ids = torch.randint(0, vocab, (batch, context), device=device, generator=generator)
        loss = step_fn(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tokens_per_s": steps * batch * context / seconds,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
            "step_ms": 1e3 * seconds / steps}


def timer_note(steps: int, warmup: int) -> str:
    """How :func:`measure_training` times, in words (a recorded file's ``meta["timer"]`` says it too).

    Args:
        steps, warmup: as :func:`measure_training` takes them.

    Returns:
        e.g. ``"wall clock of 10 training steps between torch.cuda.synchronize() calls, after 3
        warm-up steps"``.
    """
    return (f"wall clock of {steps} training steps between torch.cuda.synchronize() calls, after "
            f"{warmup} warm-up steps")


def _out_of_memory(exc: BaseException) -> bool:
    """True for CUDA running out of memory, also when torch.compile wrapped the error."""
    while exc is not None:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def measure_grid(contexts, impls=None, size: LlamaSize = BENCH_SIZE,
                 tokens_per_step: int = BENCH_TOKENS_PER_STEP, steps: int = 10, warmup: int = 3,
                 dtype: torch.dtype = torch.bfloat16, log=print) -> list[dict]:
    """:func:`measure_training` for each implementation of :data:`IMPLS` (all by default) at each
    context length, a Llama of ``size`` in ``dtype`` on random tokens (``BENCH_VOCAB`` of them),
    ``tokens_per_step // T`` sequences a step. A cell that runs out of memory is a row with
    ``oom: True``.

    Logs the timer (:func:`timer_note`) first, then one line per row.

    Returns:
        rows ``{"impl", "context", "batch", "oom", "tokens_per_s", "peak_mib", "step_ms"}``.
    """
    import gc

    impls = tuple(IMPLS) if impls is None else tuple(impls)
    unknown = [impl for impl in impls if impl not in IMPLS]
    if unknown:
        raise ValueError(f"impls must be among {', '.join(IMPLS)}, got {unknown}")
    if any(IMPLS[impl][0] == "course" for impl in impls):
        from course_lib.integrations import hf

        hf.register()  # "course": the library's kernels
    log(f"timed by the {timer_note(steps, warmup)}")
    rows = []
    for context in contexts:
        batch = max(1, tokens_per_step // context)
        config = llama_config(BENCH_VOCAB, size)
        config.max_position_embeddings = context
        for impl in impls:
            attn, compiled, label = IMPLS[impl]
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            row = {"impl": impl, "context": context, "batch": batch, "oom": False}
            model = None
            try:
                model = build_llama(config, attn, device="cuda").to(dtype)
                row.update(measure_training(model, context, batch, steps, warmup, compiled))
            except Exception as exc:  # noqa: BLE001 - out of memory is a result; the rest is not
                if not _out_of_memory(exc):
                    raise
                row["oom"] = True
            finally:
                del model
            rows.append(row)
            log(f"T={context:>6} B={batch:>3} {label:<48} " + (
                "out of memory" if row["oom"] else
                f"{row['tokens_per_s']:>10,.0f} tokens/s {row['peak_mib'] / 1024:6.1f} GiB"))
    return rows


# ----------------------------------------------------------------------------------------------
# Recorded results (tools/bench_model.py on an H100)

RECORDED_FILE = RECORDED_DIR / "h100_model.json"
# impl -> (attn_implementation, compiled, label)
IMPLS = {
    "course_compiled": ("course", True, "course kernels, torch.compile"),
    "course": ("course", False, "course kernels, eager"),
    "sdpa_compiled": ("sdpa", True, "SDPA, torch.compile"),
    "sdpa": ("sdpa", False, "SDPA, eager"),
    "eager": ("eager", False, "materialised attention (transformers' 'eager')"),
}
META_KEYS = ("gpu", "torch", "triton", "transformers", "date", "model", "timer")
ROW_KEYS = ("impl", "context", "batch", "oom")
NOT_RECORDED = ("No H100 results are recorded yet for chapter 12 "
                "(course_lib/data/benchmarks/h100_model.json is absent): the table and the plot "
                "appear once tools/bench_model.py has been run on a GPU and its file committed.")


def validate(data) -> dict:
    """``data`` when it has :func:`tools/bench_model.py`'s format; else ValueError naming what is
    wrong. ``{"meta": {gpu, torch, triton, transformers, date, model, timer, ...}, "rows":
    [{impl, context, batch, oom, tokens_per_s, peak_mib, ...}]}`` (a row that ran out of memory
    has ``oom: true`` and no numbers)."""
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict):
        raise ValueError("data must be a dict with a 'meta' dict (the provenance header)")
    missing = [key for key in META_KEYS if key not in data["meta"]]
    if missing:
        raise ValueError(f"data['meta'] lacks {', '.join(missing)}")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError("data['rows'] must be a non-empty list of measurements")
    for i, row in enumerate(rows):
        lacking = [key for key in ROW_KEYS if key not in row]
        if lacking:
            raise ValueError(f"data['rows'][{i}] lacks {', '.join(lacking)}")
        if row["impl"] not in IMPLS:
            raise ValueError(f"data['rows'][{i}]['impl'] must be one of {', '.join(IMPLS)}, got "
                             f"{row['impl']!r}")
        if not row["oom"] and not (row.get("tokens_per_s", 0) > 0 and row.get("peak_mib", 0) > 0):
            raise ValueError(f"data['rows'][{i}] must have positive tokens_per_s and peak_mib "
                             f"(or oom: true)")
    return data


def recorded(path: Path | str = RECORDED_FILE) -> dict | None:
    """The recorded results, validated; None when the file is absent (a malformed one raises)."""
    path = Path(path)
    if not path.exists():
        return None
    return validate(json.loads(path.read_text()))


def status(path: Path | str = RECORDED_FILE) -> str:
    """One line: where the recorded results come from, or that none are recorded yet."""
    data = recorded(path)
    if data is None:
        return NOT_RECORDED
    m = data["meta"]
    return (f"recorded on {m['gpu']}, torch {m['torch']}, triton {m['triton']}, transformers "
            f"{m['transformers']}, {m['date']}; {m['model']}; {m['timer']}")


def table(data: dict) -> str:
    """Tokens/s and peak memory per implementation (rows) and context length (columns)."""
    contexts = sorted({row["context"] for row in data["rows"]})
    cells = {(row["impl"], row["context"]): row for row in data["rows"]}
    head = f"{'':<48}" + "".join(f"{f'T = {t:,}':>22}" for t in contexts)
    lines = [head, f"{'':<48}" + "".join(f"{'tokens/s   peak GiB':>22}" for _ in contexts)]
    for impl, (_, _, label) in IMPLS.items():
        if not any(key[0] == impl for key in cells):
            continue
        parts = []
        for t in contexts:
            row = cells.get((impl, t))
            parts.append(f"{'—':>22}" if row is None else f"{'out of memory':>22}" if row["oom"]
                         else f"{row['tokens_per_s']:>12,.0f}{row['peak_mib'] / 1024:>10.1f}")
        lines.append(f"{label:<48}" + "".join(parts))
    return "\n".join(lines)


def plot(data: dict):
    """Two panels against the context length: tokens/s and peak memory, one line per
    implementation (an × where it ran out of memory). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 3.6))
    for impl, (_, _, label) in IMPLS.items():
        rows = sorted((r for r in data["rows"] if r["impl"] == impl), key=lambda r: r["context"])
        if not rows:
            continue
        fits = [r for r in rows if not r["oom"]]
        line, = speed.plot([r["context"] for r in fits], [r["tokens_per_s"] for r in fits],
                           marker="o", label=label)
        memory.plot([r["context"] for r in fits], [r["peak_mib"] / 1024 for r in fits],
                    marker="o", color=line.get_color())
        for r in rows:
            if r["oom"]:
                memory.plot([r["context"]], [memory.get_ylim()[1]], marker="x", markersize=10,
                            color=line.get_color(), linestyle="none")
    contexts = sorted({row["context"] for row in data["rows"]})
    for ax, name in ((speed, "training tokens / s"), (memory, "peak memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{t / 1024:g}k" for t in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context length T (tokens)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    speed.legend(fontsize=8)
    memory.set_title("× = out of memory", fontsize=9)
    fig.suptitle(f"{data['meta']['model']} — {data['meta']['gpu']}", fontsize=10)
    fig.tight_layout()
    return fig


def size_dict(size: LlamaSize) -> dict:
    """``size`` as a plain dict (for a recorded file's provenance)."""
    return asdict(size)
