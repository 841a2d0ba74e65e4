"""The FlashAttention forward kernel in Triton (chapter 06).

One program owns one tile of BLOCK_M query rows of one (batch, head). It loads its Q tile once,
then walks over the keys and values BLOCK_N rows at a time, keeping the online-softmax state of
chapter 03 in registers:

    m_i  (BLOCK_M,)            running row maximum of the scores (in log2 units, see below)
    l_i  (BLOCK_M,)            running row sum of exp2(score - m_i)
    acc  (BLOCK_M, HEAD_DIM)   running sum of exp2(score - m_i) · v, not yet divided by l_i

and at the end writes ``o = acc / l_i`` and the log-sum-exp ``lse`` that the backward needs.
The N×N score matrix never leaves the chip.

Performance tricks, each introduced in chapter 06's prose before it appears here:

- **exp2 with the scale folded in.** ``exp(x) = exp2(x · LOG2_E)`` and the GPU has a fast exp2
  instruction, so we multiply the scores once by ``scale · LOG2_E`` and work in log2 units.
- **Masks only where needed.** Key tiles entirely inside the sequence and (when causal) entirely
  left of the diagonal need no mask: a first loop runs over them unmasked; a second loop runs over
  the few tiles that straddle the diagonal or the ragged end of the sequence, with the mask.
- **Causal tile skipping.** Key tiles entirely right of the diagonal are never visited.

Layout: every tensor is seen as ``(B, H, N, d)`` through its four strides, so non-contiguous
inputs (a transposed ``(B, N, H, d)`` view, say) need no copy. ``HEAD_DIM`` is the head dim
rounded up to a power of two (``tl.arange`` needs one); columns ``D <= c < HEAD_DIM`` are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib import runtime
from course_lib.kernels import tuning

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

# exp(x) = exp2(x * LOG2_E) and log(x) = log2(x) * LN_2 (math.log2(math.e), math.log(2)).
LOG2_E_FLOAT = 1.4426950408889634
LOG2_E: tl.constexpr = tl.constexpr(LOG2_E_FLOAT)
LN_2: tl.constexpr = tl.constexpr(0.6931471805599453)
# Masked scores are -inf, so exp2 turns them into exactly 0. A row always sees key 0 (top-left
# causal alignment), so its running maximum is finite after the first tile and -inf - m never
# becomes NaN.
MASKED_SCORE: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def _forward_kv_tiles(acc, l_i, m_i, q, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                      offs_m, offs_n, d_mask, n_k, kv_start, kv_end, qk_scale_log2,
                      MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                      ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold key/value tiles [kv_start, kv_end) into the online-softmax state (m_i, l_i, acc)."""
    for start_n in range(kv_start, kv_end, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key indices of this tile
        load_mask = (cols[:, None] < n_k) & d_mask[None, :]
        k = tl.load(k_tile_ptrs + start_n * stride_kn, mask=load_mask, other=0.0)  # (BLOCK_N, HEAD_DIM)
        # scores in log2 units: s = scale * q k^T * LOG2_E                         (BLOCK_M, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale_log2
        if MASKED:
            visible = cols[None, :] < n_k  # ragged end of the keys
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None])  # key j <= query i
            s = tl.where(visible, s, MASKED_SCORE)
        # online softmax (chapter 03): new maximum, rescale the old state, add this tile
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (BLOCK_M,)
        p = tl.math.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_new)  # (BLOCK_M,) how much the old state shrinks
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_tile_ptrs + start_n * stride_vn, mask=load_mask, other=0.0)  # (BLOCK_N, HEAD_DIM)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_forward_kernel(
        Q, K, V, O, LSE,  # Q, O: (B, H, N_Q, d); K, V: (B, H, N_K, d); LSE: (B, H, N_Q) contiguous
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_on, stride_od,
        n_heads, n_q, n_k, qk_scale_log2,
        D: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: one BLOCK_M tile of queries of one (batch, head). 1-D grid over both."""
    num_m_tiles = tl.cdiv(n_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_bh = pid // num_m_tiles
    pid_m = pid % num_m_tiles
    b = pid_bh // n_heads
    h = pid_bh % n_heads

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows of this program
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key rows within a tile
    offs_d = tl.arange(0, HEAD_DIM)  # (HEAD_DIM,) columns, padded to a power of two
    d_mask = offs_d < D

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < n_q) & d_mask[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM)
    k_tile_ptrs = K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_tile_ptrs = V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], MASKED_SCORE, dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DTYPE)

    # Which key tiles need a mask? [0, full_end): none (inside the keys, left of the diagonal);
    # [full_end, kv_end): the diagonal band and the ragged end. Tiles past kv_end are skipped.
    if CAUSAL:
        kv_end = tl.minimum(n_k, start_m + BLOCK_M)  # last query row of the tile sees keys < kv_end
        full_end = tl.minimum((start_m + 1) // BLOCK_N, n_k // BLOCK_N) * BLOCK_N
    else:
        kv_end = n_k
        full_end = (n_k // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _forward_kv_tiles(acc, l_i, m_i, q, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                                      offs_m, offs_n, d_mask, n_k, 0, full_end, qk_scale_log2,
                                      False, CAUSAL, BLOCK_N, ACC_DTYPE, DOT_PRECISION)
    acc, l_i, m_i = _forward_kv_tiles(acc, l_i, m_i, q, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                                      offs_m, offs_n, d_mask, n_k, full_end, kv_end, qk_scale_log2,
                                      True, CAUSAL, BLOCK_N, ACC_DTYPE, DOT_PRECISION)

    o = acc / l_i[:, None]  # (BLOCK_M, HEAD_DIM)
    lse = (m_i + tl.math.log2(l_i)) * LN_2  # (BLOCK_M,) natural-log log-sum-exp of the scores
    row_ok = offs_m < n_q
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    tl.store(LSE + pid_bh * n_q + offs_m, lse, mask=row_ok)


attention_forward_kernel_tuned = triton.autotune(
    configs=tuning.forward_configs(),
    key=["n_q", "n_k", "HEAD_DIM", "CAUSAL", "DOT_PRECISION"],
    prune_configs_by={"early_config_prune": tuning.prune_for_head_dim},
)(attention_forward_kernel)


# ----------------------------------------------------------------------------------------------
# Host side: dtypes, padding, the launch


def padded_head_dim(d: int) -> int:
    """``tl.arange`` needs a power of two, and ``tl.dot`` at least 16: round d up."""
    return max(16, triton.next_power_of_2(d))


def compute_dtype(dtype: torch.dtype, interpreted: bool) -> torch.dtype:
    """The dtype the kernels see. bf16 is wrong in Triton's interpreter (FACTS.md), so there we
    compute bf16 inputs in fp32 and round the results back to bf16."""
    if interpreted and dtype == torch.bfloat16:
        return torch.float32
    return dtype


def kernel_dtypes(dtype: torch.dtype):
    """(ACC_DTYPE, DOT_PRECISION) for inputs of ``dtype``.

    Accumulate in fp32 (fp64 for the interpreter-only float64 used by gradcheck). fp32 inputs
    use IEEE fp32 dot products, not tf32: fp32 is the "exact" dtype of the course (same answer as
    the reference to ~1e-6), and the fast dtypes are fp16/bf16. tf32 would be ~3x faster on an
    H100 but only ~1e-3 accurate. The interpreter ignores the setting (its dots are exact).
    """
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    precision = "ieee" if dtype in (torch.float32, torch.float64) else "tf32"
    return acc, precision


def attention_forward(q, k, v, causal: bool, scale: float, blocks: tuning.Blocks | None = None):
    """Run the forward kernel on ``(B, H, N, d)`` views.

    Args:
        q: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)``, any strides, same dtype and device.
        causal: top-left aligned causal mask (key j visible to query i when j <= i).
        scale: the score scale (1/sqrt(d) by default, chosen by the caller).
        blocks: force one launch config (tests, tuning); None = interpreter default / autotune.

    Returns:
        ``(o, lse)``: ``o`` ``(B, H, N_q, d)`` contiguous in q's dtype; ``lse`` ``(B, H, N_q)``
        float32 (float64 for float64 inputs), natural log.
    """
    interpreted = _rt.interpreted
    work = compute_dtype(q.dtype, interpreted)
    qw, kw, vw = (x.to(work) for x in (q, k, v))  # no copy unless bf16 in the interpreter
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    o = torch.empty((batch, heads, n_q, d), dtype=work, device=q.device)
    acc_dtype, precision = kernel_dtypes(work)
    lse = torch.empty((batch, heads, n_q), device=q.device,
                      dtype=torch.float64 if work == torch.float64 else torch.float32)
    args = (qw, kw, vw, o, lse, *qw.stride(), *kw.stride(), *vw.stride(), *o.stride(),
            heads, n_q, n_k, scale * LOG2_E_FLOAT)
    meta = dict(D=d, HEAD_DIM=padded_head_dim(d), CAUSAL=bool(causal), ACC_DTYPE=acc_dtype,
                DOT_PRECISION=precision)
    if blocks is None and interpreted:
        blocks = tuning.INTERPRETER_FORWARD
    elif blocks is None and not tuning.autotune_enabled():
        blocks = tuning.gpu_default("forward", meta["HEAD_DIM"], qw.element_size())
    if blocks is not None:
        grid = (triton.cdiv(n_q, blocks.block_m) * batch * heads,)
        attention_forward_kernel[grid](*args, **meta, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n,
                                       num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    else:
        def grid(cfg):
            return (triton.cdiv(n_q, cfg["BLOCK_M"]) * batch * heads,)

        attention_forward_kernel_tuned[grid](*args, **meta)
    return o.to(q.dtype), lse
