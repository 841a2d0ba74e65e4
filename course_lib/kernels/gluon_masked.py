"""The masked forward of chapter 10 on Hopper, in Gluon: chapter 09's ping-pong kernel walking tile lists.

:mod:`course_lib.kernels.masked` gives each 128-row Q tile two lists of K/V tiles, its FULL ones
(no element mask) and its PARTIAL ones (element mask), and its Triton kernel loads each listed
tile with pointer loads. On an H100 the dense forward at head dim 128 runs the Gluon ping-pong
kernel of :mod:`course_lib.kernels.gluon_hopper` (TMA rings, a producer warp, two consumer
warpgroups taking turns on the tensor cores), so a masked call there paid for the plainer kernel
on top of its tiles. This file is the same ping-pong design, with two changes:

- the producer warp reads the tile index of each step from the lists (a scalar load: step ``t``
  is ``FULL[t]`` for ``t < n_full``, then ``PARTIAL[t - n_full]``) and asks TMA for the K and V
  tiles at that index; SKIP tiles are in neither list, so they are never copied;
- the consumers walk the same steps; on the PARTIAL ones they rebuild the element mask of
  :func:`course_lib.kernels.masked.visible` (key bound, band ``i + lo <= j <= i + hi`` for causal
  and sliding windows, equal document ids, a dense boolean mask) and guard rows that have seen no
  key yet (their running max is still ``-inf``, and ``-inf - (-inf)`` would be NaN).

Rows that see no key get ``o = 0`` and ``lse = -inf``, as in the Triton kernel. GQA: query head
``h`` reads K/V head ``h // group``.

Covered (:func:`masked_gluon_unsupported_reason` names what is not): ``(B, H, N, d)`` tensors
without per-sample lengths (ragged and packed batches keep the Triton kernel), d in {64, 128},
fp16/bf16, a block mask of 128x128 tiles (the kernel's own), a Hopper GPU (or the stand-in
driver that only compiles, :func:`course_lib.kernels.gluon_hopper.stand_in_sm90`).
"""

from __future__ import annotations

import torch

from course_lib.attention.blockmask import UNBOUNDED
from course_lib.kernels import compat
from course_lib.kernels import gluon_hopper as gh

if gh.available():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from course_lib.kernels.compat import tma_load  # its spelling depends on the Triton version

VARIANT = "pingpong"  # the design it is built on (gluon_hopper's config and register budgets)
TILE = 128  # BLOCK_M = BLOCK_N of the kernel, and so of the block masks it takes
# Head dims the library sends here on an H100: tools/gluon_masked.py measured both (fp16, N = 4k
# and 16k, five masks): 1.35-1.53x the Triton masked forward at d=128, 1.09-1.22x at d=64.
LIBRARY_HEAD_DIMS = (64, 128)


