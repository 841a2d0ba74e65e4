"""Chapter 06 (FlashAttention forward in Triton): the checks of the five exercises.

The chapter builds the teaching kernel of :mod:`course_lib.kernels.teaching` from pieces the
learner writes (6.1 the online-softmax update and finish, 6.2 masked loads and the ragged mask,
6.3 the causal mask and the end of the K/V loop, 6.4 the same with exp2). One check per
exercise runs the learner's pieces through the whole kernel, on guarded tensors (see
:mod:`course_lib.teaching.kernel_checks`), against float64 attention on ragged shapes, and names the
classic mistakes by replaying the known wrong pieces in ``*_MISTAKES``. The launch with the
learner's pieces is :func:`launch_answer`, called through ``grade_channel.run_with``: the grader
runs it in the notebook's process, where the pieces live, and the rest of the check in its own
(6.3's tile count, :func:`visited_tiles`, likewise). Exercise 6.5 is the
whole kernel and its launcher, written from a signature: :func:`check_forward_kernel` runs the
learner's launcher and replays the teaching kernel with one mistake each (``FORWARD_MISTAKES``);
``FORWARD_HINTS`` and ``FORWARD_SKELETON`` feed the notebook's hint ladder.

The kernel, its launcher :func:`~course_lib.kernels.teaching.forward` and the correct pieces
live in :mod:`course_lib.kernels.teaching`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import triton
import triton.language as tl

from course_lib.teaching.checks import learner_check
from course_lib.teaching import checks, grade_channel
from course_lib.platform import runtime
from course_lib.teaching.checks import TOLERANCES, Case, ExerciseFailed, describe_value
from course_lib.teaching import kernel_checks
from course_lib.attention.reference import default_scale, naive_attention_torch

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
# Guarded runs of the learner's pieces, each tensor in its own layout

# The teaching kernel reads columns at stride 1 (its contract), so the layouts vary everything
# else: heads interleaved with rows (a (N, BH, d) buffer seen as (BH, N, d)), gaps between rows
# of different widths per tensor, room past the end.
ROW_MARGIN = CHECK_BLOCK
COL_MARGIN = 8
HEADS_INTERLEAVED = kernel_checks.Layout((1, 0, 2), (0, 1, COL_MARGIN))
ROWS_WITH_GAPS = kernel_checks.Layout((0, 1, 2), (0, ROW_MARGIN, 3))
SPARE_HEAD = kernel_checks.Layout((0, 1, 2), (1, 0, 5))
LSE_LAYOUT = kernel_checks.Layout((0, 1), (1, 0))  # LSE is contiguous (the kernel's contract)
# (q, k, v, o, lse): every tensor with its own strides
PIECES_LAYOUTS = (HEADS_INTERLEAVED, ROWS_WITH_GAPS, SPARE_HEAD, ROWS_WITH_GAPS, LSE_LAYOUT)
PIECES_LAYOUTS_2 = (ROWS_WITH_GAPS, HEADS_INTERLEAVED, ROWS_WITH_GAPS, SPARE_HEAD, LSE_LAYOUT)
# Scores scaled by this are hundreds (|q·k| ~ 4 for d = 16, times 150, times scale 0.25 or so):
# exp() of them overflows unless the running max is subtracted.
LARGE_LOGITS = 150.0


def _launch_3d(pieces: Pieces, q, k, v, o, lse, causal: bool, scale: float,
               block_m: int, block_n: int) -> None:
    """:func:`launch_forward` on the checks' ``(BH, N, d)`` tensors and ``(BH, N_q)`` lse: one batch."""
    launch_forward(pieces, q[None], k[None], v[None], o[None], lse[None], causal, scale,
                   block_m, block_n)


def _q_tile_of(index, block_m=CHECK_BLOCK, **_) -> str:
    head, row = index[0], index[1]
    return (f"row {row} of head {head} belongs to Q tile {row // block_m} (rows "
            f"{row // block_m * block_m}–{row // block_m * block_m + block_m - 1}, BLOCK_M={block_m})")


def _layout_run(launch) -> kernel_checks.LayoutRun:
    """A guarded run of ``launch(q, k, v, o, lse, causal=, scale=, block_m=, block_n=)``:
    ``run(q, k, v, causal=, scale=, block_m=, block_n=, layouts=(q, k, v, o, lse))`` on (BH, N, d)
    tensors."""
    return kernel_checks.LayoutRun(
        launch=launch, names=("q", "k", "v"),
        outputs=(kernel_checks.Out("o", lambda q, k, v, **_: (tuple(q.shape), q.dtype), _q_tile_of),
                 kernel_checks.Out("lse", lambda q, k, v, **_: (tuple(q.shape[:2]), torch.float32),
                                   _q_tile_of)))


def runner(pieces: Pieces) -> kernel_checks.LayoutRun:
    """A guarded run of the teaching kernel with ``pieces``: ``run(q, k, v, causal=, scale=,
    block_m=, block_n=, layouts=(q, k, v, o, lse))`` on (BH, N, d) tensors."""
    return _layout_run(functools.partial(_launch_3d, pieces))


def launch_answer(answer: tuple, make_pieces, q, k, v, o, lse, causal: bool, scale: float,
                  block_m: int, block_n: int) -> None:
    """The teaching kernel with ``make_pieces(*answer)``, the learner's helpers in their places, on
    (BH, N, d) tensors: the launch of a check of 6.1–6.4. The grader runs it in the notebook's
    process (``grade_channel.run_with``), where the helpers live; the check stays in the grader."""
    _launch_3d(make_pieces(*answer), q, k, v, o, lse, causal, scale, block_m, block_n)


def answer_runner(answer: tuple, make_pieces) -> kernel_checks.LayoutRun:
    """As :func:`runner`, with the learner's ``answer`` (their helpers) put into the kernel by
    ``make_pieces`` wherever the helpers are (:func:`launch_answer`)."""
    return _layout_run(functools.partial(grade_channel.run_with, answer, launch_answer,
                                         make_pieces))


def _pieces_reference(q, k, v, causal=False, scale=None, **_):
    return reference(q, k, v, causal, scale)


