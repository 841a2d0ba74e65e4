"""Chapter 06 (FlashAttention forward in Triton): the teaching kernel, its pieces, and the checks.

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

This module holds the correct helpers (the "library" versions the notebook falls back on), the
kernel and its launcher (:func:`forward`), and one check per exercise. Each check runs the
learner's pieces through the whole kernel, on guarded tensors (see
:mod:`course_lib.exercises.ch05`), against float64 attention on ragged shapes, and names the
classic mistakes by replaying the known wrong helpers in ``*_MISTAKES``.

The tuned kernel of the library is :mod:`course_lib.kernels.forward`; this one is deliberately
plainer (no two-stage loop, no autotuning) so that it reads like the algorithm.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings

import torch
import triton
import triton.language as tl

from course_lib import runtime
from course_lib.checks import TOLERANCES, Case, ExerciseFailed
from course_lib.exercises import ch05
from course_lib.reference import default_scale, naive_attention_torch

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

# exp(x) = exp2(x · LOG2_E); the same constant the library kernel uses (math.log2(math.e)).
from course_lib.kernels.forward import LOG2_E  # noqa: E402

# Masked scores are -inf so that exp() turns them into exactly 0. No row is ever fully masked:
# with the top-left causal alignment every query sees key 0.
MASKED_SCORE: tl.constexpr = tl.constexpr(float("-inf"))

# Block sizes. 16 is the smallest tile tl.dot accepts, so the checks' short sequences already
# span several tiles; the demo sizes trade interpreter speed (fewer, larger tiles) against GPU
# occupancy. This kernel is not tuned: chapter 06's benchmark times the library kernel.
CHECK_BLOCK = 16
DEMO_BLOCKS = {runtime.GPU: (64, 64), runtime.INTERPRETER: (32, 32)}
# Head dims the teaching kernel takes: tl.arange needs a power of two, tl.dot at least 16.
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


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
def mask_ragged(s, offs_n, seq_len_k):
    """Scores of keys past the end of the sequence (the ragged last tile) become -inf."""
    return tl.where(offs_n[None, :] < seq_len_k, s, MASKED_SCORE)


@triton.jit
def mask_causal(s, offs_m, offs_n):
    """Query i sees key j only when j <= i (top-left aligned); the rest becomes -inf."""
    return tl.where(offs_n[None, :] <= offs_m[:, None], s, MASKED_SCORE)


@triton.jit
def kv_loop_end(start_m, seq_len_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key the Q tile starting at ``start_m`` can see."""
    if CAUSAL:
        return tl.minimum(seq_len_k, start_m + BLOCK_M)  # its last row is start_m + BLOCK_M - 1
    return seq_len_k


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
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,  # q, o: (BH, N_q, HEAD_DIM); k, v: (BH, N_k, HEAD_DIM); lse: (BH, N_q)
        stride_q_bh, stride_q_n, stride_k_bh, stride_k_n, stride_v_bh, stride_v_n,
        stride_o_bh, stride_o_n, stride_lse_bh,
        seq_len_q, seq_len_k, scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
        LOAD_TILE: tl.constexpr, MASK_RAGGED: tl.constexpr, MASK_CAUSAL: tl.constexpr,
        KV_LOOP_END: tl.constexpr, UPDATE: tl.constexpr, FINISH: tl.constexpr):
    """One program: one tile of BLOCK_M query rows of one (batch·head); grid (cdiv(N_q, BLOCK_M), BH)."""
    start_m = tl.program_id(0) * BLOCK_M  # first query row of this program's Q tile
    bh = tl.program_id(1)  # which (batch, head)
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_d = tl.arange(0, HEAD_DIM)  # (HEAD_DIM,) columns
    # read the Q tile once: it stays in registers for the whole loop
    q = LOAD_TILE(q_ptr + bh * stride_q_bh, offs_m, offs_d, stride_q_n, seq_len_q)  # (BLOCK_M, HEAD_DIM)

    m_i = tl.full([BLOCK_M], MASKED_SCORE, dtype=tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exponentials
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of exponentials · v

    for start_n in range(0, KV_LOOP_END(start_m, seq_len_k, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key rows of this tile
        k = LOAD_TILE(k_ptr + bh * stride_k_bh, offs_n, offs_d, stride_k_n, seq_len_k)  # (BLOCK_N, HEAD_DIM)
        v = LOAD_TILE(v_ptr + bh * stride_v_bh, offs_n, offs_d, stride_v_n, seq_len_k)  # (BLOCK_N, HEAD_DIM)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32, never in HBM
        s = MASK_RAGGED(s, offs_n, seq_len_k)
        if CAUSAL:
            s = MASK_CAUSAL(s, offs_m, offs_n)
        m_i, l_i, acc = UPDATE(s, v, m_i, l_i, acc, scale)

    o, lse = FINISH(acc, m_i, l_i)  # (BLOCK_M, HEAD_DIM), (BLOCK_M,)
    row_ok = offs_m < seq_len_q  # the last Q tile may stick out past N_q
    tl.store(o_ptr + bh * stride_o_bh + offs_m[:, None] * stride_o_n + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])  # write BLOCK_M × HEAD_DIM
    tl.store(lse_ptr + bh * stride_lse_bh + offs_m, lse, mask=row_ok)  # write BLOCK_M


def source(jit_fn) -> str:
    """The Python source of a ``@triton.jit`` function (to read it in a notebook)."""
    return inspect.getsource(getattr(jit_fn, "fn", jit_fn))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: IEEE products (a GPU would use TF32 by default, ~3 digits); the interpreter
    # ignores the hint. fp16/bf16: the hint does not apply.
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_forward(pieces: Pieces, q, k, v, o, lse, causal: bool, scale: float,
                   block_m: int, block_n: int) -> None:
    """Launch :func:`flash_forward_kernel` on 3-D views; no validation.

    q, o: ``(BH, N_q, d)``; k, v: ``(BH, N_k, d)`` — rows may be strided, columns contiguous;
    lse: ``(BH, N_q)`` float32.
    """
    bh, n_q, d = q.shape
    grid = (triton.cdiv(n_q, block_m), bh)
    flash_forward_kernel[grid](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), lse.stride(0),
        n_q, k.shape[1], scale,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal),
        DOT_PRECISION=_dot_precision(q.dtype),
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
    if d < MIN_HEAD_DIM or d > MAX_HEAD_DIM or d & (d - 1):
        raise ValueError(f"the teaching kernel needs a power-of-two head dim in "
                         f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {d} (course_lib.flash_attention "
                         f"takes any)")
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive number (masking happens before scaling), "
                         f"got {scale!r}")


def _as_3d(x):
    """(..., N, d) -> (BH, N, d) with unit column stride (a view when possible)."""
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


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
    q3, k3, v3 = _as_3d(q), _as_3d(k), _as_3d(v)
    o = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q3.shape[:2], dtype=torch.float32, device=q.device)
    launch_forward(pieces, q3, k3, v3, o, lse, causal, scale, block_m, block_n)
    return o.reshape(q.shape), lse.reshape(q.shape[:-1])


