"""Chapter 06's teaching kernel: the FlashAttention forward, built from pieces the learner writes.

The chapter builds the forward kernel in four exercises. The learner writes small ``@triton.jit``
helpers; :func:`flash_forward_kernel` — the loop over K/V tiles, the same in every step — calls
them. The helpers are passed to the kernel as ``tl.constexpr`` arguments (a Triton feature since
3.4), not looked up as notebook globals, so a re-run cell can never leave a stale compiled
kernel behind on a GPU, and each check can swap in exactly the piece it checks.

====  =====================================  ===========================================
step  the learner writes                     what it adds
====  =====================================  ===========================================
6.1   ``update_tile``, ``finish_rows``       online softmax in registers (``tl.exp``)
6.2   ``load_tile``, ``mask_ragged``         masked loads and -inf scores for ragged N
6.3   ``mask_causal``, ``kv_loop_end``       the causal mask; tiles right of it skipped
6.4   ``update_tile_exp2``,                  ``exp2`` with ``scale·log2(e)`` folded in;
      ``finish_rows_exp2``                   the log-sum-exp converted back to natural log
====  =====================================  ===========================================

This module holds the correct pieces (the "library" versions the notebook falls back on), the
kernel and its launcher (:func:`forward`). The checks of the exercises are in
:mod:`course_lib.teaching.exercises.ch06`.

The library kernel, :func:`course_lib.kernels.forward.attention_forward_kernel`, has the same
names and the same shape: it calls the tile helpers of :mod:`course_lib.kernels.tiles` where
this one calls the learner's pieces, and adds what this one leaves out so that it reads like the
algorithm — the two-stage loop (unmasked tiles, then the masked band), any head dim (padded,
``HEAD_DIM_REAL``), any column stride, and autotuning.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
import triton
import triton.language as tl

from course_lib import constants
from course_lib.platform import runtime
from course_lib.kernels import tiles
from course_lib.kernels.inputs import as_4d
from course_lib.kernels.forward import kernel_dtypes
from course_lib.kernels.tiles import LOG2_E, MASK_VALUE, kv_loop_end
from course_lib.attention.reference import default_scale

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

# Block sizes of the demos: interpreter speed (fewer, larger tiles) against GPU occupancy. This
# kernel is not tuned: chapter 06's benchmark times the library kernel.
DEMO_BLOCKS = {runtime.GPU: (64, 64), runtime.INTERPRETER: (32, 32)}


# ----------------------------------------------------------------------------------------------
# The pieces (the exercises' answers, as the library provides them)


@triton.jit
def update_tile(s, v, m_i, l_i, acc, scale):
    """Fold one K/V tile into the online-softmax state (natural exp).

    s: (BLOCK_M, BLOCK_N) fp32 raw scores q·kᵀ (-inf where masked); v: (BLOCK_N, HEAD_DIM);
    m_i, l_i: (BLOCK_M,) fp32; acc: (BLOCK_M, HEAD_DIM) fp32. Returns the new (m_i, l_i, acc).
    """
    s = s * scale
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (BLOCK_M,) running max including this tile
    p = tl.exp(s - m_new[:, None])  # (BLOCK_M, BLOCK_N) relative to the new max
    alpha = tl.exp(m_i - m_new)  # (BLOCK_M,) <= 1: shrinks the old state to the new max
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def finish_rows(acc, m_i, l_i):
    """(o, lse) from the final state: o = acc / l_i (BLOCK_M, HEAD_DIM); lse = m_i + log l_i."""
    return acc / l_i[:, None], m_i + tl.log(l_i)


@triton.jit
def load_tile(ptr, offs_rows, offs_d, stride_row, n_rows):
    """Rows ``offs_rows`` of a (n_rows, HEAD_DIM) matrix at ``ptr``; rows >= n_rows read as 0."""
    return tl.load(ptr + offs_rows[:, None] * stride_row + offs_d[None, :],
                   mask=offs_rows[:, None] < n_rows, other=0.0)


@triton.jit
def mask_ragged(s, offs_n, n_k):
    """Scores of keys past the end of the sequence (the ragged last tile) become -inf."""
    return tl.where(offs_n[None, :] < n_k, s, MASK_VALUE)


@triton.jit
def mask_causal(s, offs_m, offs_n):
    """Query i sees key j only when j <= i (top-left aligned); the rest becomes -inf."""
    return tl.where(offs_n[None, :] <= offs_m[:, None], s, MASK_VALUE)


# kv_loop_end(start_m, n_k, BLOCK_M, CAUSAL), exercise 6.3's second piece, is the library's own
# (course_lib.kernels.tiles.kv_loop_end): the library kernel's tile split starts from it.


@triton.jit
def update_tile_exp2(s, v, m_i, l_i, acc, scale):
    """As :func:`update_tile`, with exp2: the scores are scaled once by scale·LOG2_E."""
    s = s * (scale * LOG2_E)  # now exp(scale·x) = exp2(s): m_i and s are in log2 units
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def finish_rows_exp2(acc, m_i, l_i):
    """As :func:`finish_rows` for a state in log2 units: lse = (m_i + log2 l_i) / LOG2_E."""
    return acc / l_i[:, None], (m_i + tl.math.log2(l_i)) / LOG2_E


@dataclasses.dataclass(frozen=True)
class Pieces:
    """The helpers the kernel calls; ``update`` and ``finish`` must use the same exponential."""

    load_tile: object = load_tile
    mask_ragged: object = mask_ragged
    mask_causal: object = mask_causal
    kv_loop_end: object = kv_loop_end
    update: object = update_tile_exp2
    finish: object = finish_rows_exp2

    def replace(self, **changes) -> "Pieces":
        return dataclasses.replace(self, **changes)


LIBRARY_PIECES = Pieces()
NATURAL_EXP_PIECES = Pieces(update=update_tile, finish=finish_rows)


# ----------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def flash_forward_kernel(
        Q, K, V, O, LSE,  # Q, O: (B, H, N_q, HEAD_DIM); K, V: (B, H, N_k, HEAD_DIM); LSE: (B, H, N_q) contiguous
        stride_qb, stride_qh, stride_qn,  # columns are contiguous (stride 1) in Q, K, V and O
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_on,
        n_heads, n_q, n_k, scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
        LOAD_TILE: tl.constexpr, MASK_RAGGED: tl.constexpr, MASK_CAUSAL: tl.constexpr,
        KV_LOOP_END: tl.constexpr, UPDATE: tl.constexpr, FINISH: tl.constexpr):
    """One program: one BLOCK_M tile of queries of one (batch, head). 1-D grid over both."""
    pid_bh, b, h, start_m = tiles.program_tile(n_q, n_heads, BLOCK=BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows of this program
    offs_d = tl.arange(0, HEAD_DIM)  # (HEAD_DIM,) columns
    # read the Q tile once: it stays in registers for the whole loop
    q_head = tiles.head_start(Q, b, h, stride_qb, stride_qh)  # this (batch, head)'s (N_q, HEAD_DIM) queries
    q = LOAD_TILE(q_head, offs_m, offs_d, stride_qn, n_q)  # (BLOCK_M, HEAD_DIM)
    k_head = tiles.head_start(K, b, h, stride_kb, stride_kh)  # this (batch, head)'s (N_k, HEAD_DIM) keys
    v_head = tiles.head_start(V, b, h, stride_vb, stride_vh)

    m_i = tl.full([BLOCK_M], MASK_VALUE, dtype=tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exponentials
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of exponentials · v

    for start_n in range(0, KV_LOOP_END(start_m, n_k, BLOCK_M=BLOCK_M, CAUSAL=CAUSAL), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key rows of this tile
        k = LOAD_TILE(k_head, offs_n, offs_d, stride_kn, n_k)  # (BLOCK_N, HEAD_DIM)
        v = LOAD_TILE(v_head, offs_n, offs_d, stride_vn, n_k)  # (BLOCK_N, HEAD_DIM)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32, never in HBM
        s = MASK_RAGGED(s, offs_n, n_k)
        if CAUSAL:
            s = MASK_CAUSAL(s, offs_m, offs_n)
        m_i, l_i, acc = UPDATE(s, v, m_i, l_i, acc, scale)

    o, lse = FINISH(acc, m_i, l_i)  # (BLOCK_M, HEAD_DIM), (BLOCK_M,)
    row_ok = offs_m < n_q  # the last Q tile may stick out past N_q
    o_ptrs = tiles.head_start(O, b, h, stride_ob, stride_oh) + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])  # write BLOCK_M × HEAD_DIM
    tl.store(LSE + pid_bh * n_q + offs_m, lse, mask=row_ok)  # write BLOCK_M


def source(jit_fn) -> str:
    """The Python source of a ``@triton.jit`` function (to read it in a notebook)."""
    return inspect.getsource(getattr(jit_fn, "fn", jit_fn))


def launch_forward(pieces: Pieces, q, k, v, o, lse, causal: bool, scale: float,
                   block_m: int, block_n: int) -> None:
    """Launch :func:`flash_forward_kernel` on 4-D views; no validation.

    q, o: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)`` — any strides but contiguous columns;
    lse: ``(B, H, N_q)`` float32, contiguous.
    """
    batch, heads, n_q, d = q.shape
    grid = (triton.cdiv(n_q, block_m) * batch * heads,)
    flash_forward_kernel[grid](
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        heads, n_q, k.shape[2], scale,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal),
        DOT_PRECISION=kernel_dtypes(q.dtype)[1],
        LOAD_TILE=pieces.load_tile, MASK_RAGGED=pieces.mask_ragged, MASK_CAUSAL=pieces.mask_causal,
        KV_LOOP_END=pieces.kv_loop_end, UPDATE=pieces.update, FINISH=pieces.finish)


def validate_inputs(q, k, v, scale) -> None:
    """Check the teaching kernel's inputs; raise TypeError/ValueError naming the problem."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape (..., N, d), got {tuple(x.shape)}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
        if x.device.type != _rt.device:
            raise ValueError(f"{name} is on {x.device}; kernels run on {_rt.device!r} in this mode")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype == torch.bfloat16 and _rt.interpreted:
        raise TypeError("bfloat16 is computed wrongly by Triton's interpreter; use float32 or "
                        "float16 on CPU (the library's flash_attention upcasts for you)")
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k, v must share the head dim, got {q.shape[-1]}, {k.shape[-1]}, "
                         f"{v.shape[-1]}")
    if d < constants.MIN_HEAD_DIM or d > constants.MAX_HEAD_DIM or d & (d - 1):
        raise ValueError(f"the teaching kernel needs a power-of-two head dim in "
                         f"[{constants.MIN_HEAD_DIM}, {constants.MAX_HEAD_DIM}], got {d} "
                         f"(course_lib.flash_attention takes any)")
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive number (masking happens before scaling), "
                         f"got {scale!r}")


