"""Decoding attention, split over the keys ("flash-decoding", chapter 08).

When a model generates one token at a time, one new query row per head attends to the whole KV
cache (:mod:`course_lib.attention.kvcache`): ~1 FLOP per byte (:func:`decode_step_cost`), far below any
GPU's balance point, and only ``batch · heads`` rows of work — too few programs to fill the GPU
(:func:`num_splits_to_fill`). So the cache is cut into ``S`` chunks (:func:`split_bounds`), each
chunk's partial softmax state ``(m, l, o)`` is computed independently
(:func:`split_kv_partials`), and the states are merged with chapter 03's
:func:`course_lib.attention.softmax.merge_states_with_output` (:func:`merge_splits`, :func:`flash_decode`).
Query heads that share a K/V head (GQA/MQA) are grouped by index mapping
(:mod:`course_lib.attention.gqa`): the cache is never copied.

Shapes: a decoding query has no ``N_q`` axis, ``q`` ``(..., H, d)``; the cache ``k``/``v`` is
``(..., H_kv, N, d)``. NumPy float32/float64 only (half precision is a GPU story). An empty chunk
is the empty state ``m = -inf, l = 0, o = 0`` (the policy of :mod:`course_lib.attention.softmax`).
"""

from __future__ import annotations

from functools import reduce
from numbers import Integral

import numpy as np

from course_lib.attention import costmodel
from course_lib.attention.gqa import check_gqa_inputs, group_queries, repeat_kv
from course_lib.attention.iomodel import num_blocks
from course_lib.attention.iomodel import validate_block_size as _positive_int
from course_lib.attention.kvcache import KV_TENSORS, cache_bytes_per_element
from course_lib.attention.softmax import merge_states_with_output
from course_lib.attention.tiled import (
    DEFAULT_BLOCK_N, check_float_array, resolve_scale, softmax_state, state_lse,
)

__all__ = [
    "decode_step_cost", "num_splits_to_fill", "split_bounds", "split_kv_partials", "merge_splits",
    "combine_splits", "flash_decode", "decode_attention_reference",
]

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
        A :class:`course_lib.attention.costmodel.StepCost`; ``.intensity`` is FLOP per byte.
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
# flash-decoding: split the keys, compute partial states, merge
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
    group = check_gqa_inputs(q, k, v, q_extra_dims=0)
    scale = resolve_scale(scale, q.shape[-1])
    n, d_v = k.shape[-2], v.shape[-1]
    q_rows = group_queries(q, group, q.ndim - 2)  # (..., H_kv, G, d): G heads share a K/V head
    ms, ls, os_ = [], [], []
    for start, stop in split_bounds(n, splits):
        k_chunk = k[..., start:stop, :]  # (..., H_kv, n_s, d) a view: nothing copied
        v_chunk = v[..., start:stop, :]  # (..., H_kv, n_s, d_v)
        s = scale * (q_rows @ np.swapaxes(k_chunk, -1, -2))  # (..., H_kv, G, n_s)
        m, l, o = softmax_state(s, v_chunk)  # (..., H_kv, G), (..., H_kv, G, d_v)
        ms.append(m.reshape(q.shape[:-1]))
        ls.append(l.reshape(q.shape[:-1]))
        os_.append(o.reshape(q.shape[:-1] + (d_v,)))
    dtype = q.dtype
    return (np.stack(ms).astype(dtype, copy=False), np.stack(ls).astype(dtype, copy=False),
            np.stack(os_).astype(dtype, copy=False))


def _check_states(m, l, o):
    for name, x in (("m", m), ("l", l), ("o", o)):
        check_float_array(name, x)
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
    return o.astype(q.dtype, copy=False), state_lse(m, l).astype(q.dtype, copy=False)


def decode_attention_reference(q, k, v, scale: float | None = None):
    """The oracle for :func:`flash_decode`: K/V repeated per query head, one softmax, float64.

    Returns:
        ``(o, lse)``: ``(..., H, d_v)`` in the input dtype and ``(..., H)`` float64.
    """
    check_gqa_inputs(q, k, v, q_extra_dims=0)
    scale = resolve_scale(scale, q.shape[-1])
    k64, v64 = (repeat_kv(x.astype(np.float64), q.shape[-2]) for x in (k, v))  # (..., H, N, d)
    s = scale * (q.astype(np.float64)[..., None, :] @ np.swapaxes(k64, -1, -2))  # (..., H, 1, N)
    m, l, o = softmax_state(s, v64)
    return o[..., 0, :].astype(q.dtype), state_lse(m, l)[..., 0]