def _cases(device, specs, seed):
    """Cases from (bh, n_q, n_k, d, dtype, causal, scale, (block_m, block_n), logit factor,
    layouts) specs; inputs are (BH, N, d)."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for bh, n_q, n_k, d, dtype, causal, scale, (bm, bn), factor, layouts in specs:
        q, k, v = (torch.randn(bh, n, d, generator=gen) for n in (n_q, n_k, n_k))
        q = (q * factor).to(device=device, dtype=dtype)
        k, v = (x.to(device=device, dtype=dtype) for x in (k, v))
        scale = default_scale(d) if scale is None else scale
        label = (f"{'causal' if causal else 'non-causal'}, BH={bh}, N_q={n_q}, N_k={n_k}, d={d}, "
                 f"{str(dtype).replace('torch.', '')}, scale={scale:.3g}, BLOCK_M={bm}, "
                 f"BLOCK_N={bn}" + (f", scores ×{factor:g}" if factor != 1 else ""))
        cases.append(kernel_checks.LayoutCase((q, k, v), {"causal": causal, "scale": scale, "block_m": bm,
                                                          "block_n": bn, "layouts": layouts}, label=label))
    return cases


def _case_dtypes():
    # fp32 is exact only in the interpreter (TF32 products on a GPU); bf16 only on a GPU.
    return (torch.float32, torch.float16) if _rt.interpreted else (torch.float16, torch.bfloat16)


def _specs(*rows):
    """Spec rows (bh, n_q, n_k, d, which dtype (0/1), causal, scale, blocks, factor, layouts)."""
    return tuple((bh, n_q, n_k, d, _case_dtypes()[i], causal, scale, blocks, factor, layouts)
                 for bh, n_q, n_k, d, i, causal, scale, blocks, factor, layouts in rows)


@functools.lru_cache(maxsize=None)
def _replay_pieces(make_pieces, wrong):
    """The teaching kernel with known-wrong pieces, run as the case says (same scale, blocks and
    layouts as the learner's run, so that it computes exactly what that mistake computes). One
    function per (make_pieces, wrong), the same at every check: the checks remember a model's
    outputs by the model (``checks._model_output``)."""
    def mistaken(q, k, v, causal=False, scale=None, block_m=CHECK_BLOCK, block_n=CHECK_BLOCK,
                 layouts=None):
        run = runner(make_pieces(*wrong))
        return kernel_checks._quietly(run, q, k, v, causal=causal, scale=scale, block_m=block_m,
                                      block_n=block_n, layouts=layouts)
    return mistaken


def _check(exercise, answer, fallback, make_pieces, specs, seed, mistakes):
    """Check the learner's pieces in the teaching kernel; mistakes replay known-wrong pieces."""
    return kernel_checks.check_layout_kernel(
        exercise, answer, answer_runner(answer, make_pieces), _pieces_reference,
        _cases(_rt.device, specs, seed),
        fallback=fallback, names=("q", "k", "v", "o", "lse"),
        mistakes={cause: _replay_pieces(make_pieces, wrong) for cause, wrong in mistakes.items()})


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
def _update_alpha_inverted(s, v, m_i, l_i, acc, scale):
    s = s * scale
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_new - m_i)  # the inverse of the rescale (inf on the first tile)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _update_keeps_old_max(s, v, m_i, l_i, acc, scale):
    s = s * scale
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_i, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _finish_no_division(acc, m_i, l_i):
    return acc, m_i + tl.log(l_i)


@triton.jit
def _finish_lse_without_max(acc, m_i, l_i):
    return acc / l_i[:, None], tl.log(l_i)


FORGOT_RESCALE_ACC = ("acc is not rescaled: when the running max grows, the old acc (a sum of "
                      "exp(s - m_old)·v) must be multiplied by alpha = exp(m_old - m_new) too")
FORGOT_RESCALE_L = "l_i is not rescaled: l_new = l_i · alpha + rowsum(p), alpha = exp(m_old - m_new)"
ALPHA_INVERTED = ("alpha = exp(m_new - m_i) is the inverse of the rescale: the old state shrinks by "
                  "exp(m_old - m_new) ≤ 1 when the max grows (on the first tile m_i = -inf makes "
                  "this one inf, and 0 · inf = NaN)")
OLD_MAX_RETURNED = ("the update returns the old m_i instead of m_new: the running max never "
                    "advances, so the next tile rescales by exp(m_i - m_new) against a max that "
                    "was never kept (the state stays -inf, and alpha wipes it)")
FORGOT_FINAL_DIVISION = ("the final 1/l is missing: acc holds the unnormalised sum Σ exp(s - m)·v; "
                         "o = acc / l_i[:, None]")

UPDATE_MISTAKES = {
    FORGOT_RESCALE_ACC: (_update_no_rescale_acc, finish_rows),
    FORGOT_RESCALE_L: (_update_no_rescale_l, finish_rows),
    "each tile is exponentiated relative to its own max; use the new running max m_new, the "
    "same reference the rescaled old state uses": (_update_tile_own_max, finish_rows),
    "the scores are not multiplied by scale (the kernel passes raw q·kᵀ)":
        (_update_no_scale, finish_rows),
    OLD_MAX_RETURNED: (_update_keeps_old_max, finish_rows),
    ALPHA_INVERTED: (_update_alpha_inverted, finish_rows),
    FORGOT_FINAL_DIVISION: (update_tile, _finish_no_division),
    "lse must include the running max: lse = m_i + log(l_i), since l_i is a sum of exp(s - m_i)":
        (update_tile, _finish_lse_without_max),
}

# Non-causal and N a multiple of the block first (the plain loop), then a causal and a ragged
# case, whose -inf scores the update must survive; leading dims of 2 and 3 heads.
ONLINE_SOFTMAX_SPECS = _specs(
    (2, 40, 40, 16, 0, False, None, (16, 16), 1, PIECES_LAYOUTS),
    (1, 37, 53, 32, 0, False, 0.3, (16, 32), 1, PIECES_LAYOUTS_2),
    (2, 33, 33, 16, 0, True, None, (32, 16), 1, PIECES_LAYOUTS),
    (1, 30, 40, 16, 0, False, 0.2, (16, 16), LARGE_LOGITS, PIECES_LAYOUTS_2),  # exp overflows without the max
    (2, 29, 40, 16, 1, True, None, (16, 16), 1, PIECES_LAYOUTS),
)


