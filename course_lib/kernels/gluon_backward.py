"""A one-pass FlashAttention backward for Hopper written in Gluon (chapter 09, last section).

Chapter 07's one-pass backward (:mod:`course_lib.kernels.backward`, ``DQ_MODE``) does 5 tile
products per (key tile, query tile) pair where the two-kernel backward does 7. At head dim 128 it
does not fit: one program of 8 warps holds the dK and dV accumulators (2 × 128 × 128 fp32 = 128
registers per thread), the score tiles and the dQ tile, more than a thread's 255 registers, so
the library kept two kernels there. FlashAttention-3 fits it by giving the warps that only copy
data few registers and the warps that compute the rest (``setmaxnreg``). Triton cannot say that;
Gluon can (``gl.warp_specialize`` with register budgets), and this file does it.

One program owns ``BLOCK_N`` = 128 keys of one (batch, head) and walks the query tiles (64 rows
each) that see them. Three partitions:

- a 1-warp **producer** (``LOADER_REGS`` registers per thread): copies K and V once, then Q_i
  and dO_i of each query tile by TMA into a ring of ``STAGES`` slots, and the tile's lse and Δ by
  ``cp.async`` (each producer thread arrives on the slot's barrier once its copies land), each
  slot with a "full" mbarrier (the bytes have landed) and an "empty" one (the consumers are done
  with it);
- two **consumer** warpgroups (8 warps, 240 registers per thread, what the producer leaves), working together
  on one product at a time (each wgmma is issued by one warpgroup and covers 64 rows: warpgroup 0
  owns keys 0-63 of the tile, warpgroup 1 keys 64-127). Per query tile:

      Sᵀ  = K Q_iᵀ                      (128 × 64)    issued, then
      dPᵀ = V dO_iᵀ                     (128 × 64)    issued before Sᵀ is waited for
      Pᵀ  = exp2(Sᵀ · scale · log2 e − lse_i · log2 e)   under dPᵀ's product
      dV += Pᵀ dO_i                     (Pᵀ from registers)
      dSᵀ = scale · Pᵀ ∘ (dPᵀ − Δ_i)    (Δ = rowsum(dO ∘ O), chapter 07's preprocess kernel)
      dK += dSᵀ Q_i                     (dSᵀ from registers)
      dQ_i = dS K                       (64 × 128, dSᵀ through shared memory: the two warpgroups
                                         each hold half of the keys, and dQ sums over all of them;
                                         each warpgroup makes 64 of dQ's 128 columns)

  and adds ``dQ_i`` into an fp32 buffer with atomic adds (Gluon on Triton 3.6 has no TMA
  reduce-add), which a cast turns into dQ at the end. The order of the adds changes from run to
  run, so the last bits of dQ can too: ``flash_attention(..., deterministic=True)`` keeps chapter
  07's two kernels.

The scale is folded into dSᵀ once, so neither dK nor dQ needs a pass of its own. Query rows past
N read as zeros (TMA) and add nothing (their dO rows are zero too); keys past N and the causal
diagonal are masked on the tiles that need it only (the first two query tiles of a causal
program, every tile of the program that holds the ragged end of the keys).

Not covered (the launcher raises ValueError, :func:`gluon_backward_unsupported_reason`): what the
Gluon forward does not cover (non-Hopper GPUs, dtypes other than fp16/bf16, ``N_q != N_k``,
strides TMA cannot read), and head dims other than 128.
"""

from __future__ import annotations

import torch
import triton

from course_lib.kernels import gluon_hopper

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
except ImportError:  # pragma: no cover - gluon_hopper.GLUON_IMPORT_ERROR says why
    pass

HEAD_DIMS = (64, 128)
# How the consumers add dQ_i into the fp32 buffer: straight from the accumulator's layout (8-byte
# atomics; each thread holds 2 neighbouring columns), or after a layout change through shared
# memory (16-byte atomics). Measured on an H100 (NOTES.md): the wide adds are 10% faster.
DQ_BY_CONSUMER, DQ_BY_CONSUMER_WIDE = 0, 1
SPILL_BYTES_ALLOWED = 64  # a few scalars; measured by tests/test_gluon_backward.py
CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "STAGES": 2, "num_warps": 8, "LOADER_REGS": 24,
          "DQ_MODE": DQ_BY_CONSUMER_WIDE,
          "STATS_ASYNC": 1}