def reference(q, k, v, causal: bool = False, scale: float | None = None):
    """float64 attention rounded like the kernel's outputs: (o in q's dtype, lse float32)."""
    o, lse = naive_attention_torch(q.double(), k.double(), v.double(), causal, scale)
    return o.to(q.dtype), lse.float()


# ----------------------------------------------------------------------------------------------
# Guarded runs of the learner's pieces


# Margins around each (BH, N, d) tensor: a tile's worth of rows after every head (so a missing
# row mask reads NaN instead of the next head's data) and a few columns after every row (so the
# row stride differs from d and a kernel that assumes stride = d shows).
ROW_MARGIN = CHECK_BLOCK
COL_MARGIN = 8


def runner(pieces: Pieces, causal: bool, scale: float | None = None,
           blocks: tuple[int, int] = (CHECK_BLOCK, CHECK_BLOCK), **hints) -> ch05.GuardedRun:
    """A guarded run of the kernel with ``pieces`` on (BH, N, d) tensors."""
    margin = (0, ROW_MARGIN, COL_MARGIN)

    def launch(q, k, v, o, lse):
        s = default_scale(q.shape[-1]) if scale is None else scale
        launch_forward(pieces, q, k, v, o, lse, causal, s, *blocks)

    return ch05.GuardedRun(
        launch=launch, margins=(margin, margin, margin),
        outputs=(ch05.Output("o", margin),
                 ch05.Output("lse", (0, ROW_MARGIN),
                             lambda q, k, v: (tuple(q.shape[:2]), torch.float32))),
        **hints)