if gh.available():

    @gluon.jit
    def _step_tile(full_row, part_row, t, n_full):
        """The K/V tile index of step ``t``: the FULL list first, then the PARTIAL one."""
        if t < n_full:
            kv = gl.load(full_row + t)
        else:
            kv = gl.load(part_row + (t - n_full))
        return kv

    @gluon.jit
    def _issue_tile(desc, ring, bars, b, h, t, kv, BAR0: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr):
        """Step ``t``'s copy: K/V tile ``kv`` of ``desc`` into ring slot ``t % STAGES`` (as
        :func:`~course_lib.kernels.gluon_hopper._issue`, but at the listed tile's rows)."""
        bar = bars.index(BAR0 + t % STAGES)
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma_load(desc, [b, h, kv * BLOCK_N, 0], bar, ring.index(t % STAGES))

    @gluon.jit
    def _masked_producer(k_desc, v_desc, k_ring, v_ring, ready, empty, b, h_kv, full_row, part_row, n_full,
                         n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The producer warp: K of step t, then V of step t - 1 (the order the consumers need them),
        each once its slot is empty (as :func:`~course_lib.kernels.gluon_hopper._producer`). The tile
        index is loaded before the wait, so the load's latency hides behind it."""
        kv_prev = n_full * 0
        for t in range(0, n_tiles + 1):
            kv = kv_prev
            if t < n_tiles:
                kv = _step_tile(full_row, part_row, t, n_full)
                mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
                _issue_tile(k_desc, k_ring, ready, b, h_kv, t, kv, 0, BLOCK_N, STAGES)
            if t > 0:
                u = t - 1
                mbarrier.wait(empty.index(STAGES + u % STAGES), ((u // STAGES) & 1) ^ 1)
                _issue_tile(v_desc, v_ring, ready, b, h_kv, u, kv_prev, STAGES, BLOCK_N, STAGES)
            kv_prev = kv

    @gluon.jit
    def _dense_mask_tile(MASK, stride_mn, stride_mk, q0, k0, n_q, n_k, Q_ROWS: gl.constexpr, K_COLS: gl.constexpr,
                         layout: gl.constexpr, num_warps: gl.constexpr, TRANSPOSED: gl.constexpr):
        """The dense boolean mask's entries of queries ``q0 ... q0 + Q_ROWS`` and keys ``k0 ... k0 +
        K_COLS`` as a boolean tile in ``layout``: ``(Q_ROWS, K_COLS)``, or (TRANSPOSED, the backward's
        keys-along-rows tiles) ``(K_COLS, Q_ROWS)``. Loaded in a layout of its own, 16 consecutive
        bytes per thread (in the scores' layout each thread holds pairs of columns: a load per
        pair, and a 64-bit address per entry, more registers than a consumer has), then moved into
        ``layout`` through shared memory."""
        m_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
        rows = q0 + gl.arange(0, Q_ROWS, layout=gl.SliceLayout(1, m_layout))
        cols = k0 + gl.arange(0, K_COLS, layout=gl.SliceLayout(0, m_layout))
        inside = (rows[:, None] < n_q) & (cols[None, :] < n_k)
        entries = gl.load(MASK + rows[:, None] * stride_mn + cols[None, :] * stride_mk, mask=inside, other=0)
        if TRANSPOSED:
            entries = gl.permute(entries, (1, 0))
        return gl.convert_layout(entries, layout) != 0

    @gluon.jit
    def _masked_step(s, m_i, l_i, t, n_full, part_row, row0, rows, doc_q, n_q, n_k, lo, hi, DOC_K, MASK, stride_mn,
                     stride_mk, qk_scale_log2, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, BAND: gl.constexpr,
                     DOCS: gl.constexpr, DENSE_MASK: gl.constexpr, num_warps: gl.constexpr):
        """One online-softmax step on the raw scores of step ``t``; on a PARTIAL step (``t >=
        n_full``) the element mask first. A row with no visible key so far keeps ``m = -inf``
        and uses 0 as its max (exponentials of ``-inf`` are 0, not NaN). Returns
        (m_new, p, alpha, l_new) as :func:`~course_lib.kernels.gluon_hopper._softmax_step`."""
        s = s * qk_scale_log2
        if t >= n_full:
            kv = gl.load(part_row + (t - n_full))
            cols = kv * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            inside = (rows[:, None] < n_q) & (cols[None, :] < n_k)  # keys past N were read as zeros
            seen = inside
            if BAND:
                seen = seen & (cols[None, :] >= rows[:, None] + lo) & (cols[None, :] <= rows[:, None] + hi)
            if DOCS:
                doc_k = gl.load(DOC_K + cols, mask=cols < n_k, other=-2)
                seen = seen & (doc_q[:, None] == doc_k[None, :])
            if DENSE_MASK:
                seen = seen & _dense_mask_tile(MASK, stride_mn, stride_mk, row0, kv * BLOCK_N, n_q, n_k,
                                               rows.type.shape[0], BLOCK_N, s_layout, num_warps, False)
            s = gl.where(seen, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.reduce(s, 1, gh._max_combine))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_new = l_i * alpha + gl.reduce(p, 1, gh._add_combine)
        return m_new, p, alpha, l_new

    @gluon.jit
    def _masked_consumer(q_bufs, k_ring, v_ring, ready, empty, q_bar, turn, o_desc, LSE, b, h, start_m, pid_bh,
                         n_q, n_k, part_row, n_full, n_tiles, lo, hi, DOC_Q, DOC_K, MASK, stride_mn, stride_mk,
                         qk_scale_log2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                         STAGES: gl.constexpr, BAND: gl.constexpr, DOCS: gl.constexpr, DENSE_MASK: gl.constexpr,
                         WG: gl.constexpr, num_warps: gl.constexpr):
        """Consumer warpgroup ``WG`` of two: rows ``[WG·BLOCK_M, (WG+1)·BLOCK_M)`` of the tile over
        the listed steps, with the ping-pong turns and the product overlap of
        :func:`~course_lib.kernels.gluon_hopper._consumer` (design d), then its half of O and lse.
        Both consumers walk the same steps, so they take the same number of turns."""
        q_smem = gh._tile2d(q_bufs, WG)
        row0 = start_m + WG * BLOCK_M
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        rows = row0 + gl.arange(0, BLOCK_M, layout=row_s)
        doc_q = rows  # placeholder without documents
        if DOCS:
            doc_q = gl.load(DOC_Q + rows, mask=rows < n_q, other=-1)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        mbarrier.wait(q_bar, 0)  # also when no step follows: O goes out through Q's buffer

        if n_tiles > 0:
            mbarrier.wait(ready.index(0), 0)
            mbarrier.wait(turn.index(WG), 1 - WG)
            s_tok = warpgroup_mma(q_smem, gh._tile2d(k_ring, 0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.arrive(turn.index(1 - WG), count=1)
            s = warpgroup_mma_wait(0, deps=(s_tok,))
            mbarrier.arrive(empty.index(0), count=1)
            m_i, p, alpha, l_i = _masked_step(s, m_i, l_i, 0, n_full, part_row, row0, rows, doc_q, n_q, n_k, lo, hi,
                                              DOC_K, MASK, stride_mn, stride_mk, qk_scale_log2, s_layout, BLOCK_N,
                                              BAND, DOCS, DENSE_MASK, num_warps)
            p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
            for t in range(1, n_tiles):
                slot = t % STAGES
                prev = (t - 1) % STAGES
                mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
                mbarrier.wait(ready.index(STAGES + prev), ((t - 1) // STAGES) & 1)
                mbarrier.wait(turn.index(WG), (t & 1) ^ (1 - WG))
                s_tok = warpgroup_mma(q_smem, gh._tile2d(k_ring, slot).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                o_tok = warpgroup_mma(p_op, gh._tile2d(v_ring, prev), acc, is_async=True)
                mbarrier.arrive(turn.index(1 - WG), count=1)
                s = warpgroup_mma_wait(1, deps=(s_tok,))
                mbarrier.arrive(empty.index(slot), count=1)  # K_t read
                m_i, p, alpha, l_i = _masked_step(s, m_i, l_i, t, n_full, part_row, row0, rows, doc_q, n_q, n_k, lo,
                                                  hi, DOC_K, MASK, stride_mn, stride_mk, qk_scale_log2, s_layout,
                                                  BLOCK_N, BAND, DOCS, DENSE_MASK, num_warps)
                acc, p_old = warpgroup_mma_wait(0, deps=(o_tok, p_op))
                mbarrier.arrive(empty.index(STAGES + prev), count=1)  # V_{t-1} read
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
            last = n_tiles - 1
            mbarrier.wait(ready.index(STAGES + last % STAGES), (last // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, gh._tile2d(v_ring, last % STAGES), acc, is_async=True)
            acc, p_old = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            mbarrier.arrive(empty.index(STAGES + last % STAGES), count=1)

        empty_row = l_i == 0.0  # saw no key (l >= 1 otherwise: the max's own exponential is 1)
        l_safe = gl.where(empty_row, 1.0, l_i)
        lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_safe)) * gh.LN_2)
        o = acc / gl.convert_layout(l_safe, row_o)[:, None]
        gh._write_out(o, lse, q_bufs.index(WG), o_desc, LSE, b, h, row0, pid_bh, n_q, BLOCK_M, HEAD_DIM)

    @gluon.jit
    def masked_forward_gluon_kernel(q_desc, k_desc, v_desc, o_desc, LSE,
                                    FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, list_sb, list_sh, list_len, ORDER,
                                    DOC_Q, DOC_K, stride_docq, stride_dock, MASK, stride_mb, stride_mh, stride_mn,
                                    stride_mk, n_heads, group, n_q, n_k, lo, hi, qk_scale_log2,
                                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                    STAGES: gl.constexpr, BAND: gl.constexpr, DOCS: gl.constexpr,
                                    DENSE_MASK: gl.constexpr, LOADER_REGS: gl.constexpr,
                                    CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """One program: the 128 query rows of Q tile ``tile`` of one (batch, head), and the K/V
        tiles its block-mask row lists. Grid ``(T_q, B·H)``; ``ORDER`` (laid out as the lists'
        counts) says which Q tile each program takes: the ones with the most tiles first, so that
        the short ones fill the GPU at the end."""
        pid_bh = gl.program_id(1)
        b = pid_bh // n_heads
        h = pid_bh % n_heads
        h_kv = h // group
        tile = gl.load(ORDER + b * list_sb + h * list_sh + gl.program_id(0))
        start_m = tile * BLOCK_M
        lrow = b * list_sb + h * list_sh + tile  # this Q tile's row of the block mask
        n_full = gl.load(FULL_NUM + lrow)
        n_tiles = n_full + gl.load(PART_NUM + lrow)
        full_row = FULL_IDX + lrow * list_len
        part_row = PART_IDX + lrow * list_len
        q_bufs, k_ring, v_ring, ready, empty, q_bar, turn = gh._buffers(
            q_desc, k_desc, v_desc, b, h, start_m, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, True)
        Q_ROWS: gl.constexpr = q_desc.block_type.shape[2]
        doc_q_ptr = DOC_Q + b * stride_docq
        doc_k_ptr = DOC_K + b * stride_dock
        mask_ptr = MASK + b * stride_mb + h * stride_mh
        gl.warp_specialize(
            [(_masked_consumer, (q_bufs, k_ring, v_ring, ready, empty, q_bar, turn, o_desc, LSE, b, h, start_m,
                                 pid_bh, n_q, n_k, part_row, n_full, n_tiles, lo, hi, doc_q_ptr, doc_k_ptr, mask_ptr,
                                 stride_mn, stride_mk, qk_scale_log2, Q_ROWS, BLOCK_N, HEAD_DIM, STAGES, BAND, DOCS,
                                 DENSE_MASK, 0, num_warps)),
             (_masked_consumer, (q_bufs, k_ring, v_ring, ready, empty, q_bar, turn, o_desc, LSE, b, h, start_m,
                                 pid_bh, n_q, n_k, part_row, n_full, n_tiles, lo, hi, doc_q_ptr, doc_k_ptr, mask_ptr,
                                 stride_mn, stride_mk, qk_scale_log2, Q_ROWS, BLOCK_N, HEAD_DIM, STAGES, BAND, DOCS,
                                 DENSE_MASK, 1, 4)),
             (_masked_producer, (k_desc, v_desc, k_ring, v_ring, ready, empty, b, h_kv, full_row, part_row, n_full,
                                 n_tiles, BLOCK_N, STAGES))],
            [4, 1], [CONSUMER_REGS, LOADER_REGS])
        gh._invalidate(ready, empty, q_bar, turn, STAGES)


# ----------------------------------------------------------------------------------------------
# Host side


def masked_gluon_unsupported_reason(q, k, v, plan) -> str | None:
    """Why :func:`masked_forward_gluon` cannot take these inputs and this
    :class:`~course_lib.kernels.masked.MaskPlan`, or None if it can."""
    if not gh.available():
        return gh.GLUON_IMPORT_ERROR
    if plan.ragged or plan.varlen or plan.num_samples is not None:
        return "per-sample lengths (seq_lens, cu_seqlens) are served by the Triton masked kernel"
    bmask = plan.block_mask
    if (bmask.block_m, bmask.block_n) != (TILE, TILE):
        return f"the block mask's tiles must be {TILE}x{TILE} (the kernel's), got {bmask.block_m}x{bmask.block_n}"
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return f"q must be (B, H, N_q, d) and k, v (B, H_kv, N_k, d), got {tuple(q.shape)}, {tuple(k.shape)}"
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1] or q.shape[1] % k.shape[1]:
        return f"k, v must share q's batch and head dim, with H_kv dividing H, got {tuple(q.shape)}, {tuple(k.shape)}"
    if (bmask.n_q, bmask.n_k) != (q.shape[2], k.shape[2]):
        return f"the block mask was built for (n_q, n_k) = {(bmask.n_q, bmask.n_k)}, not {(q.shape[2], k.shape[2])}"
    m = bmask.mask
    if m is not None and (m.stride(3) != 1 or m.stride(2) % 16 or m.data_ptr() % 16):
        return ("a dense element mask needs rows of a multiple of 16 bytes (n_k % 16 == 0, contiguous): "
                "the kernel reads 16 of its bytes at a time")
    if q.shape[-1] not in gh.HEAD_DIMS:
        return f"the head dim must be one of {gh.HEAD_DIMS}, got {q.shape[-1]}"
    for x in (q, k, v):  # device, dtype, TMA-readable strides: the dense Gluon forward's checks, one tensor at a time
        why = gh.gluon_unsupported_reason(x, x, x)
        if why:
            return why
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v must all be float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
    return None


def library_uses_gluon_masked(q, k, v, plan) -> bool:
    """Whether the library's masked forward (``api._masked_kernels_forward``) takes this kernel: a Hopper GPU,
    head dim in :data:`LIBRARY_HEAD_DIMS`, inputs it covers, ``COURSE_LIB_GLUON`` not 0 (the
    dense Gluon forward's switch, :func:`course_lib.kernels.tuning.gluon_enabled`)."""
    from course_lib.platform import runtime
    from course_lib.kernels import tuning

    if runtime.current().interpreted or q.device.type != "cuda" or not tuning.gluon_enabled():
        return False
    return q.shape[-1] in LIBRARY_HEAD_DIMS and masked_gluon_unsupported_reason(q, k, v, plan) is None


def _window_band(plan, n_q: int, n_k: int) -> tuple[int, int]:
    """``(lo, hi)`` of :func:`course_lib.kernels.masked.band` for one sample of ``n_q`` queries
    and ``n_k`` keys (every sample's, the batch not being ragged)."""
    left, right = plan.window if plan.window is not None else (-1, -1)
    off = n_k - n_q
    lo = off - (UNBOUNDED if left < 0 else left)
    hi = off + (UNBOUNDED if right < 0 else right)
    if plan.causal:
        hi = min(hi, off if plan.causal_bottom_right else 0)
    return lo, hi


def tile_order(bmask, heaviest_first: bool = True, transposed: bool = False) -> torch.Tensor:
    """The order in which the programs take the Q tiles of each block-mask row (``transposed``:
    the K/V tiles of each column, for the backward): by decreasing number of tiles visited (under a
    causal mask: the last Q tiles first, the first K/V tiles first), or (``heaviest_first=False``)
    simply from the last tile to the first. int32, shaped like the lists' counts; computed once per
    block mask (kept in it, as the API keeps its device copies)."""
    orders = bmask.__dict__.setdefault("_gluon_tile_order", {})
    key = (heaviest_first, transposed)
    if key not in orders:
        if transposed:
            counts = bmask.full_q_num_blocks + bmask.q_num_blocks
        else:
            counts = bmask.full_kv_num_blocks + bmask.kv_num_blocks
        if heaviest_first:
            order = torch.argsort(counts, dim=-1, descending=True, stable=True)
        else:
            order = torch.arange(counts.shape[-1] - 1, -1, -1, device=counts.device).expand(counts.shape)
        orders[key] = order.to(torch.int32).contiguous()
    return orders[key]


def masked_forward_gluon(q, k, v, scale: float, plan, heaviest_first: bool = True):
    """``(o, lse)`` of :func:`course_lib.kernels.masked.masked_forward` with the Gluon kernel:
    ``o`` ``(B, H, N_q, d)`` in q's dtype, ``lse`` ``(B, H, N_q)`` float32, natural log, ``-inf``
    (and ``o = 0``) for rows that see no key. ``heaviest_first``: see :func:`tile_order`.

    Raises:
        ValueError naming what is not covered (:func:`masked_gluon_unsupported_reason`).
    """
    why = masked_gluon_unsupported_reason(q, k, v, plan)
    if why:
        raise ValueError(f"masked_forward_gluon: q, k, v, plan: {why}")
    from course_lib.kernels import masked

    batch, heads, n_q, d = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    cfg = gh.config(VARIANT, d)
    bmask = plan.block_mask
    o = torch.empty((batch, heads, n_q, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    # the Triton kernel's arguments from FULL_NUM on: the lists and their strides (7), the ragged
    # batch's (4, unused here), the document ids' (4), the dense mask's (5)
    rule_args, rule_meta = masked._rule_args(plan, dummy, forward_lists=True)
    lists, docs, mask = rule_args[:7], rule_args[11:15], list(rule_args[15:20])
    if bmask.mask is not None:
        mask[0] = mask[0].view(torch.uint8)  # the same bytes, loaded as integers
    lo, hi = _window_band(plan, n_q, n_k)
    grid = (bmask.shape[-2], batch * heads)
    with compat.FallBack("the Gluon masked forward", strict=gh._compiling_only()) as launch:
        kernel = masked_forward_gluon_kernel[grid](
            gh._descriptor(q, cfg["Q_ROWS"]), gh._descriptor(k, TILE), gh._descriptor(v, TILE),
            gh._descriptor(o, cfg["Q_ROWS"]), lse, *lists, tile_order(bmask, heaviest_first), *docs,
            *mask,
            heads, heads // n_kv_heads, n_q, n_k, lo, hi, scale * gh.LOG2_E,
            HEAD_DIM=d, BLOCK_M=TILE, BLOCK_N=TILE, STAGES=cfg["STAGES"], BAND=rule_meta["BAND"],
            DOCS=rule_meta["DOCS"], DENSE_MASK=rule_meta["DENSE_MASK"],
            LOADER_REGS=cfg["LOADER_REGS"], CONSUMER_REGS=cfg["CONSUMER_REGS"], num_warps=cfg["num_warps"])
    if launch.failed:  # this Triton cannot compile it (warned once): the Triton masked forward (Gluon is off now)
        return masked.masked_forward(q, k, v, scale, plan)
    masked_forward_gluon.last_kernel = kernel
    return o, lse


masked_forward_gluon.last_kernel = None


def _cross_inputs(q_shape, kv_heads, dtype, causal, window, documents, dense_mask):
    """Zero q and k (CPU) and the :class:`~course_lib.kernels.masked.MaskPlan` the library's API
    builds for one of the masks :func:`cross_compile` names (under a stand-in driver)."""
    from course_lib.attention import blockmask as bm
    from course_lib.kernels import masked

    batch, heads, n, d = q_shape
    q = torch.zeros(q_shape, dtype=dtype)
    k = torch.zeros(batch, kv_heads, n, d, dtype=dtype)
    if documents:
        ids = torch.arange(n) * documents // n
        block_mask = bm.document_block_mask(ids, TILE, TILE, causal=causal)
    elif dense_mask:
        keep = torch.rand(1, 1, n, n, generator=torch.Generator().manual_seed(0)) < 0.5
        block_mask = bm.BlockMask.from_mask_mod(lambda b, h, i, j: keep[0, 0, i, j], 1, 1, n, n, TILE, TILE)
    elif window is not None:
        block_mask = bm.sliding_window_block_mask(n, n, window, TILE, TILE, causal=causal)
    else:
        block_mask = bm.causal_block_mask(n, n, TILE, TILE)
    # the plan the API's _masked_call would build, without its device check (a GPU session refuses CPU tensors)
    plan = masked.mask_plan(q, batch, heads, n, n, TILE, TILE, block_mask.causal, block_mask.window, None,
                            block_mask)
    return q, k, plan


def cross_compile(q_shape=(1, 2, 1000, 128), kv_heads: int = 1, dtype=torch.float16, *, causal: bool = True,
                  window=None, documents: int = 0, dense_mask: bool = False) -> dict:
    """Compile the kernel for sm_90 without a GPU (:func:`gluon_hopper.stand_in_sm90`) on a mask
    built by the library's own API, and return :func:`gluon_hopper.kernel_facts`."""
    with gh.stand_in_sm90():
        q, k, plan = _cross_inputs(q_shape, kv_heads, dtype, causal, window, documents, dense_mask)
        masked_forward_gluon(q, k, k, q.shape[-1] ** -0.5, plan)
        return gh.kernel_facts(masked_forward_gluon.last_kernel)


__all__ = ["masked_forward_gluon", "tile_order", "masked_gluon_unsupported_reason", "library_uses_gluon_masked",
           "cross_compile",
           "VARIANT", "TILE", "LIBRARY_HEAD_DIMS"]
