"""The FlashAttention backward kernels in Triton (chapter 07).

With ``P = softmax(S)``, ``S = scale · q kᵀ`` and the upstream gradient ``dO`` (chapter 07
derives each line):

    dV = Pᵀ dO              dP = dO Vᵀ
    dS = P ∘ (dP − D)       with D = rowsum(dO ∘ O)   (= rowsum(P ∘ dP), one number per query)
    dQ = scale · dS K       dK = scale · dSᵀ Q

P is never stored: each kernel rebuilds a tile of it from q, k and the log-sum-exp saved by the
forward, ``P = exp(S − lse)`` (in log2 units: ``exp2(S · LOG2_E − lse · LOG2_E)``).

Three kernels, no atomics, so the result is bit-for-bit deterministic:

1. ``preprocess``: ``D = rowsum(dO ∘ O)``, one value per query row.
2. ``dkdv``: one program per BLOCK_N tile of keys; it loops over the query tiles and accumulates
   dK and dV for its keys in registers (the keys' rows are written once, by one program).
3. ``dq``: one program per BLOCK_M tile of queries; it loops over the key tiles and accumulates dQ.

The price of not using atomics: S and dP are recomputed in both the dK/dV and the dQ kernel
(7 matrix products per tile pair instead of 5). The FlashAttention-2 code instead adds dQ
contributions from the dK/dV loop with fp32 atomic adds: fewer FLOPs, but the order of the adds
(and so the last bits of dQ) changes from run to run.

Masks follow the forward: tiles that straddle the causal diagonal or the ragged end of the
sequence get a mask, the others run unmasked, and tiles entirely above the diagonal are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib import runtime
from course_lib.kernels import tuning
from course_lib.kernels.forward import LOG2_E, LOG2_E_FLOAT, compute_dtype, kernel_dtypes, padded_head_dim

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

PREPROCESS_BLOCK_M = 64  # query rows per program of the D kernel (memory-bound; any size works)


@triton.jit
def preprocess_kernel(O, DO, DELTA,  # O, DO: (B, H, N_Q, d); DELTA: (B, H, N_Q) contiguous
                      stride_ob, stride_oh, stride_on, stride_od,
                      stride_dob, stride_doh, stride_don, stride_dod,
                      n_heads, n_q,
                      D: tl.constexpr, HEAD_DIM: tl.constexpr, ACC_DTYPE: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """D_i = sum_c dO_ic · O_ic for one BLOCK_M tile of query rows. Reads 2·BLOCK_M·d, writes BLOCK_M."""
    num_m_tiles = tl.cdiv(n_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_bh = pid // num_m_tiles
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    offs_m = (pid % num_m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < D)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
                mask=mask, other=0.0).to(ACC_DTYPE)  # (BLOCK_M, HEAD_DIM)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=mask, other=0.0).to(ACC_DTYPE)  # (BLOCK_M, HEAD_DIM)
    tl.store(DELTA + pid_bh * n_q + offs_m, tl.sum(o * do, axis=1), mask=offs_m < n_q)


@triton.jit
def _dkdv_q_tiles(dk, dv, k, v, q_tile_ptrs, do_tile_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                  offs_m, offs_n, d_mask, n_q, q_start, q_end, qk_scale_log2,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                  ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the contributions of query tiles [q_start, q_end) to this program's dK, dV.

    Works with transposed score tiles (keys along rows) so that dK and dV come out as
    (BLOCK_N, HEAD_DIM) without transposing the accumulators.
    """
    for start_m in range(q_start, q_end, BLOCK_M):
        rows = start_m + offs_m  # (BLOCK_M,) query indices of this tile
        load_mask = (rows[:, None] < n_q) & d_mask[None, :]
        q = tl.load(q_tile_ptrs + start_m * stride_qn, mask=load_mask, other=0.0)  # (BLOCK_M, HEAD_DIM)
        lse_log2 = tl.load(lse_ptr + rows, mask=rows < n_q, other=0.0) * LOG2_E  # (BLOCK_M,)
        # P^T rebuilt from the saved log-sum-exp                               (BLOCK_N, BLOCK_M)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale_log2
        p_t = tl.math.exp2(s_t - lse_log2[None, :])
        if MASKED:
            visible = rows[None, :] < n_q  # ragged end of the queries
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :])  # key j <= query i
            p_t = tl.where(visible, p_t, 0.0)
        do = tl.load(do_tile_ptrs + start_m * stride_don, mask=load_mask, other=0.0)  # (BLOCK_M, HEAD_DIM)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        delta = tl.load(delta_ptr + rows, mask=rows < n_q, other=0.0)  # (BLOCK_M,)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])  # (BLOCK_N, BLOCK_M)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return dk, dv


