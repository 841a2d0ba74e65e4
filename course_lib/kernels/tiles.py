"""Tile helpers shared by the Triton kernels (chapters 06 and 07).

Every kernel of the course does the same few things around its own arithmetic: find which
(batch, head) and which tile of rows its program owns, point at a tile of a ``(B, H, N, d)``
tensor, load it with the ragged rows and the padded head-dim columns masked, decide which tiles
of the other sequence need a mask, and (forward) fold a tile of scores into the online-softmax
state. Each of those is written once here; the kernels of :mod:`~course_lib.kernels.teaching`,
:mod:`~course_lib.kernels.forward` and :mod:`~course_lib.kernels.backward` call them.

Triton inlines ``@triton.jit`` helpers into the kernel that calls them, so a helper costs
nothing at run time: the compiled kernel is the one you would get by pasting the body in.

Names, as in every kernel: ``n_q``, ``n_k`` sequence lengths; ``BLOCK_M`` query rows and
``BLOCK_N`` key rows per tile; ``HEAD_DIM`` the head dim rounded up to a power of two
(``tl.arange`` needs one) and ``HEAD_DIM_REAL`` the true one; ``d_mask`` ``(HEAD_DIM,)`` is
``offs_d < HEAD_DIM_REAL``. A tensor ``X`` is seen as ``(B, H, N, d)`` through its strides
``stride_xb, stride_xh, stride_xn, stride_xd``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from course_lib import constants
from course_lib.platform import runtime

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

# The course's constants (course_lib.constants) as tl.constexpr, usable inside kernels.
LOG2_E: tl.constexpr = tl.constexpr(constants.LOG2_E)
LN_2: tl.constexpr = tl.constexpr(constants.LN_2)
MASK_VALUE: tl.constexpr = tl.constexpr(constants.MASK_VALUE)


# ----------------------------------------------------------------------------------------------
# Which tile a program owns, and where it lies in memory


@triton.jit
def program_tile(n_rows, n_heads, BLOCK: tl.constexpr):
    """``(pid_bh, b, h, start)`` of this program in a 1-D grid of cdiv(n_rows, BLOCK) tiles per
    (batch, head): the tile holds rows ``start .. start + BLOCK - 1`` of head ``h`` of batch ``b``;
    ``pid_bh = b · n_heads + h`` indexes contiguous ``(B, H, N)`` row vectors (LSE, delta)."""
    num_tiles = tl.cdiv(n_rows, BLOCK)
    pid = tl.program_id(0)
    pid_bh = pid // num_tiles
    return pid_bh, pid_bh // n_heads, pid_bh % n_heads, (pid % num_tiles) * BLOCK


# Orders of a causal grid's programs (the query tiles that see the most keys are the last ones):
ORDER_BY_HEAD: tl.constexpr = tl.constexpr(0)  # head by head, each head's tiles first to last
ORDER_LONGEST_FIRST_PER_HEAD: tl.constexpr = tl.constexpr(1)  # head by head, each head's last tile first
ORDER_LONGEST_FIRST: tl.constexpr = tl.constexpr(2)  # every head's last tile, then every head's ..., first


@triton.jit
def program_tile_ordered(n_rows, n_heads, BLOCK: tl.constexpr, ORDER: tl.constexpr):
    """:func:`program_tile` with the programs in ``ORDER``: the GPU starts programs roughly in
    order of their id, so under a causal mask, where the last query tile does the most work,
    starting the long tiles first leaves only short ones for the end (less idle time at the tail)."""
    if ORDER == ORDER_LONGEST_FIRST:
        num_tiles = tl.cdiv(n_rows, BLOCK)
        n_bh = tl.num_programs(0) // num_tiles
        pid = tl.program_id(0)
        pid_bh = pid % n_bh
        return pid_bh, pid_bh // n_heads, pid_bh % n_heads, (num_tiles - 1 - pid // n_bh) * BLOCK
    pid_bh, b, h, start = program_tile(n_rows, n_heads, BLOCK=BLOCK)
    if ORDER == ORDER_LONGEST_FIRST_PER_HEAD:
        start = (tl.cdiv(n_rows, BLOCK) - 1) * BLOCK - start
    return pid_bh, b, h, start


@triton.jit
def head_start(X, b, h, stride_xb, stride_xh):
    """Pointer to ``X[b, h, 0, 0]``: the ``(N, d)`` matrix of one (batch, head)."""
    return X + b * stride_xb + h * stride_xh


@triton.jit
def tile_ptrs(X, b, h, rows, cols, stride_xb, stride_xh, stride_xn, stride_xd):
    """Pointers to ``X[b, h, rows, cols]``: ``(len(rows), len(cols))``."""
    return head_start(X, b, h, stride_xb, stride_xh) + rows[:, None] * stride_xn + cols[None, :] * stride_xd


@triton.jit
def row_mask(rows, n_rows, d_mask):
    """``(len(rows), HEAD_DIM)``: True for rows inside the sequence and real head-dim columns."""
    return (rows[:, None] < n_rows) & d_mask[None, :]


@triton.jit
def load_tile(X, b, h, rows, cols, mask, stride_xb, stride_xh, stride_xn, stride_xd):
    """``X[b, h, rows, cols]`` where ``mask`` (see :func:`row_mask`), 0 elsewhere."""
    return tl.load(tile_ptrs(X, b, h, rows, cols, stride_xb, stride_xh, stride_xn, stride_xd),
                   mask=mask, other=0.0)


@triton.jit
def load_tile_at(first_tile_ptrs, start, offs, n_rows, d_mask, stride_xn):
    """The tile of rows ``start + offs`` in a loop over tiles; ``first_tile_ptrs`` point at rows
    ``offs`` (see :func:`tile_ptrs`). Returns ``(rows, mask, tile)``: the row indices, the
    :func:`row_mask` (for the other tensor of the same rows), and the tile, 0 outside ``mask``."""
    rows = start + offs
    mask = row_mask(rows, n_rows, d_mask)
    return rows, mask, tl.load(first_tile_ptrs + start * stride_xn, mask=mask, other=0.0)


# ----------------------------------------------------------------------------------------------
# Which tiles need a mask


@triton.jit
def kv_loop_end(start_m, n_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key the Q tile of rows ``start_m .. start_m + BLOCK_M - 1`` can see."""
    if CAUSAL:
        return tl.minimum(n_k, start_m + BLOCK_M)  # its last row is start_m + BLOCK_M - 1
    return n_k