def _as_4d_unit_columns(x):
    """(..., N, d) -> (B, H, N, d) with unit column stride (a view when possible)."""
    x4 = as_4d(x)
    return x4 if x4.stride(-1) == 1 else x4.contiguous()


def forward(q, k, v, causal: bool = False, scale: float | None = None, *,
            pieces: Pieces = LIBRARY_PIECES, blocks: tuple[int, int] | None = None):
    """Attention by the teaching kernel, with the given pieces.

    Args:
        q: ``(..., N_q, d)``; k, v: ``(..., N_k, d)``; same dtype, on the runtime's device.
        causal: key j visible to query i when j <= i (top-left aligned, as SDPA).
        scale: default ``1/sqrt(d)``.
        pieces: the helpers to run (the learner's, or the library's).
        blocks: ``(BLOCK_M, BLOCK_N)``; default :data:`DEMO_BLOCKS` for this mode.

    Returns:
        ``(o, lse)``: ``o`` ``(..., N_q, d)`` in q's dtype; ``lse`` ``(..., N_q)`` float32.
    """
    scale = default_scale(q.shape[-1]) if scale is None else scale
    validate_inputs(q, k, v, scale)
    block_m, block_n = blocks or DEMO_BLOCKS[_rt.mode]
    q4, k4, v4 = (_as_4d_unit_columns(x) for x in (q, k, v))
    o = torch.empty(q4.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q4.shape[:3], dtype=torch.float32, device=q.device)
    launch_forward(pieces, q4, k4, v4, o, lse, causal, scale, block_m, block_n)
    return o.reshape(q.shape), lse.reshape(q.shape[:-1])
