"""The FlashAttention backward kernels in Triton (chapter 07).

With ``P = softmax(S)``, ``S = scale · q kᵀ`` and the upstream gradient ``dO`` (chapter 07
derives each line):

    dV = Pᵀ dO              dP = dO Vᵀ
    dS = P ∘ (dP − D)       with D = rowsum(dO ∘ O)   (= rowsum(P ∘ dP), one number per query)

The paper's ``D`` is called ``delta`` in the code (``D`` would read like a head dim).
    dQ = scale · dS K       dK = scale · dSᵀ Q

P is never stored: each kernel rebuilds a tile of it from q, k and the log-sum-exp saved by the
forward, ``P = exp(S − lse)`` (in log2 units: ``exp2(S · LOG2_E − lse · LOG2_E)``).

Three kernels, no atomics, so the result is bit-for-bit deterministic:

1. ``preprocess``: ``delta = rowsum(dO ∘ O)`` (the paper's D), one value per query row.
2. ``dkdv``: one program per BLOCK_N tile of keys; it loops over the query tiles and accumulates
   dK and dV for its keys in registers (the keys' rows are written once, by one program).
3. ``dq``: one program per BLOCK_M tile of queries; it loops over the key tiles and accumulates dQ.

The price of not using atomics: S and dP are recomputed in both the dK/dV and the dQ kernel
(7 matrix products per tile pair instead of 5). The FlashAttention-2 code instead adds dQ
contributions from the dK/dV loop with fp32 atomic adds: fewer FLOPs, but the order of the adds
(and so the last bits of dQ) changes from run to run.

Masks follow the forward: tiles that straddle the causal diagonal or the ragged end of the
sequence get a mask, the others run unmasked, and tiles entirely above the diagonal are skipped.
The pointers, masks and tile splits come from :mod:`course_lib.kernels.tiles`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib.platform import runtime
from course_lib.kernels import fit, tiles, tuning
from course_lib.kernels.launch import CachedLaunch
from course_lib.kernels.forward import LOG2_E_FLOAT, compute_dtype, kernel_dtypes, padded_head_dim
from course_lib.kernels.tiles import LOG2_E

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

# How the dK/dV kernel also produces dQ: not at all (the two-kernel backward), by one fp32 atomic
# add per element, or by one TMA reduce-add per tile (Hopper).
DQ_NONE: tl.constexpr = tl.constexpr(0)
DQ_ATOMIC: tl.constexpr = tl.constexpr(1)
DQ_TMA: tl.constexpr = tl.constexpr(2)

PREPROCESS_BLOCK_M = 64  # query rows per program of the delta kernel (memory-bound; any size works)

# Chapter 07's check replays classic learner mistakes on these kernels: they are its mistake
# models. ``MISTAKE`` is a constexpr that is 0 in the library, so every ``if MISTAKE ...`` below
# is removed at compile time and the library's kernels compile exactly as they would without it.
MISTAKES = ("dk_no_scale", "dq_no_scale", "d_from_tile", "tile_softmax", "no_causal_mask",
            "dv_p_not_pt", "dk_ds_not_dst", "ds_sign", "dq_overwrite", "exp2_lse_natural",
            "no_lse", "kv_end_block_n", "rowstats_no_head")
MISTAKE_CODES = {name: code for code, name in enumerate(MISTAKES, 1)}
_DK_NO_SCALE: tl.constexpr = tl.constexpr(MISTAKE_CODES["dk_no_scale"])
_DQ_NO_SCALE: tl.constexpr = tl.constexpr(MISTAKE_CODES["dq_no_scale"])
_D_FROM_TILE: tl.constexpr = tl.constexpr(MISTAKE_CODES["d_from_tile"])
_TILE_SOFTMAX: tl.constexpr = tl.constexpr(MISTAKE_CODES["tile_softmax"])
_NO_CAUSAL_MASK: tl.constexpr = tl.constexpr(MISTAKE_CODES["no_causal_mask"])
_DV_P_NOT_PT: tl.constexpr = tl.constexpr(MISTAKE_CODES["dv_p_not_pt"])
_DK_DS_NOT_DST: tl.constexpr = tl.constexpr(MISTAKE_CODES["dk_ds_not_dst"])
_DS_SIGN: tl.constexpr = tl.constexpr(MISTAKE_CODES["ds_sign"])
_DQ_OVERWRITE: tl.constexpr = tl.constexpr(MISTAKE_CODES["dq_overwrite"])
_EXP2_LSE_NATURAL: tl.constexpr = tl.constexpr(MISTAKE_CODES["exp2_lse_natural"])
_NO_LSE: tl.constexpr = tl.constexpr(MISTAKE_CODES["no_lse"])
_KV_END_BLOCK_N: tl.constexpr = tl.constexpr(MISTAKE_CODES["kv_end_block_n"])
_ROWSTATS_NO_HEAD: tl.constexpr = tl.constexpr(MISTAKE_CODES["rowstats_no_head"])


@triton.jit
def preprocess_kernel(O, DO, DELTA,  # O, DO: (B, H, N_Q, d); DELTA: (B, H, N_Q) contiguous
                      stride_ob, stride_oh, stride_on, stride_od,
                      stride_dob, stride_doh, stride_don, stride_dod,
                      n_heads, n_q,
                      HEAD_DIM_REAL: tl.constexpr, HEAD_DIM: tl.constexpr, ACC_DTYPE: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """delta = rowsum(dO ∘ O) (the paper's D) for one BLOCK_M tile of query rows.

    Reads 2·BLOCK_M·d elements, writes BLOCK_M.
    """
    pid_bh, b, h, start_m = tiles.program_tile(n_q, n_heads, BLOCK=BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = tiles.row_mask(offs_m, n_q, offs_d < HEAD_DIM_REAL)
    o = tiles.load_tile(O, b, h, offs_m, offs_d, mask,
                        stride_ob, stride_oh, stride_on, stride_od).to(ACC_DTYPE)  # (BLOCK_M, HEAD_DIM)
    do = tiles.load_tile(DO, b, h, offs_m, offs_d, mask,
                         stride_dob, stride_doh, stride_don, stride_dod).to(ACC_DTYPE)  # (BLOCK_M, HEAD_DIM)
    tl.store(DELTA + pid_bh * n_q + offs_m, tl.sum(o * do, axis=1), mask=offs_m < n_q)


@triton.jit
def _mistaken_p(p, s, lse_log2, seen, MISTAKE: tl.constexpr, KEYS: tl.constexpr):
    """Mistake models only: the tile of P a classic mistake rebuilds, else ``p`` as it is.

    ``s``: scores in log2 units; ``lse_log2``: broadcast to ``s``; ``seen``: what that mistaken
    code keeps (keys inside the sequence, and the causal mask unless it forgot it); ``KEYS``: the
    keys' axis (1 for P, 0 for Pᵀ).
    """
    if MISTAKE == _TILE_SOFTMAX:  # a softmax over this tile's keys alone
        s = tl.where(seen, s, float("-inf"))
        e = tl.math.exp2(s - tl.expand_dims(tl.max(s, axis=KEYS), KEYS))
        p = tl.where(seen, e / tl.expand_dims(tl.sum(e, axis=KEYS), KEYS), 0.0)
    elif MISTAKE == _NO_LSE:  # exp(S): the saved lse is not subtracted
        p = tl.where(seen, tl.math.exp2(s), 0.0)
    elif MISTAKE == _EXP2_LSE_NATURAL:  # log2-unit scores minus the natural-log lse
        p = tl.where(seen, tl.math.exp2(s - lse_log2 / LOG2_E), 0.0)
    elif MISTAKE == _NO_CAUSAL_MASK:
        p = tl.where(seen, tl.math.exp2(s - lse_log2), 0.0)
    return p


@triton.jit
def _seen_by_mistake(offs_q, offs_k, n_q, n_k, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                     MISTAKE: tl.constexpr):
    """Mistake models only: ``(len(offs_q), len(offs_k))`` True where a learner's kernel keeps
    P: both indices inside their sequences and, in masked tiles, the causal mask (forgotten by
    ``no_causal_mask``)."""
    seen = (offs_q[:, None] < n_q) & (offs_k[None, :] < n_k)
    if MASKED:
        if CAUSAL:
            if MISTAKE != _NO_CAUSAL_MASK:
                seen = seen & (offs_k[None, :] <= offs_q[:, None])
    return seen


@triton.jit
def _dkdv_q_tiles(dk, dv, k, v, q_tile_ptrs, do_tile_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                  offs_m, offs_n, d_mask, n_q, n_k, q_start, q_end, qk_scale_log2,
                  dq_acc, stride_dqan, scale,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                  ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, MISTAKE: tl.constexpr,
                  DQ_MODE: tl.constexpr):
    """Add the contributions of query tiles [q_start, q_end) to this program's dK, dV.

    Works with transposed score tiles (keys along rows) so that dK and dV come out as
    (BLOCK_N, HEAD_DIM) without transposing the accumulators. With ``DQ_MODE`` (the one-pass
    backward) it also adds this key tile's share of dQ, ``scale · dS K``, into the fp32 ``dq_acc``:
    pointers to the head's first query tile (DQ_ATOMIC) or a descriptor of the head's rows
    (DQ_TMA).
    """
    for start_m in range(q_start, q_end, BLOCK_M):
        # rows (BLOCK_M,) query indices of this tile; q (BLOCK_M, HEAD_DIM)
        rows, load_mask, q = tiles.load_tile_at(q_tile_ptrs, start_m, offs_m, n_q, d_mask, stride_qn)
        lse_log2 = tl.load(lse_ptr + rows, mask=rows < n_q, other=0.0) * LOG2_E  # (BLOCK_M,)
        # P^T rebuilt from the saved log-sum-exp                               (BLOCK_N, BLOCK_M)
        s_t = tiles.scores_log2(k, q, qk_scale_log2, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
        p_t = tl.math.exp2(s_t - lse_log2[None, :])
        if MASKED:
            p_t = tl.where(tiles.visible_t(offs_n, rows, n_q, CAUSAL=CAUSAL), p_t, 0.0)
        if MISTAKE != 0:  # chapter 07's mistake models (MISTAKE is 0 in the library: compiled away)
            p_t = _mistaken_p(p_t, s_t, lse_log2[None, :], tl.trans(_seen_by_mistake(
                rows, offs_n, n_q, n_k, MASKED=MASKED, CAUSAL=CAUSAL, MISTAKE=MISTAKE)), MISTAKE, 0)
        do = tl.load(do_tile_ptrs + start_m * stride_don, mask=load_mask, other=0.0)  # (BLOCK_M, HEAD_DIM)
        if MISTAKE == _DV_P_NOT_PT:
            dv = tl.dot(tl.trans(p_t).to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        delta = tl.load(delta_ptr + rows, mask=rows < n_q, other=0.0)  # (BLOCK_M,)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)  # (BLOCK_N, BLOCK_M)
        if MISTAKE == _D_FROM_TILE:
            delta = tl.sum(p_t * dp_t, axis=0)
        ds_t = p_t * (dp_t - delta[None, :])  # (BLOCK_N, BLOCK_M)
        if MISTAKE == _DS_SIGN:
            ds_t = -ds_t
        if MISTAKE == _DK_DS_NOT_DST:
            ds_t = tl.trans(ds_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        if DQ_MODE != DQ_NONE:  # the one-pass backward: this key tile's part of dQ = scale · dS K
            dq = tl.dot(tl.trans(ds_t).to(k.dtype), k, input_precision=DOT_PRECISION,
                        out_dtype=ACC_DTYPE) * scale  # (BLOCK_M, HEAD_DIM)
            if DQ_MODE == DQ_TMA:  # one bulk reduce-add of the whole tile (Hopper's TMA)
                dq_acc.atomic_add([start_m, 0], dq)
            else:  # one atomic add per element, in whatever order the programs arrive
                tl.atomic_add(dq_acc + start_m * stride_dqan, dq, mask=load_mask, sem="relaxed")
    return dk, dv


@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA,  # LSE, DELTA: (B, H, N_Q) contiguous
                stride_qb, stride_qh, stride_qn, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_dob, stride_doh, stride_don, stride_dod,
                DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd,  # the outputs share one layout
                DQ_ACC,  # one-pass backward only: fp32 (B, H, N_Q, HEAD_DIM_REAL) contiguous, zeroed
                n_heads, n_q, n_k, scale, qk_scale_log2,
                HEAD_DIM_REAL: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MISTAKE: tl.constexpr = 0,
                DQ_MODE: tl.constexpr = 0):
    """One program: dK and dV for one BLOCK_N tile of keys of one (batch, head).

    Grid: cdiv(n_k, BLOCK_N) · B · H programs on one axis. Keeps its K, V tiles and the dK, dV
    accumulators on chip and loops over the query tiles that see its keys. ``MISTAKE`` (0: none)
    replays one of :data:`MISTAKES` for chapter 07's check. ``DQ_MODE`` (0: none) makes it the
    one-pass backward: it also adds its keys' share of dQ into ``DQ_ACC`` (a pointer, or with
    :data:`DQ_TMA` a descriptor of one head's ``(N_Q, HEAD_DIM_REAL)`` rows, made here).
    """
    pid_bh, b, h, start_n = tiles.program_tile(n_k, n_heads, BLOCK=BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key rows of this program
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows within a tile
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM_REAL
    kv_mask = tiles.row_mask(offs_n, n_k, d_mask)
    k = tiles.load_tile(K, b, h, offs_n, offs_d, kv_mask,
                        stride_kb, stride_kh, stride_kn, stride_kd)  # (BLOCK_N, HEAD_DIM)
    v = tiles.load_tile(V, b, h, offs_n, offs_d, kv_mask,
                        stride_vb, stride_vh, stride_vn, stride_vd)  # (BLOCK_N, HEAD_DIM)
    q_tile_ptrs = tiles.tile_ptrs(Q, b, h, offs_m, offs_d, stride_qb, stride_qh, stride_qn, stride_qd)
    do_tile_ptrs = tiles.tile_ptrs(DO, b, h, offs_m, offs_d, stride_dob, stride_doh, stride_don, stride_dod)
    lse_ptr = LSE + pid_bh * n_q
    delta_ptr = DELTA + pid_bh * n_q
    if MISTAKE == _ROWSTATS_NO_HEAD:  # mistake model: head 0's rows for every head
        lse_ptr, delta_ptr = LSE, DELTA
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=ACC_DTYPE)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=ACC_DTYPE)
    dq_acc = DQ_ACC
    if DQ_MODE == DQ_ATOMIC:  # pointers to the rows offs_m of the head's first query tile
        dq_acc = DQ_ACC + (pid_bh * n_q + offs_m[:, None]) * HEAD_DIM_REAL + offs_d[None, :]
    elif DQ_MODE == DQ_TMA:  # the head's rows; TMA drops what falls past n_q or HEAD_DIM_REAL
        dq_acc = tl.make_tensor_descriptor(DQ_ACC + pid_bh * n_q * HEAD_DIM_REAL, shape=[n_q, HEAD_DIM_REAL],
                                           strides=[HEAD_DIM_REAL, 1], block_shape=[BLOCK_M, HEAD_DIM])

    # Query tiles: the diagonal band (masked), the unmasked middle, the ragged end (masked).
    q_lo, band_end, full_end, tail_start = tiles.q_split(start_n, n_q, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                                         CAUSAL=CAUSAL)
    dk, dv = _dkdv_q_tiles(dk, dv, k, v, q_tile_ptrs, do_tile_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                           offs_m, offs_n, d_mask, n_q, n_k, q_lo, band_end, qk_scale_log2,
                           dq_acc, HEAD_DIM_REAL, scale,
                           MASKED=True, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M,
                           ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION, MISTAKE=MISTAKE,
                           DQ_MODE=DQ_MODE)
    dk, dv = _dkdv_q_tiles(dk, dv, k, v, q_tile_ptrs, do_tile_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                           offs_m, offs_n, d_mask, n_q, n_k, band_end, full_end, qk_scale_log2,
                           dq_acc, HEAD_DIM_REAL, scale,
                           MASKED=False, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M,
                           ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION, MISTAKE=MISTAKE,
                           DQ_MODE=DQ_MODE)
    dk, dv = _dkdv_q_tiles(dk, dv, k, v, q_tile_ptrs, do_tile_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                           offs_m, offs_n, d_mask, n_q, n_k, tail_start, n_q, qk_scale_log2,
                           dq_acc, HEAD_DIM_REAL, scale,
                           MASKED=True, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M,
                           ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION, MISTAKE=MISTAKE,
                           DQ_MODE=DQ_MODE)

    if MISTAKE != _DK_NO_SCALE:
        dk = dk * scale  # dK = scale · dSᵀ Q: the scale was left out of the loop
    out_offs = b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    tl.store(DK + out_offs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_offs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_kv_tiles(dq, q, do, lse_log2, delta, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                 offs_m, offs_n, d_mask, n_q, n_k, kv_start, kv_end, qk_scale_log2,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                 ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, MISTAKE: tl.constexpr):
    """Add the contributions of key tiles [kv_start, kv_end) to this program's dQ."""
    for start_n in range(kv_start, kv_end, BLOCK_N):
        # cols (BLOCK_N,) key indices of this tile; k, v (BLOCK_N, HEAD_DIM)
        cols, load_mask, k = tiles.load_tile_at(k_tile_ptrs, start_n, offs_n, n_k, d_mask, stride_kn)
        v = tl.load(v_tile_ptrs + start_n * stride_vn, mask=load_mask, other=0.0)
        # P rebuilt from the saved log-sum-exp                                 (BLOCK_M, BLOCK_N)
        s = tiles.scores_log2(q, k, qk_scale_log2, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
        p = tl.math.exp2(s - lse_log2[:, None])
        if MASKED:
            p = tl.where(tiles.visible(offs_m, cols, n_k, CAUSAL=CAUSAL), p, 0.0)
        if MISTAKE != 0:  # chapter 07's mistake models (MISTAKE is 0 in the library: compiled away)
            p = _mistaken_p(p, s, lse_log2[:, None], _seen_by_mistake(
                offs_m, cols, n_q, n_k, MASKED=MASKED, CAUSAL=CAUSAL, MISTAKE=MISTAKE), MISTAKE, 1)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)  # (BLOCK_M, BLOCK_N)
        if MISTAKE == _D_FROM_TILE:
            delta = tl.sum(p * dp, axis=1)
        ds = p * (dp - delta[:, None])  # (BLOCK_M, BLOCK_N)
        if MISTAKE == _DS_SIGN:
            ds = -ds
        if MISTAKE == _DQ_OVERWRITE:  # only the last K/V tile's part survives
            dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return dq


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,  # LSE, DELTA: (B, H, N_Q) contiguous
              stride_qb, stride_qh, stride_qn, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_dob, stride_doh, stride_don, stride_dod,
              stride_dqb, stride_dqh, stride_dqn, stride_dqd,
              n_heads, n_q, n_k, scale, qk_scale_log2,
              HEAD_DIM_REAL: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
              ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MISTAKE: tl.constexpr = 0):
    """One program: dQ for one BLOCK_M tile of queries of one (batch, head). ``MISTAKE`` as in
    :func:`dkdv_kernel`."""
    pid_bh, b, h, start_m = tiles.program_tile(n_q, n_heads, BLOCK=BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows of this program
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM_REAL
    row_ok = offs_m < n_q
    q_mask = row_ok[:, None] & d_mask[None, :]
    q = tiles.load_tile(Q, b, h, offs_m, offs_d, q_mask,
                        stride_qb, stride_qh, stride_qn, stride_qd)  # (BLOCK_M, HEAD_DIM)
    do = tiles.load_tile(DO, b, h, offs_m, offs_d, q_mask,
                         stride_dob, stride_doh, stride_don, stride_dod)  # (BLOCK_M, HEAD_DIM)
    row_stats = pid_bh * n_q
    if MISTAKE == _ROWSTATS_NO_HEAD:  # mistake model: head 0's rows for every head
        row_stats = 0
    lse_log2 = tl.load(LSE + row_stats + offs_m, mask=row_ok, other=0.0) * LOG2_E  # (BLOCK_M,)
    delta = tl.load(DELTA + row_stats + offs_m, mask=row_ok, other=0.0)  # (BLOCK_M,)
    k_tile_ptrs = tiles.tile_ptrs(K, b, h, offs_n, offs_d, stride_kb, stride_kh, stride_kn, stride_kd)
    v_tile_ptrs = tiles.tile_ptrs(V, b, h, offs_n, offs_d, stride_vb, stride_vh, stride_vn, stride_vd)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DTYPE)

    # Same tile split as the forward: unmasked tiles first, then the diagonal band / ragged end.
    full_end, kv_end = tiles.kv_split(start_m, n_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    if MISTAKE == _KV_END_BLOCK_N:  # mistake model: the causal loop ends at start_m + BLOCK_N
        if CAUSAL:
            kv_end = tl.minimum(n_k, start_m + BLOCK_N)
            full_end = tl.minimum(full_end, kv_end)
    dq = _dq_kv_tiles(dq, q, do, lse_log2, delta, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                      offs_m, offs_n, d_mask, n_q, n_k, 0, full_end, qk_scale_log2,
                      MASKED=False, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N,
                      ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION, MISTAKE=MISTAKE)
    dq = _dq_kv_tiles(dq, q, do, lse_log2, delta, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                      offs_m, offs_n, d_mask, n_q, n_k, full_end, kv_end, qk_scale_log2,
                      MASKED=True, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N,
                      ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION, MISTAKE=MISTAKE)

    if MISTAKE != _DQ_NO_SCALE:
        dq = dq * scale  # dQ = scale · dS K
    tl.store(tiles.tile_ptrs(DQ, b, h, offs_m, offs_d, stride_dqb, stride_dqh, stride_dqn, stride_dqd),
             dq.to(DQ.dtype.element_ty), mask=q_mask)


_AUTOTUNE_KEY = ["n_q", "n_k", "HEAD_DIM", "CAUSAL", "DOT_PRECISION"]
dkdv_kernel_tuned = triton.autotune(
    configs=tuning.dkdv_configs(), key=_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": tuning.prune_dkdv})(dkdv_kernel)
dq_kernel_tuned = triton.autotune(
    configs=tuning.dq_configs(), key=_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": tuning.prune_dq})(dq_kernel)


def _cached_launch(kernel, tuned, n_tiles_of, blocks, meta: dict, cache: bool) -> CachedLaunch:
    """A fixed config's launch (interpreter, measured GPU table, tests), or the autotuner's."""
    if blocks is not None:
        meta = dict(meta, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, num_warps=blocks.num_warps,
                    num_stages=blocks.num_stages)
        return CachedLaunch(kernel, (n_tiles_of(blocks.block_m, blocks.block_n),), meta, cache)
    return CachedLaunch(tuned, lambda cfg: (n_tiles_of(cfg["BLOCK_M"], cfg["BLOCK_N"]),), meta)


def delta_launch(shape, acc_dtype, cache: bool = False) -> CachedLaunch:
    """The preprocess kernel's launch for ``o`` and ``dO`` of ``shape`` ``(B, H, N_q, d)``: ``delta =
    rowsum(dO ∘ O)``, accumulated in ``acc_dtype`` (run it with :func:`run_delta`)."""
    batch, heads, n_q, d = shape
    return CachedLaunch(preprocess_kernel, (triton.cdiv(n_q, PREPROCESS_BLOCK_M) * batch * heads,),
                        dict(HEAD_DIM_REAL=d, HEAD_DIM=padded_head_dim(d), ACC_DTYPE=acc_dtype,
                             BLOCK_M=PREPROCESS_BLOCK_M), cache)


def run_delta(launch: CachedLaunch, o, do, lse, delta=None, tail=None):
    """``delta`` ``(B, H, N_q)``, laid out like ``lse``: rowsum(dO ∘ O) (the paper's D) by ``launch``
    (:func:`delta_launch`), into ``delta`` when given (:meth:`Buffers.scratch`). ``tail``: the
    launch's arguments after the three tensors (:func:`delta_tail`), when the caller kept them."""
    delta = torch.empty_like(lse) if delta is None else delta
    args = (o, do, delta, *(tail or delta_tail(o, do)))
    if launch.compiled is None and not _rt.interpreted:  # the first launch on a GPU: fit its warps
        _fit_delta(launch, args)
    launch(*args)
    return delta


def _fit_delta(launch: CachedLaunch, args: tuple) -> None:
    """Put the first of :func:`tuning.preprocess_candidates` that this GPU loads without spilling
    (:func:`course_lib.kernels.fit.choose`; the H100 keeps Triton's default 4 warps) into ``launch``'s
    options, before its first launch compiles it."""
    meta = {name: value for name, value in launch.meta.items() if name not in ("BLOCK_M", "num_warps", "num_stages")}
    blocks = fit.choose(preprocess_kernel, tuning.preprocess_candidates(launch.meta["BLOCK_M"], meta["HEAD_DIM"]),
                        args, meta, block_args=lambda b: {"BLOCK_M": b.block_m})
    launch.meta.update(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def delta_tail(o, do) -> tuple:
    """The preprocess kernel's arguments after its tensors: the strides of ``o`` and ``do``, heads, N_q."""
    return (*o.stride(), *do.stride(), o.shape[1], o.shape[2])


def _strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


class Buffers:
    """What one backward call allocates, in as few allocations as its signature allows (issue 33:
    on an H100 a CUDA allocation cost ~7 µs of host time per call in the profile, a view ~1 µs).

    - the scratch: dQ's fp32 accumulator (one-pass backwards: zeroed) and Δ, one buffer; Δ starts
      :data:`SCRATCH_ALIGN_BYTES` aligned, as its own allocation would, so the kernels' pointer
      specialization (16-byte alignment) is the same as with separate buffers;
    - the gradients dq, dk, dv keep one allocation each: they are the call's outputs, and outputs
      that share storage break the custom op's contract (``torch.library.opcheck`` on the H100:
      "Outputs 1 and 2 alias unexpectedly") and would tie ``q.grad``, ``k.grad`` and ``v.grad``
      to one block of memory.

    Only CUDA tensors share allocations: the caching allocator's per-call cost is what this saves.
    On CPU tensors (the interpreter, the sm_90 stand-in) each buffer keeps its own allocation: glibc
    serves blocks over 128 KiB with mmap, and a combined buffer crosses that sooner (measured with
    tools/profile_overhead.py --stand-in 90 at (1, 4, 128, 64): torch.zeros of the combined scratch
    took 1.3 ms per call in the loop, against 3 µs alone; our CPU, 2026-11-27).

    Args:
        q_shape, k_shape: ``(B, H, N_q, d)``, ``(B, H, N_k, d)``. work: the gradients' dtype.
        acc: dQ's accumulator and Δ's dtype. one_pass: whether the call accumulates dQ (zeroed scratch).
        combine: share allocations (None: on CUDA devices only, see above).
    """

    def __init__(self, q_shape, k_shape, work: torch.dtype, acc: torch.dtype, device, one_pass: bool,
                 combine: bool | None = None):
        self.q_shape, self.k_shape, self.work, self.acc, self.device = q_shape, k_shape, work, acc, device
        self.one_pass = one_pass
        self.combine = torch.device(device).type == "cuda" if combine is None else combine
        self.lse_shape = q_shape[:-1]
        n_acc = 1
        for n in q_shape:
            n_acc *= n
        align = SCRATCH_ALIGN_BYTES // acc.itemsize
        self.delta_offset = -(-n_acc // align) * align
        self.scratch_numel = self.delta_offset + n_acc // q_shape[-1]
        self.q_strides, self.lse_strides = _strides(q_shape), _strides(self.lse_shape)
        self.dq_is_acc = one_pass and work == acc  # dq is dQ's accumulator as it is (fp32 work)

    def scratch(self):
        """``(dq_acc, delta)``: dQ's accumulator ``(B, H, N_q, d)``, zeroed (None unless one-pass), and
        Δ's buffer ``(B, H, N_q)``, laid out like the forward's lse."""
        if not self.one_pass:
            return None, torch.empty(self.lse_shape, dtype=self.acc, device=self.device)
        if not self.combine:
            return (torch.zeros(self.q_shape, dtype=self.acc, device=self.device),
                    torch.empty(self.lse_shape, dtype=self.acc, device=self.device))
        buf = torch.zeros(self.scratch_numel, dtype=self.acc, device=self.device)
        return (buf.as_strided(self.q_shape, self.q_strides, 0),
                buf.as_strided(self.lse_shape, self.lse_strides, self.delta_offset))

    def grads(self):
        """``(dq, dk, dv)`` in the work dtype, contiguous, each its own allocation; dq is None for a
        one-pass call (:meth:`dq_from` makes it from the accumulator)."""
        dk = torch.empty(self.k_shape, dtype=self.work, device=self.device)
        dv = torch.empty_like(dk)
        return None if self.one_pass else torch.empty(self.q_shape, dtype=self.work, device=self.device), dk, dv

    def dq_from(self, dq, dq_acc):
        """dQ in the work dtype from the one-pass accumulator ``dq_acc``, rounded once (as ``.to``
        rounds): into ``dq`` when given (the caller's ``out``)."""
        if dq is not None:
            return dq.copy_(dq_acc)
        return dq_acc if self.dq_is_acc else dq_acc.to(self.work)


SCRATCH_ALIGN_BYTES = 512  # the CUDA caching allocator's block alignment


def dq_mode(q: torch.Tensor, head_dim: int, interpreted: bool) -> int:
    """How the one-pass backward adds dQ on this device: :data:`DQ_TMA` (one bulk reduce-add per
    tile) on a Hopper GPU where the fp32 rows of ``dq_acc`` meet TMA's 16-byte rule and
    ``COURSE_LIB_TMA`` is not 0, else :data:`DQ_ATOMIC` (one atomic add per element; the
    interpreter runs the programs one after another, so there the adds are in a fixed order)."""
    if (not interpreted and q.device.type == "cuda" and tuning.tma_enabled()
            and torch.cuda.get_device_capability(q.device)[0] == 9 and (head_dim * 4) % 16 == 0):
        return DQ_TMA.value
    return DQ_ATOMIC.value


class BackwardLaunch:
    """The backward kernels' launches for one call signature: dtypes, the one-pass choice,
    constexprs, launch configs and grids, worked out once (the library's launch plans keep one per
    signature, :mod:`course_lib.kernels.plan`).

    Args:
        q: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)``: their shapes and dtype (and the strides of
            every tensor of a call) are the signature; every call must match them.
        causal, dkdv_blocks, dq_blocks, mistake, deterministic: as :func:`attention_backward`.
        cache: launch later calls by the compiled kernels' handles
            (:class:`~course_lib.kernels.launch.CachedLaunch`); calls then take no ``out``.
    """

    def __init__(self, q, k, v, causal: bool, dkdv_blocks: tuning.Blocks | None = None,
                 dq_blocks: tuning.Blocks | None = None, *, mistake: str | None = None,
                 deterministic: bool = False, cache: bool = False):
        interpreted = _rt.interpreted
        self.dtype, self.work, self.device, self.cache = q.dtype, compute_dtype(q.dtype, interpreted), q.device, cache
        batch, heads, n_q, d = q.shape
        n_k = k.shape[2]
        self.q_shape, self.k_shape, self.sizes = (batch, heads, n_q, d), (batch, heads, n_k, d), (heads, n_q, n_k)
        head_dim = padded_head_dim(d)
        acc_dtype, precision = kernel_dtypes(self.work, head_dim)
        self.delta = delta_launch(q.shape, acc_dtype, cache)
        # the one-pass backward unless asked for reproducible bits, replaying a mistake (chapter 07's
        # models are the two kernels), or where it does not pay on a GPU (tuning.one_pass_pays; a
        # small problem, tuning.small_problem: the two kernels are fewer launches)
        self.one_pass = not deterministic and mistake is None and (
            interpreted or tuning.one_pass_pays(max(n_q, n_k), head_dim, causal, tuning.small_problem_on_gpu(q)))
        self.meta = dict(HEAD_DIM_REAL=d, HEAD_DIM=head_dim, ACC_DTYPE=acc_dtype, CAUSAL=bool(causal),
                         DOT_PRECISION=precision)
        if mistake is not None:
            self.meta.update(MISTAKE=MISTAKE_CODES[mistake])
        self.dq_acc_dtype = torch.float64 if self.work == torch.float64 else torch.float32
        if self.one_pass:
            self.meta.update(DQ_MODE=dq_mode(q, d, interpreted))
        # the kernel makes its descriptor of dq_acc on the device: Triton needs an allocator for it
        self.needs_allocator = self.one_pass and self.meta["DQ_MODE"] == DQ_TMA.value
        self.buffers = Buffers(self.q_shape, self.k_shape, self.work, self.dq_acc_dtype, self.device, self.one_pass)
        if interpreted:
            dkdv_blocks = dkdv_blocks or tuning.INTERPRETER_BACKWARD
            dq_blocks = dq_blocks or tuning.INTERPRETER_BACKWARD
        self.blocks = (dkdv_blocks, dq_blocks)
        self.table = None  # the measured table, fitted to this GPU at the first call
        if not interpreted and not tuning.autotune_enabled():
            self.table = dict(head_dim=head_dim, element_size=self.work.itemsize, seq_len=max(n_q, n_k), causal=causal)
        self.dkdv = self.dq = None
        self.strides = None  # the launches' stride arguments, kept at the first call (cache=True)

    def __call__(self, do, q, k, v, o, lse, scale: float, out=None):
        """``(dq, dk, dv)`` of :func:`attention_backward` for inputs of this signature."""
        if out is not None and self.cache:
            raise ValueError("out: only for a BackwardLaunch made with cache=False (its strides are not the "
                             "signature's)")
        work = self.work
        tensors = (do, q, k, v, o)
        same = do.dtype == work and q.dtype == work and k.dtype == work and v.dtype == work and o.dtype == work
        dow, qw, kw, vw, ow = tensors if same else (x.to(work) for x in tensors)
        dq_acc, delta = self.buffers.scratch()  # dq_acc: zeroed (one-pass), else None
        if out is not None and all(x.dtype == work for x in out):
            dq, dk, dv = out
        else:
            dq, dk, dv = self.buffers.grads()  # one-pass: dq (a slice or None) is filled from dq_acc below
        # every stride is part of the call signature: a cached launch reads them once (H100 host
        # profile: 25 stride() calls were 12 µs of cProfile's own time per forward+backward)
        strides = self.strides or self._strides(ow, dow, qw, kw, vw, dk, dq)
        delta = run_delta(self.delta, ow, dow, lse, delta, strides[0])  # (B, H, N_q): rowsum(dO ∘ O), the paper's D
        if self.one_pass:
            if self.needs_allocator:
                from course_lib.kernels.hopper import ensure_descriptor_allocator

                ensure_descriptor_allocator()
        _, common, dk_strides, dq_strides = strides
        scalars = (*self.sizes, scale, scale * LOG2_E_FLOAT)
        # the two-kernel backward passes dk as a placeholder for dq_acc (the kernel never touches it)
        dkdv_args = (qw, kw, vw, dow, lse, delta, *common, dk, dv, *dk_strides, dk if dq_acc is None else dq_acc,
                     *scalars)
        dq_args = None if self.one_pass else (qw, kw, vw, dow, lse, delta, dq, *common, *dq_strides, *scalars)
        if self.dkdv is None:
            self._make_launches(dkdv_args, dq_args)
        self.dkdv(*dkdv_args)
        if self.one_pass:  # dQ summed in fp32 by the adds, rounded to the work dtype once
            dq = self.buffers.dq_from(dq if out is None else None, dq_acc)
        else:
            self.dq(*dq_args)
        if out is not None:
            for target, grad in zip(out, (dq, dk, dv)):
                if target is not grad:
                    target.copy_(grad)
            return out
        if work == self.dtype:
            return dq, dk, dv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def _strides(self, o, do, q, k, v, dk, dq) -> tuple:
        """``(delta tail, q/k/v/dO strides, dk's, dq's)`` of this call; kept when later calls are
        launched by handle (same signature, same strides), else worked out per call."""
        found = (delta_tail(o, do), (*q.stride(), *k.stride(), *v.stride(), *do.stride()), dk.stride(),
                 None if dq is None else dq.stride())
        if self.cache:
            self.strides = found
        return found

    def _make_launches(self, dkdv_args, dq_args) -> None:
        dkdv_blocks, dq_blocks = self.blocks
        if self.table is not None:  # the measured table, fitted to this GPU
            dkdv_blocks = dkdv_blocks or fit.choose(dkdv_kernel, tuning.gpu_candidates(
                "fused" if self.one_pass else "dkdv", **self.table), dkdv_args, self.meta)
            if not self.one_pass:
                dq_blocks = dq_blocks or fit.choose(dq_kernel, tuning.gpu_candidates("dq", **self.table), dq_args,
                                                    self.meta)
        n_bh = self.q_shape[0] * self.q_shape[1]
        heads, n_q, n_k = self.sizes
        self.dkdv = _cached_launch(dkdv_kernel, dkdv_kernel_tuned, lambda bm, bn: triton.cdiv(n_k, bn) * n_bh,
                                   dkdv_blocks, self.meta, self.cache)
        if not self.one_pass:
            self.dq = _cached_launch(dq_kernel, dq_kernel_tuned, lambda bm, bn: triton.cdiv(n_q, bm) * n_bh,
                                     dq_blocks, self.meta, self.cache)


def attention_backward(do, q, k, v, o, lse, causal: bool, scale: float,
                       dkdv_blocks: tuning.Blocks | None = None, dq_blocks: tuning.Blocks | None = None,
                       *, out=None, mistake: str | None = None, deterministic: bool = False):
    """Gradients of attention w.r.t. q, k, v, on ``(B, H, N, d)`` views.

    Args:
        do: ``(B, H, N_q, d)`` upstream gradient; q, o: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)``;
            any strides. lse: ``(B, H, N_q)`` contiguous, from :func:`attention_forward`.
        causal, scale: as in the forward.
        dkdv_blocks, dq_blocks: force a launch config per kernel (the one-pass backward uses
            ``dkdv_blocks``); None = interpreter default / the measured GPU table (autotune with
            COURSE_LIB_AUTOTUNE=1).
        out: ``(dq, dk, dv)`` to write into (dk and dv with one layout), or None for new tensors.
        mistake: one of :data:`MISTAKES` — chapter 07's check replays that learner mistake (on the
            two-kernel backward); the library never sets it.
        deterministic: False (default): the one-pass backward, one kernel for dK, dV and dQ that
            adds dQ with fp32 atomics (5 tile products per tile pair; the order of the adds, and
            so the last bits of dQ, can change from run to run on a GPU). True: the two-kernel
            backward, dK/dV then dQ with no atomics (7 tile products per pair), bit-for-bit
            reproducible.

    Returns:
        ``(dq, dk, dv)``, contiguous, shaped like q, k, v, in their dtype (``out`` when given).
    """
    return BackwardLaunch(q, k, v, causal, dkdv_blocks, dq_blocks, mistake=mistake, deterministic=deterministic)(
        do, q, k, v, o, lse, scale, out=out)