def _natural(update, finish):
    return NATURAL_EXP_PIECES.replace(update=update, finish=finish)


@learner_check
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


@triton.jit
def _mask_ragged_rows(s, offs_n, n_k):
    return tl.where(offs_n[:, None] < n_k, s, MASK_VALUE)


PADDED_KEYS_NOT_MASKED = ("the padded keys past N_k are not masked: load_tile reads them as 0, so "
                          "their scores are 0, not -inf, and each adds exp(0 - m) to l_i — "
                          "mask_ragged must set s to -inf (not 0) where offs_n >= n_k")
RAGGED_MISTAKES = {
    # (a mask to 0 instead of -inf, _mask_ragged_to_zero, gives the same output: 0 is 0)
    PADDED_KEYS_NOT_MASKED: (load_tile, _mask_ragged_none),
    "the ragged mask is off by one: key indices run 0 .. n_k - 1, keep offs_n < n_k":
        (load_tile, _mask_ragged_off_by_one),
    "offs_n[:, None] puts the key indices down the rows (the queries): the mask hides whole "
    "query rows and broadcasts only when BLOCK_M == BLOCK_N — the keys are the columns, "
    "offs_n[None, :] < n_k": (load_tile, _mask_ragged_rows),
}

RAGGED_SPECS = _specs(
    (2, 37, 37, 16, 0, False, None, (16, 16), 1, PIECES_LAYOUTS),
    (1, 45, 21, 32, 0, False, 0.3, (32, 16), 1, PIECES_LAYOUTS_2),
    (3, 9, 70, 16, 0, False, None, (16, 32), 1, PIECES_LAYOUTS),
    (1, 30, 45, 16, 0, False, 0.2, (16, 16), LARGE_LOGITS, PIECES_LAYOUTS_2),
    (1, 37, 21, 16, 1, False, None, (16, 32), 1, PIECES_LAYOUTS_2),
)


def _ragged(load, mask):
    return LIBRARY_PIECES.replace(load_tile=load, mask_ragged=mask)


@learner_check
def check_ragged(load, mask):
    """Check exercise 6.2; return (load_tile, mask_ragged) or, not done yet, the library's."""
    return _check("Exercise 6.2", (load, mask), (load_tile, mask_ragged), _ragged, RAGGED_SPECS,
                  6_2, RAGGED_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 6.3: mask_causal(s, offs_m, offs_n) and kv_loop_end(start_m, n_k, BLOCK_M, CAUSAL)


@triton.jit
def _mask_causal_strict(s, offs_m, offs_n):
    return tl.where(offs_n[None, :] < offs_m[:, None], s, MASK_VALUE)


@triton.jit
def _mask_causal_transposed(s, offs_m, offs_n):
    return tl.where(offs_n[None, :] >= offs_m[:, None], s, MASK_VALUE)


@triton.jit
def _mask_causal_axes_swapped(s, offs_m, offs_n):
    return tl.where(offs_n[:, None] <= offs_m[None, :], s, MASK_VALUE)


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
    "the mask's index vectors sit on the wrong axes: offs_n[:, None] runs down the rows (the "
    "queries) and offs_m[None, :] along the columns (the keys), which compares the wrong pairs "
    "and broadcasts only when BLOCK_M == BLOCK_N — keep offs_n[None, :] <= offs_m[:, None]":
        (_mask_causal_axes_swapped, kv_loop_end),
    "the K/V loop stops too early: the Q tile's last row start_m + BLOCK_M - 1 sees keys up to "
    "itself, so the loop must run to min(n_k, start_m + BLOCK_M)":
        (mask_causal, _kv_loop_end_stops_at_diagonal),
}

CAUSAL_SPECS = _specs(
    (2, 40, 40, 16, 0, True, None, (16, 16), 1, PIECES_LAYOUTS),
    (1, 70, 45, 16, 0, True, 0.3, (32, 16), 1, PIECES_LAYOUTS_2),   # more queries than keys: late rows see every key
    (2, 30, 64, 32, 0, True, None, (16, 32), 1, PIECES_LAYOUTS),  # more keys than queries: late keys are never seen
    (1, 35, 35, 16, 0, True, 0.2, (16, 16), LARGE_LOGITS, PIECES_LAYOUTS_2),
    (1, 40, 40, 16, 0, False, None, (16, 16), 1, PIECES_LAYOUTS),  # non-causal calls must visit every tile
    (1, 50, 50, 16, 1, True, None, (16, 32), 1, PIECES_LAYOUTS_2),
)


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


@learner_check
def check_causal(mask, end):
    """Check exercise 6.3; return (mask_causal, kv_loop_end) or, not done yet, the library's.

    Beyond the outputs, counts the K/V tiles each Q tile visits: a loop that reaches tiles
    right of the diagonal (all -inf for every row of the Q tile) gives right answers slowly.
    """
    for _, n_q, n_k, _, _, causal, _, (bm, bn), _, _ in CAUSAL_SPECS:
        try:
            got = grade_channel.run_with(end, visited_tiles, n_q, n_k, causal, bm, bn)
        except grade_channel.ChannelError:  # (grader) the notebook answered with what is not data:
            raise                           # never skip the count for it
        except Exception:  # noqa: BLE001 - a stub or a broken kv_loop_end: the check below says
            break
        want = visited_tiles(kv_loop_end, n_q, n_k, causal, bm, bn)
        for tile, (g, w) in enumerate(zip(got, want)):
            if g > w:
                raise checks.failed_with("Exercise 6.3", (
                    f"✗ Exercise 6.3: the Q tile starting at row "
                    f"{tile * bm} visits {g} K/V tiles where {w} suffice "
                    f"({'causal' if causal else 'non-causal'}, N_q={n_q}, N_k={n_k}, "
                    f"BLOCK_M={bm}, BLOCK_N={bn}) — tiles right of the diagonal are fully "
                    f"masked: for causal, stop the loop at min(n_k, start_m + BLOCK_M)"))
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
def _update_exp2_alpha_exp(s, v, m_i, l_i, acc, scale):
    s = s * (scale * LOG2_E)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)  # base e on maxima in log2 units
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _update_exp2_keeps_old_max(s, v, m_i, l_i, acc, scale):
    s = s * (scale * LOG2_E)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return m_i, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _finish_exp2_lse_in_log2(acc, m_i, l_i):
    return acc / l_i[:, None], m_i + tl.math.log2(l_i)


