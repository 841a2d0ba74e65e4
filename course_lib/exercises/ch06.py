"""Chapter 06 (FlashAttention forward in Triton): the checks of the four exercises.

The chapter builds the teaching kernel of :mod:`course_lib.kernels.teaching` from pieces the
learner writes (6.1 the online-softmax update and finish, 6.2 masked loads and the ragged mask,
6.3 the causal mask and the end of the K/V loop, 6.4 the same with exp2). One check per
exercise runs the learner's pieces through the whole kernel, on guarded tensors (see
:mod:`course_lib.exercises.ch05`), against float64 attention on ragged shapes, and names the
classic mistakes by replaying the known wrong pieces in ``*_MISTAKES``.

The kernel, its launcher :func:`~course_lib.kernels.teaching.forward` and the correct pieces
live in :mod:`course_lib.kernels.teaching`.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from course_lib import runtime
from course_lib.checks import TOLERANCES, Case, ExerciseFailed
from course_lib.exercises import ch05
from course_lib.reference import default_scale, naive_attention_torch

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

# The teaching kernel's launcher and the correct pieces: the checks run and replay them, and
# tests and tools/ablation.py reach them as ch06.forward, ch06.update_tile, ...
from course_lib.kernels.teaching import (  # noqa: E402, F401 - forward: re-exported
    LIBRARY_PIECES, NATURAL_EXP_PIECES, Pieces, finish_rows, finish_rows_exp2, forward,
    kv_loop_end, launch_forward, load_tile, mask_causal, mask_ragged, update_tile,
    update_tile_exp2)
from course_lib.kernels.tiles import LOG2_E, MASK_VALUE  # noqa: E402

# 16 is the smallest tile tl.dot accepts, so the checks' short sequences already span several
# tiles.
CHECK_BLOCK = 16


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


def _launch_3d(pieces: Pieces, q, k, v, o, lse, causal: bool, scale: float,
               block_m: int, block_n: int) -> None:
    """:func:`launch_forward` on the checks' ``(BH, N, d)`` tensors and ``(BH, N_q)`` lse: one batch."""
    launch_forward(pieces, q[None], k[None], v[None], o[None], lse[None], causal, scale,
                   block_m, block_n)


def runner(pieces: Pieces, causal: bool, scale: float | None = None,
           blocks: tuple[int, int] = (CHECK_BLOCK, CHECK_BLOCK), **hints) -> ch05.GuardedRun:
    """A guarded run of the kernel with ``pieces`` on (BH, N, d) tensors."""
    margin = (0, ROW_MARGIN, COL_MARGIN)

    def launch(q, k, v, o, lse):
        s = default_scale(q.shape[-1]) if scale is None else scale
        _launch_3d(pieces, q, k, v, o, lse, causal, s, *blocks)

    return ch05.GuardedRun(
        launch=launch, margins=(margin, margin, margin),
        outputs=(ch05.Output("o", margin),
                 ch05.Output("lse", (1, 0),  # a head's worth of room past the end
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
                _launch_3d(make_pieces(*wrong), q, k, v, o, lse, causal,
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
# Exercise 6.2: load_tile(ptr, offs_rows, offs_d, stride_row, n_rows) and mask_ragged(s, offs_n, n_k)


@triton.jit
def _mask_ragged_none(s, offs_n, n_k):
    return s


@triton.jit
def _mask_ragged_to_zero(s, offs_n, n_k):
    return tl.where(offs_n[None, :] < n_k, s, 0.0)


@triton.jit
def _mask_ragged_off_by_one(s, offs_n, n_k):
    return tl.where(offs_n[None, :] <= n_k, s, MASK_VALUE)


PADDED_KEYS_NOT_MASKED = ("the padded keys past N_k are not masked: load_tile reads them as 0, so "
                          "their scores are 0, not -inf, and each adds exp(0 - m) to l_i — "
                          "mask_ragged must set s to -inf (not 0) where offs_n >= n_k")
RAGGED_MISTAKES = {
    # (a mask to 0 instead of -inf, _mask_ragged_to_zero, gives the same output: 0 is 0)
    PADDED_KEYS_NOT_MASKED: (load_tile, _mask_ragged_none),
    "the ragged mask is off by one: key indices run 0 .. n_k - 1, keep offs_n < n_k":
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
# Exercise 6.3: mask_causal(s, offs_m, offs_n) and kv_loop_end(start_m, n_k, BLOCK_M, CAUSAL)


@triton.jit
def _mask_causal_strict(s, offs_m, offs_n):
    return tl.where(offs_n[None, :] < offs_m[:, None], s, MASK_VALUE)


@triton.jit
def _mask_causal_transposed(s, offs_m, offs_n):
    return tl.where(offs_n[None, :] >= offs_m[:, None], s, MASK_VALUE)


@triton.jit
def _kv_loop_end_stops_at_diagonal(start_m, n_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    if CAUSAL:
        return tl.minimum(n_k, start_m)
    return n_k


@triton.jit
def _kv_loop_end_always_all(start_m, n_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    return n_k


CAUSAL_OFF_BY_ONE = ("the causal mask is off by one: query i sees key j when j <= i (the "
                     "diagonal included), so keep offs_n[None, :] <= offs_m[:, None]")
CAUSAL_MISTAKES = {
    CAUSAL_OFF_BY_ONE: (_mask_causal_strict, kv_loop_end),
    "the causal mask is transposed: keep keys j <= i (the past), not j >= i":
        (_mask_causal_transposed, kv_loop_end),
    "the K/V loop stops too early: the Q tile's last row start_m + BLOCK_M - 1 sees keys up to "
    "itself, so the loop must run to min(n_k, start_m + BLOCK_M)":
        (mask_causal, _kv_loop_end_stops_at_diagonal),
}

CAUSAL_SPECS = tuple(
    spec for dtype in _case_dtypes() for spec in (
        (2, 50, 50, 16, dtype, True),
        (1, 70, 45, 16, dtype, True),   # more queries than keys: late rows see every key
        (2, 30, 64, 32, dtype, True),   # more keys than queries: late keys are never seen
    )) + ((1, 40, 40, 16, _case_dtypes()[0], False),)  # non-causal calls must visit every tile


@triton.jit
def _kv_loop_end_probe(out_ptr, n_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                       KV_LOOP_END: tl.constexpr):
    """out[pid] = KV_LOOP_END for the Q tile of program pid (to count the tiles it visits)."""
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, KV_LOOP_END(pid * BLOCK_M, n_k, BLOCK_M=BLOCK_M, CAUSAL=CAUSAL))


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
                    f"min(n_k, start_m + BLOCK_M)")
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