LOG2_E = gluon_hopper.LOG2_E


if gluon_hopper.available():
    LOG2_E_GL = gl.constexpr(LOG2_E)
    DQ_BY_CONSUMER_WIDE_GL = gl.constexpr(DQ_BY_CONSUMER_WIDE)
    # A barrier of the partition's warps: gl.thread_barrier in Triton 3.6, gl.barrier in 3.7.
    _sync_warps = getattr(gl, "barrier", None) or gl.thread_barrier

    @gluon.jit
    def _bwd_producer(q_desc, do_desc, k_desc, v_desc, k4, v4, q_ring, do_ring, lse_ring, delta_ring, kv_bar, ready,
                      empty, LSE, DELTA, b, h, pid_bh, start_n, first, n_tiles, n_q, BLOCK_M: gl.constexpr,
                      STAGES: gl.constexpr, STATS_ASYNC: gl.constexpr):
        """One warp: K and V of the program's key tile once, then Q_i and dO_i of each query tile
        into ring slot ``t % STAGES`` once the consumers have freed it (the first pass over the
        ring waits on phase 1 of fresh barriers, which counts as complete)."""
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, h, start_n, 0], kv_bar, k4)
        tma.async_copy_global_to_shared(v_desc, [b, h, start_n, 0], kv_bar, v4)
        for t in range(0, n_tiles):
            slot = t % STAGES
            mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            row = (first + t) * BLOCK_M
            tma.async_copy_global_to_shared(q_desc, [b, h, row, 0], bar, q_ring.index(slot))
            tma.async_copy_global_to_shared(do_desc, [b, h, row, 0], bar, do_ring.index(slot))
            if STATS_ASYNC:  # lse and Δ of the tile by cp.async; each thread arrives once its copies land
                stat_l: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
                offs = row + gl.arange(0, BLOCK_M, layout=stat_l)
                inside = offs < n_q  # rows past N read as 0: harmless, their Q and dO rows are zeros
                async_copy.async_copy_global_to_shared(lse_ring.index(slot), LSE + pid_bh * n_q + offs, mask=inside)
                async_copy.async_copy_global_to_shared(delta_ring.index(slot), DELTA + pid_bh * n_q + offs,
                                                       mask=inside)
                async_copy.mbarrier_arrive(bar, increment_count=False)

    @gluon.jit
    def _bwd_tile(t, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_smem, ready, empty, LSE,
                  DELTA, dq_base, stats, keys, st_zero, dq_zero, first, n_q, n_k, scale, qk_scale_log2,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, MASKED: gl.constexpr, DQ_MODE: gl.constexpr, STATS_ASYNC: gl.constexpr,
                  a_layout: gl.constexpr, dq_layout: gl.constexpr, add_layout: gl.constexpr):
        """One query tile (the t-th of the program): every product, dK and dV updated and returned,
        dQ_i added into the buffer. ``MASKED``: apply the element mask (causal, ragged keys)."""
        dtype: gl.constexpr = k_smem.dtype
        cols_l: gl.constexpr = gl.SliceLayout(0, st_zero.type.layout)
        dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, add_layout))
        dq_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, add_layout))
        slot = t % STAGES
        row0 = (first + t) * BLOCK_M
        # lse and Δ of the tile's queries: read here while the copies land (rows past N get
        # lse = +inf, so P = 0 there), or (STATS_ASYNC, the library's) copied by the producer with
        # the tile (rows past N read as 0: their Q and dO rows are zeros, so they add nothing).
        cols = row0 + gl.arange(0, BLOCK_M, layout=cols_l)
        if not STATS_ASYNC:
            lse_log2 = gl.load(LSE + stats + cols, mask=cols < n_q, other=float("inf")) * LOG2_E_GL
            delta = gl.load(DELTA + stats + cols, mask=cols < n_q, other=0.0)
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)  # Q_i and dO_i have landed
        if STATS_ASYNC:
            lse_log2 = lse_ring.index(slot).load(cols_l) * LOG2_E_GL
            delta = delta_ring.index(slot).load(cols_l)
        q = gluon_hopper._tile2d(q_ring, slot)  # (BLOCK_M, HEAD_DIM)
        do = gluon_hopper._tile2d(do_ring, slot)

        # Sᵀ and dPᵀ issued back to back; Sᵀ is waited for first (wgmma groups finish in
        # order: "at most 1 pending" leaves dPᵀ running under the exponentials).
        st_tok = warpgroup_mma(k_smem, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_smem, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st_tok,))
        st = st * qk_scale_log2 - lse_log2[None, :]
        if MASKED:  # the diagonal band (causal), the ragged end of the keys
            visible = keys[:, None] < n_k
            if CAUSAL:
                visible = visible & (keys[:, None] <= cols[None, :])
            st = gl.where(visible, st, float("-inf"))
        pt = gl.exp2(st)  # Pᵀ (BLOCK_N, BLOCK_M), fp32
        pt_op = gl.convert_layout(pt.to(dtype), a_layout)
        dv_tok = warpgroup_mma(pt_op, do, dv, is_async=True)  # dV += Pᵀ dO_i
        dpt = warpgroup_mma_wait(1, deps=(dpt_tok,))  # dPᵀ done; dV's product may still run
        dst = (pt * (dpt - delta[None, :]) * scale).to(dtype)  # scale · dSᵀ
        dst_op = gl.convert_layout(dst, a_layout)
        dk_tok = warpgroup_mma(dst_op, q, dk, is_async=True)  # dK += dSᵀ Q_i
        # dSᵀ to shared memory (two buffers: one warpgroup may write the next while the other
        # still reads this one), visible to the tensor cores and to both warpgroups.
        ds_buf = ds_smem.index(t % 2)
        ds_buf.store(dst)
        fence_async_shared()
        _sync_warps()
        dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
        dv, dk, dq, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, pt_op, dst_op))
        mbarrier.arrive(empty.index(slot), count=1)  # Q_i and dO_i are read: the slot is free
        if DQ_MODE == DQ_BY_CONSUMER_WIDE_GL:  # 16-byte atomics, after a layout change through shared memory
            dq_add = gl.convert_layout(dq, add_layout)
            rows = row0 + dq_rows
            gl.atomic_add(dq_base + rows[:, None] * HEAD_DIM + dq_cols[None, :], dq_add,
                          mask=rows[:, None] < n_q, sem="relaxed")
        else:  # 8-byte atomics straight from the accumulator's layout
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
            gl.atomic_add(dq_base + rows[:, None] * HEAD_DIM + cols[None, :], dq, mask=rows[:, None] < n_q,
                          sem="relaxed")

        return dk, dv

    @gluon.jit
    def _bwd_consumer(k4, v4, q_ring, do_ring, lse_ring, delta_ring, ds_smem, kv_bar, ready, empty,
                      dk_desc, dv_desc, LSE, DELTA, DQ, b, h, pid_bh, start_n, first, n_tiles, n_q, n_k, scale,
                      qk_scale_log2, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr, STATS_ASYNC: gl.constexpr,
                      num_warps: gl.constexpr):
        """The two consumer warpgroups: every product of the loop, then dK and dV out by TMA."""
        dtype: gl.constexpr = k4.dtype
        k_smem = k4.reshape([BLOCK_N, HEAD_DIM])  # the 2-D views the products read
        v_smem = v4.reshape([BLOCK_N, HEAD_DIM])
        # Accumulator layouts (Hopper's wgmma, warps stacked along the 128 keys: warpgroup 0 owns
        # keys 0-63). Sᵀ and dPᵀ: (BLOCK_N, BLOCK_M); dK and dV: (BLOCK_N, HEAD_DIM).
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        # Pᵀ and dSᵀ are the first operand of dV's and dK's products, straight from registers.
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        # dQ_i (BLOCK_M, HEAD_DIM): only 64 rows, so the two warpgroups split its columns.
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                            instr_shape=[16, HEAD_DIM // (num_warps // 4), 16])
        # The atomic adds from a layout where each thread holds 4 neighbouring columns (16 bytes).
        add_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32],
                                                    warps_per_cta=[num_warps, 1], order=[1, 0])
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))  # one per row of Sᵀ
        dq_base = DQ + pid_bh.to(gl.int64) * n_q * HEAD_DIM
        stats = pid_bh * n_q
        ragged_keys = start_n + BLOCK_N > n_k  # this program holds the last, partial key tile

        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
        st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)  # use_acc=False ignores it
        dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)

        mbarrier.wait(kv_bar, 0)  # K and V have landed
        # The tiles that need the element mask first (a causal program's first BLOCK_N // BLOCK_M
        # query tiles hold the diagonal; every tile of the program with the ragged keys), then the
        # rest without it: two loops, so that the unmasked one carries no mask code at all.
        n_masked = n_tiles if ragged_keys else (gl.minimum(BLOCK_N // BLOCK_M, n_tiles) if CAUSAL else 0)
        for t in range(0, n_masked):
            dk, dv = _bwd_tile(t, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_smem,
                               ready, empty, LSE, DELTA, dq_base, stats, keys, st_zero, dq_zero,
                               first, n_q, n_k, scale, qk_scale_log2, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, True,
                               DQ_MODE, STATS_ASYNC, a_layout, dq_layout, add_layout)
        for t in range(n_masked, n_tiles):
            dk, dv = _bwd_tile(t, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_smem,
                               ready, empty, LSE, DELTA, dq_base, stats, keys, st_zero, dq_zero,
                               first, n_q, n_k, scale, qk_scale_log2, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, False,
                               DQ_MODE, STATS_ASYNC, a_layout, dq_layout, add_layout)

        # dK and dV out through the K and V buffers (no product reads them any more); TMA clips
        # the rows past N.
        _sync_warps()
        k_smem.store(dk.to(dtype))
        v_smem.store(dv.to(dtype))
        fence_async_shared()
        _sync_warps()
        tma.async_copy_shared_to_global(dk_desc, [b, h, start_n, 0], k4)
        tma.async_copy_shared_to_global(dv_desc, [b, h, start_n, 0], v4)
        tma.store_wait(0)

    @gluon.jit
    def attention_backward_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, DQ,
                                        n_heads, n_q, n_k, scale, qk_scale_log2,
                                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr,
                                        STATS_ASYNC: gl.constexpr,
                                        LOADER_REGS: gl.constexpr,
                                        num_warps: gl.constexpr):
        """One program: BLOCK_N keys of one (batch, head). Grid ``(cdiv(N, BLOCK_N), B·H)``; axis 0
        from the first key tile, which (causal) sees the most query tiles, so the longest programs
        start first."""
        start_n = gl.program_id(0) * BLOCK_N
        pid_bh = gl.program_id(1)
        b = pid_bh // n_heads
        h = pid_bh % n_heads
        dtype: gl.constexpr = q_desc.dtype
        first = start_n // BLOCK_M if CAUSAL else 0  # causal: queries before the tile see none of its keys
        n_tiles = (n_q + BLOCK_M - 1) // BLOCK_M - first

        # Shared memory: K and V (2-D views of one TMA block each), the Q and dO rings, dSᵀ twice.
        k4 = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v4 = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], gl.NVMMASharedLayout.get_default_for(
            [BLOCK_N, BLOCK_M], dtype))
        stats_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
        delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            # the producer's expect, plus (STATS_ASYNC) one cp.async arrival per producer thread
            mbarrier.init(ready.index(i), count=1 + 32 * STATS_ASYNC)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()

        gl.warp_specialize(
            [(_bwd_consumer, (k4, v4, q_ring, do_ring, lse_ring, delta_ring, ds_smem, kv_bar, ready, empty,
                              dk_desc, dv_desc, LSE, DELTA, DQ, b, h, pid_bh, start_n, first, n_tiles, n_q, n_k,
                              scale, qk_scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_MODE,
                              STATS_ASYNC, num_warps)),
             (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, k4, v4, q_ring, do_ring, lse_ring, delta_ring,
                              kv_bar, ready, empty, LSE, DELTA, b, h, pid_bh, start_n, first, n_tiles, n_q,
                              BLOCK_M, STAGES, STATS_ASYNC))],
            [1], [LOADER_REGS])

        mbarrier.invalidate(kv_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


# ----------------------------------------------------------------------------------------------
# Host side


def gluon_backward_unsupported_reason(q, k, v, o, do) -> str | None:
    """Why :func:`attention_backward_gluon` cannot take these inputs, or None if it can."""
    why = gluon_hopper.gluon_unsupported_reason(q, k, v)
    if why:
        return why
    if q.shape[-1] not in HEAD_DIMS:
        return f"the head dim must be one of {HEAD_DIMS}, got {q.shape[-1]}"
    return gluon_hopper.gluon_unsupported_reason(o, do, do)


def library_uses_gluon_backward(q, k, v, o, do) -> bool:
    """Whether :func:`course_lib.flash_attention`'s (non-deterministic) backward takes this kernel:
    a Hopper GPU, head dim in :data:`~course_lib.kernels.tuning.GLUON_BACKWARD_HEAD_DIMS`, inputs
    it covers, no autotuning asked for, and neither ``COURSE_LIB_GLUON`` nor
    ``COURSE_LIB_GLUON_BACKWARD`` set to 0."""
    from course_lib import runtime
    from course_lib.kernels import tuning

    if runtime.current().interpreted or q.device.type != "cuda" or not gluon_hopper.available():
        return False
    if (not tuning.gluon_backward_enabled() or tuning.autotune_enabled()
            or q.shape[-1] not in tuning.GLUON_BACKWARD_HEAD_DIMS):
        return False
    return gluon_backward_unsupported_reason(q, k, v, o, do) is None


def attention_backward_gluon(do, q, k, v, o, lse, causal: bool, scale: float, config: dict | None = None):
    """``(dq, dk, dv)`` of attention with the Gluon one-pass kernel, in q's dtype, contiguous.

    Args:
        do, q, k, v, o: ``(B, H, N, d)`` fp16/bf16 CUDA tensors of one shape (or CPU ones under a
            stand-in driver that only compiles), d = 128, TMA-readable strides.
        lse: ``(B, H, N)`` float32 contiguous, the natural-log log-sum-exp of the forward.
        causal, scale: as in the forward.

    Raises:
        ValueError naming what is not covered (see :func:`gluon_backward_unsupported_reason`).
    """
    from course_lib.kernels.backward import PREPROCESS_BLOCK_M, preprocess_kernel

    why = gluon_backward_unsupported_reason(q, k, v, o, do)
    if why:
        raise ValueError(f"attention_backward_gluon: q, k, v, o, do: {why}")
    if lse.shape != q.shape[:-1] or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"attention_backward_gluon: lse must be float32 contiguous {tuple(q.shape[:-1])}, "
                         f"got {lse.dtype} {tuple(lse.shape)}")
    batch, heads, n, d = q.shape
    cfg = {**CONFIG, **(config or {})}
    if gluon_hopper._compiling_only():  # cross_compile: no kernel but this one may touch the stand-in
        delta = torch.zeros_like(lse)
    else:  # Δ = rowsum(dO ∘ O), chapter 07's preprocess kernel
        delta = torch.empty_like(lse)
        preprocess_kernel[(triton.cdiv(n, PREPROCESS_BLOCK_M) * batch * heads,)](
            o, do, delta, *o.stride(), *do.stride(), heads, n, HEAD_DIM_REAL=d, HEAD_DIM=d,
            ACC_DTYPE=triton.language.float32, BLOCK_M=PREPROCESS_BLOCK_M)
    dq_acc = torch.zeros((batch, heads, n, d), dtype=torch.float32, device=q.device)
    dk = torch.empty((batch, heads, n, d), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    desc = gluon_hopper._descriptor
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), batch * heads)
    kernel = attention_backward_gluon_kernel[grid](
        desc(q, cfg["BLOCK_M"]), desc(k, cfg["BLOCK_N"]), desc(v, cfg["BLOCK_N"]), desc(do, cfg["BLOCK_M"]),
        desc(dk, cfg["BLOCK_N"]), desc(dv, cfg["BLOCK_N"]), lse, delta, dq_acc, heads, n, n, scale,
        scale * LOG2_E, HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"],
        CAUSAL=bool(causal), DQ_MODE=cfg["DQ_MODE"], STATS_ASYNC=cfg["STATS_ASYNC"], LOADER_REGS=cfg["LOADER_REGS"],
        num_warps=cfg["num_warps"])
    attention_backward_gluon.last_kernel = kernel
    return dq_acc.to(q.dtype), dk, dv


attention_backward_gluon.last_kernel = None


def cross_compile(causal: bool = True, dtype=torch.float16, n: int = 1000, head_dim: int = 128,
                  config: dict | None = None) -> dict:
    """Compile the kernel for sm_90 without a GPU and return :func:`gluon_hopper.kernel_facts`."""
    with gluon_hopper.stand_in_sm90():
        x = torch.zeros(1, 1, n, head_dim, dtype=dtype)
        lse = torch.zeros(1, 1, n, dtype=torch.float32)
        attention_backward_gluon(x, x, x, x, x, lse, causal, head_dim ** -0.5, config=config)
        return gluon_hopper.kernel_facts(attention_backward_gluon.last_kernel)