@triton.jit
def _finish_exp2_lse_times_log2e(acc, m_i, l_i):
    return acc / l_i[:, None], (m_i + tl.math.log2(l_i)) * LOG2_E


@triton.jit
def _finish_exp2_lse_log2_of_l(acc, m_i, l_i):
    return acc / l_i[:, None], m_i / LOG2_E + tl.math.log2(l_i)


@triton.jit
def _finish_exp2_lse_m_unconverted(acc, m_i, l_i):
    return acc / l_i[:, None], m_i + tl.log(l_i)


EXP2_WITHOUT_LOG2E = ("exp2 is used but the scale does not include LOG2_E: exp2(x) = exp(x · ln 2), "
                      "so multiply the scores by scale · LOG2_E before exp2")
EXP2_MISTAKES = {
    EXP2_WITHOUT_LOG2E: (_update_exp2_without_log2e, finish_rows_exp2),
    "the scores were scaled by scale · LOG2_E (log2 units) but exponentiated with tl.exp: use "
    "tl.math.exp2 for p and alpha": (_update_exp_with_log2e, finish_rows_exp2),
    "alpha uses tl.exp on maxima in log2 units: p is exp2(s - m_new), so the rescale must be "
    "exp2(m_i - m_new) too": (_update_exp2_alpha_exp, finish_rows_exp2),
    OLD_MAX_RETURNED.replace("exp(m_i", "exp2(m_i"): (_update_exp2_keeps_old_max, finish_rows_exp2),
    "lse is left in log2 units: m_i + log2(l_i) is log2 Σ exp(s); divide by LOG2_E for the "
    "natural log the backward expects": (update_tile_exp2, _finish_exp2_lse_in_log2),
    "lse is multiplied by LOG2_E: m_i + log2(l_i) is in log2 units, and log2 units become the "
    "natural log by dividing by LOG2_E (log2 x = ln x · LOG2_E)": (
        update_tile_exp2, _finish_exp2_lse_times_log2e),
    "lse mixes units: m_i / LOG2_E is in natural-log units but log2(l_i) is not — use "
    "m_i / LOG2_E + log(l_i), or (m_i + log2(l_i)) / LOG2_E": (
        update_tile_exp2, _finish_exp2_lse_log2_of_l),
    "lse mixes units: m_i is still in log2 units (the scores were scaled by LOG2_E) while log(l_i) "
    "is natural — use m_i / LOG2_E + log(l_i)": (update_tile_exp2, _finish_exp2_lse_m_unconverted),
}

EXP2_SPECS = _specs(
    (2, 40, 40, 16, 0, False, None, (16, 16), 1, PIECES_LAYOUTS),
    (1, 45, 30, 32, 0, True, 0.3, (32, 16), 1, PIECES_LAYOUTS_2),
    (1, 37, 53, 16, 0, False, None, (16, 32), 1, PIECES_LAYOUTS),
    (1, 30, 40, 16, 0, False, 0.2, (16, 16), LARGE_LOGITS, PIECES_LAYOUTS_2),
    (1, 45, 30, 32, 1, True, None, (16, 16), 1, PIECES_LAYOUTS),
)


def _exp2(update, finish):
    return LIBRARY_PIECES.replace(update=update, finish=finish)


