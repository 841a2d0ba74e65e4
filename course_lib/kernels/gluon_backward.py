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

Two switches of the dense kernel (issue 35), off by default until the H100 says otherwise
(``tools/gluon_bwd_ablation.py`` checks and times them):

- **overlap** (``CONFIG["PIPELINE"]``): the consumers wait for all five products of a step and then
  add its dQ, so the tensor cores idle while the atomics issue. With the switch on, a step leaves its
  dQ in shared memory; the next one issues its Sᵀ (and dPᵀ) first and adds the previous dQ under them
  (:data:`PIPELINE_ST_DPT`, :data:`PIPELINE_ST`);
- **persistent grid** (``CONFIG["PERSISTENT"]``, N <= :data:`PERSISTENT_MAX_N`): at most one program
  per SM, each walking (key tile, batch·head) items; the ring's slots and phases run on across items,
  and a ``kv_empty`` barrier holds the next item's K and V until this item's dK and dV have left
  their buffers.

The scale is folded into dSᵀ once, so neither dK nor dQ needs a pass of its own. Query rows past
N read as zeros (TMA) and add nothing (their dO rows are zero too); keys past N and the causal
diagonal are masked on the tiles that need it only (the first two query tiles of a causal
program, every tile of the program that holds the ragged end of the keys).

Not covered (the launcher raises ValueError, :func:`gluon_backward_unsupported_reason`): what the
Gluon forward does not cover (non-Hopper GPUs, dtypes other than fp16/bf16, ``N_q != N_k``,
strides TMA cannot read), and head dims other than 64 and 128.