@triton.jit
def kv_split(start_m, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(full_end, kv_end)`` for the Q tile at ``start_m``: the key tiles in ``[0, full_end)``
    need no mask (inside the keys and, when causal, left of the diagonal); those in
    ``[full_end, kv_end)`` straddle the diagonal or the ragged end and do; the rest are skipped."""
    kv_end = kv_loop_end(start_m, n_k, BLOCK_M=BLOCK_M, CAUSAL=CAUSAL)
    if CAUSAL:
        full_end = tl.minimum((start_m + 1) // BLOCK_N, n_k // BLOCK_N) * BLOCK_N
    else:
        full_end = (n_k // BLOCK_N) * BLOCK_N
    return full_end, kv_end


@triton.jit
def q_split(start_n, n_q, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(q_lo, band_end, full_end, tail_start)`` for the key tile at ``start_n`` (dK/dV).

    Query tiles, in order: ``[q_lo, band_end)`` straddle the diagonal (masked);
    ``[band_end, full_end)`` need no mask; ``[tail_start, n_q)`` is the ragged end (masked).
    Tiles before ``q_lo`` only hold queries i < start_n, which see none of these keys: skipped.
    """
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
    return q_lo, band_end, full_end, tail_start


@triton.jit
def visible(offs_q, offs_k, n_k, CAUSAL: tl.constexpr):
    """``(len(offs_q), len(offs_k))``: True where query i may see key j — j < n_k and, when
    causal, j <= i (top-left aligned)."""
    seen = offs_k[None, :] < n_k  # ragged end of the keys
    if CAUSAL:
        seen = seen & (offs_k[None, :] <= offs_q[:, None])
    return seen


@triton.jit
def visible_t(offs_k, offs_q, n_q, CAUSAL: tl.constexpr):
    """:func:`visible` transposed, keys along the rows: ``(len(offs_k), len(offs_q))``, True
    where i < n_q and, when causal, j <= i."""
    seen = offs_q[None, :] < n_q  # ragged end of the queries
    if CAUSAL:
        seen = seen & (offs_k[:, None] <= offs_q[None, :])
    return seen


# ----------------------------------------------------------------------------------------------
# Arithmetic on a tile


@triton.jit
def scores_log2(a, b, qk_scale_log2, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``a · bᵀ · scale · LOG2_E``: a tile of scores in log2 units (``qk_scale_log2`` =
    scale · LOG2_E, folded on the host). ``(q, k)`` gives S, ``(k, q)`` gives Sᵀ."""
    return tl.dot(a, tl.trans(b), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale_log2


@triton.jit
def softmax_update(s, m_i, l_i):
    """The first half of an online-softmax step: new max, probabilities, correction factor, sum.

    s: ``(BLOCK_M, BLOCK_N)`` scores in log2 units (MASK_VALUE where masked); m_i, l_i:
    ``(BLOCK_M,)``. Returns ``(m_new, p, alpha, l_i)``: ``p = exp2(s - m_new)`` and
    ``alpha = exp2(m_i - m_new)``, how much the old state shrinks.
    """
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (BLOCK_M,)
    p = tl.math.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
    alpha = tl.math.exp2(m_i - m_new)  # (BLOCK_M,)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, p, alpha, l_i


@triton.jit
def accumulate(acc, alpha, p, v, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The second half: ``acc · alpha + p · v`` with p cast to v's dtype for the tensor cores.
    acc ``(BLOCK_M, HEAD_DIM)``, p ``(BLOCK_M, BLOCK_N)``, v ``(BLOCK_N, HEAD_DIM)``."""
    acc = acc * alpha[:, None]
    return tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v_ptrs, v_mask,
                        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores ``s`` (log2 units, MASK_VALUE where masked) into the state.

    s: ``(BLOCK_M, BLOCK_N)``; m_i, l_i: ``(BLOCK_M,)``; acc: ``(BLOCK_M, HEAD_DIM)``; the V tile
    is loaded from ``v_ptrs`` (``v_mask``) after the exponentials, so that its load overlaps
    them. Returns the new ``(m_i, l_i, acc)``.
    """
    m_new, p, alpha, l_i = softmax_update(s, m_i, l_i)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)  # (BLOCK_N, HEAD_DIM)
    acc = accumulate(acc, alpha, p, v, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
    return m_new, l_i, acc