@learner_check
def check_exp2(update, finish):
    """Check exercise 6.4; return (update, finish) or, not done yet, the library's."""
    return _check("Exercise 6.4", (update, finish), (update_tile_exp2, finish_rows_exp2), _exp2,
                  EXP2_SPECS, 6_4, EXP2_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 6.5: the whole kernel and its launcher, from a signature and a docstring
#
# The learner writes ``flash_forward_kernel(Q, K, V, O, LSE, <4 strides of each>, n_heads, n_q,
# n_k, scale, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL)`` and ``flash_forward(q, k, v, causal=False,
# scale=None, block_m=..., block_n=...) -> (o, lse)`` on (B, H, N, d) tensors. The check calls
# only the launcher: on inputs embedded in NaN-filled buffers (a spare head per batch, a tile of
# rows after every head, padded rows), with the launcher's own ``torch.empty`` outputs embedded
# in sentinel-filled buffers (one spare batch past the end), so rows never written, stores past
# the end and loads outside the inputs each get their own diagnosis. Value errors name the
# output, the first bad row, its Q tile and the K tiles it sees, and the likely cause, found by
# replaying the teaching kernel with one known mistake on the same guarded inputs.

# Layouts of the guarded (B, H, N, d) inputs, one per tensor: (B, N, H, d) memory seen as
# (B, H, N, d) (heads interleaved with rows), a column stride != 1 ((B, H, d, N) memory), a spare
# head after each batch's heads and gaps between rows.
BNHD = kernel_checks.Layout((0, 2, 1, 3), (0, 0, 1, 4))
COLUMNS_STRIDED = kernel_checks.Layout((0, 1, 3, 2), (0, 1, 0, 3))
SPARE_HEAD_4D = kernel_checks.Layout((0, 1, 2, 3), (1, 1, CHECK_BLOCK, COL_MARGIN))


def library_forward(q, k, v, causal: bool = False, scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None):
    """Exercise 6.5's fallback: the teaching kernel with the library's pieces, same signature."""
    blocks = None if block_m is None or block_n is None else (block_m, block_n)
    return forward(q, k, v, causal, scale, blocks=blocks)


@contextlib.contextmanager
def _sentinel_allocations():
    """While active, ``torch.empty``/``torch.empty_like`` return tensors filled with the sentinel
    (contiguous ones as views of buffers one slice longer along dim 0, to see a store past the
    end on a GPU). Yields the list of ``(allocation, buffer)`` made."""
    made = []
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def guard(t):
        if not t.is_floating_point() or t.ndim == 0 or t.numel() == 0:
            return t
        if t.is_contiguous():
            buffer = torch.full((t.shape[0] + 1, *t.shape[1:]), kernel_checks.OUTPUT_SENTINEL,
                                dtype=t.dtype, device=t.device)
            t = buffer[: t.shape[0]]
        else:
            buffer = t.fill_(kernel_checks.OUTPUT_SENTINEL)
        made.append((t, buffer))
        return t

    torch.empty = lambda *args, **kwargs: guard(real_empty(*args, **kwargs))
    torch.empty_like = lambda *args, **kwargs: guard(real_empty_like(*args, **kwargs))
    try:
        yield made
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


@contextlib.contextmanager
def _kernel_tensors_allowed(guard, inputs: dict):
    """While active (interpreter), every tensor handed to a kernel launch is registered with the
    memory guard under the kernel's parameter name: the check's inputs read-only, any other (what
    the launcher allocated or copied) writable — judged afterwards by what the launcher returns.
    No guard in force (on a GPU): nothing to register."""
    if not _rt.interpreted or guard is None:
        yield
        return
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run
    ours = {x.untyped_storage().data_ptr() for x in inputs.values()}

    def run(self, *args, **kwargs):
        for name, a in [*zip(self.arg_names, args), *kwargs.items()]:
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() not in ours:
                guard.allow(name, a, write=True)
        return original(self, *args, **kwargs)

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = original


def _buffer_of(t, made):
    """The sentinel buffer ``t`` lives in (allocated under :func:`_sentinel_allocations`), or None."""
    for _, buffer in made:
        if t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
            return buffer
    return None


def _tiles(index: int, block: int) -> str:
    return f"rows {index // block * block}–{index // block * block + block - 1}"


def _outputs_of(result, q):
    """``(o, lse)`` from what the launcher returned, or KernelProblem saying what is off."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise kernel_checks.KernelProblem(f"your launcher must return (o, lse), got {describe_value(result)}")
    expected = {"o": (tuple(q.shape), q.dtype, "q's shape and dtype"),
                "lse": (tuple(q.shape[:3]), torch.float32, "(B, H, N_q) float32")}
    for (name, (shape, dtype, says)), x in zip(expected.items(), result):
        if not isinstance(x, torch.Tensor):
            raise kernel_checks.KernelProblem(f"your launcher returned {name} as {describe_value(x)}: "
                                     f"expected a tensor")
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise kernel_checks.KernelProblem(
                f"your launcher returned {name} {describe_value(x)}: expected {says}, "
                f"{shape} {str(dtype).replace('torch.', '')}")
    return tuple(result)


def _unwritten_rows(x):
    """``(B, H, N_q)``: the rows of ``x`` (B, H, N_q[, d]) with an element never written."""
    unwritten = x == kernel_checks.OUTPUT_SENTINEL
    return unwritten.any(dim=-1) if x.ndim == 4 else unwritten


def _only_first_pair(x) -> bool:
    """Whether exactly (batch 0, head 0) of ``x`` was written, completely, and no other pair."""
    rows = _unwritten_rows(x).flatten(0, 1)  # (B·H, N_q)
    return rows.shape[0] > 1 and not bool(rows[0].any()) and bool(rows[1:].all())


def _pair_note(name, other, only_first) -> str:
    """Why only (batch 0, head 0) of output ``name`` was written, from what the other output
    shows (``only_first``: {output: only its first pair written}; ``other``: its name)."""
    if not only_first.get(name):
        return ""
    if only_first.get(other):
        return (f"\n  only (batch 0, head 0) was written, in {name} and {other} alike: no "
                f"program stored a row of another (batch, head) — the grid has no programs for "
                f"the other pairs (it needs B · H of them besides the Q tiles), or the kernel "
                f"reads their index from a program_id axis the grid does not have, or their "
                f"programs' rows start past N_q (a tile's first row counted over every program, "
                f"pid · BLOCK_M, not over the pair's own tiles)")
    return (f"\n  {other} was written for every (batch, head), so a program ran for each: "
            f"{name}'s offset does not move with the (batch, head) — every program stored its rows "
            f"into (batch 0, head 0)'s place; add the (batch, head) part to {name}'s offset")


def _unwritten(name, x, block_m=CHECK_BLOCK, note=""):
    """A KernelProblem naming where ``x`` (B, H, N_q[, d]) still holds the sentinel, or None;
    ``note`` (a line of its own) is added to the pattern seen."""
    unwritten = _unwritten_rows(x)
    if not unwritten.any():
        return None
    b, h, row = (int(i) for i in torch.nonzero(unwritten)[0])
    rows_per_head = unwritten.sum(dim=-1)  # (B, H)
    first_tile_done = not unwritten[..., :block_m].any()
    if first_tile_done and bool((unwritten[..., block_m:]).all()):
        pattern = (f"only the first Q tile of each head was written — as if the grid had one "
                   f"program per (batch, head); it needs cdiv(N_q, BLOCK_M) · B · H programs")
    elif bool(((rows_per_head == 0) | (rows_per_head == x.shape[2])).all()):
        pattern = (f"{int((rows_per_head == x.shape[2]).sum())} of the {x.shape[0] * x.shape[1]} "
                   f"(batch, head) pairs were never written at all, the others completely")
    else:
        pattern = (f"program pid owns Q tile pid % cdiv(N_q, BLOCK_M) of (batch, head) "
                   f"pid // cdiv(N_q, BLOCK_M), and the grid has cdiv(N_q, BLOCK_M) · B · H programs")
    return kernel_checks.KernelProblem(
        f"{int(unwritten.sum())} row(s) of {name} {tuple(x.shape)} were never written, the first "
        f"row {row} of (batch {b}, head {h}), Q tile {row // block_m} ({_tiles(row, block_m)}, "
        f"BLOCK_M={block_m})\n  {pattern}{note}")


def call_launcher(launcher, q, k, v, causal, **kwargs):
    """``launcher(q, k, v, causal, **kwargs)`` with every ``torch.empty``/``empty_like`` it makes
    filled with the sentinel (:func:`_sentinel_allocations`) and every tensor it hands a kernel
    allowed by the memory guard in force (:func:`_kernel_tensors_allowed`). Returns what the
    launcher returned and the ``[(allocation, buffer)]`` it made. The grader runs it in the
    notebook's process (``grade_channel.run_with``), under a guard allowing the same q, k, v."""
    with _sentinel_allocations() as made, _kernel_tensors_allowed(
            kernel_checks.active_guard(), {"q": q, "k": k, "v": v}):
        return launcher(q, k, v, causal, **kwargs), made


class ForwardRun:
    """``run(q, k, v, causal=, scale=, block_m=, block_n=, layouts=) -> (o, lse)``: the learner's
    launcher on guarded copies of q, k, v (each in its own layout); what the launcher allocates
    is filled with the sentinel and registered with the memory guard when a kernel gets it;
    outputs are judged by what the returned tensors view."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.nonfinite: dict = {}

    def launch(self, q, k, v, causal, scale, block_m, block_n, layouts, fill):
        layouts = tuple(layouts or ()) + (None,) * 3
        placed = [kernel_checks.place(x, lay, fill) for x, lay in zip((q, k, v), layouts)]
        views = [view for view, _ in placed]
        pristine = [buffer.clone() for _, buffer in placed]
        kwargs = {"block_m": block_m, "block_n": block_n}
        if scale is not None:
            kwargs["scale"] = scale
        with warnings.catch_warnings(), kernel_checks.memory_guard() as guard:
            warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's overflows
            for name, view in zip("qkv", views):
                guard.allow(name, view)
            try:
                result, made = grade_channel.run_with(self.launcher, call_launcher, *views,
                                                      causal, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the guard's diagnosis comes as it is
                violation = next((e for e in kernel_checks.exception_chain(exc)
                                  if isinstance(e, kernel_checks.MemoryViolation)), None)
                if violation is None:
                    raise
                raise violation.extended(None) from None
        if q.device.type == "cuda":
            torch.cuda.synchronize()
        for name, (_, buffer), before in zip("qkv", placed, pristine):
            if not checks.same_value(before, buffer):
                raise kernel_checks.KernelProblem(f"your kernel wrote into its input `{name}` — "
                                                  f"inputs are read-only: tl.store only to O and "
                                                  f"LSE (pointers swapped?)")
        o, lse = _outputs_of(result, q)
        return o, lse, made

    def __call__(self, q, k, v, causal=False, scale=None, block_m=CHECK_BLOCK,
                 block_n=CHECK_BLOCK, layouts=None):
        o, lse, made = self.launch(q, k, v, causal, scale, block_m, block_n, layouts,
                                   kernel_checks.INPUT_MARGIN_FILL)
        for name, x in (("o", o), ("lse", lse)):
            buffer = _buffer_of(x, made)
            alloc = next((a for a, b in made if b is buffer), None)
            if (buffer is not None and alloc is not None and buffer.shape[0] > alloc.shape[0]
                    and bool((buffer[alloc.shape[0]:] != kernel_checks.OUTPUT_SENTINEL).any())):
                raise kernel_checks.KernelProblem(
                    f"your kernel wrote past the end of the tensor {name} views "
                    f"{tuple(alloc.shape)}: a tl.store with a missing mask or a wrong offset")
        only_first = {"o": _only_first_pair(o), "lse": _only_first_pair(lse)}
        for name, x, other in (("o", o, "lse"), ("lse", lse, "o")):
            problem = _unwritten(name, x, block_m, _pair_note(name, other, only_first))
            if problem:
                raise problem
        got = (o.clone(), lse.clone())
        if not all(torch.isfinite(x).all() for x in got) and not _rt.interpreted:
            again = self.launch(q, k, v, causal, scale, block_m, block_n, layouts,
                                kernel_checks.INPUT_MARGIN_REFILL)[:2]
            if all(torch.isfinite(x).all() for x in again):
                raise kernel_checks.KernelProblem(
                    "the output depends on memory outside the inputs (their margins hold NaN, "
                    "and NaN came out): a load without a mask, or a wrong offset or stride")
        return got


def forward_runner(launcher):
    """The guarded run of a learner's 6.5 launcher (see :class:`ForwardRun`)."""
    return ForwardRun(launcher)


def _forward_reference(q, k, v, causal=False, scale=None, **_):
    return reference(q, k, v, causal, scale)


def _forward_row_of(index, block_m=CHECK_BLOCK, **_) -> str:
    b, h, row = index[:3]
    return (f"row {row} of (batch {b}, head {h}) is in Q tile {row // block_m} "
            f"({_tiles(row, block_m)}, BLOCK_M={block_m})")


def _replay(pieces=LIBRARY_PIECES, flat_heads=False):
    """A known-wrong launcher: the teaching kernel with ``pieces``, run as the case says (scale,
    blocks, and q, k, v in the case's layouts), so that it computes what that mistake computes.

    ``flat_heads``: the kernel reaches (batch, head) as pid_bh · stride_h, as if the heads of
    all batches were evenly spaced (true only when B and H are contiguous together).
    """
    def wrong(q, k, v, causal=False, scale=None, block_m=CHECK_BLOCK, block_n=CHECK_BLOCK,
              layouts=None):
        layouts = tuple(layouts or ()) + (None,) * 3
        views = [kernel_checks.place(x, lay, 0.0)[0] for x, lay in zip((q, k, v), layouts)]
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        seen = [*views, o]
        if flat_heads:
            seen = [x.as_strided(x.shape, (x.shape[1] * x.stride(1), *x.stride()[1:]))
                    for x in seen]
        if any(x.stride(-1) != 1 for x in seen):  # the teaching kernel reads columns at stride 1
            seen = [x if x.stride(-1) == 1 else x.contiguous() for x in seen[:3]] + seen[3:]
        scale = default_scale(q.shape[-1]) if scale is None else scale
        with warnings.catch_warnings(), kernel_checks.memory_guard() as guard:
            warnings.simplefilter("ignore", RuntimeWarning)
            for name, x in zip("qkv", seen):
                guard.allow(name, x if not flat_heads else views["qkv".index(name)])
            guard.allow("o", o, write=True)
            guard.allow("lse", lse, write=True)
            launch_forward(pieces, *seen, lse, causal, scale, block_m, block_n)
        return o, lse
    return wrong


@triton.jit
def _load_unmasked(ptr, offs_rows, offs_d, stride_row, n_rows):
    return tl.load(ptr + offs_rows[:, None] * stride_row + offs_d[None, :])


@triton.jit
def _update_then_normalise(s, v, m_i, l_i, acc, scale):
    m_new, l_new, acc = update_tile_exp2(s, v, m_i, l_i, acc, scale)
    return m_new, l_new, acc / l_new[:, None]  # the epilogue's division, inside the loop


@triton.jit
def _finish_exp2_no_division(acc, m_i, l_i):
    return acc, (m_i + tl.math.log2(l_i)) / LOG2_E


FLAT_HEADS = ("the (batch, head) offset is pid_bh · stride_h, which assumes the heads of all "
              "batches are evenly spaced in memory — they are not here: use b · stride_qb + "
              "h · stride_qh with b = pid_bh // n_heads, h = pid_bh % n_heads (and the same for "
              "K, V and O)")
KV_LOADS_UNMASKED = ("the loads of the ragged last K/V tile are not masked: rows past N_k belong "
                     "to the next head or to nobody — load with mask=offs_n[:, None] < n_k, "
                     "other=0.0 (masking only the scores is not enough: 0 · NaN is NaN in p @ v)")
RAGGED_SCORES_NOT_MASKED = ("the scores of the padded keys past N_k are not masked: their K rows "
                            "load as 0, so their scores are 0, not -inf, and each adds exp(0 - m) "
                            "to l_i — set s to -inf where offs_n >= n_k")
LSE_IN_LOG2 = ("lse is left in log2 units: with exp2, m_i + log2(l_i) is log2 Σ exp(s); divide "
               "by LOG2_E (from course_lib.kernels.tiles, imported at the top of the notebook) "
               "for the natural log the backward expects")
DIVIDED_INSIDE_LOOP = ("acc is divided by l_i inside the K/V loop: the division o = acc / l_i "
                       "belongs after the loop, once, when l_i sums every tile (is the epilogue "
                       "indented into the loop?)")
CAUSAL_LOOP_SHORT = ("the causal K/V loop stops one tile early: the Q tile's last row "
                     "start_m + BLOCK_M - 1 sees keys up to itself, so loop to "
                     "min(n_k, start_m + BLOCK_M)")

FORWARD_MISTAKES = {
    FLAT_HEADS: _replay(flat_heads=True),
    KV_LOADS_UNMASKED: _replay(LIBRARY_PIECES.replace(load_tile=_load_unmasked)),
    RAGGED_SCORES_NOT_MASKED: _replay(LIBRARY_PIECES.replace(mask_ragged=_mask_ragged_none)),
    FORGOT_RESCALE_ACC: _replay(NATURAL_EXP_PIECES.replace(update=_update_no_rescale_acc)),
    FORGOT_RESCALE_L: _replay(NATURAL_EXP_PIECES.replace(update=_update_no_rescale_l)),
    "the scores are not multiplied by scale (1/√d by default; with exp2, by scale · LOG2_E)":
        _replay(NATURAL_EXP_PIECES.replace(update=_update_no_scale)),
    EXP2_WITHOUT_LOG2E: _replay(LIBRARY_PIECES.replace(update=_update_exp2_without_log2e)),
    "the scores were scaled by scale · LOG2_E (log2 units) but exponentiated with tl.exp: use "
    "tl.math.exp2 for p and alpha": _replay(LIBRARY_PIECES.replace(update=_update_exp_with_log2e)),
    LSE_IN_LOG2: _replay(LIBRARY_PIECES.replace(finish=_finish_exp2_lse_in_log2)),
    "lse must include the running max: lse = m_i + log(l_i), since l_i is a sum of exp(s - m_i)":
        _replay(NATURAL_EXP_PIECES.replace(finish=_finish_lse_without_max)),
    FORGOT_FINAL_DIVISION: _replay(LIBRARY_PIECES.replace(finish=_finish_exp2_no_division)),
    DIVIDED_INSIDE_LOOP: _replay(LIBRARY_PIECES.replace(update=_update_then_normalise,
                                                        finish=_finish_exp2_no_division)),
    CAUSAL_OFF_BY_ONE: _replay(LIBRARY_PIECES.replace(mask_causal=_mask_causal_strict)),
    CAUSAL_LOOP_SHORT: _replay(LIBRARY_PIECES.replace(kv_loop_end=_kv_loop_end_stops_at_diagonal)),
    "the causal mask is transposed: keep keys j <= i (the past), not j >= i":
        _replay(LIBRARY_PIECES.replace(mask_causal=_mask_causal_transposed)),
}

# (B, H, N_q, N_k, d, dtype, causal, scale, (block_m, block_n), logit factor, layouts of q, k, v):
# ragged lengths, N_q ≠ N_k both ways with ragged last tiles where the causal loop end matters,
# batches and heads > 1 (so batch and head strides both matter), each tensor in its own layout
# (heads interleaved, a column stride != 1, spare heads and row gaps), explicit scales, BLOCK_M
# ≠ BLOCK_N both ways, scores in the hundreds; the half-precision cases last.
FORWARD_SPECS = (
    (2, 2, 45, 45, 16, 0, False, None, (16, 16), 1, (BNHD, COLUMNS_STRIDED, SPARE_HEAD_4D)),
    (1, 2, 37, 70, 32, 0, True, 0.3, (16, 32), 1, (SPARE_HEAD_4D, BNHD, COLUMNS_STRIDED)),
    (2, 1, 64, 29, 16, 0, True, None, (32, 16), 1, (COLUMNS_STRIDED, SPARE_HEAD_4D, BNHD)),
    (1, 2, 33, 40, 16, 0, False, 0.2, (16, 16), LARGE_LOGITS, (BNHD, SPARE_HEAD_4D, BNHD)),
    (1, 2, 50, 50, 16, 1, True, None, (16, 32), 1, (BNHD, COLUMNS_STRIDED, SPARE_HEAD_4D)),
    (2, 1, 33, 48, 32, 1, False, 0.15, (16, 16), 1, (SPARE_HEAD_4D, BNHD, COLUMNS_STRIDED)),
)


def _forward_cases(device):
    gen = torch.Generator().manual_seed(6_5)
    cases = []
    for batch, heads, n_q, n_k, d, i, causal, scale, (bm, bn), factor, layouts in FORWARD_SPECS:
        dtype = _case_dtypes()[i]
        q, k, v = (torch.randn(batch, heads, n, d, generator=gen) for n in (n_q, n_k, n_k))
        q = (q * factor).to(device=device, dtype=dtype)
        k, v = (x.to(device=device, dtype=dtype) for x in (k, v))
        label = (f"{'causal' if causal else 'non-causal'}, B={batch}, H={heads}, N_q={n_q}, "
                 f"N_k={n_k}, d={d}, {str(dtype).replace('torch.', '')}, "
                 f"scale={'default' if scale is None else scale}, BLOCK_M={bm}, BLOCK_N={bn}"
                 + (f", scores ×{factor:g}" if factor != 1 else "")
                 + f"; strides q {layouts[0].strides(q.shape)}, k {layouts[1].strides(k.shape)}, "
                   f"v {layouts[2].strides(v.shape)}")
        cases.append(kernel_checks.LayoutCase((q, k, v), {"causal": causal, "scale": scale, "block_m": bm,
                                                          "block_n": bn, "layouts": layouts}, label=label))
    return cases


@learner_check
def check_forward_kernel(launcher):
    """Check exercise 6.5; return the learner's launcher or, not done yet, the library's.

    ``launcher(q, k, v, causal=False, scale=None, block_m=..., block_n=...)`` on (B, H, N, d)
    tensors returns ``(o, lse)``; the check runs it with 16- and 32-row tiles.
    """
    return kernel_checks.check_layout_kernel(
        "Exercise 6.5", launcher, forward_runner(launcher), _forward_reference,
        _forward_cases(_rt.device), fallback=library_forward, mistakes=FORWARD_MISTAKES,
        names=("q", "k", "v"), locate=_forward_row_of, output_names=("o", "lse"))


FORWARD_HINTS = [
    "Start from the launcher: o = torch.empty_like(q); lse = torch.empty((B, H, N_q), "
    "dtype=torch.float32, device=q.device); one program per Q tile of each (batch, head), so grid = "
    "(triton.cdiv(N_q, block_m) * B * H,); pass *q.stride(), *k.stride(), *v.stride(), "
    "*o.stride() in the kernel's order, and HEAD_DIM=d, BLOCK_M, BLOCK_N, CAUSAL as keywords.",
    "In the kernel, pid = tl.program_id(0); with num_tiles = tl.cdiv(n_q, BLOCK_M): "
    "pid_bh = pid // num_tiles, b = pid_bh // n_heads, h = pid_bh % n_heads, start_m = "
    "(pid % num_tiles) * BLOCK_M. (tiles.program_tile does exactly this.)",
    "Pointers: Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + "
    "offs_d[None, :] * stride_qd, with offs_m = start_m + tl.arange(0, BLOCK_M) and offs_d = "
    "tl.arange(0, HEAD_DIM). Load the Q tile once, masked with offs_m[:, None] < n_q, other=0.0.",
    "State before the loop: m_i = full([BLOCK_M], -inf), l_i = zeros([BLOCK_M]), acc = "
    "zeros([BLOCK_M, HEAD_DIM]), all fp32. Loop start_n over range(0, kv_end, BLOCK_N) with kv_end "
    "= min(n_k, start_m + BLOCK_M) when CAUSAL, else n_k (exercise 6.3's kv_loop_end).",
    "In the loop: load K and V tiles masked with offs_n[:, None] < n_k; s = tl.dot(q, tl.trans(k)); "
    "-inf where offs_n >= n_k and, when CAUSAL, where offs_n > offs_m; then exercise 6.4's update "
    "(s · scale · LOG2_E, exp2, rescale l_i and acc by alpha, tl.dot(p.to(v.dtype), v)).",
    "After the loop: o = acc / l_i[:, None], lse = (m_i + log2(l_i)) / LOG2_E (LOG2_E is the "
    "tl.constexpr the notebook imports at the top, from course_lib.kernels.tiles; multiplying by "
    "LN_2 = ln 2 is the same, after from course_lib.kernels.tiles import LN_2); store o "
    "as O's dtype (o.to(O.dtype.element_ty)) and lse at LSE + pid_bh * n_q + offs_m, both masked "
    "with offs_m < n_q.",
]

FORWARD_SKELETON = '''\
@triton.jit
def flash_forward_kernel(Q, K, V, O, LSE, stride_qb, stride_qh, stride_qn, stride_qd, ...,
                         n_heads, n_q, n_k, scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr):
    num_tiles = tl.cdiv(n_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_bh = ...
    b, h = ...
    start_m = ...
    offs_m = start_m + tl.arange(0, BLOCK_M)                  # (BLOCK_M,) query rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(..., mask=offs_m[:, None] < n_q, other=0.0)  # (BLOCK_M, HEAD_DIM), once

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    kv_end = ...                                            # n_k, or less when CAUSAL
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(..., mask=..., other=0.0)               # (BLOCK_N, HEAD_DIM)
        v = tl.load(..., mask=..., other=0.0)
        s = tl.dot(q, tl.trans(k)) * (scale * LOG2_E)       # (BLOCK_M, BLOCK_N), log2 units
        s = tl.where(..., s, float("-inf"))                 # ragged keys
        if CAUSAL:
            s = tl.where(..., s, float("-inf"))             # keys after the query
        m_new = ...
        p = ...
        alpha = ...
        l_i = ...
        acc = ...
        m_i = m_new

    o = ...
    lse = ...                                               # natural log
    tl.store(..., o.to(O.dtype.element_ty), mask=...)
    tl.store(..., lse, mask=...)


def flash_forward(q, k, v, causal=False, scale=None, block_m=32, block_n=32):
    batch, heads, n_q, d = q.shape
    scale = ...
    o = torch.empty_like(q)
    lse = torch.empty(..., dtype=torch.float32, device=q.device)
    grid = (...,)
    flash_forward_kernel[grid](q, k, v, o, lse, *q.stride(), ..., heads, n_q, k.shape[2], scale,
                               HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal)
    return o, lse
'''