def _cases(device, specs, seed):
    """Cases from (bh, n_q, n_k, d, dtype, causal) specs; inputs are (BH, N, d)."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for bh, n_q, n_k, d, dtype, causal in specs:
        q, k, v = (torch.randn(bh, n, d, generator=gen).to(device=device, dtype=dtype)
                   for n in (n_q, n_k, n_k))
        label = (f"{'causal' if causal else 'non-causal'}, N_q={n_q}, N_k={n_k}, d={d}, "
                 f"{str(dtype).replace('torch.', '')}, BLOCK_M=BLOCK_N={CHECK_BLOCK}")
        cases.append(Case((q, k, v), {"causal": causal}, label=label))
    return cases


def _case_dtypes():
    # fp32 is exact only in the interpreter (TF32 products on a GPU); bf16 only on a GPU.
    return (torch.float32, torch.float16) if _rt.interpreted else (torch.float16, torch.bfloat16)


def _check(exercise, answer, fallback, make_pieces, specs, seed, mistakes, **hints):
    """Run ``check_kernel`` with the learner's pieces in place; mistakes replay wrong pieces."""
    learner = make_pieces(*answer)

    def replay(wrong):
        def mistaken(q, k, v, causal):
            o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
            with warnings.catch_warnings():  # NumPy's overflow warnings from the interpreter
                warnings.simplefilter("ignore", RuntimeWarning)
                launch_forward(make_pieces(*wrong), q, k, v, o, lse, causal,
                               default_scale(q.shape[-1]), CHECK_BLOCK, CHECK_BLOCK)
            return o, lse
        return mistaken

    def run(q, k, v, causal):
        def explain_nonfinite(inputs, outputs):
            """The known mistake whose NaN/inf pattern and values the learner's output repeats."""
            atol, rtol = TOLERANCES[str(q.dtype).replace("torch.", "")]
            for cause, wrong in mistakes.items():
                expected = replay(wrong)(*inputs, causal)
                if all(torch.allclose(g.double(), w.double(), atol=atol, rtol=rtol, equal_nan=True)
                       for g, w in zip(outputs, expected)):
                    return cause
            return None

        return runner(learner, causal, explain_nonfinite=explain_nonfinite, **hints)(q, k, v)

    return ch05.check_kernel(
        exercise, answer, run, reference, _cases(_rt.device, specs, seed), fallback=fallback,
        mistakes={cause: replay(wrong) for cause, wrong in mistakes.items()})


# ----------------------------------------------------------------------------------------------
# Exercise 6.1: update_tile(s, v, m_i, l_i, acc, scale) and finish_rows(acc, m_i, l_i)


@triton.jit
def _update_no_rescale_acc(s, v, m_i, l_i, acc, scale):
    s = s * scale
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc + tl.dot(p.to(v.dtype), v)


@triton.jit
def _update_no_rescale_l(s, v, m_i, l_i, acc, scale):
    s = s * scale
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _update_tile_own_max(s, v, m_i, l_i, acc, scale):
    s = s * scale
    m_tile = tl.max(s, axis=1)
    m_new = tl.maximum(m_i, m_tile)
    p = tl.exp(s - m_tile[:, None])  # relative to the tile's max, not the running one
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _update_no_scale(s, v, m_i, l_i, acc, scale):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _finish_no_division(acc, m_i, l_i):
    return acc, m_i + tl.log(l_i)