**The masked backward** (chapter 10, :func:`masked_backward_gluon`) is the same program walking
block-mask lists instead of a range of query tiles (``LISTS``): one program per 128-key K/V tile
of one (batch, K/V head) reads the *transposed* lists (which Q tiles visit this K/V tile), and for
each query head of the K/V head's GQA group takes the Q tiles of its FULL list (no element mask)
and then of its PARTIAL list (the element mask of :func:`course_lib.kernels.masked.visible`,
transposed: band, document ids, a dense boolean mask), 64 query rows a step. The producer walks
the same steps, so the ring's slots and phases follow one running step count. dK and dV are
summed over the group in registers; dQ of each query head goes to the fp32 buffer by atomics. A
saved ``lse = -inf`` (a row that saw no key) is read as ``+inf``, so its P is 0. Programs take
the K/V tiles with the most Q tiles first (:func:`course_lib.kernels.gluon_masked.tile_order`).
Covered: what the masked Gluon forward covers (no per-sample lengths, 128x128 block-mask tiles).
"""

from __future__ import annotations

import re

import torch
import triton

from course_lib.attention.blockmask import UNBOUNDED
from course_lib.kernels import compat, gluon_hopper, gluon_masked
from course_lib.kernels.launch import CachedLaunch

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
# Spilled bytes per thread that tests/test_gluon_backward.py allows: a few scalars, never a tile.
# Cross-compiled for sm_90 at d=128 (2026-11): 48 B with Triton 3.6.0, 40 with 3.7.1 and 3.8.0, 144
# with 3.9.0, whose register allocator keeps fewer of the loop's scalars in the consumers' 240
# registers (0 at d=64 with every version; 3.9's cost on an H100 is not measured).
_NEWER_ALLOCATOR = compat.triton_version() >= (3, 9)
SPILL_BYTES_ALLOWED = 160 if _NEWER_ALLOCATOR else 64
# The masked kernel keeps the lists' pointers and counters live across its loops: 136 bytes
# measured (documents + band, Triton 3.7.1), 192-200 with a dense element mask (3.7.1, 3.6.0);
# 272 and 280 with 3.9.0
MASKED_SPILL_BYTES_ALLOWED = 320 if _NEWER_ALLOCATOR else 256
# CONFIG["PIPELINE"] (issue 35; the dense kernel only, the masked one keeps 0): where a step's dQ
# atomics go. NO_PIPELINE: after all five of its products, the tensor cores idle while they issue.
# PIPELINE_ST_DPT: in the next step, once its Sᵀ and dPᵀ are issued (Sᵀ alone in the loop over the
# diagonal's masked tiles, whose mask code needs the registers); PIPELINE_ST: under Sᵀ alone.
# Cross-compiled for sm_90 (Triton 3.7.1, 2026-11-27), consumers' spills: none at d = 64 in any mode;
# at d = 128 NO_PIPELINE 40 B, PIPELINE_ST_DPT 8 B (non-causal) / 64 B (causal), PIPELINE_ST 0 / 56 B;
# the causal kernels' extra is in the masked loop (<= 2 steps a program), not the unmasked one
# (SWITCH_EXTRA_SPILL_BYTES).
NO_PIPELINE, PIPELINE_ST_DPT, PIPELINE_ST = 0, 1, 2
PIPELINES = (NO_PIPELINE, PIPELINE_ST_DPT, PIPELINE_ST)
# CONFIG["PERSISTENT"] (issue 35; the dense kernel, default off): where N <= PERSISTENT_MAX_N, a grid
# of at most one program per SM, each walking (key tile, batch·head) items, instead of one program
# per item: short programs pay their start (barriers, K and V's first copy) and end (dK, dV out) once
# per program, not per item. Longer sequences keep the one-program-per-item grid.
PERSISTENT_MAX_N = 2048
# Spilled bytes either switch alone may add to the library's kernel at d = 128 (tests/test_gluon_backward.py):
# scalars, never a tile. Cross-compiled for sm_90 (2026-11-27), causal kernels: the overlap +16 to +24 B
# with Triton 3.6.0-3.8.0 (its masked loop), +8 with 3.9.0; the persistent grid (its item loop) +0 with
# 3.6.0-3.8.0 (+8 non-causal with 3.6.0), +32 with 3.9.0. None at d = 64. Both switches together spill
# more at d = 128 (112-160 B with 3.7.1, 128-168 with 3.6.0): tools/gluon_bwd_ablation.py times them.
SWITCH_EXTRA_SPILL_BYTES = 32
CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "STAGES": 2, "num_warps": 8, "LOADER_REGS": 24,
          "DQ_MODE": DQ_BY_CONSUMER_WIDE,
          "STATS_ASYNC": 1, "PIPELINE": NO_PIPELINE, "PERSISTENT": False}
LOG2_E = gluon_hopper.LOG2_E


if gluon_hopper.available():
    LOG2_E_GL = gl.constexpr(LOG2_E)
    UNBOUNDED_GL = gl.constexpr(UNBOUNDED)
    DQ_BY_CONSUMER_WIDE_GL = gl.constexpr(DQ_BY_CONSUMER_WIDE)
    PIPELINE_ST_DPT_GL = gl.constexpr(PIPELINE_ST_DPT)
    PIPELINE_ST_GL = gl.constexpr(PIPELINE_ST)
    # Names whose spelling depends on the Triton version (course_lib/kernels/compat.py): a barrier of
    # the partition's warps, the TMA copies, cp.async.
    from course_lib.kernels.compat import cp_async_load, tma_load, tma_store
    from course_lib.kernels.compat import sync_warps as _sync_warps

    @gluon.jit
    def _bwd_load_kv(k_desc, v_desc, k4, v4, kv_bar, b, h, start_n):
        """K and V of the program's key tile, once, by TMA (``kv_bar`` says they have landed)."""
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [b, h, start_n, 0], kv_bar, k4)
        tma_load(v_desc, [b, h, start_n, 0], kv_bar, v4)

    @gluon.jit
    def _bwd_load(t, row0, q_desc, do_desc, q_ring, do_ring, lse_ring, delta_ring, ready, empty, LSE, DELTA,
                  b, h, stats, n_q, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, STATS_ASYNC: gl.constexpr):
        """Step ``t``'s copies: Q and dO rows ``row0 ...`` of head ``h`` by TMA into ring slot
        ``t % STAGES`` once the consumers have freed it (the first pass over the ring waits on phase
        1 of fresh barriers, which counts as complete), and (STATS_ASYNC) their lse and Δ (at
        ``stats + row``) by ``cp.async``, each producer thread arriving once its copies land."""
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, row0, 0], bar, q_ring.index(slot))
        tma_load(do_desc, [b, h, row0, 0], bar, do_ring.index(slot))
        if STATS_ASYNC:
            stat_l: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
            offs = row0 + gl.arange(0, BLOCK_M, layout=stat_l)
            inside = offs < n_q  # rows past N read as 0: harmless, their Q and dO rows are zeros
            cp_async_load(lse_ring.index(slot), LSE + stats + offs, mask=inside)
            cp_async_load(delta_ring.index(slot), DELTA + stats + offs, mask=inside)
            async_copy.mbarrier_arrive(bar, increment_count=False)

    @gluon.jit
    def _list_row(IDX, lrow, list_len, s, SPARSE_M: gl.constexpr, BLOCK_M: gl.constexpr):
        """First query row of step ``s`` of a walk over the Q tiles listed in row ``lrow`` of a
        transposed block-mask list (``SPARSE_M`` rows each), ``BLOCK_M`` rows a step."""
        per_tile: gl.constexpr = SPARSE_M // BLOCK_M
        return gl.load(IDX + lrow * list_len + s // per_tile) * SPARSE_M + (s % per_tile) * BLOCK_M

    @gluon.jit
    def _bwd_producer(q_desc, do_desc, k_desc, v_desc, k4, v4, q_ring, do_ring, lse_ring, delta_ring, kv_bar,
                      kv_empty, ready, empty, LSE, DELTA, b, h, pid_bh, start_n, first, n_tiles, n_items, n_bh, n_q,
                      FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, lrow0, list_sh, list_len, n_heads, group,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STATS_ASYNC: gl.constexpr,
                      LISTS: gl.constexpr, SPARSE_M: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr):
        """One warp: K and V of the program's key tile once, then the copies of each step, in the
        consumers' order: dense, query tiles ``first ...``; LISTS (the masked backward), for each
        query head of the K/V head's group, the Q tiles of its FULL list, then of its PARTIAL one.
        PERSISTENT (dense): for each of the program's items, K and V once the consumers have stored the
        previous item's dK and dV from their buffers (``kv_empty``), then the item's steps."""
        if PERSISTENT:
            step0 = 0
            for j in range(0, _program_items(n_items)):
                b, h, pid_bh, start_n, first, n_tiles = _dense_item(j, n_bh, n_heads, n_q, BLOCK_M, BLOCK_N, CAUSAL)
                mbarrier.wait(kv_empty, (j & 1) ^ 1)  # phase 1 of a fresh barrier counts as complete
                _bwd_load_kv(k_desc, v_desc, k4, v4, kv_bar, b, h, start_n)
                for t in range(0, n_tiles):
                    _bwd_load(step0 + t, (first + t) * BLOCK_M, q_desc, do_desc, q_ring, do_ring, lse_ring, delta_ring,
                              ready, empty, LSE, DELTA, b, h, pid_bh * n_q, n_q, BLOCK_M, STAGES, STATS_ASYNC)
                step0 += n_tiles
        else:
            _bwd_load_kv(k_desc, v_desc, k4, v4, kv_bar, b, h, start_n)
        if LISTS:
            it = 0
            for g in range(0, group):
                hq = h * group + g
                lrow = lrow0 + hq * list_sh
                stats = (b * n_heads + hq) * n_q
                for part in gl.static_range(2):  # the consumers' order: the FULL list, then the PARTIAL one
                    if part == 0:
                        idx, count = FULL_IDX, gl.load(FULL_NUM + lrow)
                    else:
                        idx, count = PART_IDX, gl.load(PART_NUM + lrow)
                    for s in range(0, count * (SPARSE_M // BLOCK_M)):
                        _bwd_load(it, _list_row(idx, lrow, list_len, s, SPARSE_M, BLOCK_M), q_desc, do_desc, q_ring,
                                  do_ring, lse_ring, delta_ring, ready, empty, LSE, DELTA, b, hq, stats, n_q, BLOCK_M,
                                  STAGES, STATS_ASYNC)
                        it += 1
        elif not PERSISTENT:
            for t in range(0, n_tiles):
                _bwd_load(t, (first + t) * BLOCK_M, q_desc, do_desc, q_ring, do_ring, lse_ring, delta_ring, ready,
                          empty, LSE, DELTA, b, h, pid_bh * n_q, n_q, BLOCK_M, STAGES, STATS_ASYNC)

    @gluon.jit
    def _dq_atomics(dq, row0, dq_base, n_q, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, DQ_MODE: gl.constexpr,
                    add_layout: gl.constexpr):
        """Add ``dq`` (dQ of query rows ``row0 ...``, ``(BLOCK_M, HEAD_DIM)`` fp32) into the buffer at
        ``dq_base``: 16-byte atomics after a layout change through shared memory (DQ_BY_CONSUMER_WIDE;
        none when ``dq`` is in ``add_layout`` already), or 8-byte ones from the accumulator's layout."""
        if DQ_MODE == DQ_BY_CONSUMER_WIDE_GL:
            dq = gl.convert_layout(dq, add_layout)
        layout: gl.constexpr = dq.type.layout
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        gl.atomic_add(dq_base + rows[:, None] * HEAD_DIM + cols[None, :], dq, mask=rows[:, None] < n_q, sem="relaxed")

    @gluon.jit
    def _dq_atomics_staged(dq_smem, row0, dq_base, n_q, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                           DQ_MODE: gl.constexpr, dq_layout: gl.constexpr, add_layout: gl.constexpr):
        """PIPELINE: add the dQ a step left in ``dq_smem`` (rows ``row0 ...``) into the buffer, read
        back in the atomics' layout (the layout change of :func:`_dq_atomics`, through this buffer).
        The barrier: every consumer thread's share of the tile is stored before any is read."""
        _sync_warps()
        if DQ_MODE == DQ_BY_CONSUMER_WIDE_GL:
            dq = dq_smem.load(add_layout)
        else:
            dq = dq_smem.load(dq_layout)
        _dq_atomics(dq, row0, dq_base, n_q, HEAD_DIM, BLOCK_M, DQ_MODE, add_layout)

    @gluon.jit
    def _tile_stats(lse, delta, lse_ring, delta_ring, slot, cols_l: gl.constexpr, STATS_ASYNC: gl.constexpr,
                    EMPTY_ROWS: gl.constexpr):
        """``(lse · log2 e, Δ)`` of a step's queries: ``lse`` and ``delta`` as loaded from global
        memory, or (STATS_ASYNC) read from ring slot ``slot``; a saved ``lse = -inf`` read as ``+inf``
        when ``EMPTY_ROWS`` (see :func:`_bwd_tile`)."""
        if STATS_ASYNC:
            lse = lse_ring.index(slot).load(cols_l)
            delta = delta_ring.index(slot).load(cols_l)
        if EMPTY_ROWS:
            lse = gl.where(lse == float("-inf"), float("inf"), lse)
        return lse * LOG2_E_GL, delta

    @gluon.jit
    def _bwd_tile(t, row0, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_smem, ready, empty,
                  LSE, DELTA, dq_base, stats, keys, start_n, st_zero, dq_zero, n_q, n_k, scale, qk_scale_log2,
                  lo, hi, doc_k, DOC_Q, MASK, stride_mn, stride_mk, dq_smem, step0,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  MASKED: gl.constexpr, BAND: gl.constexpr, DOCS: gl.constexpr, DENSE_MASK: gl.constexpr,
                  EMPTY_ROWS: gl.constexpr, DQ_MODE: gl.constexpr, STATS_ASYNC: gl.constexpr, PIPELINE: gl.constexpr,
                  a_layout: gl.constexpr, dq_layout: gl.constexpr, add_layout: gl.constexpr, num_warps: gl.constexpr):
        """Step ``t`` of the program's item (ring step ``step0 + t``: its slot and phase; ``step0``, the
        steps of the items before it, is 0 but in the persistent kernel): query rows ``row0 ...``, every
        product, dK and dV updated and returned, dQ_i added into the buffer. ``MASKED``: apply the
        element mask (keys and queries in range; BAND: ``row + lo <= key <= row + hi``, causal and
        sliding windows, ``BAND`` 2, or the upper bound only, 1; DOCS: equal document ids; DENSE_MASK: the boolean mask).
        ``EMPTY_ROWS``: a saved ``lse = -inf`` (a row that saw no key) is read as ``+inf``, so that
        its P is 0 (the masked forward leaves such rows; the dense one cannot).

        ``PIPELINE`` 0: dQ_i is added here, after every product of the step. Otherwise (the dense
        kernel, whose steps are consecutive query tiles) dQ_i is left in ``dq_smem`` and the previous
        step's (rows ``row0 - BLOCK_M ...``, none at ``t`` = 0) is added here, once this step's Sᵀ and
        dPᵀ (PIPELINE_ST_DPT) or Sᵀ alone (PIPELINE_ST) are issued, so that the tensor cores work
        while the atomics issue and drain; the caller adds the last step's. Staged in shared memory,
        not registers: the consumers' 240 registers hold dK, dV and both products already."""
        dtype: gl.constexpr = k_smem.dtype
        st_layout: gl.constexpr = st_zero.type.layout
        cols_l: gl.constexpr = gl.SliceLayout(0, st_layout)
        slot = (step0 + t) % STAGES
        # lse and Δ of the tile's queries: read here while the copies land (rows past N get
        # lse = +inf, so P = 0 there), or (STATS_ASYNC, the library's) copied by the producer with
        # the tile (rows past N read as 0: their Q and dO rows are zeros, so they add nothing).
        cols = row0 + gl.arange(0, BLOCK_M, layout=cols_l)
        lse, delta = cols, cols  # placeholders, unused with STATS_ASYNC
        if not STATS_ASYNC:
            lse = gl.load(LSE + stats + cols, mask=cols < n_q, other=float("inf"))
            delta = gl.load(DELTA + stats + cols, mask=cols < n_q, other=0.0)
        mbarrier.wait(ready.index(slot), ((step0 + t) // STAGES) & 1)  # Q_i and dO_i have landed
        if not PIPELINE:
            lse_log2, delta = _tile_stats(lse, delta, lse_ring, delta_ring, slot, cols_l, STATS_ASYNC, EMPTY_ROWS)
        q = gluon_hopper._tile2d(q_ring, slot)  # (BLOCK_M, HEAD_DIM)
        do = gluon_hopper._tile2d(do_ring, slot)

        # Sᵀ and dPᵀ issued back to back; Sᵀ is waited for first (wgmma groups finish in
        # order: "at most 1 pending" leaves dPᵀ running under the exponentials).
        st_tok = warpgroup_mma(k_smem, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        if PIPELINE == PIPELINE_ST_GL:  # the previous step's dQ under Sᵀ's product alone
            if t > 0:
                _dq_atomics_staged(dq_smem, row0 - BLOCK_M, dq_base, n_q, HEAD_DIM, BLOCK_M, DQ_MODE, dq_layout,
                                   add_layout)
        dpt_tok = warpgroup_mma(v_smem, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        if PIPELINE == PIPELINE_ST_DPT_GL:  # the previous step's dQ under this step's two products
            if t > 0:
                _dq_atomics_staged(dq_smem, row0 - BLOCK_M, dq_base, n_q, HEAD_DIM, BLOCK_M, DQ_MODE, dq_layout,
                                   add_layout)
        if PIPELINE:  # read after the atomics, so that the registers they take are not held across them
            lse_log2, delta = _tile_stats(lse, delta, lse_ring, delta_ring, slot, cols_l, STATS_ASYNC, EMPTY_ROWS)
        st = warpgroup_mma_wait(1, deps=(st_tok,))
        st = st * qk_scale_log2 - lse_log2[None, :]
        if MASKED:  # keys-along-rows tiles: the element mask of gluon_masked's forward, transposed
            visible = keys[:, None] < n_k  # (queries past N have zero Q and dO rows: they add nothing)
            if BAND:  # 1: key <= row + hi (the dense causal kernel); 2: also key >= row + lo
                visible = visible & (keys[:, None] <= cols[None, :] + hi)
                if BAND == 2:
                    visible = visible & (keys[:, None] >= cols[None, :] + lo)
            if DOCS:
                doc_q = gl.load(DOC_Q + cols, mask=cols < n_q, other=-1)
                visible = visible & (doc_k[:, None] == doc_q[None, :])
            if DENSE_MASK:
                visible = visible & gluon_masked._dense_mask_tile(
                    MASK, stride_mn, stride_mk, row0, start_n, n_q, n_k, BLOCK_M,
                    keys.type.shape[0], st_layout, num_warps, True)
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
        if PIPELINE:  # for the next step; every thread loaded the previous dQ before the barrier above
            dq_smem.store(dq)
        else:
            _dq_atomics(dq, row0, dq_base, n_q, HEAD_DIM, BLOCK_M, DQ_MODE, add_layout)
        return dk, dv

    @gluon.jit
    def _bwd_consumer(k4, v4, q_ring, do_ring, lse_ring, delta_ring, ds_smem, dq_smem, kv_bar, kv_empty, ready, empty,
                      dk_desc, dv_desc, LSE, DELTA, DQ, b, h, pid_bh, start_n, first, n_tiles, n_items, n_bh, n_q, n_k,
                      scale, qk_scale_log2, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, lrow0, list_sh, list_len, n_heads,
                      group, lo, hi, DOC_Q, DOC_K, MASK, stride_mh, stride_mn, stride_mk,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr, STATS_ASYNC: gl.constexpr,
                      LISTS: gl.constexpr, SPARSE_M: gl.constexpr, BAND: gl.constexpr, DOCS: gl.constexpr,
                      DENSE_MASK: gl.constexpr, PIPELINE: gl.constexpr, PERSISTENT: gl.constexpr,
                      num_warps: gl.constexpr):
        """The two consumer warpgroups: every product of every step, then dK and dV out by TMA.
        Dense: the query tiles ``first ...`` (PERSISTENT: of each of the program's items, see
        :func:`_dense_item`); LISTS: the steps of :func:`_bwd_producer`, FULL ones without the element
        mask, PARTIAL ones with it, summing dK and dV over the group's heads."""
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
        st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)  # use_acc=False ignores it
        dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)

        if LISTS:
            keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))  # one per row of Sᵀ
            doc_k = keys  # placeholder without documents
            if DOCS:
                doc_k = gl.load(DOC_K + keys, mask=keys < n_k, other=-2)
            dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
            dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
            mbarrier.wait(kv_bar, 0)  # K and V have landed
            it = 0
            for g in range(0, group):
                hq = h * group + g
                lrow = lrow0 + hq * list_sh
                stats = (b * n_heads + hq) * n_q
                dq_base = DQ + stats.to(gl.int64) * HEAD_DIM
                mask_h = MASK + hq * stride_mh
                for part in gl.static_range(2):  # the FULL list without the element mask, then the PARTIAL one
                    if part == 0:
                        idx, count = FULL_IDX, gl.load(FULL_NUM + lrow)
                    else:
                        idx, count = PART_IDX, gl.load(PART_NUM + lrow)
                    for s in range(0, count * (SPARSE_M // BLOCK_M)):
                        dk, dv = _bwd_tile(it, _list_row(idx, lrow, list_len, s, SPARSE_M, BLOCK_M), dk, dv, k_smem,
                                           v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_smem, ready, empty, LSE,
                                           DELTA, dq_base, stats, keys, start_n, st_zero, dq_zero, n_q, n_k, scale,
                                           qk_scale_log2, lo, hi, doc_k, DOC_Q, mask_h, stride_mn, stride_mk, dq_smem,
                                           0, HEAD_DIM, BLOCK_M, STAGES, part == 1, BAND, DOCS, DENSE_MASK, True,
                                           DQ_MODE, STATS_ASYNC, 0, a_layout, dq_layout, add_layout, num_warps)
                        it += 1
            _bwd_store_dkdv(dk, dv, k4, v4, dk_desc, dv_desc, b, h, start_n)
        elif PERSISTENT:
            # Items (key tile, batch·head) program_id + j · num_programs; the ring's steps run on across
            # items (step0), kv_bar completes once an item (phase j & 1), and kv_empty tells the
            # producer that this item's dK and dV have left K's and V's buffers for the next K and V.
            step0 = 0
            for j in range(0, _program_items(n_items)):
                b, h, pid_bh, start_n, first, n_tiles = _dense_item(j, n_bh, n_heads, n_q, BLOCK_M, BLOCK_N, CAUSAL)
                mbarrier.wait(kv_bar, j & 1)  # this item's K and V have landed
                dk, dv = _bwd_dense_steps(k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_smem, dq_smem,
                                          ready, empty, LSE, DELTA, DQ, pid_bh, start_n, first, n_tiles, n_q, n_k,
                                          scale, qk_scale_log2, lo, hi, MASK, st_zero, dq_zero, step0, HEAD_DIM,
                                          BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_MODE, STATS_ASYNC, PIPELINE, a_layout,
                                          dq_layout, add_layout, kv_layout, num_warps)
                _bwd_store_dkdv(dk, dv, k4, v4, dk_desc, dv_desc, b, h, start_n)
                _sync_warps()  # every thread past the store's wait (the thread that issued it waited for it)
                mbarrier.arrive(kv_empty, count=1)
                step0 += n_tiles
        else:
            mbarrier.wait(kv_bar, 0)  # K and V have landed
            dk, dv = _bwd_dense_steps(k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_smem, dq_smem, ready,
                                      empty, LSE, DELTA, DQ, pid_bh, start_n, first, n_tiles, n_q, n_k, scale,
                                      qk_scale_log2, lo, hi, MASK, st_zero, dq_zero, 0, HEAD_DIM, BLOCK_M, BLOCK_N,
                                      STAGES, CAUSAL, DQ_MODE, STATS_ASYNC, PIPELINE, a_layout, dq_layout, add_layout,
                                      kv_layout, num_warps)
            _bwd_store_dkdv(dk, dv, k4, v4, dk_desc, dv_desc, b, h, start_n)

    @gluon.jit
    def _program_items(n_items):
        """How many of the ``n_items`` work items this program of the persistent grid takes: items
        ``program_id, program_id + num_programs, ...``."""
        return (n_items - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)

    @gluon.jit
    def _dense_item(j, n_bh, n_heads, n_q, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """``(b, h, pid_bh, start_n, first, n_tiles)`` of this program's ``j``-th work item of the
        persistent grid, item ``program_id + j · num_programs``. Items count (key tile, batch·head)
        pairs key tile first (causal: the first key tiles, which see the most query tiles, come
        first), the order of the one-item grid's programs."""
        item = gl.program_id(0) + j * gl.num_programs(0)
        pid_bh = item % n_bh
        start_n = (item // n_bh) * BLOCK_N
        first = start_n // BLOCK_M if CAUSAL else 0  # causal: queries before the tile see none of its keys
        return pid_bh // n_heads, pid_bh % n_heads, pid_bh, start_n, first, (n_q + BLOCK_M - 1) // BLOCK_M - first

    @gluon.jit
    def _bwd_dense_steps(k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_smem, dq_smem, ready, empty, LSE,
                         DELTA, DQ, pid_bh, start_n, first, n_tiles, n_q, n_k, scale, qk_scale_log2, lo, hi, MASK,
                         st_zero, dq_zero, step0, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr,
                         STATS_ASYNC: gl.constexpr, PIPELINE: gl.constexpr, a_layout: gl.constexpr,
                         dq_layout: gl.constexpr, add_layout: gl.constexpr, kv_layout: gl.constexpr,
                         num_warps: gl.constexpr):
        """Every step of one dense item (query tiles ``first ...`` against keys ``start_n ...``;
        ring steps ``step0 ...``): ``(dk, dv)``, fp32, dQ added into the buffer."""
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_zero.type.layout))  # one per row of Sᵀ
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
        dq_base = DQ + pid_bh.to(gl.int64) * n_q * HEAD_DIM
        stats = pid_bh * n_q
        ragged_keys = start_n + BLOCK_N > n_k  # this item holds the last, partial key tile
        # The tiles that need the element mask first (a causal item's first BLOCK_N // BLOCK_M query
        # tiles hold the diagonal; every tile of the item with the ragged keys), then the rest
        # without it: two loops, so that the unmasked one carries no mask code at all.
        n_masked = n_tiles if ragged_keys else (gl.minimum(BLOCK_N // BLOCK_M, n_tiles) if CAUSAL else 0)
        # PIPELINE: each step leaves its dQ in dq_smem for the next, which adds it under its own
        # first products; the last step's is added after the loops. (The element mask acts on Sᵀ
        # after its product, so the hand-over crosses from the masked loop to the unmasked one as is.)
        MASKED_PIPELINE: gl.constexpr = PIPELINE_ST_GL if PIPELINE else 0  # see PIPELINE_ST_DPT
        for t in range(0, n_masked):
            dk, dv = _bwd_tile(t, (first + t) * BLOCK_M, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring,
                               ds_smem, ready, empty, LSE, DELTA, dq_base, stats, keys, start_n, st_zero, dq_zero, n_q,
                               n_k, scale, qk_scale_log2, lo, hi, keys, LSE, MASK, 0, 0, dq_smem, step0, HEAD_DIM,
                               BLOCK_M, STAGES, True, CAUSAL, False, False, False, DQ_MODE, STATS_ASYNC,
                               MASKED_PIPELINE, a_layout, dq_layout, add_layout, num_warps)
        for t in range(n_masked, n_tiles):
            dk, dv = _bwd_tile(t, (first + t) * BLOCK_M, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring,
                               ds_smem, ready, empty, LSE, DELTA, dq_base, stats, keys, start_n, st_zero, dq_zero, n_q,
                               n_k, scale, qk_scale_log2, lo, hi, keys, LSE, MASK, 0, 0, dq_smem, step0, HEAD_DIM,
                               BLOCK_M, STAGES, False, CAUSAL, False, False, False, DQ_MODE, STATS_ASYNC, PIPELINE,
                               a_layout, dq_layout, add_layout, num_warps)
        if PIPELINE:
            if n_tiles > 0:  # the last step's dQ
                _dq_atomics_staged(dq_smem, (first + n_tiles - 1) * BLOCK_M, dq_base, n_q, HEAD_DIM, BLOCK_M,
                                   DQ_MODE, dq_layout, add_layout)
        return dk, dv

    @gluon.jit
    def _bwd_store_dkdv(dk, dv, k4, v4, dk_desc, dv_desc, b, h, start_n):
        """dK and dV out through the K and V buffers (no product reads them any more), waiting until
        the copies have read them; TMA clips the rows past N."""
        dtype: gl.constexpr = k4.dtype
        k_smem = k4.reshape([k4.shape[2], k4.shape[3]])
        v_smem = v4.reshape([v4.shape[2], v4.shape[3]])
        _sync_warps()
        k_smem.store(dk.to(dtype))
        v_smem.store(dv.to(dtype))
        fence_async_shared()
        _sync_warps()
        tma_store(dk_desc, [b, h, start_n, 0], k4)
        tma_store(dv_desc, [b, h, start_n, 0], v4)
        tma.store_wait(0)

    @gluon.jit
    def _bwd_buffers(q_desc, k_desc, v_desc, do_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, STATS_ASYNC: gl.constexpr, PIPELINE: gl.constexpr,
                     PERSISTENT: gl.constexpr):
        """Shared memory and barriers: K and V (2-D views of one TMA block each), the Q and dO
        rings, dSᵀ twice, the lse and Δ rings, (PIPELINE) one step's dQ in fp32 (``dq_smem``; dSᵀ's
        buffers stand in for it otherwise, unused); ``kv_bar``, (PERSISTENT) ``kv_empty`` (``kv_bar``
        stands in otherwise, unused) and each slot's ready and empty barriers."""
        dtype: gl.constexpr = q_desc.dtype
        k4 = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v4 = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], gl.NVMMASharedLayout.get_default_for(
            [BLOCK_N, BLOCK_M], dtype))
        stats_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
        delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
        dq_smem = ds_smem
        if PIPELINE:
            # Swizzled by 16-byte chunks: the accumulator layout's stores (8 rows x 8 columns a warp)
            # and the atomics' loads (one row a warp) both find 32 distinct banks.
            dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], gl.SwizzledSharedLayout(
                4, 1, 8, order=[1, 0]))
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        kv_empty = kv_bar
        if PERSISTENT:
            kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(kv_empty, count=1)
        for i in gl.static_range(STAGES):
            # the producer's expect, plus (STATS_ASYNC) one cp.async arrival per producer thread
            mbarrier.init(ready.index(i), count=1 + 32 * STATS_ASYNC)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        return k4, v4, q_ring, do_ring, ds_smem, lse_ring, delta_ring, dq_smem, kv_bar, kv_empty, ready, empty

    @gluon.jit
    def _bwd_invalidate(kv_bar, kv_empty, ready, empty, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
        mbarrier.invalidate(kv_bar)
        if PERSISTENT:
            mbarrier.invalidate(kv_empty)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))

    @gluon.jit
    def attention_backward_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, DQ,
                                        n_heads, n_bh, n_q, n_k, scale, qk_scale_log2,
                                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr,
                                        STATS_ASYNC: gl.constexpr, PIPELINE: gl.constexpr, PERSISTENT: gl.constexpr,
                                        LOADER_REGS: gl.constexpr,
                                        num_warps: gl.constexpr):
        """One program: BLOCK_N keys of one (batch, head). Grid ``(cdiv(N, BLOCK_N), B·H)``; axis 0
        from the first key tile, which (causal) sees the most query tiles, so the longest programs
        start first. PERSISTENT: a grid ``(P,)`` whose program ``p`` takes the work items (key tile,
        batch·head) ``p, p + P, ...`` of the ``cdiv(N, BLOCK_N) · n_bh`` in that order
        (:func:`_dense_item`); the partitions work them out for themselves."""
        start_n = gl.program_id(0) * BLOCK_N
        pid_bh = gl.program_id(1)
        b = pid_bh // n_heads
        h = pid_bh % n_heads
        first = start_n // BLOCK_M if CAUSAL else 0  # causal: queries before the tile see none of its keys
        n_tiles = (n_q + BLOCK_M - 1) // BLOCK_M - first
        n_items = (n_k + BLOCK_N - 1) // BLOCK_N * n_bh
        k4, v4, q_ring, do_ring, ds_smem, lse_ring, delta_ring, dq_smem, kv_bar, kv_empty, ready, empty = _bwd_buffers(
            q_desc, k_desc, v_desc, do_desc, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, STATS_ASYNC, PIPELINE, PERSISTENT)
        lo = -UNBOUNDED_GL  # the causal band: key <= query (hi = 0), no lower bound
        gl.warp_specialize(
            [(_bwd_consumer, (k4, v4, q_ring, do_ring, lse_ring, delta_ring, ds_smem, dq_smem, kv_bar, kv_empty, ready,
                              empty, dk_desc, dv_desc, LSE, DELTA, DQ, b, h, pid_bh, start_n, first, n_tiles, n_items,
                              n_bh, n_q, n_k, scale, qk_scale_log2, LSE, LSE, LSE, LSE, 0, 0, 0, n_heads, 1,
                              lo, 0, LSE, LSE, LSE, 0, 0, 0,
                              HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_MODE,
                              STATS_ASYNC, False, BLOCK_N, CAUSAL, False, False, PIPELINE, PERSISTENT, num_warps)),
             (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, k4, v4, q_ring, do_ring, lse_ring, delta_ring,
                              kv_bar, kv_empty, ready, empty, LSE, DELTA, b, h, pid_bh, start_n, first, n_tiles,
                              n_items, n_bh, n_q, LSE, LSE, LSE, LSE, 0, 0, 0, n_heads, 1,
                              BLOCK_M, BLOCK_N, STAGES, STATS_ASYNC, False, BLOCK_N, CAUSAL, PERSISTENT))],
            [1], [LOADER_REGS])
        _bwd_invalidate(kv_bar, kv_empty, ready, empty, STAGES, PERSISTENT)

    @gluon.jit
    def masked_backward_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, DQ,
                                     FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, list_sb, list_sh, list_len, ORDER,
                                     DOC_Q, DOC_K, stride_docq, stride_dock, MASK, stride_mb, stride_mh, stride_mn,
                                     stride_mk, n_heads, n_kv_heads, group, n_q, n_k, lo, hi, scale, qk_scale_log2,
                                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                     STAGES: gl.constexpr, DQ_MODE: gl.constexpr, STATS_ASYNC: gl.constexpr,
                                     SPARSE_M: gl.constexpr, BAND: gl.constexpr, DOCS: gl.constexpr,
                                     DENSE_MASK: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """The masked backward (chapter 10): one program per K/V tile (``BLOCK_N`` = the block
        mask's column width) of one (batch, K/V head), walking the *transposed* lists (the Q tiles
        that visit this K/V tile) of every query head of its GQA group. Grid ``(T_k, B·H_kv)``;
        ``ORDER`` (laid out as the lists' counts) says which K/V tile each program takes, the
        busiest first."""
        pid_bh = gl.program_id(1)
        b = pid_bh // n_kv_heads
        h = pid_bh % n_kv_heads
        tile = gl.load(ORDER + b * list_sb + h * group * list_sh + gl.program_id(0))
        start_n = tile * BLOCK_N
        lrow0 = b * list_sb + tile  # this K/V tile's row of the transposed lists, head 0
        k4, v4, q_ring, do_ring, ds_smem, lse_ring, delta_ring, dq_smem, kv_bar, kv_empty, ready, empty = _bwd_buffers(
            q_desc, k_desc, v_desc, do_desc, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, STATS_ASYNC, 0, False)
        doc_q = DOC_Q + b * stride_docq
        doc_k = DOC_K + b * stride_dock
        mask = MASK + b * stride_mb
        gl.warp_specialize(
            [(_bwd_consumer, (k4, v4, q_ring, do_ring, lse_ring, delta_ring, ds_smem, dq_smem, kv_bar, kv_empty, ready,
                              empty, dk_desc, dv_desc, LSE, DELTA, DQ, b, h, pid_bh, start_n, 0, 0, 0, 0, n_q, n_k,
                              scale, qk_scale_log2, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, lrow0, list_sh, list_len,
                              n_heads, group, lo, hi, doc_q, doc_k, mask, stride_mh, stride_mn, stride_mk,
                              HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, False, DQ_MODE, STATS_ASYNC, True, SPARSE_M,
                              BAND, DOCS, DENSE_MASK, 0, False, num_warps)),
             (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, k4, v4, q_ring, do_ring, lse_ring, delta_ring,
                              kv_bar, kv_empty, ready, empty, LSE, DELTA, b, h, pid_bh, start_n, 0, 0, 0, 0, n_q,
                              FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, lrow0, list_sh, list_len, n_heads, group,
                              BLOCK_M, BLOCK_N, STAGES, STATS_ASYNC, True, SPARSE_M, False, False))],
            [1], [LOADER_REGS])
        _bwd_invalidate(kv_bar, kv_empty, ready, empty, STAGES, False)


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
    from course_lib.platform import runtime
    from course_lib.kernels import tuning

    if runtime.current().interpreted or q.device.type != "cuda" or not gluon_hopper.available():
        return False
    if (not tuning.gluon_backward_enabled() or tuning.autotune_enabled()
            or q.shape[-1] not in tuning.GLUON_BACKWARD_HEAD_DIMS):
        return False
    return gluon_backward_unsupported_reason(q, k, v, o, do) is None


