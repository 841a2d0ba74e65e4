"""Beyond the training kernel (chapter 08): KV cache, flash-decoding, GQA/MQA, sparse masks.

Four ideas, each a small extension of chapters 02–04:

* **KV-cache memory.** When a model generates text one token at a time it keeps the keys and
  values of every earlier token: ``bytes = 2 · layers · kv_heads · head_dim · seq_len · batch ·
  bytes_per_element`` (the 2 is K and V). :func:`kv_cache_bytes`, :data:`MODELS`.
* **Decoding attention, split over the keys ("flash-decoding").** One new query row per head
  attends to the whole cache: ~1 FLOP per byte (:func:`decode_step_cost`), far below any GPU's
  balance point, and only ``batch · heads`` rows of work — too few programs to fill the GPU. So
  the cache is cut into ``S`` chunks, each chunk's partial softmax state ``(m, l, o)`` is computed
  independently (:func:`split_kv_partials`), and the states are merged with chapter 03's
  :func:`course_lib.softmax.merge_states_with_output` (:func:`merge_splits`,
  :func:`flash_decode`).
* **GQA / MQA.** ``n_heads`` query heads share ``n_kv_heads`` K/V heads (MQA: one). Query head
  ``h`` reads K/V head ``h // group`` with ``group = n_heads // n_kv_heads``
  (:func:`kv_head_index`). The naive way copies K and V ``group`` times (:func:`repeat_kv`); the
  fast path only maps indices (:func:`gqa_attention`, :func:`flash_decode`): no copy of the cache.
* **Sliding-window and block-sparse masks** as tile predicates. Query ``i`` sees key ``j`` when
  ``i − W < j ≤ i`` (window ``W``, top-left aligned like the causal mask). A ``(Q tile, K/V tile)``
  pair is fully masked (skipped), partially masked (computed with a mask) or fully visible
  (computed without one): :func:`classify_tiles` (brute force from any mask),
  :func:`sliding_window_tile_classes` (from indices alone, as a kernel would),
  :func:`flash_attention_numpy_masked` (the tiled loop that skips).

Shapes follow the rest of the library: ``q`` ``(..., H, N_q, d)``, ``k``/``v`` ``(..., H_kv, N_k,
d)``; a decoding query has no ``N_q`` axis: ``(..., H, d)``. NumPy float32/float64 only (half
precision is a GPU story). A fully masked query row gets ``o = 0`` and ``lse = -inf`` (the policy
of :mod:`course_lib.softmax`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from numbers import Integral

import numpy as np

from course_lib import costmodel
from course_lib.iomodel import block_rows, num_blocks
from course_lib.iomodel import validate_block_size as _positive_int
from course_lib.reference import NUMPY_FLOAT_DTYPES, default_scale
from course_lib.softmax import merge_states_with_output
from course_lib.tiled import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, MASK_VALUE, IOCounter, load_tile

__all__ = [
    "KV_TENSORS", "FP8_NAMES", "ModelShape", "MODELS", "DEFAULT_MODEL", "cache_bytes_per_element",
    "kv_cache_bytes", "kv_cache_bytes_per_token", "max_cached_tokens", "decode_step_cost",
    "num_splits_to_fill", "split_bounds", "split_kv_partials", "merge_splits", "combine_splits",
    "flash_decode", "decode_attention_reference", "kv_head_index", "repeat_kv", "gqa_attention",
    "SKIP", "PARTIAL", "FULL", "TILE_CLASS_NAMES", "sliding_window_mask", "block_sparse_mask",
    "classify_tiles", "sliding_window_tile_classes", "tile_counts", "skipped_fraction",
    "masked_attention_numpy", "flash_attention_numpy_masked", "sliding_window_attention_numpy",
]

# ----------------------------------------------------------------------------------------------
# (a) KV-cache memory
# ----------------------------------------------------------------------------------------------

KV_TENSORS = 2  # a cache holds two tensors per layer and head, K and V: the "2" of the formula
FP8_NAMES = ("float8", "fp8")  # 8-bit caches (e4m3/e5m2) are common in serving: 1 byte/element
_FP8_BYTES = 1


def cache_bytes_per_element(dtype) -> int:
    """Bytes per cached element: :func:`course_lib.costmodel.bytes_per_element`, plus ``"fp8"``."""
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


# ----------------------------------------------------------------------------------------------
# decoding is memory-bound
# ----------------------------------------------------------------------------------------------

def decode_step_cost(seq_len: int, head_dim: int, dtype="float16", *, batch: int = 1,
                     heads: int = 1, kv_heads: int | None = None) -> costmodel.StepCost:
    """FLOPs and HBM bytes of one decoding step of attention (one layer).

    Each of ``batch · heads`` query rows does two matrix-vector products with the cache,
    ``q·Kᵀ`` and ``p·V``: ``2 · 2 · N · d`` FLOPs (the papers' convention: softmax not counted).
    The bytes are dominated by reading the cache once, ``2 · batch · kv_heads · N · d`` elements,
    plus ``q`` read and ``o`` written (``batch · heads · d`` each).

    Args:
        seq_len: N, cached tokens. head_dim: d. dtype: element type of q, the cache and o.
        batch, heads: query rows. kv_heads: K/V heads (default ``heads``: multi-head attention).

    Returns:
        A :class:`course_lib.costmodel.StepCost`; ``.intensity`` is FLOP per byte.
    """
    n, d = _positive_int("seq_len", seq_len), _positive_int("head_dim", head_dim)
    batch, heads = _positive_int("batch", batch), _positive_int("heads", heads)
    kv_heads = heads if kv_heads is None else _positive_int("kv_heads", kv_heads)
    if heads % kv_heads:
        raise ValueError(f"heads must be a multiple of kv_heads, got heads={heads}, "
                         f"kv_heads={kv_heads}")
    b = cache_bytes_per_element(dtype)
    flops = 2 * costmodel.FLOPS_PER_MULTIPLY_ADD * batch * heads * n * d  # q·Kᵀ and p·V
    read = (KV_TENSORS * batch * kv_heads * n * d + batch * heads * d) * b  # the cache, and q
    written = batch * heads * d * b  # o
    return costmodel.StepCost("decode", flops, read, written)


def num_splits_to_fill(sm_count: int, batch: int, heads: int, seq_len: int,
                       block_n: int = DEFAULT_BLOCK_N) -> int:
    """Smallest number of K/V splits that gives every SM at least one program.

    Decoding launches ``batch · heads · splits`` programs; without a split (``splits = 1``) a
    batch of 1 with 32 heads keeps 32 SMs busy out of 132. A split shorter than one K/V tile
    would be wasted, so the answer is capped at ``ceil(seq_len / block_n)``.
    """
    sm_count, batch = _positive_int("sm_count", sm_count), _positive_int("batch", batch)
    heads, seq_len = _positive_int("heads", heads), _positive_int("seq_len", seq_len)
    block_n = _positive_int("block_n", block_n)
    wanted = -(-sm_count // (batch * heads))
    return max(1, min(wanted, num_blocks(seq_len, block_n)))


# ----------------------------------------------------------------------------------------------
# partial softmax states (shared by split-KV decoding, the masked tiled loop and the references)
# ----------------------------------------------------------------------------------------------

def _partial_state(s: np.ndarray, v: np.ndarray):
    """Softmax state of a block of scores: ``m (..., R)``, ``l (..., R)``, ``o (..., R, d_v)``.

    ``s`` ``(..., R, C)`` holds ``-inf`` where masked; ``v`` ``(..., C, d_v)``. ``o`` is the
    normalised weighted average (chapter 03's convention); an all-masked row is the empty state
    ``m = -inf, l = 0, o = 0``.
    """
    m = np.max(s, axis=-1, initial=-np.inf)  # (..., R)
    shift = np.where(np.isfinite(m), m, 0)  # the empty row exponentiates to 0, not NaN
    p = np.exp(s - shift[..., None])  # (..., R, C)
    l = p.sum(axis=-1)  # (..., R)
    o = (p @ v) / np.where(l > 0, l, 1)[..., None]  # (..., R, d_v); 0 where l = 0
    return m, l, o


def _lse(m, l):
    """``m + log l``, and ``-inf`` for the empty state."""
    with np.errstate(divide="ignore"):
        return np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf)


def _check_array(name: str, x) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if x.dtype.type not in NUMPY_FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64, got dtype {x.dtype}")
    return x


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    return float(scale)


def _check_gqa(q, k, v, q_extra_dims: int):
    """Validate ``q (..., H, [N_q,] d)``, ``k``/``v`` ``(..., H_kv, N_k, d)``; return the group.

    ``q_extra_dims`` is 1 when ``q`` has an ``N_q`` axis, 0 for a decoding query.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    q_shape = "(..., H, N_q, d)" if q_extra_dims else "(..., H, d)"
    if q.ndim < 2 + q_extra_dims:
        raise ValueError(f"q must have shape {q_shape}, got shape {q.shape}")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim + 1 - q_extra_dims:
            raise ValueError(f"{name} must have shape (..., H_kv, N_k, d) with one more dim than "
                             f"q {q_shape}; got q {q.shape} and {name} {x.shape}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same (..., H_kv, N_k) dims, got k {k.shape} "
                         f"and v {v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim d, got q {q.shape} and k {k.shape}")
    lead_q, lead_k = q.shape[:-2 - q_extra_dims], k.shape[:-3]
    if lead_q != lead_k:
        raise ValueError(f"q and k must have the same leading (batch) dims, got q {q.shape} "
                         f"and k {k.shape}")
    n_heads, n_kv_heads = q.shape[-2 - q_extra_dims], k.shape[-3]
    if n_kv_heads == 0 or n_heads % n_kv_heads:
        raise ValueError(f"the number of query heads must be a multiple of the number of K/V "
                         f"heads, got {n_heads} query heads (q {q.shape}) and {n_kv_heads} K/V "
                         f"heads (k {k.shape})")
    return n_heads // n_kv_heads


# ----------------------------------------------------------------------------------------------
# (b) flash-decoding: split the keys, compute partial states, merge
# ----------------------------------------------------------------------------------------------

def split_bounds(seq_len: int, splits) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the key chunks.

    Args:
        seq_len: N, the number of cached keys.
        splits: an int ``S`` — ``S`` chunks as even as possible (the first ``N mod S`` one key
            longer; empty chunks when ``S > N``) — or a sequence of chunk lengths summing to N.
    """
    seq_len = _positive_int("seq_len", seq_len)
    if isinstance(splits, Integral) and not isinstance(splits, bool):
        splits = _positive_int("splits", splits)
        base, extra = divmod(seq_len, splits)
        sizes = [base + (1 if s < extra else 0) for s in range(splits)]
    else:
        try:
            sizes = [int(x) for x in splits]
        except TypeError:
            raise TypeError(f"splits must be a positive int or a sequence of chunk lengths, got "
                            f"{type(splits).__name__}") from None
        if not sizes or any(x < 0 for x in sizes) or sum(sizes) != seq_len:
            raise ValueError(f"splits must be non-negative chunk lengths summing to seq_len="
                             f"{seq_len}, got {list(splits)}")
    starts = np.cumsum([0] + sizes[:-1])
    return [(int(a), int(a) + n) for a, n in zip(starts, sizes)]


def _group_queries(q: np.ndarray, group: int, h_axis: int) -> np.ndarray:
    """``(..., H, *rest)`` → ``(..., H_kv, G, *rest)``: query head ``h = g·G + r`` lands at
    ``[g, r]``, next to the K/V head ``g = h // G`` it reads (a reshape: a view of ``q``)."""
    shape = q.shape
    return q.reshape(shape[:h_axis] + (shape[h_axis] // group, group) + shape[h_axis + 1:])


def split_kv_partials(q, k, v, splits, scale: float | None = None):
    """One decoding query per head against the cache, split into chunks: each chunk's state.

    Each chunk is what one GPU program of flash-decoding computes: the scores of the query rows
    against its keys, then ``(m, l, o)`` of those scores alone. The chunks are independent.

    Args:
        q: ``(..., H, d)`` — one query row per (batch, head).
        k: ``(..., H_kv, N, d)``; v: ``(..., H_kv, N, d_v)`` — the cache; ``H % H_kv == 0``.
        splits: number of chunks or their lengths (see :func:`split_bounds`).
        scale: score scale, default ``1/sqrt(d)``.

    Returns:
        ``(m, l, o)``: ``(S, ..., H)``, ``(S, ..., H)``, ``(S, ..., H, d_v)`` in the input dtype;
        ``o`` normalised per chunk; an empty chunk gives ``m = -inf, l = 0, o = 0``.
    """
    group = _check_gqa(q, k, v, q_extra_dims=0)
    scale = _check_scale(scale, q.shape[-1])
    n, d_v = k.shape[-2], v.shape[-1]
    q_rows = _group_queries(q, group, q.ndim - 2)  # (..., H_kv, G, d): G heads share a K/V head
    ms, ls, os_ = [], [], []
    for start, stop in split_bounds(n, splits):
        k_chunk = k[..., start:stop, :]  # (..., H_kv, n_s, d) a view: nothing copied
        v_chunk = v[..., start:stop, :]  # (..., H_kv, n_s, d_v)
        s = scale * (q_rows @ np.swapaxes(k_chunk, -1, -2))  # (..., H_kv, G, n_s)
        m, l, o = _partial_state(s, v_chunk)  # (..., H_kv, G), (..., H_kv, G, d_v)
        ms.append(m.reshape(q.shape[:-1]))
        ls.append(l.reshape(q.shape[:-1]))
        os_.append(o.reshape(q.shape[:-1] + (d_v,)))
    dtype = q.dtype
    return (np.stack(ms).astype(dtype, copy=False), np.stack(ls).astype(dtype, copy=False),
            np.stack(os_).astype(dtype, copy=False))


def _check_states(m, l, o):
    for name, x in (("m", m), ("l", l), ("o", o)):
        _check_array(name, x)
    if m.ndim < 1 or m.shape[0] < 1:
        raise ValueError(f"m must have shape (S, ...) with S >= 1 chunks, got shape {m.shape}")
    if l.shape != m.shape or o.shape[:-1] != m.shape:
        raise ValueError(f"m, l must have shape (S, ...) and o (S, ..., d_v) with the same "
                         f"(S, ...), got m {m.shape}, l {l.shape}, o {o.shape}")


def merge_splits(m, l, o):
    """Merge ``S`` partial states (axis 0) into one, with chapter 03's merge (any order works).

    Args:
        m, l: ``(S, ...)``; o: ``(S, ..., d_v)`` (normalised per chunk).

    Returns:
        ``(m, l, o)`` of all the keys: ``(...)``, ``(...)``, ``(..., d_v)``.
    """
    _check_states(m, l, o)
    return reduce(lambda a, b: merge_states_with_output(*a, *b), zip(m, l, o))


def combine_splits(m, l, o):
    """The final output of split-KV decoding from the chunks' states: ``(..., d_v)``.

    ``o = Σ_s l_s e^{m_s − m} o_s / Σ_s l_s e^{m_s − m}`` with ``m = max_s m_s`` (exercise 8.2).
    """
    return merge_splits(m, l, o)[2]


def flash_decode(q, k, v, splits=1, scale: float | None = None):
    """Decoding attention by split-KV: partial states of ``splits`` key chunks, then a merge.

    Args: as :func:`split_kv_partials` (``q`` ``(..., H, d)``, cache ``(..., H_kv, N, d)``).

    Returns:
        ``(o, lse)``: ``(..., H, d_v)`` and ``(..., H)``, in the input dtype.
    """
    m, l, o = merge_splits(*split_kv_partials(q, k, v, splits, scale))
    return o.astype(q.dtype, copy=False), _lse(m, l).astype(q.dtype, copy=False)


def decode_attention_reference(q, k, v, scale: float | None = None):
    """The oracle for :func:`flash_decode`: K/V repeated per query head, one softmax, float64.

    Returns:
        ``(o, lse)``: ``(..., H, d_v)`` in the input dtype and ``(..., H)`` float64.
    """
    _check_gqa(q, k, v, q_extra_dims=0)
    scale = _check_scale(scale, q.shape[-1])
    k64, v64 = (repeat_kv(x.astype(np.float64), q.shape[-2]) for x in (k, v))  # (..., H, N, d)
    s = scale * (q.astype(np.float64)[..., None, :] @ np.swapaxes(k64, -1, -2))  # (..., H, 1, N)
    m, l, o = _partial_state(s, v64)
    return o[..., 0, :].astype(q.dtype), _lse(m, l)[..., 0]


# ----------------------------------------------------------------------------------------------
# (c) GQA / MQA: query heads share K/V heads
# ----------------------------------------------------------------------------------------------

def _check_heads(n_heads, n_kv_heads) -> int:
    n_heads, n_kv_heads = _positive_int("n_heads", n_heads), _positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads must be a multiple of n_kv_heads, got n_heads={n_heads}, "
                         f"n_kv_heads={n_kv_heads}")
    return n_heads // n_kv_heads


def kv_head_index(h, n_heads: int, n_kv_heads: int):
    """The K/V head that query head ``h`` reads: ``h // (n_heads // n_kv_heads)``.

    Consecutive query heads form a group: with 32 heads and 8 K/V heads, heads 0–3 read K/V head
    0, heads 4–7 read K/V head 1, … (the layout of GQA checkpoints and of SDPA's ``enable_gqa``).

    Args:
        h: a query-head index or an integer array of them, each in ``[0, n_heads)``.

    Returns:
        An int (for an int) or an integer array of the same shape.
    """
    group = _check_heads(n_heads, n_kv_heads)
    arr = np.asarray(h)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"h must be an integer head index or integer array, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= n_heads):
        raise ValueError(f"h must be in [0, n_heads={n_heads}), got values from {arr.min()} "
                         f"to {arr.max()}")
    out = arr // group
    return int(out) if out.ndim == 0 else out


def repeat_kv(x: np.ndarray, n_heads: int) -> np.ndarray:
    """The naive GQA: repeat each K/V head ``group`` times (``H_kv`` heads → ``H`` heads).

    Correct and simple, but it allocates ``group`` times the cache — what the fast path avoids.
    """
    _check_array("x", x)
    if x.ndim < 3:
        raise ValueError(f"x must have shape (..., H_kv, N, d), got shape {x.shape}")
    group = _check_heads(n_heads, x.shape[-3])
    return np.repeat(x, group, axis=-3)


def gqa_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Attention with grouped K/V heads, by index mapping (K and V are never repeated).

    The query heads are viewed as ``(..., H_kv, G, N_q, d)``; K/V get a size-1 group axis, so the
    matmul broadcasts each K/V head over its ``G`` query heads without copying it.

    Args:
        q: ``(..., H, N_q, d)``; k: ``(..., H_kv, N_k, d)``; v: ``(..., H_kv, N_k, d_v)``;
            ``H % H_kv == 0`` (``H_kv = H``: MHA; ``H_kv = 1``: MQA).
        causal: top-left aligned causal mask, as SDPA's ``is_causal``. scale: default 1/sqrt(d).

    Returns:
        ``(o, lse)``: ``(..., H, N_q, d_v)`` in the input dtype, ``(..., H, N_q)`` float64.
    """
    group = _check_gqa(q, k, v, q_extra_dims=1)
    scale = _check_scale(scale, q.shape[-1])
    n_q, n_k = q.shape[-2], k.shape[-2]
    q_groups = _group_queries(q.astype(np.float64), group, q.ndim - 3)  # (..., H_kv, G, N_q, d)
    k_shared = k.astype(np.float64)[..., :, None, :, :]  # (..., H_kv, 1, N_k, d)
    v_shared = v.astype(np.float64)[..., :, None, :, :]
    s = scale * (q_groups @ np.swapaxes(k_shared, -1, -2))  # (..., H_kv, G, N_q, N_k)
    if causal:
        s = np.where(np.arange(n_k)[None, :] <= np.arange(n_q)[:, None], s, MASK_VALUE)
    m, l, o = _partial_state(s, v_shared)
    o_shape = q.shape[:-1] + (v.shape[-1],)
    return o.reshape(o_shape).astype(q.dtype), _lse(m, l).reshape(q.shape[:-1])


# ----------------------------------------------------------------------------------------------
# (d) sliding-window and block-sparse masks as tile predicates
# ----------------------------------------------------------------------------------------------

SKIP, PARTIAL, FULL = 0, 1, 2  # tile classes: fully masked, partly masked, fully visible
TILE_CLASS_NAMES = {SKIP: "skipped (fully masked)", PARTIAL: "partial (needs a mask)",
                    FULL: "full (no mask)"}


def sliding_window_mask(n_q: int, n_k: int, window: int) -> np.ndarray:
    """``(n_q, n_k)`` boolean, True where query ``i`` sees key ``j``: ``i − window < j ≤ i``.

    ``window = 1`` keeps only the diagonal; ``window ≥ n_k`` is the causal mask.
    """
    n_q, n_k = _positive_int("n_q", n_q), _positive_int("n_k", n_k)
    window = _positive_int("window", window)
    i = np.arange(n_q)[:, None]  # (n_q, 1)
    j = np.arange(n_k)[None, :]  # (1, n_k)
    return (j <= i) & (j > i - window)


def block_sparse_mask(layout, n_q: int, n_k: int, block_m: int, block_n: int) -> np.ndarray:
    """Expand a ``(T_r, T_c)`` boolean block layout to the ``(n_q, n_k)`` element mask.

    ``layout[i, j]`` says whether Q tile ``i`` attends to K/V tile ``j`` at all (every entry of a
    True tile is visible, every entry of a False one masked).
    """
    n_q, n_k = _positive_int("n_q", n_q), _positive_int("n_k", n_k)
    block_m, block_n = _positive_int("block_m", block_m), _positive_int("block_n", block_n)
    layout = np.asarray(layout)
    expected = (num_blocks(n_q, block_m), num_blocks(n_k, block_n))
    if layout.dtype != bool or layout.shape != expected:
        raise ValueError(f"layout must be a boolean array of shape (T_r, T_c) = {expected} for "
                         f"n_q={n_q}, n_k={n_k}, block_m={block_m}, block_n={block_n}; got "
                         f"{layout.dtype} {layout.shape}")
    rows = np.repeat(layout, block_m, axis=0)[:n_q]
    return np.repeat(rows, block_n, axis=1)[:, :n_k]


def _check_mask(mask) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.ndim != 2:
        raise ValueError(f"mask must be a 2-D boolean array (n_q, n_k), True = visible; got "
                         f"{mask.dtype} with shape {mask.shape}")
    return mask


def classify_tiles(mask, block_m: int, block_n: int) -> np.ndarray:
    """Brute force, for any mask: ``(T_r, T_c)`` of SKIP / PARTIAL / FULL.

    Only real entries count (the padding of a ragged last tile is masked anyway, as in every
    kernel): a tile is FULL when all its real entries are visible, SKIP when none is.
    """
    mask = _check_mask(mask)
    block_m, block_n = _positive_int("block_m", block_m), _positive_int("block_n", block_n)
    n_q, n_k = mask.shape
    t_r, t_c = num_blocks(n_q, block_m), num_blocks(n_k, block_n)

    def tiles(pad_value):  # (T_r, BLOCK_M, T_c, BLOCK_N), the padding set to pad_value
        padded = np.full((t_r * block_m, t_c * block_n), pad_value)
        padded[:n_q, :n_k] = mask
        return padded.reshape(t_r, block_m, t_c, block_n)

    any_visible = tiles(False).any(axis=(1, 3))
    all_visible = tiles(True).all(axis=(1, 3))
    return np.where(all_visible, FULL, np.where(any_visible, PARTIAL, SKIP))


def sliding_window_tile_classes(n_q: int, n_k: int, window: int, block_m: int,
                                block_n: int) -> np.ndarray:
    """The same classes as :func:`classify_tiles` of :func:`sliding_window_mask`, from indices.

    A tile covers real query rows ``r0..r1`` and key columns ``c0..c1``. Row ``i`` sees the keys
    ``i−W+1 .. i``, so the rows together see ``r0−W+1 .. r1``:

    * nothing visible (SKIP) when ``c0 > r1`` (above the diagonal, as causal) or
      ``c1 < r0 − W + 1`` (entirely older than the window of the tile's first row);
    * everything visible (FULL) when ``c1 ≤ r0`` (left of the diagonal for every row) and
      ``c0 ≥ r1 − W + 1`` (inside the window of the tile's last row);
    * otherwise PARTIAL.

    This is the test a kernel makes to choose its K/V loop bounds and where to apply a mask.
    """
    n_q, n_k = _positive_int("n_q", n_q), _positive_int("n_k", n_k)
    window = _positive_int("window", window)
    block_m, block_n = _positive_int("block_m", block_m), _positive_int("block_n", block_n)
    i = np.arange(num_blocks(n_q, block_m))[:, None]  # (T_r, 1)
    j = np.arange(num_blocks(n_k, block_n))[None, :]  # (1, T_c)
    r0, r1 = i * block_m, np.minimum((i + 1) * block_m, n_q) - 1  # first and last real query
    c0, c1 = j * block_n, np.minimum((j + 1) * block_n, n_k) - 1  # first and last real key
    none_visible = (c0 > r1) | (c1 < r0 - window + 1)
    all_visible = (c1 <= r0) & (c0 >= r1 - window + 1)
    return np.where(none_visible, SKIP, np.where(all_visible, FULL, PARTIAL))


def tile_counts(classes) -> dict[str, int]:
    """``{"skipped": …, "partial": …, "full": …, "total": …}`` of a tile-class grid."""
    classes = np.asarray(classes)
    return {"skipped": int((classes == SKIP).sum()), "partial": int((classes == PARTIAL).sum()),
            "full": int((classes == FULL).sum()), "total": int(classes.size)}


def skipped_fraction(classes) -> float:
    """Fraction of the tiles that are never loaded nor computed."""
    classes = np.asarray(classes)
    if classes.size == 0:
        raise ValueError("classes must hold at least one tile")
    return float((classes == SKIP).mean())


def masked_attention_numpy(q, k, v, mask, scale: float | None = None):
    """Reference attention with any boolean ``(N_q, N_k)`` mask (True = visible), float64 inside.

    Args:
        q: ``(..., N_q, d)``; k: ``(..., N_k, d)``; v: ``(..., N_k, d_v)``; same leading dims.
        mask: ``(N_q, N_k)`` boolean, shared by all leading dims.

    Returns:
        ``(o, lse)``: ``(..., N_q, d_v)`` in the input dtype, ``(..., N_q)`` float64; a row that
        sees no key gets ``o = 0``, ``lse = -inf``.
    """
    q, k, v, mask, scale = _check_masked_inputs(q, k, v, mask, scale)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = np.where(mask, scale * (q64 @ np.swapaxes(k64, -1, -2)), MASK_VALUE)  # (..., N_q, N_k)
    m, l, o = _partial_state(s, v64)
    return o.astype(q.dtype), _lse(m, l)


def _check_masked_inputs(q, k, v, mask, scale):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x)
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape (..., N, d), got shape {x.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1] or q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q (..., N_q, d), k (..., N_k, d) and v (..., N_k, d_v) do not fit "
                         f"together: q {q.shape}, k {k.shape}, v {v.shape}")
    mask = _check_mask(mask)
    if mask.shape != (q.shape[-2], k.shape[-2]):
        raise ValueError(f"mask must have shape (N_q, N_k) = {(q.shape[-2], k.shape[-2])}, "
                         f"got {mask.shape}")
    return q, k, v, mask, _check_scale(scale, q.shape[-1])


def flash_attention_numpy_masked(q, k, v, mask, scale: float | None = None,
                                 block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                                 counter: IOCounter | None = None, classes=None):
    """Tiled attention (FA2 order) with any mask: skip SKIP tiles, mask only PARTIAL ones.

    Each computed tile yields a partial state ``(m, l, o)`` that is merged into the Q tile's
    running state with :func:`course_lib.softmax.merge_states_with_output` — the same algebra
    as the online-softmax update of chapter 04, written as a merge.

    Args:
        q, k, v, mask, scale: as :func:`masked_attention_numpy`.
        block_m, block_n: tile sizes (BLOCK_M, BLOCK_N).
        counter: optional :class:`course_lib.tiled.IOCounter`: reads of q, k, v and writes of
            o, lse (elements), and a "compute" or "skip" event per tile.
        classes: the ``(T_r, T_c)`` tile classes if already known (a kernel derives them from
            indices, e.g. :func:`sliding_window_tile_classes`); default :func:`classify_tiles`.

    Returns:
        ``(o, lse)``: ``(..., N_q, d_v)`` and ``(..., N_q)`` in the input dtype.
    """
    q, k, v, mask, scale = _check_masked_inputs(q, k, v, mask, scale)
    block_m, block_n = _positive_int("block_m", block_m), _positive_int("block_n", block_n)
    n_q, n_k, d, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    batch, lead, dtype = math.prod(q.shape[:-2]), q.shape[:-2], q.dtype
    t_r, t_c = num_blocks(n_q, block_m), num_blocks(n_k, block_n)
    classes = classify_tiles(mask, block_m, block_n) if classes is None else np.asarray(classes)
    if classes.shape != (t_r, t_c):
        raise ValueError(f"classes must have shape (T_r, T_c) = {(t_r, t_c)}, got {classes.shape}")
    padded_mask = np.zeros((t_r * block_m, t_c * block_n), dtype=bool)
    padded_mask[:n_q, :n_k] = mask  # padding never visible
    o = np.empty(lead + (n_q, d_v), dtype=dtype)  # (..., N_q, d_v), "in HBM"
    lse = np.empty(lead + (n_q,), dtype=dtype)  # (..., N_q)

    for i in range(t_r):
        q_start, rows = i * block_m, block_rows(i, n_q, block_m)
        q_tile = load_tile(q, q_start, block_m)  # (..., BLOCK_M, d)
        if counter:
            counter.read("q", batch * rows * d)
        state = (np.full(lead + (block_m,), -np.inf, dtype=dtype),  # m_i
                 np.zeros(lead + (block_m,), dtype=dtype),  # l_i
                 np.zeros(lead + (block_m, d_v), dtype=dtype))  # o, normalised
        for j in range(t_c):
            if classes[i, j] == SKIP:
                if counter:
                    counter.event("skip", i, j)
                continue  # never loaded, never computed
            k_start, cols = j * block_n, block_rows(j, n_k, block_n)
            k_tile = load_tile(k, k_start, block_n)  # (..., BLOCK_N, d)
            v_tile = load_tile(v, k_start, block_n)  # (..., BLOCK_N, d_v)
            s = scale * (q_tile @ np.swapaxes(k_tile, -1, -2))  # (..., BLOCK_M, BLOCK_N)
            if classes[i, j] == PARTIAL or cols < block_n:  # a mask only where one is needed
                tile_mask = padded_mask[q_start:q_start + block_m, k_start:k_start + block_n]
                s = np.where(tile_mask, s, MASK_VALUE)
            state = merge_states_with_output(*state, *_partial_state(s, v_tile))
            if counter:
                counter.read("k", batch * cols * d)
                counter.read("v", batch * cols * d_v)
                counter.event("compute", i, j)
        m_i, l_i, o_i = state
        o[..., q_start:q_start + rows, :] = o_i[..., :rows, :]
        lse[..., q_start:q_start + rows] = _lse(m_i, l_i)[..., :rows]
        if counter:
            counter.write("o", batch * rows * d_v)
            counter.write("lse", batch * rows)
            counter.event("store", i, None)
    return o, lse


def sliding_window_attention_numpy(q, k, v, window: int, scale: float | None = None,
                                   block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                                   counter: IOCounter | None = None):
    """Sliding-window attention (query ``i`` sees keys ``i−W < j ≤ i``), tiled, with the tiles
    outside the band skipped. Returns ``(o, lse)`` as :func:`flash_attention_numpy_masked`."""
    for name, x in (("q", q), ("k", k)):
        _check_array(name, x)
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape (..., N, d), got shape {x.shape}")
    n_q, n_k = q.shape[-2], k.shape[-2]
    classes = sliding_window_tile_classes(n_q, n_k, window, block_m, block_n)
    return flash_attention_numpy_masked(q, k, v, sliding_window_mask(n_q, n_k, window), scale,
                                        block_m, block_n, counter, classes=classes)