@triton.jit
def _finish_lse_without_max(acc, m_i, l_i):
    return acc / l_i[:, None], tl.log(l_i)


FORGOT_RESCALE_ACC = ("acc is not rescaled: when the running max grows, the old acc (a sum of "
                      "exp(s - m_old)·v) must be multiplied by alpha = exp(m_old - m_new) too")
FORGOT_RESCALE_L = "l_i is not rescaled: l_new = l_i · alpha + rowsum(p), alpha = exp(m_old - m_new)"
FORGOT_FINAL_DIVISION = ("the final 1/l is missing: acc holds the unnormalised sum Σ exp(s - m)·v; "
                         "o = acc / l_i[:, None]")

UPDATE_MISTAKES = {
    FORGOT_RESCALE_ACC: (_update_no_rescale_acc, finish_rows),
    FORGOT_RESCALE_L: (_update_no_rescale_l, finish_rows),
    "each tile is exponentiated relative to its own max; use the new running max m_new, the "
    "same reference the rescaled old state uses": (_update_tile_own_max, finish_rows),
    "the scores are not multiplied by scale (the kernel passes raw q·kᵀ)":
        (_update_no_scale, finish_rows),
    FORGOT_FINAL_DIVISION: (update_tile, _finish_no_division),
    "lse must include the running max: lse = m_i + log(l_i), since l_i is a sum of exp(s - m_i)":
        (update_tile, _finish_lse_without_max),
}

# Non-causal and N a multiple of the block first (the plain loop), then a causal and a ragged
# case, whose -inf scores the update must survive; leading dims of 2 and 3 heads.
ONLINE_SOFTMAX_SPECS = tuple(
    spec for dtype in _case_dtypes() for spec in (
        (2, 64, 64, 16, dtype, False),
        (3, 32, 48, 32, dtype, False),
    )) + ((2, 48, 48, 16, _case_dtypes()[0], True), (1, 37, 53, 16, _case_dtypes()[0], False))


def _natural(update, finish):
    return NATURAL_EXP_PIECES.replace(update=update, finish=finish)