@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,  # LSE, DELTA: (B, H, N_Q) contiguous
                stride_qb, stride_qh, stride_qn, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_dob, stride_doh, stride_don, stride_dod,
                stride_dkb, stride_dkh, stride_dkn, stride_dkd,  # DK and DV share one layout
                n_heads, n_q, n_k, scale, qk_scale_log2,
                D: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dK and dV for one BLOCK_N tile of keys of one (batch, head)."""
    num_n_tiles = tl.cdiv(n_k, BLOCK_N)
    pid = tl.program_id(0)
    pid_bh = pid // num_n_tiles
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    start_n = (pid % num_n_tiles) * BLOCK_N

    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key rows of this program
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows within a tile
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < D
    kv_mask = (offs_n[:, None] < n_k) & d_mask[None, :]
    k = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)  # (BLOCK_N, HEAD_DIM)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)  # (BLOCK_N, HEAD_DIM)
    q_tile_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
    do_tile_ptrs = DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod
    lse_ptr = LSE + pid_bh * n_q
    delta_ptr = DELTA + pid_bh * n_q
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=ACC_DTYPE)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=ACC_DTYPE)

    # Query tiles, in order: [q_lo, band_end) straddle the diagonal (masked); [band_end, full_end)
    # need no mask; [full_end, n_q) is the ragged end (masked). Tiles before q_lo only hold
    # queries i < start_n, which see none of these keys: skipped.
    full_end = (n_q // BLOCK_M) * BLOCK_M
    if CAUSAL:
        q_lo = (start_n // BLOCK_M) * BLOCK_M
        # first query tile whose every row i >= the last key start_n + BLOCK_N - 1
        band_end = tl.maximum(q_lo, tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, full_end))
        tail_start = tl.maximum(band_end, full_end)
    else:
        q_lo = 0
        band_end = 0
        tail_start = full_end
    dk, dv = _dkdv_q_tiles(dk, dv, k, v, q_tile_ptrs, do_tile_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                           offs_m, offs_n, d_mask, n_q, q_lo, band_end, qk_scale_log2,
                           True, CAUSAL, BLOCK_M, ACC_DTYPE, DOT_PRECISION)
    dk, dv = _dkdv_q_tiles(dk, dv, k, v, q_tile_ptrs, do_tile_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                           offs_m, offs_n, d_mask, n_q, band_end, full_end, qk_scale_log2,
                           False, CAUSAL, BLOCK_M, ACC_DTYPE, DOT_PRECISION)
    dk, dv = _dkdv_q_tiles(dk, dv, k, v, q_tile_ptrs, do_tile_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                           offs_m, offs_n, d_mask, n_q, tail_start, n_q, qk_scale_log2,
                           True, CAUSAL, BLOCK_M, ACC_DTYPE, DOT_PRECISION)

    dk = dk * scale  # dK = scale · dSᵀ Q: the scale was left out of the loop
    out_offs = b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    tl.store(DK + out_offs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_offs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_kv_tiles(dq, q, do, lse_log2, delta, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                 offs_m, offs_n, d_mask, n_k, kv_start, kv_end, qk_scale_log2,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                 ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the contributions of key tiles [kv_start, kv_end) to this program's dQ."""
    for start_n in range(kv_start, kv_end, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key indices of this tile
        load_mask = (cols[:, None] < n_k) & d_mask[None, :]
        k = tl.load(k_tile_ptrs + start_n * stride_kn, mask=load_mask, other=0.0)  # (BLOCK_N, HEAD_DIM)
        v = tl.load(v_tile_ptrs + start_n * stride_vn, mask=load_mask, other=0.0)  # (BLOCK_N, HEAD_DIM)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale_log2
        p = tl.math.exp2(s - lse_log2[:, None])  # (BLOCK_M, BLOCK_N)
        if MASKED:
            visible = cols[None, :] < n_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])  # (BLOCK_M, BLOCK_N)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return dq


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
              stride_qb, stride_qh, stride_qn, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_dob, stride_doh, stride_don, stride_dod,
              stride_dqb, stride_dqh, stride_dqn, stride_dqd,
              n_heads, n_q, n_k, scale, qk_scale_log2,
              D: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
              ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dQ for one BLOCK_M tile of queries of one (batch, head)."""
    num_m_tiles = tl.cdiv(n_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_bh = pid // num_m_tiles
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    start_m = (pid % num_m_tiles) * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows of this program
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < D
    row_ok = offs_m < n_q
    q_mask = row_ok[:, None] & d_mask[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)  # (BLOCK_M, HEAD_DIM)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=q_mask, other=0.0)  # (BLOCK_M, HEAD_DIM)
    lse_log2 = tl.load(LSE + pid_bh * n_q + offs_m, mask=row_ok, other=0.0) * LOG2_E  # (BLOCK_M,)
    delta = tl.load(DELTA + pid_bh * n_q + offs_m, mask=row_ok, other=0.0)  # (BLOCK_M,)
    k_tile_ptrs = K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_tile_ptrs = V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DTYPE)

    # Same tile split as the forward: unmasked tiles first, then the diagonal band / ragged end.
    if CAUSAL:
        kv_end = tl.minimum(n_k, start_m + BLOCK_M)
        full_end = tl.minimum((start_m + 1) // BLOCK_N, n_k // BLOCK_N) * BLOCK_N
    else:
        kv_end = n_k
        full_end = (n_k // BLOCK_N) * BLOCK_N
    dq = _dq_kv_tiles(dq, q, do, lse_log2, delta, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                      offs_m, offs_n, d_mask, n_k, 0, full_end, qk_scale_log2,
                      False, CAUSAL, BLOCK_N, ACC_DTYPE, DOT_PRECISION)
    dq = _dq_kv_tiles(dq, q, do, lse_log2, delta, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                      offs_m, offs_n, d_mask, n_k, full_end, kv_end, qk_scale_log2,
                      True, CAUSAL, BLOCK_N, ACC_DTYPE, DOT_PRECISION)

    dq = dq * scale  # dQ = scale · dS K
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=q_mask)


_AUTOTUNE_KEY = ["n_q", "n_k", "HEAD_DIM", "CAUSAL", "DOT_PRECISION"]
dkdv_kernel_tuned = triton.autotune(
    configs=tuning.dkdv_configs(), key=_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": tuning.prune_for_head_dim})(dkdv_kernel)
dq_kernel_tuned = triton.autotune(
    configs=tuning.dq_configs(), key=_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": tuning.prune_for_head_dim})(dq_kernel)


def _launch(kernel, tuned, n_tiles_of, blocks, args, meta):
    """Launch with a fixed config (interpreter, tests) or through the autotuner (GPU)."""
    if blocks is not None:
        grid = (n_tiles_of(blocks.block_m, blocks.block_n),)
        kernel[grid](*args, **meta, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n,
                     num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    else:
        tuned[lambda cfg: (n_tiles_of(cfg["BLOCK_M"], cfg["BLOCK_N"]),)](*args, **meta)


def attention_backward(do, q, k, v, o, lse, causal: bool, scale: float,
                       dkdv_blocks: tuning.Blocks | None = None, dq_blocks: tuning.Blocks | None = None):
    """Gradients of attention w.r.t. q, k, v, on ``(B, H, N, d)`` views.

    Args:
        do: ``(B, H, N_q, d)`` upstream gradient; q, o: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)``;
            any strides. lse: ``(B, H, N_q)`` contiguous, from :func:`attention_forward`.
        causal, scale: as in the forward.
        dkdv_blocks, dq_blocks: force a launch config per kernel; None = interpreter default /
            autotune.

    Returns:
        ``(dq, dk, dv)``, contiguous, shaped like q, k, v, in their dtype.
    """
    interpreted = _rt.interpreted
    work = compute_dtype(q.dtype, interpreted)
    dow, qw, kw, vw, ow = (x.to(work) for x in (do, q, k, v, o))
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    n_bh = batch * heads
    acc_dtype, precision = kernel_dtypes(work)
    meta = dict(D=d, HEAD_DIM=padded_head_dim(d), ACC_DTYPE=acc_dtype)

    delta = torch.empty_like(lse)  # (B, H, N_q): D = rowsum(dO ∘ O)
    preprocess_kernel[(triton.cdiv(n_q, PREPROCESS_BLOCK_M) * n_bh,)](
        ow, dow, delta, *ow.stride(), *dow.stride(), heads, n_q, **meta, BLOCK_M=PREPROCESS_BLOCK_M)

    dq = torch.empty((batch, heads, n_q, d), dtype=work, device=q.device)
    dk = torch.empty((batch, heads, n_k, d), dtype=work, device=q.device)
    dv = torch.empty_like(dk)
    meta.update(CAUSAL=bool(causal), DOT_PRECISION=precision)
    common = (*qw.stride(), *kw.stride(), *vw.stride(), *dow.stride())
    scalars = (heads, n_q, n_k, scale, scale * LOG2_E_FLOAT)
    if interpreted:
        dkdv_blocks = dkdv_blocks or tuning.INTERPRETER_BACKWARD
        dq_blocks = dq_blocks or tuning.INTERPRETER_BACKWARD
    elif not tuning.autotune_enabled():
        dkdv_blocks = dkdv_blocks or tuning.gpu_default("dkdv", meta["HEAD_DIM"], qw.element_size())
        dq_blocks = dq_blocks or tuning.gpu_default("dq", meta["HEAD_DIM"], qw.element_size())
    _launch(dkdv_kernel, dkdv_kernel_tuned, lambda bm, bn: triton.cdiv(n_k, bn) * n_bh, dkdv_blocks,
            (qw, kw, vw, dow, lse, delta, dk, dv, *common, *dk.stride(), *scalars), meta)
    _launch(dq_kernel, dq_kernel_tuned, lambda bm, bn: triton.cdiv(n_q, bm) * n_bh, dq_blocks,
            (qw, kw, vw, dow, lse, delta, dq, *common, *dq.stride(), *scalars), meta)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