def _check_lse(caller: str, lse, q) -> None:
    """ValueError unless ``lse`` is the forward's: float32, contiguous, shaped like ``q`` without d."""
    if lse.shape != q.shape[:-1] or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"{caller}: lse must be float32 contiguous {tuple(q.shape[:-1])}, "
                         f"got {lse.dtype} {tuple(lse.shape)}")


def _delta_launch(o, cache: bool = False):
    """The preprocess kernel's launch for ``o``'s signature (chapter 07's, accumulating in fp32), or
    None while cross-compiling (no kernel but the backward's may touch the stand-in driver)."""
    from course_lib.kernels.backward import delta_launch

    return None if gluon_hopper._compiling_only() else delta_launch(o.shape, triton.language.float32, cache)


def _delta(o, do, lse, launch, delta=None):
    """Δ = rowsum(dO ∘ O), ``(B, H, N)`` float32, by ``launch`` (:func:`_delta_launch`; zeros when
    it is None: cross-compiling), into ``delta`` when given."""
    from course_lib.kernels.backward import run_delta

    if launch is None:
        return torch.zeros_like(lse) if delta is None else delta.zero_()
    return run_delta(launch, o, do, lse, delta)


def _sm_count(device) -> int:
    """Streaming multiprocessors of ``device``'s GPU (an H100's for CPU tensors: the sm_90 stand-in,
    which compiles and never launches)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    from course_lib.platform import hardware

    return hardware.get_gpu("H100 SXM").sm_count


class BackwardLaunch:
    """:func:`attention_backward_gluon` for one call signature: the inputs checked, config, grid,
    constexprs and the Δ launch worked out once (the library's launch plans keep one per signature,
    :mod:`course_lib.kernels.plan`).

    Args:
        q, k, v, o, do, lse, causal, config: as :func:`attention_backward_gluon`.
        cache: launch later calls by the compiled kernels' handles, with the first call's descriptors.

    Raises:
        ValueError naming what is not covered (see :func:`gluon_backward_unsupported_reason`) or a
        ``PIPELINE`` out of range; TypeError for a ``PERSISTENT`` that is not a bool.
    """

    def __init__(self, q, k, v, o, do, lse, causal: bool, config: dict | None = None, cache: bool = False):
        why = gluon_backward_unsupported_reason(q, k, v, o, do)
        if why:
            raise ValueError(f"attention_backward_gluon: q, k, v, o, do: {why}")
        _check_lse("attention_backward_gluon", lse, q)
        batch, heads, n, d = q.shape
        cfg = {**CONFIG, **(config or {})}
        if cfg["PIPELINE"] not in PIPELINES:
            raise ValueError(f"attention_backward_gluon: config['PIPELINE'] must be one of {PIPELINES}, "
                             f"got {cfg['PIPELINE']!r}")
        if not isinstance(cfg["PERSISTENT"], bool):
            raise TypeError(f"attention_backward_gluon: config['PERSISTENT'] must be a bool, got {cfg['PERSISTENT']!r}")
        self.shape, self.dtype, self.device = (batch, heads, n, d), q.dtype, q.device
        self.sizes = (heads, batch * heads, n, n)
        self.compiling_only = gluon_hopper._compiling_only()
        self.delta = _delta_launch(o, cache)
        from course_lib.kernels.backward import Buffers

        # dQ's fp32 accumulator and Δ in one allocation, dq, dk, dv in another (backward.Buffers)
        self.buffers = Buffers(self.shape, self.shape, q.dtype, torch.float32, q.device, one_pass=True)
        m, n_rows = cfg["BLOCK_M"], cfg["BLOCK_N"]
        self.descriptors = gluon_hopper.Descriptors((m, n_rows, n_rows, m, n_rows, n_rows), cache)  # q k v do dk dv
        grid = (triton.cdiv(n, n_rows), batch * heads)
        persistent = bool(cfg["PERSISTENT"]) and n <= PERSISTENT_MAX_N
        if persistent:  # one program per SM at most, each taking items grid[0] * grid[1] / P of them
            grid = (min(_sm_count(q.device), grid[0] * grid[1]),)
        self.launch = CachedLaunch(attention_backward_gluon_kernel, grid, dict(
            HEAD_DIM=d, BLOCK_M=m, BLOCK_N=n_rows, STAGES=cfg["STAGES"], CAUSAL=bool(causal), DQ_MODE=cfg["DQ_MODE"],
            STATS_ASYNC=cfg["STATS_ASYNC"], PIPELINE=cfg["PIPELINE"], PERSISTENT=persistent,
            LOADER_REGS=cfg["LOADER_REGS"], num_warps=cfg["num_warps"]), cache)

    def __call__(self, q, k, v, do, dk, dv, lse, delta, dq_acc, scale: float):
        """Launch into ``dk``, ``dv`` and ``dq_acc``; return the compiled kernel."""
        return self.launch(*self.descriptors(q, k, v, do, dk, dv), lse, delta, dq_acc, *self.sizes, scale,
                           scale * LOG2_E)


def attention_backward_gluon(do, q, k, v, o, lse, causal: bool, scale: float, config: dict | None = None,
                             launch: BackwardLaunch | None = None):
    """``(dq, dk, dv)`` of attention with the Gluon one-pass kernel, in q's dtype, contiguous.

    Args:
        do, q, k, v, o: ``(B, H, N, d)`` fp16/bf16 CUDA tensors of one shape (or CPU ones under a
            stand-in driver that only compiles), d = 128, TMA-readable strides.
        lse: ``(B, H, N)`` float32 contiguous, the natural-log log-sum-exp of the forward.
        causal, scale: as in the forward.
        config: entries that replace :data:`CONFIG`'s (``PIPELINE``: one of :data:`PIPELINES`;
            ``PERSISTENT``: a bool).
        launch: a :class:`BackwardLaunch` made for these inputs' call signature (the library's
            launch plans keep one); None: made here (then ``config`` applies; a given launch has its own).

    Raises:
        ValueError naming what is not covered (see :func:`gluon_backward_unsupported_reason`) or a
        ``PIPELINE`` out of range; TypeError for a ``PERSISTENT`` that is not a bool.
    """
    launch = launch or BackwardLaunch(q, k, v, o, do, lse, causal, config)
    dq_acc, delta = launch.buffers.scratch()
    delta = _delta(o, do, lse, launch.delta, delta)
    dq, dk, dv = launch.buffers.grads()
    with compat.FallBack("the Gluon backward", strict=launch.compiling_only) as attempt:
        kernel = launch(q, k, v, do, dk, dv, lse, delta, dq_acc, scale)
    if attempt.failed:  # this Triton cannot compile it (warned once): chapter 07's Triton backward
        from course_lib.kernels.backward import attention_backward

        return attention_backward(do, q, k, v, o, lse, causal, scale)
    attention_backward_gluon.last_kernel = kernel
    return launch.buffers.dq_from(dq, dq_acc), dk, dv


attention_backward_gluon.last_kernel = None


# PTX of the dQ atomics: a 16- or 8-byte fp32 add (atom on Triton 3.6-3.8; red from 3.9, the same
# add with its old value unused), and the wgmma instructions and mbarrier waits around them.
PTX_DQ_ADD = re.compile(r"(?:atom|red)\.global\.gpu\.relaxed\.add\.v[24]\.f32")
_PTX_PIPELINE_EVENTS = re.compile(r"wgmma\.mma_async|wgmma\.wait_group|mbarrier\.try_wait|^\$L__BB\w+:|"
                                  + PTX_DQ_ADD.pattern, re.MULTILINE)


def dq_overlap(ptx: str) -> list[int]:
    """For each run of dQ atomics in ``ptx`` (in text order), how many ``wgmma.mma_async`` were
    issued before it, in the same stretch of straight-line text (no label between), since the last
    ``mbarrier.try_wait`` (a ring slot's "ready") or ``wgmma.wait_group``: the products in flight
    while the atomics issue. PIPELINE 0 gives 0 for every run (each step waits for all its products,
    then adds dQ); PIPELINE_ST gives Sᵀ's instructions (d / 16 at d = 64 and 128) for the loops'
    runs, PIPELINE_ST_DPT Sᵀ's and dPᵀ's (2 · d / 16) for the unmasked loop's and Sᵀ's for the
    masked one's; both 0 for the last step's adds, after the loops. (The if-block that skips the
    first step's adds falls through from the issue, unlabelled, as LLVM lays it out.)"""
    runs, issued, in_run = [], 0, False
    for event in _PTX_PIPELINE_EVENTS.findall(ptx):
        if PTX_DQ_ADD.fullmatch(event):
            if not in_run:
                runs.append(issued)
            in_run = True
            continue
        in_run = False
        if event == "wgmma.mma_async":
            issued += 1
        else:  # a wait for products or for a ring slot: nothing issued since is in flight any more
            issued = 0
    return runs


def cross_compile(causal: bool = True, dtype=torch.float16, n: int = 1000, head_dim: int = 128,
                  config: dict | None = None) -> dict:
    """Compile the kernel for sm_90 without a GPU and return :func:`gluon_hopper.kernel_facts`, with
    ``dq_overlap`` (:func:`dq_overlap` of its PTX)."""
    with gluon_hopper.stand_in_sm90():
        x = torch.zeros(1, 1, n, head_dim, dtype=dtype)
        lse = torch.zeros(1, 1, n, dtype=torch.float32)
        attention_backward_gluon(x, x, x, x, x, lse, causal, head_dim ** -0.5, config=config)
        kernel = attention_backward_gluon.last_kernel
        return {**gluon_hopper.kernel_facts(kernel), "dq_overlap": dq_overlap(kernel.asm["ptx"])}


# ----------------------------------------------------------------------------------------------
# The masked backward (chapter 10's block masks on this kernel)


def masked_backward_unsupported_reason(q, k, v, o, do, plan) -> str | None:
    """Why :func:`masked_backward_gluon` cannot take these inputs, or None if it can: what the
    masked Gluon forward does not cover (:func:`~course_lib.kernels.gluon_masked.masked_gluon_unsupported_reason`),
    and o, do as q."""
    why = gluon_masked.masked_gluon_unsupported_reason(q, k, v, plan)
    if why:
        return why
    for name, x in (("o", o), ("do", do)):
        if x.shape != q.shape:
            return f"{name} must be shaped like q {tuple(q.shape)}, got {tuple(x.shape)}"
        why = gluon_hopper.gluon_unsupported_reason(x, x, x)
        if why:
            return f"{name}: {why}"
    return None


def library_uses_gluon_masked_backward(q, k, v, o, do, plan) -> bool:
    """Whether the library's masked backward (non-deterministic, ``api._masked_kernels_backward``)
    takes :func:`masked_backward_gluon`: where the dense backward takes this file's kernel
    (:func:`library_uses_gluon_backward`'s switches and head dims) and the masked Gluon forward
    covers the mask."""
    from course_lib.platform import runtime
    from course_lib.kernels import tuning

    if runtime.current().interpreted or q.device.type != "cuda" or not gluon_hopper.available():
        return False
    if (not tuning.gluon_backward_enabled() or tuning.autotune_enabled()
            or q.shape[-1] not in tuning.GLUON_BACKWARD_HEAD_DIMS):
        return False
    return masked_backward_unsupported_reason(q, k, v, o, do, plan) is None


def masked_backward_gluon(do, q, k, v, o, lse, scale: float, plan, config: dict | None = None):
    """``(dq, dk, dv)`` of :func:`course_lib.kernels.masked.masked_forward` with the one-pass Gluon
    kernel: dq shaped like q, dk and dv like k and v (summed over each GQA group), in q's dtype.

    Args:
        do, q, o: ``(B, H, N_q, d)``; k, v: ``(B, H_kv, N_k, d)``: fp16/bf16 CUDA tensors (or CPU
            ones under a stand-in driver that only compiles), d in {64, 128}, TMA-readable strides.
        lse: ``(B, H, N_q)`` float32 contiguous, the masked forward's (``-inf`` for rows that saw
            no key: their gradients are 0).
        scale: as in the forward. plan: the forward's :class:`~course_lib.kernels.masked.MaskPlan`
            (no per-sample lengths; 128x128 block-mask tiles).

    Raises:
        ValueError naming what is not covered (:func:`masked_backward_unsupported_reason`).
    """
    from course_lib.kernels import masked

    why = masked_backward_unsupported_reason(q, k, v, o, do, plan)
    if why:
        raise ValueError(f"masked_backward_gluon: q, k, v, o, do, plan: {why}")
    _check_lse("masked_backward_gluon", lse, q)
    batch, heads, n_q, d = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    cfg = {**CONFIG, **(config or {})}
    bmask = plan.block_mask
    delta = _delta(o, do, lse, _delta_launch(o))
    dq_acc = torch.zeros((batch, heads, n_q, d), dtype=torch.float32, device=q.device)
    dk = torch.empty((batch, n_kv_heads, n_k, d), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    # the Triton kernels' arguments from FULL_NUM on (masked._rule_args): the transposed lists and
    # their strides (7), the ragged batch's (4, unused here), the document ids' (4), the dense mask's (5)
    rule_args, rule_meta = masked._rule_args(plan, dummy, forward_lists=False)
    lists, docs, mask = rule_args[:7], rule_args[11:15], list(rule_args[15:20])
    if bmask.mask is not None:
        mask[0] = mask[0].view(torch.uint8)  # the same bytes, loaded as integers
    lo, hi = gluon_masked._window_band(plan, n_q, n_k)
    desc = gluon_hopper._descriptor
    grid = (bmask.shape[-1], batch * n_kv_heads)
    with compat.FallBack("the Gluon masked backward", strict=gluon_hopper._compiling_only()) as launch:
        kernel = masked_backward_gluon_kernel[grid](
            desc(q, cfg["BLOCK_M"]), desc(k, cfg["BLOCK_N"]), desc(v, cfg["BLOCK_N"]), desc(do, cfg["BLOCK_M"]),
            desc(dk, cfg["BLOCK_N"]), desc(dv, cfg["BLOCK_N"]), lse, delta, dq_acc,
            *lists, gluon_masked.tile_order(bmask, transposed=True), *docs, *mask,
            heads, n_kv_heads, heads // n_kv_heads, n_q, n_k, lo, hi, scale, scale * LOG2_E,
            HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bmask.block_n, STAGES=cfg["STAGES"], DQ_MODE=cfg["DQ_MODE"],
            STATS_ASYNC=cfg["STATS_ASYNC"], SPARSE_M=bmask.block_m, BAND=2 if rule_meta["BAND"] else 0,
            DOCS=rule_meta["DOCS"], DENSE_MASK=rule_meta["DENSE_MASK"], LOADER_REGS=cfg["LOADER_REGS"],
            num_warps=cfg["num_warps"])
    if launch.failed:  # this Triton cannot compile it (warned once): the Triton masked backward (Gluon is off now)
        return masked.masked_backward(do, q, k, v, o, lse, scale, plan)
    masked_backward_gluon.last_kernel = kernel
    return dq_acc.to(q.dtype), dk, dv


masked_backward_gluon.last_kernel = None


def cross_compile_masked(q_shape=(1, 2, 1000, 128), kv_heads: int = 1, dtype=torch.float16, *, causal: bool = True,
                         window=None, documents: int = 0, dense_mask: bool = False, config: dict | None = None) -> dict:
    """Compile the masked backward for sm_90 without a GPU on a mask built as
    :func:`course_lib.kernels.gluon_masked.cross_compile` builds it; :func:`gluon_hopper.kernel_facts`."""
    with gluon_hopper.stand_in_sm90():
        q, k, plan = gluon_masked._cross_inputs(q_shape, kv_heads, dtype, causal, window, documents, dense_mask)
        lse = torch.zeros(q.shape[:-1], dtype=torch.float32)
        masked_backward_gluon(q, q, k, k, q, lse, q.shape[-1] ** -0.5, plan, config=config)
        return gluon_hopper.kernel_facts(masked_backward_gluon.last_kernel)