def check_online_softmax(update, finish):
    """Check exercise 6.1; return (update, finish) or, not done yet, the library's."""
    return _check("Exercise 6.1", (update, finish), (update_tile, finish_rows), _natural,
                  ONLINE_SOFTMAX_SPECS, 6_1, UPDATE_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 6.2: load_tile(ptr, offs_rows, offs_d, stride_row, n_rows) and mask_ragged(s, offs_n, seq_len_k)


@triton.jit
def _mask_ragged_none(s, offs_n, seq_len_k):
    return s


@triton.jit
def _mask_ragged_to_zero(s, offs_n, seq_len_k):
    return tl.where(offs_n[None, :] < seq_len_k, s, 0.0)


@triton.jit
def _mask_ragged_off_by_one(s, offs_n, seq_len_k):
    return tl.where(offs_n[None, :] <= seq_len_k, s, MASKED_SCORE)


PADDED_KEYS_NOT_MASKED = ("the padded keys past N_k are not masked: load_tile reads them as 0, so "
                          "their scores are 0, not -inf, and each adds exp(0 - m) to l_i — "
                          "mask_ragged must set s to -inf (not 0) where offs_n >= seq_len_k")
RAGGED_MISTAKES = {
    # (a mask to 0 instead of -inf, _mask_ragged_to_zero, gives the same output: 0 is 0)
    PADDED_KEYS_NOT_MASKED: (load_tile, _mask_ragged_none),
    "the ragged mask is off by one: key indices run 0 .. seq_len_k - 1, keep offs_n < seq_len_k":
        (load_tile, _mask_ragged_off_by_one),
}

RAGGED_SPECS = tuple(
    spec for dtype in _case_dtypes() for spec in (
        (2, 37, 37, 16, dtype, False),
        (1, 53, 21, 32, dtype, False),
        (3, 9, 70, 16, dtype, False),
    ))


def _ragged(load, mask):
    return LIBRARY_PIECES.replace(load_tile=load, mask_ragged=mask)


def check_ragged(load, mask):
    """Check exercise 6.2; return (load_tile, mask_ragged) or, not done yet, the library's."""
    return _check(
        "Exercise 6.2", (load, mask), (load_tile, mask_ragged), _ragged, RAGGED_SPECS, 6_2,
        RAGGED_MISTAKES,
        load_hint="load_tile reads outside the tensor: mask rows >= n_rows "
                  "(mask=offs_rows[:, None] < n_rows, other=0.0) and step rows by stride_row "
                  "(rows are stride_row elements apart, not HEAD_DIM)",
        coverage_hint="some output rows were never written")


# ----------------------------------------------------------------------------------------------
# Exercise 6.3: mask_causal(s, offs_m, offs_n) and kv_loop_end(start_m, seq_len_k, BLOCK_M, CAUSAL)


@triton.jit
def _mask_causal_strict(s, offs_m, offs_n):
    return tl.where(offs_n[None, :] < offs_m[:, None], s, MASKED_SCORE)


@triton.jit
def _mask_causal_transposed(s, offs_m, offs_n):
    return tl.where(offs_n[None, :] >= offs_m[:, None], s, MASKED_SCORE)


@triton.jit
def _kv_loop_end_stops_at_diagonal(start_m, seq_len_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    if CAUSAL:
        return tl.minimum(seq_len_k, start_m)
    return seq_len_k


@triton.jit
def _kv_loop_end_always_all(start_m, seq_len_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    return seq_len_k


CAUSAL_OFF_BY_ONE = ("the causal mask is off by one: query i sees key j when j <= i (the "
                     "diagonal included), so keep offs_n[None, :] <= offs_m[:, None]")
CAUSAL_MISTAKES = {
    CAUSAL_OFF_BY_ONE: (_mask_causal_strict, kv_loop_end),
    "the causal mask is transposed: keep keys j <= i (the past), not j >= i":
        (_mask_causal_transposed, kv_loop_end),
    "the K/V loop stops too early: the Q tile's last row start_m + BLOCK_M - 1 sees keys up to "
    "itself, so the loop must run to min(seq_len_k, start_m + BLOCK_M)":
        (mask_causal, _kv_loop_end_stops_at_diagonal),
}

CAUSAL_SPECS = tuple(
    spec for dtype in _case_dtypes() for spec in (
        (2, 50, 50, 16, dtype, True),
        (1, 70, 45, 16, dtype, True),   # more queries than keys: late rows see every key
        (2, 30, 64, 32, dtype, True),   # more keys than queries: late keys are never seen
    )) + ((1, 40, 40, 16, _case_dtypes()[0], False),)  # non-causal calls must visit every tile


@triton.jit
def _kv_loop_end_probe(out_ptr, seq_len_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                       KV_LOOP_END: tl.constexpr):
    """out[pid] = KV_LOOP_END for the Q tile of program pid (to count the tiles it visits)."""
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, KV_LOOP_END(pid * BLOCK_M, seq_len_k, BLOCK_M, CAUSAL))


def visited_tiles(kv_end_fn, n_q: int, n_k: int, causal: bool,
                  block_m: int = CHECK_BLOCK, block_n: int = CHECK_BLOCK) -> list[int]:
    """How many K/V tiles each Q tile's loop visits with ``kv_end_fn`` as its loop end."""
    n_tiles = triton.cdiv(n_q, block_m)
    ends = torch.zeros(n_tiles, dtype=torch.int32, device=_rt.device)
    _kv_loop_end_probe[(n_tiles,)](ends, n_k, BLOCK_M=block_m, CAUSAL=bool(causal),
                                   KV_LOOP_END=kv_end_fn)
    return [triton.cdiv(max(int(e), 0), block_n) for e in ends.tolist()]


def _causal(mask, end):
    return LIBRARY_PIECES.replace(mask_causal=mask, kv_loop_end=end)


def check_causal(mask, end):
    """Check exercise 6.3; return (mask_causal, kv_loop_end) or, not done yet, the library's.

    Beyond the outputs, counts the K/V tiles each Q tile visits: a loop that reaches tiles
    right of the diagonal (all -inf for every row of the Q tile) gives right answers slowly.
    """
    for _, n_q, n_k, _, _, causal in CAUSAL_SPECS:
        try:
            got = visited_tiles(end, n_q, n_k, causal)
        except Exception:  # noqa: BLE001 - a stub or a broken kv_loop_end: the check below says
            break
        want = visited_tiles(kv_loop_end, n_q, n_k, causal)
        for tile, (g, w) in enumerate(zip(got, want)):
            if g > w:
                raise ExerciseFailed(
                    f"✗ Exercise 6.3: the Q tile starting at row "
                    f"{tile * CHECK_BLOCK} visits {g} K/V tiles where {w} suffice "
                    f"({'causal' if causal else 'non-causal'}, N_q={n_q}, N_k={n_k}) — tiles "
                    f"right of the diagonal are fully masked: for causal, stop the loop at "
                    f"min(seq_len_k, start_m + BLOCK_M)")
    return _check("Exercise 6.3", (mask, end), (mask_causal, kv_loop_end), _causal,
                  CAUSAL_SPECS, 6_3, CAUSAL_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 6.4: update_tile_exp2(s, v, m_i, l_i, acc, scale) and finish_rows_exp2(acc, m_i, l_i)


@triton.jit
def _update_exp2_without_log2e(s, v, m_i, l_i, acc, scale):
    s = s * scale  # exp2(scale·x) = exp(scale·x·ln 2): a softmax at the wrong temperature
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _update_exp_with_log2e(s, v, m_i, l_i, acc, scale):
    s = s * (scale * LOG2_E)  # folded for exp2, but exponentiated with base e
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _finish_exp2_lse_in_log2(acc, m_i, l_i):
    return acc / l_i[:, None], m_i + tl.math.log2(l_i)


@triton.jit
def _finish_exp2_lse_times_log2e(acc, m_i, l_i):
    return acc / l_i[:, None], (m_i + tl.math.log2(l_i)) * LOG2_E


EXP2_WITHOUT_LOG2E = ("exp2 is used but the scale does not include LOG2_E: exp2(x) = exp(x · ln 2), "
                      "so multiply the scores by scale · LOG2_E before exp2")
EXP2_MISTAKES = {
    EXP2_WITHOUT_LOG2E: (_update_exp2_without_log2e, finish_rows_exp2),
    "the scores were scaled by scale · LOG2_E (log2 units) but exponentiated with tl.exp: use "
    "tl.math.exp2 for p and alpha": (_update_exp_with_log2e, finish_rows_exp2),
    "lse is left in log2 units: m_i + log2(l_i) is log2 Σ exp(s); divide by LOG2_E for the "
    "natural log the backward expects": (update_tile_exp2, _finish_exp2_lse_in_log2),
    "lse mixes units: m_i is in log2 units, so (m_i + log2(l_i)) / LOG2_E, or "
    "m_i / LOG2_E + log(l_i) — check which one you converted": (
        update_tile_exp2, _finish_exp2_lse_times_log2e),
}

EXP2_SPECS = tuple(
    spec for dtype in _case_dtypes() for spec in (
        (2, 64, 64, 16, dtype, False),
        (2, 45, 30, 32, dtype, True),
    )) + ((1, 37, 53, 16, _case_dtypes()[0], False),)


def _exp2(update, finish):
    return LIBRARY_PIECES.replace(update=update, finish=finish)


def check_exp2(update, finish):
    """Check exercise 6.4; return (update, finish) or, not done yet, the library's."""
    return _check("Exercise 6.4", (update, finish), (update_tile_exp2, finish_rows_exp2), _exp2,
                  EXP2_SPECS, 6_4, EXP2_MISTAKES)
