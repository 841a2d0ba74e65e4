"""Masked FlashAttention in Triton (chapter 10): visited tiles only, forward and backward.

Chapter 04 sorted tile pairs into SKIP / PARTIAL / FULL; chapter 06's kernel did it for the causal
mask with loop bounds. Here the tile rule becomes *data*: a :class:`course_lib.attention.blockmask.BlockMask`
gives each Q tile two int32 lists, its FULL K/V tiles and its PARTIAL ones. A forward program

1. loads its Q tile once;
2. walks its FULL list with chapter 06's online-softmax step, no mask at all;
3. walks its PARTIAL list with the element mask (:func:`visible`), guarding rows that have seen
   no key yet (their running max is still -inf);
4. writes ``o`` and the log-sum-exp.

SKIP tiles appear in neither list: they are never loaded. The block mask's tiles (``SPARSE_M x
SPARSE_N``, 128x128 by default on an H100, FlexAttention's default too) need not be the kernels'
tiles (``BLOCK_M x BLOCK_N``, each kernel its own, no larger): a program owns ``BLOCK_M`` query
rows (forward, dQ) or ``BLOCK_N`` keys (dK/dV) and walks each listed tile in steps of the other
size. So dK/dV keeps the dense kernel's 128-key tiles while the forward takes 64 keys a step.
The element mask, applied on partial tiles only, is the AND of:

- the keys' bound ``j < n_k`` of the sample (and ``i < n_q``);
- a band ``i + lo <= j <= i + hi``: ``causal`` (``hi = 0``, top-left as SDPA's ``is_causal``; in
  :func:`~course_lib.kernels.api.flash_attention_varlen` bottom-right, ``hi = n_k - n_q``, as
  FlashAttention-2) and the sliding window ``(left, right)`` in FlashAttention-2's convention:
  query ``i`` sees keys ``i + n_k - n_q - left <= j <= i + n_k - n_q + right`` (-1: unbounded on
  that side; the window is aligned to the bottom-right corner of each sample's score matrix);
- equal document ids (a document block mask), or a dense boolean mask (a block mask built from a
  ``mask_mod``).

Variable lengths: in a padded batch (``seq_lens``) sample ``b`` has ``len_q[b]`` real queries and
``len_k[b]`` real keys; in a packed batch (``cu_seqlens``, FlashAttention-2's varlen layout
``(total, H, d)``) sample ``b`` starts at row ``cu_seqlens[b]``. Tiles are laid out per sample,
so a program never works on padding or on another sample. GQA/MQA: query head ``h`` reads K/V head
``h // (H // H_kv)``.

Rows that see no key at all (a window that misses every key, padding rows, an empty sample) get
``o = 0`` and ``lse = -inf``; their gradients are 0, and they add nothing to dK, dV.

Backward, as chapter 07 (delta = rowsum(dO ∘ O) by chapter 07's preprocess kernel):

- dQ: a program per (Q tile, head) walks the forward's lists;
- dK/dV: a program per (K/V tile, K/V head) walks the *transposed* lists (which Q tiles see this
  K/V tile), for every query head of its group in turn, so that dK and dV of a shared K/V head are
  summed over the group in registers, written once, without atomics.

In the backward the saved ``lse = -inf`` of an empty row is read as ``+inf``, so that
``P = exp2(S - lse)`` is 0 there without a mask.

On Hopper, :func:`course_lib.flash_attention`'s default (``deterministic=False``) masked backward
is the Gluon one-pass kernel of chapter 09 walking the transposed lists
(:func:`course_lib.kernels.gluon_backward.masked_backward_gluon`): a program per (K/V tile, K/V
head), dQ added with atomics. The two kernels above remain the deterministic backward, and the one
for ragged and packed batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from course_lib.platform import runtime
from course_lib.attention import blockmask as bm
from course_lib.attention.blockmask import UNBOUNDED, BlockMask
from course_lib.kernels import fit, tiles, tuning
from course_lib.kernels.backward import delta_launch, run_delta
from course_lib.kernels.forward import LOG2_E_FLOAT, compute_dtype, kernel_dtypes, padded_head_dim
from course_lib.kernels.inputs import _named_lengths, _validate_lengths
from course_lib.kernels.tiles import LN_2, LOG2_E

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

_NO_SPECIALIZE = ["n_q", "n_k", "win_left", "win_right", "group"]


# ----------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def sample_info(b, n_q, n_k, START_Q, START_K, LEN_Q, LEN_K, RAGGED: tl.constexpr):
    """``(start_q, start_k, n_q_b, n_k_b)`` of sample ``b``: its first row in the tensors and its
    lengths (the tensors' own when not ragged)."""
    if RAGGED:
        start_q = tl.load(START_Q + b)
        start_k = tl.load(START_K + b)
        n_q_b = tl.load(LEN_Q + b)
        n_k_b = tl.load(LEN_K + b)
    else:
        start_q = b * 0
        start_k = b * 0
        n_q_b = n_q + b * 0
        n_k_b = n_k + b * 0
    return start_q, start_k, n_q_b, n_k_b


@triton.jit
def band(n_q_b, n_k_b, win_left, win_right, CAUSAL: tl.constexpr, CAUSAL_BOTTOM_RIGHT: tl.constexpr):
    """``(lo, hi)``: query ``i`` may see key ``j`` when ``i + lo <= j <= i + hi``. The window is
    aligned to the bottom-right corner (offset ``n_k_b - n_q_b``; ``win_left``/``win_right`` are
    huge when unbounded); causal caps ``hi`` at 0 (top-left) or at the offset (bottom-right)."""
    off = n_k_b - n_q_b
    lo = off - win_left
    hi = off + win_right
    if CAUSAL:
        if CAUSAL_BOTTOM_RIGHT:
            hi = tl.minimum(hi, off)
        else:
            hi = tl.minimum(hi, off * 0)
    return lo, hi


@triton.jit
def visible(qi, kj, n_q_b, n_k_b, lo, hi, doc_q, doc_k, mask_ptrs,
            BAND: tl.constexpr, DOCS: tl.constexpr, DENSE_MASK: tl.constexpr):
    """True where query ``qi`` may see key ``kj`` (sample-local indices, already broadcast to a
    tile: ``(BLOCK_M, 1)`` and ``(1, BLOCK_N)``, or transposed). ``doc_q``, ``doc_k``: their
    document ids (DOCS); ``mask_ptrs``: pointers to the dense mask's entries (DENSE_MASK)."""
    inside = (qi < n_q_b) & (kj < n_k_b)
    seen = inside
    if BAND:
        seen = seen & (kj >= qi + lo) & (kj <= qi + hi)
    if DOCS:
        seen = seen & (doc_q == doc_k)
    if DENSE_MASK:
        seen = seen & (tl.load(mask_ptrs, mask=inside, other=0) != 0)
    return seen


@triton.jit
def masked_softmax_step(s, seen, m_i, l_i, acc, v, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The online-softmax step on a PARTIAL tile: hidden scores are -inf, and a row that has seen
    no key yet keeps ``m = -inf``; its exponentials use 0 as the max, so they are exp2(-inf) = 0
    instead of exp2(-inf - (-inf)) = NaN."""
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tiles.accumulate(acc, alpha, p, v, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def in_sample(idx, n):
    """``idx < n``: on a FULL tile always true, and applied anyway. It is there for Triton's software
    pipeliner: a tile index that only feeds load addresses is itself fetched by an asynchronous
    copy, and the loop then waits for every copy in flight at each step, so no load overlaps the
    matmuls. Used by the arithmetic too, the index is loaded ahead into registers and the K/V (or
    Q/dO) loads of the next steps overlap this one's work: on an H100 (fp16, N=16k) the forward
    got 1.13x faster on the full mask at d=64, 1.29x on the causal one, 1.13x causal at d=128
    (NOTES.md, "Chapter 10")."""
    return idx < n


@triton.jit
def step_start(idx_ptr, i, SPARSE: tl.constexpr, BLOCK: tl.constexpr):
    """First row of step ``i`` of a walk over a list of block-mask tiles (``SPARSE`` rows each)
    taken ``BLOCK`` rows at a time: tile ``idx_ptr[i // (SPARSE // BLOCK)]``, part ``i % ...``."""
    return tl.load(idx_ptr + i // (SPARSE // BLOCK)) * SPARSE + (i % (SPARSE // BLOCK)) * BLOCK


# ----------------------------------------------------------------------------------------------
# Forward


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def masked_forward_kernel(
        Q, K, V, O, LSE,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_on, stride_od,
        stride_lb, stride_lh,
        FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, list_sb, list_sh, list_len,
        START_Q, START_K, LEN_Q, LEN_K,
        DOC_Q, DOC_K, stride_docq, stride_dock,
        MASK, stride_mb, stride_mh, stride_mn, stride_mk,
        n_heads, group, n_q, n_k, win_left, win_right, qk_scale_log2,
        HEAD_DIM_REAL: tl.constexpr, HEAD_DIM: tl.constexpr,
        CAUSAL: tl.constexpr, CAUSAL_BOTTOM_RIGHT: tl.constexpr, BAND: tl.constexpr,
        RAGGED: tl.constexpr, VARLEN: tl.constexpr, DOCS: tl.constexpr, DENSE_MASK: tl.constexpr,
        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: ``BLOCK_M`` query rows of one (sample, head), a part of one block-mask row
    (``SPARSE_M`` rows); each listed K/V tile (``SPARSE_N`` keys) is walked ``BLOCK_N`` keys at a
    time. Grid ``(T_q · SPARSE_M / BLOCK_M, B · H)``; the heaviest tiles (the last ones, under a
    causal mask) start first."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    h_kv = h // group
    start_q, start_k, n_q_b, n_k_b = sample_info(b, n_q, n_k, START_Q, START_K, LEN_Q, LEN_K, RAGGED=RAGGED)
    lo, hi = band(n_q_b, n_k_b, win_left, win_right, CAUSAL=CAUSAL, CAUSAL_BOTTOM_RIGHT=CAUSAL_BOTTOM_RIGHT)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) sample-local query rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM_REAL
    row_real = offs_m < n_q_b
    q_ptrs = (Q + b * stride_qb + h * stride_qh + (start_q + offs_m)[:, None] * stride_qn
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_real[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM)
    k_base = (K + b * stride_kb + h_kv * stride_kh + (start_k + offs_n)[:, None] * stride_kn
              + offs_d[None, :] * stride_kd)
    v_base = (V + b * stride_vb + h_kv * stride_vh + (start_k + offs_n)[:, None] * stride_vn
              + offs_d[None, :] * stride_vd)
    doc_q = offs_m[:, None]  # placeholders when DOCS is off
    if DOCS:
        doc_q = tl.load(DOC_Q + b * stride_docq + offs_m, mask=row_real, other=-1)[:, None]
    mask_row_ptrs = MASK + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mn

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DTYPE)

    lrow = b * list_sb + h * list_sh + tile // (SPARSE_M // BLOCK_M)  # this program's block-mask row
    busy = tile * BLOCK_M < n_q_b  # rows past the sample: nothing to add (written as padding below)
    n_full = tl.where(busy, tl.load(FULL_NUM + lrow), 0) * (SPARSE_N // BLOCK_N)  # steps, not tiles
    n_part = tl.where(busy, tl.load(PART_NUM + lrow), 0) * (SPARSE_N // BLOCK_N)
    # FULL tiles: every key visible to every real row, entirely inside the sample: no element mask.
    for i in range(0, n_full):
        start_n = step_start(FULL_IDX + lrow * list_len, i, SPARSE_N, BLOCK_N)
        k = tl.load(k_base + start_n * stride_kn, mask=d_mask[None, :], other=0.0)
        s = tiles.scores_log2(q, k, qk_scale_log2, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
        s = tl.where(in_sample(start_n + offs_n, n_k_b)[None, :], s, float("-inf"))  # see in_sample
        m_i, l_i, acc = tiles.online_softmax_step(s, m_i, l_i, acc, v_base + start_n * stride_vn,
                                                  d_mask[None, :], ACC_DTYPE=ACC_DTYPE,
                                                  DOT_PRECISION=DOT_PRECISION)
    # PARTIAL tiles: the element mask.
    for i in range(0, n_part):
        start_n = step_start(PART_IDX + lrow * list_len, i, SPARSE_N, BLOCK_N)
        cols = start_n + offs_n
        kv_mask = (cols < n_k_b)[:, None] & d_mask[None, :]
        k = tl.load(k_base + start_n * stride_kn, mask=kv_mask, other=0.0)
        s = tiles.scores_log2(q, k, qk_scale_log2, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
        doc_k = cols[None, :]
        if DOCS:
            doc_k = tl.load(DOC_K + b * stride_dock + cols, mask=cols < n_k_b, other=-2)[None, :]
        seen = visible(offs_m[:, None], cols[None, :], n_q_b, n_k_b, lo, hi, doc_q, doc_k,
                       mask_row_ptrs + cols[None, :] * stride_mk, BAND=BAND, DOCS=DOCS, DENSE_MASK=DENSE_MASK)
        v = tl.load(v_base + start_n * stride_vn, mask=kv_mask, other=0.0)
        m_i, l_i, acc = masked_softmax_step(s, seen, m_i, l_i, acc, v, ACC_DTYPE=ACC_DTYPE,
                                            DOT_PRECISION=DOT_PRECISION)

    empty = l_i == 0.0  # saw no key (l >= 1 otherwise: the max's own exponential is 1)
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty | (offs_m >= n_q_b), float("-inf"), (m_i + tl.math.log2(l_safe)) * LN_2)
    o = tl.where(row_real[:, None], o, 0.0)  # padding rows of a padded batch: zeros
    if VARLEN:
        store_rows = row_real  # rows past the sample belong to the next one
    else:
        store_rows = offs_m < n_q
    o_ptrs = (O + b * stride_ob + h * stride_oh + (start_q + offs_m)[:, None] * stride_on
              + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=store_rows[:, None] & d_mask[None, :])
    tl.store(LSE + b * stride_lb + h * stride_lh + start_q + offs_m, lse, mask=store_rows)


# ----------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _dq_kv_tiles(dq, q, do, lse_log2, delta, k_base, v_base, stride_kn, stride_vn, idx_ptr, count,
                 offs_m, offs_n, d_mask, n_q_b, n_k_b, lo, hi, doc_q, doc_k_ptr, mask_row_ptrs, stride_mk,
                 qk_scale_log2, MASKED: tl.constexpr, BAND: tl.constexpr, DOCS: tl.constexpr,
                 DENSE_MASK: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 SPARSE_N: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add the contributions of the ``count`` steps (``BLOCK_N`` keys each) over the K/V tiles
    listed at ``idx_ptr`` to dQ; MASKED: they are PARTIAL tiles (element mask), else FULL ones."""
    for i in range(0, count):
        start_n = step_start(idx_ptr, i, SPARSE_N, BLOCK_N)
        cols = start_n + offs_n
        if MASKED:
            kv_mask = (cols < n_k_b)[:, None] & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(k_base + start_n * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_base + start_n * stride_vn, mask=kv_mask, other=0.0)
        s = tiles.scores_log2(q, k, qk_scale_log2, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
        p = tl.math.exp2(s - lse_log2[:, None])  # (BLOCK_M, BLOCK_N)
        if not MASKED:
            p = tl.where(in_sample(cols, n_k_b)[None, :], p, 0.0)  # see in_sample
        if MASKED:
            doc_k = cols[None, :]
            if DOCS:
                doc_k = tl.load(doc_k_ptr + cols, mask=cols < n_k_b, other=-2)[None, :]
            seen = visible(offs_m[:, None], cols[None, :], n_q_b, n_k_b, lo, hi, doc_q, doc_k,
                           mask_row_ptrs + cols[None, :] * stride_mk, BAND=BAND, DOCS=DOCS,
                           DENSE_MASK=DENSE_MASK)
            p = tl.where(seen, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return dq


@triton.jit
def _dkdv_q_tiles(dk, dv, k, v, q_base, do_base, stats_base, delta_base, stride_qn, stride_don, start_q,
                  idx_ptr, count, offs_m, offs_n, d_mask, n_q_b, n_k_b, lo, hi, doc_k, doc_q_ptr,
                  mask_col_ptrs, stride_mn, qk_scale_log2, MASKED: tl.constexpr, BAND: tl.constexpr,
                  DOCS: tl.constexpr, DENSE_MASK: tl.constexpr, ACC_DTYPE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, SPARSE_M: tl.constexpr, BLOCK_M: tl.constexpr):
    """Add the contributions of the ``count`` steps (``BLOCK_M`` query rows each) over the Q tiles
    listed at ``idx_ptr`` to dK, dV (transposed tiles: keys along the rows)."""
    for i in range(0, count):
        start_m = step_start(idx_ptr, i, SPARSE_M, BLOCK_M)
        rows = start_m + offs_m  # (BLOCK_M,) sample-local queries
        row_real = rows < n_q_b  # even a FULL tile may hold rows past the sample: masked loads
        q_mask = row_real[:, None] & d_mask[None, :]
        q = tl.load(q_base + (start_q + rows)[:, None] * stride_qn, mask=q_mask, other=0.0)
        do = tl.load(do_base + (start_q + rows)[:, None] * stride_don, mask=q_mask, other=0.0)
        lse = tl.load(stats_base + rows, mask=row_real, other=float("-inf"))
        lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E)  # empty rows: P = 0
        delta = tl.load(delta_base + rows, mask=row_real, other=0.0)
        s_t = tiles.scores_log2(k, q, qk_scale_log2, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
        p_t = tl.math.exp2(s_t - lse_log2[None, :])  # (BLOCK_N, BLOCK_M)
        if not MASKED:
            p_t = tl.where(in_sample(rows, n_q_b)[None, :], p_t, 0.0)  # see in_sample
        if MASKED:
            doc_q = rows[None, :]
            if DOCS:
                doc_q = tl.load(doc_q_ptr + rows, mask=row_real, other=-1)[None, :]
            seen_t = visible(rows[None, :], offs_n[:, None], n_q_b, n_k_b, lo, hi, doc_q, doc_k,
                             mask_col_ptrs + rows[None, :] * stride_mn, BAND=BAND, DOCS=DOCS,
                             DENSE_MASK=DENSE_MASK)
            p_t = tl.where(seen_t, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return dk, dv


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def masked_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_dob, stride_doh, stride_don, stride_dod,
        stride_dqb, stride_dqh, stride_dqn, stride_dqd,
        stride_lb, stride_lh,
        FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, list_sb, list_sh, list_len,
        START_Q, START_K, LEN_Q, LEN_K,
        DOC_Q, DOC_K, stride_docq, stride_dock,
        MASK, stride_mb, stride_mh, stride_mn, stride_mk,
        n_heads, group, n_q, n_k, win_left, win_right, scale, qk_scale_log2,
        HEAD_DIM_REAL: tl.constexpr, HEAD_DIM: tl.constexpr,
        CAUSAL: tl.constexpr, CAUSAL_BOTTOM_RIGHT: tl.constexpr, BAND: tl.constexpr,
        RAGGED: tl.constexpr, VARLEN: tl.constexpr, DOCS: tl.constexpr, DENSE_MASK: tl.constexpr,
        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dQ for ``BLOCK_M`` query rows of one (sample, head), over the forward's lists
    (as :func:`masked_forward_kernel`)."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    h_kv = h // group
    start_q, start_k, n_q_b, n_k_b = sample_info(b, n_q, n_k, START_Q, START_K, LEN_Q, LEN_K, RAGGED=RAGGED)
    lo, hi = band(n_q_b, n_k_b, win_left, win_right, CAUSAL=CAUSAL, CAUSAL_BOTTOM_RIGHT=CAUSAL_BOTTOM_RIGHT)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM_REAL
    row_real = offs_m < n_q_b
    q_mask = row_real[:, None] & d_mask[None, :]
    rows = (start_q + offs_m)[:, None]
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows * stride_qn + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows * stride_don + offs_d[None, :] * stride_dod,
                 mask=q_mask, other=0.0)
    stats = b * stride_lb + h * stride_lh + start_q + offs_m
    lse = tl.load(LSE + stats, mask=row_real, other=float("-inf"))
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E)  # empty rows: P = 0
    delta = tl.load(DELTA + stats, mask=row_real, other=0.0)
    k_base = (K + b * stride_kb + h_kv * stride_kh + (start_k + offs_n)[:, None] * stride_kn
              + offs_d[None, :] * stride_kd)
    v_base = (V + b * stride_vb + h_kv * stride_vh + (start_k + offs_n)[:, None] * stride_vn
              + offs_d[None, :] * stride_vd)
    doc_q = offs_m[:, None]
    if DOCS:
        doc_q = tl.load(DOC_Q + b * stride_docq + offs_m, mask=row_real, other=-1)[:, None]
    mask_row_ptrs = MASK + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mn
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DTYPE)

    lrow = b * list_sb + h * list_sh + tile // (SPARSE_M // BLOCK_M)
    busy = tile * BLOCK_M < n_q_b
    steps = SPARSE_N // BLOCK_N
    dq = _dq_kv_tiles(dq, q, do, lse_log2, delta, k_base, v_base, stride_kn, stride_vn,
                      FULL_IDX + lrow * list_len, tl.where(busy, tl.load(FULL_NUM + lrow), 0) * steps,
                      offs_m, offs_n, d_mask,
                      n_q_b, n_k_b, lo, hi, doc_q, DOC_K + b * stride_dock, mask_row_ptrs, stride_mk,
                      qk_scale_log2, MASKED=False, BAND=BAND, DOCS=DOCS, DENSE_MASK=DENSE_MASK,
                      ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION, SPARSE_N=SPARSE_N, BLOCK_N=BLOCK_N)
    dq = _dq_kv_tiles(dq, q, do, lse_log2, delta, k_base, v_base, stride_kn, stride_vn,
                      PART_IDX + lrow * list_len, tl.where(busy, tl.load(PART_NUM + lrow), 0) * steps,
                      offs_m, offs_n, d_mask,
                      n_q_b, n_k_b, lo, hi, doc_q, DOC_K + b * stride_dock, mask_row_ptrs, stride_mk,
                      qk_scale_log2, MASKED=True, BAND=BAND, DOCS=DOCS, DENSE_MASK=DENSE_MASK,
                      ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION, SPARSE_N=SPARSE_N, BLOCK_N=BLOCK_N)

    dq = dq * scale
    if VARLEN:
        store_rows = row_real
    else:
        store_rows = offs_m < n_q
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqn + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=store_rows[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def masked_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_dob, stride_doh, stride_don, stride_dod,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd,  # dK and dV share one layout
        stride_lb, stride_lh,
        FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, list_sb, list_sh, list_len,
        START_Q, START_K, LEN_Q, LEN_K,
        DOC_Q, DOC_K, stride_docq, stride_dock,
        MASK, stride_mb, stride_mh, stride_mn, stride_mk,
        n_kv_heads, group, n_q, n_k, win_left, win_right, scale, qk_scale_log2,
        HEAD_DIM_REAL: tl.constexpr, HEAD_DIM: tl.constexpr,
        CAUSAL: tl.constexpr, CAUSAL_BOTTOM_RIGHT: tl.constexpr, BAND: tl.constexpr,
        RAGGED: tl.constexpr, VARLEN: tl.constexpr, DOCS: tl.constexpr, DENSE_MASK: tl.constexpr,
        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dK, dV for ``BLOCK_N`` keys of one (sample, K/V head), a part of one block-mask
    column, summed over the query heads of its group; it walks the transposed lists (the Q tiles
    that see this K/V tile), ``BLOCK_M`` query rows at a time. Works with transposed score tiles
    (keys along the rows), as chapter 07's dK/dV kernel."""
    tile = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    h_kv = pid_bh % n_kv_heads
    start_q, start_k, n_q_b, n_k_b = sample_info(b, n_q, n_k, START_Q, START_K, LEN_Q, LEN_K, RAGGED=RAGGED)
    lo, hi = band(n_q_b, n_k_b, win_left, win_right, CAUSAL=CAUSAL, CAUSAL_BOTTOM_RIGHT=CAUSAL_BOTTOM_RIGHT)

    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) sample-local keys of this program
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM_REAL
    key_real = offs_n < n_k_b
    kv_mask = key_real[:, None] & d_mask[None, :]
    krows = (start_k + offs_n)[:, None]
    k = tl.load(K + b * stride_kb + h_kv * stride_kh + krows * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + h_kv * stride_vh + krows * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    doc_k = offs_n[:, None]
    if DOCS:
        doc_k = tl.load(DOC_K + b * stride_dock + offs_n, mask=key_real, other=-2)[:, None]
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=ACC_DTYPE)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=ACC_DTYPE)
    busy = tile * BLOCK_N < n_k_b  # keys past the sample: their gradients are 0
    steps = tl.where(busy, SPARSE_M // BLOCK_M, 0)

    for g in range(0, group):  # GQA: every query head that reads this K/V head
        h = h_kv * group + g
        q_base = Q + b * stride_qb + h * stride_qh + offs_d[None, :] * stride_qd
        do_base = DO + b * stride_dob + h * stride_doh + offs_d[None, :] * stride_dod
        stats_base = LSE + b * stride_lb + h * stride_lh + start_q
        delta_base = DELTA + b * stride_lb + h * stride_lh + start_q
        mask_col_ptrs = MASK + b * stride_mb + h * stride_mh + offs_n[:, None] * stride_mk
        lrow = b * list_sb + h * list_sh + tile // (SPARSE_N // BLOCK_N)
        dk, dv = _dkdv_q_tiles(dk, dv, k, v, q_base, do_base, stats_base, delta_base, stride_qn, stride_don,
                               start_q, FULL_IDX + lrow * list_len, tl.load(FULL_NUM + lrow) * steps, offs_m, offs_n,
                               d_mask, n_q_b, n_k_b, lo, hi, doc_k, DOC_Q + b * stride_docq, mask_col_ptrs,
                               stride_mn, qk_scale_log2, MASKED=False, BAND=BAND, DOCS=DOCS,
                               DENSE_MASK=DENSE_MASK, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION,
                               SPARSE_M=SPARSE_M, BLOCK_M=BLOCK_M)
        dk, dv = _dkdv_q_tiles(dk, dv, k, v, q_base, do_base, stats_base, delta_base, stride_qn, stride_don,
                               start_q, PART_IDX + lrow * list_len, tl.load(PART_NUM + lrow) * steps, offs_m, offs_n,
                               d_mask, n_q_b, n_k_b, lo, hi, doc_k, DOC_Q + b * stride_docq, mask_col_ptrs,
                               stride_mn, qk_scale_log2, MASKED=True, BAND=BAND, DOCS=DOCS,
                               DENSE_MASK=DENSE_MASK, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION,
                               SPARSE_M=SPARSE_M, BLOCK_M=BLOCK_M)

    dk = dk * scale
    if VARLEN:
        store_rows = key_real
    else:
        store_rows = offs_n < n_k
    out = b * stride_dkb + h_kv * stride_dkh + krows * stride_dkn + offs_d[None, :] * stride_dkd
    out_mask = store_rows[:, None] & d_mask[None, :]
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=out_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=out_mask)


# ----------------------------------------------------------------------------------------------
# Host side


@dataclass
class MaskPlan:
    """Everything the three kernels need besides q, k, v: built by the API
    (:func:`course_lib.kernels.api.flash_attention` and friends), checked there.

    ``block_mask`` is at the launch's tile sizes and already holds every rule's tile classes;
    ``len_q``/``len_k``/``start_q``/``start_k`` (int32 ``(B,)``) are set for ragged batches
    (``varlen``: packed, the tensors are ``(1, H, total, d)`` views); ``window`` is
    ``(left, right)`` or None; ``causal_bottom_right``: FlashAttention-2's causal alignment.
    """

    block_mask: BlockMask
    causal: bool = False
    causal_bottom_right: bool = False
    window: tuple[int, int] | None = None
    len_q: torch.Tensor | None = None
    len_k: torch.Tensor | None = None
    start_q: torch.Tensor | None = None
    start_k: torch.Tensor | None = None
    varlen: bool = False
    num_samples: int | None = None  # samples (grid axis); None = the tensors' batch

    @property
    def ragged(self) -> bool:
        return self.len_q is not None


def mask_plan(q, batch, heads, n_q, n_k, block_m, block_n, causal, window, seq_lens, block_mask):
    """The :class:`MaskPlan` of a call the API (:mod:`course_lib.kernels.api`) checked: the tile
    classes of the band (causal, window, lengths) intersected with the block mask's, and the element
    rules."""
    len_q = len_k = None
    if seq_lens is not None:
        named = _named_lengths(seq_lens)
        (name_q, lq), (name_k, lk) = named[0], named[-1]
        len_q = _validate_lengths(name_q, lq, batch, n_q, q.device)
        len_k = _validate_lengths(name_k, lk, batch, n_k, q.device)
    lo, hi = bm.window_band(window, n_q if len_q is None else len_q.long(),
                            n_k if len_k is None else len_k.long(), causal)
    classes = bm.band_tile_classes(n_q, n_k, block_m, block_n, lo=lo, hi=hi, len_q=len_q, len_k=len_k,
                                   device=q.device)
    mask_kw = {}
    if block_mask is not None:
        classes = bm.combine_classes(block_mask.classes, classes)
        mask_kw = dict(mask=block_mask.mask, document_ids=block_mask.document_ids)
    return MaskPlan(
        block_mask=bm.BlockMask(classes, n_q, n_k, block_m, block_n, **mask_kw), causal=causal,
        window=window, len_q=len_q, len_k=len_k,
        start_q=None if len_q is None else torch.zeros_like(len_q),
        start_k=None if len_k is None else torch.zeros_like(len_k))


def launch_blocks(head_dim: int, dtype: torch.dtype) -> dict[str, tuning.Blocks]:
    """The masked kernels' preferred configs, ``{"forward", "dq", "dkdv"}``: the dense kernels'
    (:func:`tuning.gpu_default`, long sequences), whose tiles were measured on an H100. Interpreter:
    64x64 for all three.

    They are independent of the block mask's tiles: a program owns ``BLOCK_M`` query rows
    (forward, dQ) or ``BLOCK_N`` keys (dK/dV) and walks each listed tile in steps of the other
    size, as FlexAttention's kernels walk its 128x128 blocks. So dK/dV keeps the dense kernel's
    128-key tiles (K and V re-read per 128 keys, not per 64) whatever the forward's are. A launch
    clips them to the block mask's tiles (:func:`fit_blocks`)."""
    if _rt.interpreted:
        b = tuning.INTERPRETER_FORWARD
        return {"forward": b, "dq": b, "dkdv": b}
    size = torch.empty((), dtype=dtype).element_size()
    hd = padded_head_dim(head_dim)
    blocks = {kernel: tuning.gpu_default(kernel, hd, size) for kernel in ("forward", "dq", "dkdv")}
    if blocks["forward"] == tuning.Blocks(128, 64, 8, 3) and hd <= 64:
        # measured on an H100 (NOTES.md, "Chapter 10"): the masked forward at d=64 runs 1.21-1.29x
        # faster on 4 warps than on the dense kernel's 8 (N=16k, five mask patterns)
        blocks["forward"] = MASKED_FORWARD_D64
    return blocks


MASKED_FORWARD_D64 = tuning.Blocks(128, 64, 4, 3)


def tile_sizes(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(block_m, block_n)`` of the block masks the API builds (build yours with these): the
    largest tiles of :func:`launch_blocks`, so that every kernel keeps its preferred tile. On an
    H100 at d <= 128 (fp16/bf16) that is 128x128, FlexAttention's default block size too."""
    blocks = launch_blocks(head_dim, dtype).values()
    return max(b.block_m for b in blocks), max(b.block_n for b in blocks)


def fit_blocks(blocks: tuning.Blocks, bmask: BlockMask) -> tuning.Blocks:
    """``blocks`` with its tiles no larger than the block mask's (both are powers of two, so the
    kernel's tile then divides the mask's)."""
    return tuning.Blocks(min(blocks.block_m, bmask.block_m), min(blocks.block_n, bmask.block_n),
                         blocks.num_warps, blocks.num_stages)


def _choose(name: str, kernel, preferred: tuning.Blocks, bmask: BlockMask, q: torch.Tensor, args, meta):
    """The config of one masked launch: ``preferred`` clipped to the mask's tiles; on a GPU, the
    first of the dense table's candidates (so clipped) that fits this GPU without spilling
    (:func:`course_lib.kernels.fit.choose`)."""
    first = fit_blocks(preferred, bmask)
    if _rt.interpreted:
        return first
    size = q.element_size()
    candidates = [fit_blocks(b, bmask) for b in tuning.gpu_candidates(name, padded_head_dim(q.shape[-1]), size)]
    return fit.choose(kernel, [first, *candidates], args, meta)


def _list_strides(num: torch.Tensor) -> tuple[int, int]:
    """Strides (in list rows) of the ``(B or 1, H or 1, T)`` count tensor; 0 on a size-1 dim, so
    that one list serves every batch element / head."""
    bm, hm, t = num.shape
    return (hm * t if bm > 1 else 0), (t if hm > 1 else 0)


def _rule_args(plan: MaskPlan, dummy: torch.Tensor, forward_lists: bool):
    """The kernel arguments from ``FULL_NUM`` to the MASK strides, and the rule constexprs."""
    bmask = plan.block_mask
    if forward_lists:
        lists = (bmask.full_kv_num_blocks, bmask.full_kv_indices, bmask.kv_num_blocks, bmask.kv_indices)
    else:
        lists = (bmask.full_q_num_blocks, bmask.full_q_indices, bmask.q_num_blocks, bmask.q_indices)
    sb, sh = _list_strides(lists[0])
    ragged = (plan.start_q, plan.start_k, plan.len_q, plan.len_k) if plan.ragged else (dummy,) * 4
    if bmask.document_ids is not None:
        doc_q, doc_k = bmask.document_ids
        docs = (doc_q, doc_k, doc_q.stride(0) if doc_q.shape[0] > 1 else 0,
                doc_k.stride(0) if doc_k.shape[0] > 1 else 0)
    else:
        docs = (dummy, dummy, 0, 0)
    if bmask.mask is not None:
        m = bmask.mask
        mask = (m, m.stride(0) if m.shape[0] > 1 else 0, m.stride(1) if m.shape[1] > 1 else 0,
                m.stride(2), m.stride(3))
    else:
        mask = (dummy, 0, 0, 0, 0)
    args = (*lists, sb, sh, lists[1].shape[-1], *ragged, *docs, *mask)
    meta = dict(CAUSAL=plan.causal, CAUSAL_BOTTOM_RIGHT=plan.causal_bottom_right,
                BAND=plan.causal or plan.window is not None, RAGGED=plan.ragged, VARLEN=plan.varlen,
                DOCS=bmask.document_ids is not None, DENSE_MASK=bmask.mask is not None)
    return args, meta


def _window_args(plan: MaskPlan) -> tuple[int, int]:
    if plan.window is None:
        return UNBOUNDED, UNBOUNDED
    left, right = plan.window
    return (UNBOUNDED if left < 0 else left), (UNBOUNDED if right < 0 else right)


def _batch_strides(x: torch.Tensor, plan: MaskPlan):
    """A ``(B, H, N, d)`` tensor's strides; the batch stride is 0 for a packed (varlen) batch,
    whose samples are told apart by their start rows."""
    st = x.stride()
    return (0 if plan.varlen else st[0], *st[1:])


def _lse_strides(lse: torch.Tensor, plan: MaskPlan):
    return (0 if plan.varlen else lse.stride(0)), lse.stride(1)


def _grid_samples(q4: torch.Tensor, plan: MaskPlan) -> int:
    return plan.num_samples if plan.num_samples is not None else q4.shape[0]


def masked_forward(q, k, v, scale: float, plan: MaskPlan, blocks: tuning.Blocks | None = None):
    """Forward on ``(B, H, N_q, d)`` / ``(B, H_kv, N_k, d)`` views (packed: ``B = 1``).

    Returns ``(o, lse)``: ``o`` ``(B, H, N_q, d)`` in q's dtype, ``lse`` ``(B, H, N_q)`` float32
    (float64 for float64), natural log, ``-inf`` for rows that see no key. The Triton kernel only: on
    Hopper the API takes the Gluon kernel of :mod:`course_lib.kernels.gluon_masked` where it covers
    the inputs (``api._masked_kernels_forward``).
    """
    work = compute_dtype(q.dtype, _rt.interpreted)
    qw, kw, vw = (x.to(work) for x in (q, k, v))
    batch, heads, n_q, d = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    bmask = plan.block_mask
    o = torch.empty((batch, heads, n_q, d), dtype=work, device=q.device)
    acc_dtype, precision = kernel_dtypes(work, padded_head_dim(d))
    lse = torch.empty((batch, heads, n_q), device=q.device,
                      dtype=torch.float64 if work == torch.float64 else torch.float32)
    dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    rule_args, rule_meta = _rule_args(plan, dummy, forward_lists=True)
    win_left, win_right = _window_args(plan)
    args = (qw, kw, vw, o, lse, *_batch_strides(qw, plan), *_batch_strides(kw, plan), *_batch_strides(vw, plan),
            *_batch_strides(o, plan), *_lse_strides(lse, plan), *rule_args,
            heads, heads // n_kv_heads, n_q, n_k, win_left, win_right, scale * LOG2_E_FLOAT)
    meta = dict(HEAD_DIM_REAL=d, HEAD_DIM=padded_head_dim(d), **rule_meta, ACC_DTYPE=acc_dtype,
                DOT_PRECISION=precision, SPARSE_M=bmask.block_m, SPARSE_N=bmask.block_n)
    if blocks is None:
        blocks = _choose("forward", masked_forward_kernel, launch_blocks(d, q.dtype)["forward"], bmask, qw,
                         args, meta)
    blocks = fit_blocks(blocks, bmask)
    grid = (bmask.shape[-2] * (bmask.block_m // blocks.block_m), _grid_samples(q, plan) * heads)
    masked_forward_kernel[grid](*args, **meta, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n,
                                num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    return o.to(q.dtype), lse


def masked_backward(do, q, k, v, o, lse, scale: float, plan: MaskPlan,
                    dq_blocks: tuning.Blocks | None = None, dkdv_blocks: tuning.Blocks | None = None):
    """Gradients ``(dq, dk, dv)`` of :func:`masked_forward`, shaped like q, k, v (dk, dv summed over
    each GQA group): this file's two kernels, bit-for-bit reproducible. (On Hopper the API takes the
    Gluon one-pass backward where it covers the mask and ``deterministic=False``:
    ``api._masked_kernels_backward``.)"""
    work = compute_dtype(q.dtype, _rt.interpreted)
    dow, qw, kw, vw, ow = (x.to(work) for x in (do, q, k, v, o))
    batch, heads, n_q, d = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    bmask = plan.block_mask
    acc_dtype, precision = kernel_dtypes(work, padded_head_dim(d))
    hd = padded_head_dim(d)

    # rowsum(dO ∘ O): chapter 07's preprocess kernel and launch (its config fitted to the GPU), as they are
    delta = run_delta(delta_launch(ow.shape, acc_dtype), ow, dow, lse)

    dq = torch.empty((batch, heads, n_q, d), dtype=work, device=q.device)
    dk = torch.empty((batch, n_kv_heads, n_k, d), dtype=work, device=q.device)
    dv = torch.empty_like(dk)
    dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    samples = _grid_samples(q, plan)
    win_left, win_right = _window_args(plan)
    group = heads // n_kv_heads
    common = (*_batch_strides(qw, plan), *_batch_strides(kw, plan), *_batch_strides(vw, plan),
              *_batch_strides(dow, plan))
    meta = dict(HEAD_DIM_REAL=d, HEAD_DIM=hd, ACC_DTYPE=acc_dtype, DOT_PRECISION=precision,
                SPARSE_M=bmask.block_m, SPARSE_N=bmask.block_n)
    preferred = launch_blocks(d, q.dtype)

    rule_args, rule_meta = _rule_args(plan, dummy, forward_lists=True)
    args = (qw, kw, vw, dow, lse, delta, dq, *common, *_batch_strides(dq, plan), *_lse_strides(lse, plan),
            *rule_args, heads, group, n_q, n_k, win_left, win_right, scale, scale * LOG2_E_FLOAT)
    kmeta = {**meta, **rule_meta}
    blocks = fit_blocks(dq_blocks or _choose("dq", masked_dq_kernel, preferred["dq"], bmask, qw, args, kmeta),
                        bmask)
    masked_dq_kernel[(bmask.shape[-2] * (bmask.block_m // blocks.block_m), samples * heads)](
        *args, **kmeta, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, num_warps=blocks.num_warps,
        num_stages=blocks.num_stages)

    rule_args, rule_meta = _rule_args(plan, dummy, forward_lists=False)
    args = (qw, kw, vw, dow, lse, delta, dk, dv, *common, *_batch_strides(dk, plan), *_lse_strides(lse, plan),
            *rule_args, n_kv_heads, group, n_q, n_k, win_left, win_right, scale, scale * LOG2_E_FLOAT)
    kmeta = {**meta, **rule_meta}
    blocks = fit_blocks(dkdv_blocks or _choose("dkdv", masked_dkdv_kernel, preferred["dkdv"], bmask, qw, args,
                                               kmeta), bmask)
    masked_dkdv_kernel[(bmask.shape[-1] * (bmask.block_n // blocks.block_n), samples * n_kv_heads)](
        *args, **kmeta, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, num_warps=blocks.num_warps,
        num_stages=blocks.num_stages)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
