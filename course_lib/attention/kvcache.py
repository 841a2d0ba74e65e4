"""KV-cache memory (chapter 08): how many bytes the keys and values of generation take.

When a model generates text one token at a time it keeps the keys and values of every earlier
token, per layer and per K/V head: ``bytes = 2 · layers · kv_heads · head_dim · seq_len · batch ·
bytes_per_element`` (the 2 is K and V). :func:`kv_cache_bytes` computes it; :data:`MODELS` holds
the attention shapes of a few real models (with their sources) for the notebook and the
KV-cache calculator widget (:mod:`course_lib.teaching.widgets.kvcache`). Fewer K/V heads (GQA/MQA,
:mod:`course_lib.attention.gqa`) shrink the cache by the group size.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.attention import costmodel
from course_lib.attention.iomodel import validate_block_size as _positive_int

__all__ = [
    "KV_TENSORS", "FP8_NAMES", "ModelShape", "MODELS", "DEFAULT_MODEL", "cache_bytes_per_element",
    "kv_cache_bytes", "kv_cache_bytes_per_token", "max_cached_tokens",
]

KV_TENSORS = 2  # a cache holds two tensors per layer and head, K and V: the "2" of the formula
FP8_NAMES = ("float8", "fp8")  # 8-bit caches (e4m3/e5m2) are common in serving: 1 byte/element
_FP8_BYTES = 1


def cache_bytes_per_element(dtype) -> int:
    """Bytes per cached element: :func:`course_lib.attention.costmodel.bytes_per_element`, plus ``"fp8"``."""
    if isinstance(dtype, str) and dtype.lower() in FP8_NAMES:
        return _FP8_BYTES
    try:
        return costmodel.bytes_per_element(dtype)
    except ValueError:
        raise ValueError(f"dtype must be one of float32, float16, bfloat16, float8 (fp8), "
                         f"got {dtype!r}") from None


def kv_cache_bytes(seq_len: int, *, layers: int, kv_heads: int, head_dim: int, batch: int = 1,
                   dtype="float16") -> int:
    """Bytes of the KV cache: ``2 · layers · kv_heads · head_dim · seq_len · batch · bytes``.

    Args:
        seq_len: cached tokens per sequence (prompt plus generated so far).
        layers: transformer layers (each has its own cache). kv_heads: K/V heads per layer
            (``n_heads`` for multi-head attention, fewer for GQA, 1 for MQA).
        head_dim: d. batch: sequences held at once. dtype: cache element type (or ``"fp8"``).

    Returns:
        The size in bytes (an int).

    >>> kv_cache_bytes(4096, layers=32, kv_heads=32, head_dim=128)  # a 7B MHA model, fp16
    2147483648
    """
    per_element = cache_bytes_per_element(dtype)
    return (KV_TENSORS * _positive_int("layers", layers) * _positive_int("kv_heads", kv_heads)
            * _positive_int("head_dim", head_dim) * _positive_int("seq_len", seq_len)
            * _positive_int("batch", batch) * per_element)


def kv_cache_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, dtype="float16") -> int:
    """Bytes one more token adds to the cache of one sequence (all layers)."""
    return kv_cache_bytes(1, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)


def max_cached_tokens(memory_bytes: float, *, layers: int, kv_heads: int, head_dim: int,
                      dtype="float16", reserved_bytes: float = 0) -> int:
    """How many tokens (batch × context, summed over sequences) fit in ``memory_bytes`` after
    ``reserved_bytes`` (the weights, say) are set aside; 0 when nothing fits."""
    if not memory_bytes > 0:
        raise ValueError(f"memory_bytes must be positive, got {memory_bytes!r}")
    if not reserved_bytes >= 0:
        raise ValueError(f"reserved_bytes must be non-negative, got {reserved_bytes!r}")
    per_token = kv_cache_bytes_per_token(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                                         dtype=dtype)
    return max(0, int((memory_bytes - reserved_bytes) // per_token))


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a decoder-only model: what its KV cache depends on.

    ``params_billion`` gives the weights' size (``params × bytes per parameter``), which shares
    the GPU with the cache.
    """

    name: str
    layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    params_billion: float
    source: str

    @property
    def group(self) -> int:
        """Query heads per K/V head (1 = MHA, ``n_heads`` = MQA)."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes(self, seq_len: int, batch: int = 1, dtype="float16",
                 kv_heads: int | None = None) -> int:
        """KV-cache bytes of this model (optionally with a different number of K/V heads)."""
        return kv_cache_bytes(seq_len, layers=self.layers, kv_heads=kv_heads or self.n_kv_heads,
                              head_dim=self.head_dim, batch=batch, dtype=dtype)

    def weight_bytes(self, bytes_per_param: float = 2) -> float:
        """Bytes of the weights (fp16/bf16 by default)."""
        return self.params_billion * 1e9 * bytes_per_param


_LLAMA2 = ("Touvron et al. 2023, 'Llama 2' (arXiv:2307.09288), Table 1; layers and heads from "
           "the released config.json (num_hidden_layers, num_attention_heads, "
           "num_key_value_heads); head_dim = hidden_size / num_attention_heads")
MODELS: dict[str, ModelShape] = {m.name: m for m in [
    ModelShape("7B, multi-head (Llama-2-7B shape)", layers=32, n_heads=32, n_kv_heads=32,
               head_dim=128, params_billion=6.74, source=_LLAMA2),
    ModelShape("7B, GQA with 8 KV heads (Mistral-7B shape)", layers=32, n_heads=32, n_kv_heads=8,
               head_dim=128, params_billion=7.24,
               source="Jiang et al. 2023, 'Mistral 7B' (arXiv:2310.06825), Table 1"),
    ModelShape("7B, MQA with 1 KV head (hypothetical)", layers=32, n_heads=32, n_kv_heads=1,
               head_dim=128, params_billion=6.74,
               source="the Llama-2-7B shape with a single K/V head, for comparison"),
    ModelShape("70B, GQA with 8 KV heads (Llama-2-70B shape)", layers=80, n_heads=64,
               n_kv_heads=8, head_dim=128, params_billion=68.98, source=_LLAMA2),
]}
DEFAULT_MODEL = "7B, multi-head (Llama-2-7B shape)"

