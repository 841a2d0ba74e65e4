"""The FlashAttention backward pass in NumPy, tile by tile (chapter 07).

For one head, the forward computes ``S = scale · q kᵀ`` (masked), ``P = softmax(S)`` row by row
and ``o = P v``. Given ``do = ∂L/∂o`` the gradients are (derived in chapter 07)::

    dV = Pᵀ dO                    (N_k, d_v)
    dP = dO Vᵀ                    (N_q, N_k)
    D  = rowsum(dO ∘ O)           (N_q,)      equal to rowsum(P ∘ dP)
    dS = P ∘ (dP − D)             (N_q, N_k)  D broadcast along each row
    dQ = scale · dS K             (N_q, d)
    dK = scale · dSᵀ Q            (N_k, d)

The tiled version never holds ``P``: it rebuilds each ``(BLOCK_M, BLOCK_N)`` tile from ``q``,
``k`` and the log-sum-exp the forward saved, ``P_ij = exp(scale · q_i k_jᵀ − lse_i)``. It is laid
out like the Triton backward kernels, so the two can be read side by side:

1. *preprocess*: ``D = rowsum(dO ∘ O)``, one number per query row (:func:`compute_d`);
2. *dK/dV*: one K/V tile at a time, looping over the Q tiles that can see it
   (:func:`dk_dv_step` is the body of that loop);
3. *dQ*: one Q tile at a time, looping over the K/V tiles it can see (:func:`dq_step`).

Passes 2 and 3 both rebuild ``P`` — extra FLOPs — so that every output tile is owned by exactly
one loop (one Triton program) and no two programs ever add into the same memory: the result is
deterministic, with no atomics. With ``causal=True`` (top-left aligned, as SDPA's ``is_causal``)
tiles that lie entirely above the diagonal are skipped and only tiles that straddle it are masked.

Each tile function works on one head's 2-D tiles, as one Triton program does; the driver
:func:`tiled_backward` loops over the flattened leading dims (batch, heads). Tiles are NumPy
slices, so the last tile of a ragged ``N`` is simply shorter; a GPU kernel instead loads a full
tile with masked loads (zeros past the end) and masks its stores.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from course_lib.attention.iomodel import kv_tiles_visited, num_blocks, tile_fully_masked, validate_block_size
from course_lib.attention.reference import (NUMPY_FLOAT_DTYPES, causal_mask, default_scale,
                                            naive_attention_numpy, validate_qkv_numpy)
from course_lib.attention.tiled import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N  # the forward's tile sizes

__all__ = ["DEFAULT_BLOCK_M", "DEFAULT_BLOCK_N", "flash_attention_numpy_backward",
           "tiled_backward", "attention_backward_numpy", "compute_d", "ds_tile", "recompute_p",
           "tile_mask", "dk_dv_step", "dq_step", "tile_schedule"]


# --------------------------------------------------------------------------- the tile operations

def compute_d(o, do):
    """The preprocessing step: ``D = rowsum(dO ∘ O)``.

    Args:
        o: forward output ``(..., N_q, d_v)``; do: its gradient, same shape.

    Returns:
        ``(..., N_q)``: one number per query row.
    """
    return np.sum(do * o, axis=-1)


def ds_tile(p, dp, d):
    """The softmax backward on one tile: ``dS = P ∘ (dP − D)``, ``D`` broadcast along rows.

    Args:
        p: ``(BLOCK_M, BLOCK_N)`` probabilities; dp: ``(BLOCK_M, BLOCK_N)``; d: ``(BLOCK_M,)``.

    Returns:
        ``(BLOCK_M, BLOCK_N)``.
    """
    return p * (dp - d[:, None])


def tile_mask(q_start: int, q_end: int, k_start: int, k_end: int, causal: bool):
    """Which entries of the tile ``[q_start, q_end) × [k_start, k_end)`` are visible.

    Returns ``None`` when every entry is (no mask to apply), else a boolean
    ``(q_end − q_start, k_end − k_start)`` array, True where key ``j <= `` query ``i``.
    """
    if not causal or k_end - 1 <= q_start:  # the whole tile is on or below the diagonal
        return None
    return np.arange(k_start, k_end)[None, :] <= np.arange(q_start, q_end)[:, None]


def recompute_p(q_i, k_j, lse_i, scale: float, mask=None):
    """Rebuild one tile of ``P`` from the saved log-sum-exp: ``exp(scale · q_i k_jᵀ − lse_i)``.

    Args:
        q_i: ``(BLOCK_M, d)``; k_j: ``(BLOCK_N, d)``; lse_i: ``(BLOCK_M,)``.
        mask: ``None`` or boolean ``(BLOCK_M, BLOCK_N)``, True where visible.

    Returns:
        ``(BLOCK_M, BLOCK_N)``: exactly the forward's probabilities (already normalised).
    """
    s = scale * (q_i @ k_j.T)  # (BLOCK_M, BLOCK_N)
    if mask is not None:
        s = np.where(mask, s, -np.inf)  # exp(-inf) = 0: hidden keys get no probability
    return np.exp(s - lse_i[:, None])


def dk_dv_step(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale: float, mask=None):
    """One step of the dK/dV loop: add Q tile ``i``'s contribution to K/V tile ``j``'s gradients.

    Args:
        q_i: ``(BLOCK_M, d)``; do_i: ``(BLOCK_M, d_v)``; lse_i, d_i: ``(BLOCK_M,)``.
        k_j: ``(BLOCK_N, d)``; v_j: ``(BLOCK_N, d_v)``.
        dk_j: ``(BLOCK_N, d)``; dv_j: ``(BLOCK_N, d_v)``: the gradients accumulated so far.
        scale: the forward's score scale.
        mask: ``None`` or boolean ``(BLOCK_M, BLOCK_N)``, True where visible.

    Returns:
        ``(dk_j, dv_j)`` updated (new arrays; the inputs are not modified).
    """
    p = recompute_p(q_i, k_j, lse_i, scale, mask)  # (BLOCK_M, BLOCK_N)
    dv_j = dv_j + p.T @ do_i  # (BLOCK_N, d_v)
    dp = do_i @ v_j.T  # (BLOCK_M, BLOCK_N)
    ds = ds_tile(p, dp, d_i)  # (BLOCK_M, BLOCK_N)
    dk_j = dk_j + scale * (ds.T @ q_i)  # (BLOCK_N, d)
    return dk_j, dv_j


def dq_step(q_i, do_i, lse_i, d_i, k_j, v_j, dq_i, scale: float, mask=None):
    """One step of the dQ loop: add K/V tile ``j``'s contribution to Q tile ``i``'s gradient.

    Arguments as :func:`dk_dv_step`; dq_i: ``(BLOCK_M, d)``. Returns the updated ``dq_i``.
    """
    p = recompute_p(q_i, k_j, lse_i, scale, mask)  # (BLOCK_M, BLOCK_N)
    dp = do_i @ v_j.T  # (BLOCK_M, BLOCK_N)
    ds = ds_tile(p, dp, d_i)  # (BLOCK_M, BLOCK_N)
    return dq_i + scale * (ds @ k_j)  # (BLOCK_M, d)


# --------------------------------------------------------------------------- which tiles run

def _q_starts_for_kv_tile(k_start: int, n_q: int, block_m: int, block_n: int,
                          causal: bool) -> list[int]:
    # Causal: query i sees key j only when j <= i, so the Q tiles above this K/V tile see none
    # of it; they are skipped (never loaded, never computed).
    kv_block = k_start // block_n
    return [q_block * block_m for q_block in range(num_blocks(n_q, block_m))
            if not (causal and tile_fully_masked(q_block, kv_block, block_m, block_n, n_q))]


def _k_starts_for_q_tile(q_start: int, n_q: int, n_k: int, block_m: int, block_n: int,
                         causal: bool) -> range:
    # Causal: the K/V tiles a Q tile sees are a prefix; the rest are skipped.
    visited = kv_tiles_visited(q_start // block_m, n_q, n_k, block_m, block_n, causal)
    return range(0, visited * block_n, block_n)


def tile_schedule(n_q: int, n_k: int, block_m: int, block_n: int, causal: bool = False) -> dict:
    """The tiles each backward loop visits, in order.

    Returns:
        ``{"dk_dv": [(k_start, q_start, masked), ...], "dq": [(q_start, k_start, masked), ...],
        "total": number of tiles in the full grid}``; ``masked`` is True for tiles that straddle
        the causal diagonal. Tiles left out of the lists are skipped entirely.
    """
    block_m = validate_block_size("block_m", block_m)
    block_n = validate_block_size("block_n", block_n)
    dk_dv, dq = [], []
    for k_start in range(0, n_k, block_n):
        k_end = min(k_start + block_n, n_k)
        for q_start in _q_starts_for_kv_tile(k_start, n_q, block_m, block_n, causal):
            q_end = min(q_start + block_m, n_q)
            dk_dv.append((k_start, q_start, tile_mask(q_start, q_end, k_start, k_end, causal) is not None))
    for q_start in range(0, n_q, block_m):
        q_end = min(q_start + block_m, n_q)
        for k_start in _k_starts_for_q_tile(q_start, n_q, n_k, block_m, block_n, causal):
            k_end = min(k_start + block_n, n_k)
            dq.append((q_start, k_start, tile_mask(q_start, q_end, k_start, k_end, causal) is not None))
    total = num_blocks(n_q, block_m) * num_blocks(n_k, block_n)
    return {"dk_dv": dk_dv, "dq": dq, "total": total}


# --------------------------------------------------------------------------- validation

def _validate_backward_inputs(q, k, v, o, lse, do, causal, scale) -> None:
    validate_qkv_numpy(q, k, v, scale)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    o_shape = q.shape[:-1] + (v.shape[-1],)
    for name, x, shape in (("o", o, o_shape), ("do", do, o_shape), ("lse", lse, q.shape[:-1])):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
        if x.dtype.type not in NUMPY_FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32 or float64, got dtype {x.dtype}")
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape} (from q {q.shape} and v {v.shape}), "
                             f"got {x.shape}")
    if np.isnan(lse).any() or np.isposinf(lse).any():
        raise ValueError("lse must be finite (the log-sum-exp the forward returned), got NaN or +inf")


# --------------------------------------------------------------------------- the drivers

def tiled_backward(q, k, v, o, lse, do, causal: bool = False, scale: float | None = None,
                   block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N, *,
                   compute_d: Callable = compute_d, dk_dv_step: Callable = dk_dv_step,
                   dq_step: Callable = dq_step):
    """:func:`flash_attention_numpy_backward` with its three pieces replaceable.

    Chapter 07 plugs a learner's ``compute_d`` and ``dk_dv_step`` into these loops; the
    signatures are those of the module-level functions of the same names.
    """
    _validate_backward_inputs(q, k, v, o, lse, do, causal, scale)
    block_m = validate_block_size("block_m", block_m)
    block_n = validate_block_size("block_n", block_n)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    dtype = np.result_type(q, k, v, o, do)  # compute in the widest input precision
    lead = q.shape[:-2]
    n_q, d = q.shape[-2:]
    n_k, d_v = v.shape[-2:]
    # Flatten the leading dims (batch, heads, ...) into one: one "program column" per head.
    q3, do3, o3 = (x.reshape(-1, n_q, x.shape[-1]).astype(dtype, copy=False) for x in (q, do, o))
    k3, v3 = (x.reshape(-1, n_k, x.shape[-1]).astype(dtype, copy=False) for x in (k, v))
    lse2 = lse.reshape(-1, n_q).astype(dtype, copy=False)  # (B, N_q)
    d2 = np.asarray(compute_d(o3, do3))  # (B, N_q), the preprocessing pass
    dq = np.zeros_like(q3)  # (B, N_q, d)
    dk = np.zeros_like(k3)  # (B, N_k, d)
    dv = np.zeros_like(v3)  # (B, N_k, d_v)
    for b in range(q3.shape[0]):
        # dK/dV pass: each K/V tile stays put ("in SRAM") while the Q tiles stream past it.
        for k_start in range(0, n_k, block_n):
            k_end = min(k_start + block_n, n_k)
            k_j, v_j = k3[b, k_start:k_end], v3[b, k_start:k_end]
            dk_j = np.zeros((k_end - k_start, d), dtype)
            dv_j = np.zeros((k_end - k_start, d_v), dtype)
            for q_start in _q_starts_for_kv_tile(k_start, n_q, block_m, block_n, causal):
                q_end = min(q_start + block_m, n_q)
                rows = slice(q_start, q_end)
                dk_j, dv_j = dk_dv_step(q3[b, rows], do3[b, rows], lse2[b, rows], d2[b, rows],
                                        k_j, v_j, dk_j, dv_j, scale,
                                        tile_mask(q_start, q_end, k_start, k_end, causal))
            dk[b, k_start:k_end], dv[b, k_start:k_end] = dk_j, dv_j  # written once
        # dQ pass: each Q tile stays put while the K/V tiles it can see stream past it.
        for q_start in range(0, n_q, block_m):
            q_end = min(q_start + block_m, n_q)
            rows = slice(q_start, q_end)
            dq_i = np.zeros((q_end - q_start, d), dtype)
            for k_start in _k_starts_for_q_tile(q_start, n_q, n_k, block_m, block_n, causal):
                k_end = min(k_start + block_n, n_k)
                dq_i = dq_step(q3[b, rows], do3[b, rows], lse2[b, rows], d2[b, rows],
                               k3[b, k_start:k_end], v3[b, k_start:k_end], dq_i, scale,
                               tile_mask(q_start, q_end, k_start, k_end, causal))
            dq[b, rows] = dq_i  # written once
    return (dq.reshape(lead + (n_q, d)).astype(q.dtype, copy=False),
            dk.reshape(lead + (n_k, d)).astype(k.dtype, copy=False),
            dv.reshape(lead + (n_k, d_v)).astype(v.dtype, copy=False))


def flash_attention_numpy_backward(q, k, v, o, lse, do, causal: bool = False,
                                   scale: float | None = None, block_m: int = DEFAULT_BLOCK_M,
                                   block_n: int = DEFAULT_BLOCK_N):
    """The FlashAttention backward in NumPy: gradients from tiles, ``P`` rebuilt from ``lse``.

    Args:
        q: ``(..., N_q, d)``; k: ``(..., N_k, d)``; v: ``(..., N_k, d_v)``; float32 or float64.
        o: the forward's output ``(..., N_q, d_v)``; lse: its natural-log log-sum-exp per query
            row ``(..., N_q)`` (as returned by ``flash_attention_numpy``).
        do: ``∂L/∂o``, shape of ``o``.
        causal: top-left aligned causal mask (key ``j`` visible to query ``i`` when ``j <= i``).
        scale: score scale, default ``1/sqrt(d)``.
        block_m, block_n: tile sizes (query rows, key rows); need not divide ``N``.

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtypes of ``q``, ``k``, ``v``.

    Raises:
        TypeError / ValueError naming the argument, for non-arrays, non-float dtypes and shapes
        that do not fit together.
    """
    return tiled_backward(q, k, v, o, lse, do, causal, scale, block_m, block_n)


def attention_backward_numpy(q, k, v, do, causal: bool = False, scale: float | None = None):
    """The backward formulas on full matrices, in float64 — the untiled version, for checking.

    Args:
        q: ``(..., N_q, d)``; k: ``(..., N_k, d)``; v: ``(..., N_k, d_v)``; do: ``(..., N_q, d_v)``.

    Returns:
        ``(dq, dk, dv)`` as float64 arrays shaped like ``q``, ``k``, ``v``.
    """
    o, lse = naive_attention_numpy(*(x.astype(np.float64) for x in (q, k, v)), causal, scale)
    _validate_backward_inputs(q, k, v, o, lse, do, causal, scale)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    t = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731 - transpose of the last two axes
    s = scale * (q64 @ t(k64))  # (..., N_q, N_k)
    if causal:
        s = np.where(causal_mask(q.shape[-2], k.shape[-2]), s, -np.inf)
    p = np.exp(s - lse[..., None])  # (..., N_q, N_k)
    dv = t(p) @ do64  # (..., N_k, d_v)
    dp = do64 @ t(v64)  # (..., N_q, N_k)
    ds = p * (dp - compute_d(o, do64)[..., None])  # (..., N_q, N_k)
    dq = scale * (ds @ k64)  # (..., N_q, d)
    dk = scale * (t(ds) @ q64)  # (..., N_k, d)
    return dq, dk, dv
