"""GQA and MQA (chapter 08): many query heads share a few K/V heads.

``n_heads`` query heads share ``n_kv_heads`` K/V heads (MQA: one; MHA: as many as query heads).
Query head ``h`` reads K/V head ``h // group`` with ``group = n_heads // n_kv_heads``
(:func:`kv_head_index`): consecutive query heads form a group, the layout of GQA checkpoints and
of SDPA's ``enable_gqa``. The naive way copies K and V ``group`` times (:func:`repeat_kv`); the
fast path only maps indices (:func:`gqa_attention`, and split-KV decoding in
:mod:`course_lib.attention.decoding`): the cache is never copied.

Shapes: ``q`` ``(..., H, N_q, d)`` — or ``(..., H, d)`` for a decoding query — and ``k``/``v``
``(..., H_kv, N_k, d)``. NumPy float32/float64 only.
"""

from __future__ import annotations

import numpy as np

from course_lib.constants import MASK_VALUE
from course_lib.attention.iomodel import validate_block_size as _positive_int
from course_lib.attention.tiled import CAUSAL, check_float_array, resolve_scale, softmax_state, state_lse

__all__ = ["kv_head_index", "repeat_kv", "gqa_attention", "check_gqa_inputs", "group_queries"]


def _check_heads(n_heads, n_kv_heads) -> int:
    n_heads, n_kv_heads = _positive_int("n_heads", n_heads), _positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads must be a multiple of n_kv_heads, got n_heads={n_heads}, "
                         f"n_kv_heads={n_kv_heads}")
    return n_heads // n_kv_heads


def check_gqa_inputs(q, k, v, q_extra_dims: int) -> int:
    """Validate ``q (..., H, [N_q,] d)``, ``k``/``v`` ``(..., H_kv, N_k, d)``; return the group.

    ``q_extra_dims`` is 1 when ``q`` has an ``N_q`` axis, 0 for a decoding query. Raises
    TypeError/ValueError naming the argument.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_array(name, x)
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


def group_queries(q: np.ndarray, group: int, h_axis: int) -> np.ndarray:
    """``(..., H, *rest)`` → ``(..., H_kv, G, *rest)``: query head ``h = g·G + r`` lands at
    ``[g, r]``, next to the K/V head ``g = h // G`` it reads (a reshape: a view of ``q``)."""
    shape = q.shape
    return q.reshape(shape[:h_axis] + (shape[h_axis] // group, group) + shape[h_axis + 1:])


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
    check_float_array("x", x)
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
    group = check_gqa_inputs(q, k, v, q_extra_dims=1)
    scale = resolve_scale(scale, q.shape[-1])
    n_q, n_k = q.shape[-2], k.shape[-2]
    q_groups = group_queries(q.astype(np.float64), group, q.ndim - 3)  # (..., H_kv, G, N_q, d)
    k_shared = k.astype(np.float64)[..., :, None, :, :]  # (..., H_kv, 1, N_k, d)
    v_shared = v.astype(np.float64)[..., :, None, :, :]
    s = scale * (q_groups @ np.swapaxes(k_shared, -1, -2))  # (..., H_kv, G, N_q, N_k)
    if causal:
        s = np.where(CAUSAL.element_mask(n_q, n_k), s, MASK_VALUE)
    m, l, o = softmax_state(s, v_shared)
    o_shape = q.shape[:-1] + (v.shape[-1],)
    return o.reshape(o_shape).astype(q.dtype), state_lse(m, l).reshape(q.shape[:-1])
