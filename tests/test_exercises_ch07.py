"""Exercise checks of chapter 07: correct answers pass, stubs fall back, and realistic wrong
answers are rejected with their likely cause named (issue 9's corpus for the backward pass).

The wrong answers here are written independently of ch07's mistake models (a learner's NumPy
backward, learner kernels in the transposed exp2 layout, learner autograd Functions), so a
named cause means the check recognised the mistake, not its own code."""

from __future__ import annotations

import numpy as np
import pytest

from course_lib import runtime

runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from course_lib import tiled_backward as tb  # noqa: E402
from course_lib.checks import ExerciseFailed  # noqa: E402
from course_lib.exercises import ch07  # noqa: E402
from course_lib.kernels.api import FlashAttentionFunction  # noqa: E402
from course_lib.kernels.forward import attention_forward  # noqa: E402
from course_lib.kernels.tiles import LOG2_E  # noqa: E402

pytestmark = pytest.mark.ch07


def stub(*args, **kwargs):
    raise NotImplementedError("Exercise 7.x")


def assert_rejected(check, fn, cause: str | None):
    """The check raises ExerciseFailed; when ``cause`` is given, the message names it."""
    with pytest.raises(ExerciseFailed) as info:
        check(fn)
    message = str(info.value)
    if cause is not None:
        assert "likely cause" in message and cause in message, message
    return message


# ---- Exercise 7.1: compute_d(o, do) -> (..., N_q) --------------------------------------------

def d_einsum(o, do):
    return np.einsum("...nd,...nd->...n", o, do)


def d_loop(o, do):
    out = np.zeros(o.shape[:-1], dtype=o.dtype)
    for c in range(o.shape[-1]):
        out += o[..., c] * do[..., c]
    return out


def d_forgot_o(o, do):
    return do.sum(axis=-1)


def d_mean(o, do):
    return (o * do).mean(axis=-1)


def d_negated(o, do):
    return -(o * do).sum(-1)


def d_o_squared(o, do):
    return np.sum(o * o, -1)


def d_keepdims(o, do):
    return np.sum(o * do, axis=-1, keepdims=True)


def d_matmul(o, do):
    return do @ np.swapaxes(o, -1, -2)  # (N, N): the dot product of every pair of rows


def d_wrong_axis(o, do):
    return np.sum(o * do, axis=-2)


@pytest.mark.parametrize("fn", [tb.compute_d, d_einsum, d_loop])
def test_compute_d_correct_answers_pass(fn, capsys):
    assert ch07.check_compute_d(fn) is fn
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn,cause", [
    (d_forgot_o, "D is missing O"),
    (d_mean, "averaged instead of summed"),
    (d_negated, "the sign is flipped"),
    (d_o_squared, "multiplied O by itself"),
    (d_keepdims, None),  # shape (..., N_q, 1): the message reports the shape instead
    (d_matmul, None),
    (d_wrong_axis, None),
])
def test_compute_d_mistakes_are_rejected(fn, cause):
    message = assert_rejected(ch07.check_compute_d, fn, cause)
    if cause is None:
        assert "shape" in message


# ---- Exercise 7.2: ds_tile(p, dp, d) -> (BLOCK_M, BLOCK_N) -----------------------------------

def ds_expanded(p, dp, d):
    return p * dp - p * d.reshape(-1, 1)


def ds_sign(p, dp, d):
    return p * (d[:, None] - dp)


def ds_no_d(p, dp, d):
    return p * dp


def ds_tile_local_d(p, dp, d):
    d_here = (p * dp).sum(axis=1)  # "D = rowsum(P ∘ dP)" — but only over this tile's columns
    return p * (dp - d_here[:, None])


def ds_row_broadcast(p, dp, d):
    return p * (dp - d)  # d broadcasts along the last axis: silently wrong on square tiles


def ds_no_p(p, dp, d):
    return dp - d[:, None]


def ds_matmul(p, dp, d):
    return p @ (dp - d[:, None])


@pytest.mark.parametrize("fn", [tb.ds_tile, ds_expanded])
def test_ds_tile_correct_answers_pass(fn):
    assert ch07.check_ds_tile(fn) is fn


@pytest.mark.parametrize("fn,cause", [
    (ds_sign, "the sign is wrong"),
    (ds_no_d, "the D term is missing"),
    (ds_tile_local_d, "D was recomputed from this tile's P ∘ dP"),
    (ds_row_broadcast, "D is broadcast along the wrong axis"),
    (ds_no_p, "the product with P is missing"),
    (ds_matmul, "used a matrix product"),
])
def test_ds_tile_mistakes_are_rejected(fn, cause):
    assert_rejected(ch07.check_ds_tile, fn, cause)


# ---- Exercise 7.3: dk_dv_step(...) -> (dk_j, dv_j) -------------------------------------------

def step_in_place(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    """Correct, written the way a kernel would: scores, mask, accumulate in place."""
    s = q_i @ k_j.T * scale
    p = np.exp(s - lse_i[:, None])
    if mask is not None:
        p[~mask] = 0.0
    dv_j += p.T @ do_i
    ds = p * (do_i @ v_j.T - d_i[:, None])
    dk_j += scale * ds.T @ q_i
    return dk_j, dv_j


def step_transposed(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    """Correct, in the Triton kernel's layout: keys along the rows (Pᵀ, dPᵀ, dSᵀ)."""
    p_t = np.exp(scale * (k_j @ q_i.T) - lse_i[None, :])  # (BLOCK_N, BLOCK_M)
    if mask is not None:
        p_t = np.where(mask.T, p_t, 0.0)
    dp_t = v_j @ do_i.T
    ds_t = p_t * (dp_t - d_i[None, :])
    return dk_j + scale * ds_t @ q_i, dv_j + p_t @ do_i


def _p(q_i, k_j, lse_i, scale, mask):
    p = np.exp(scale * q_i @ k_j.T - lse_i[:, None])
    return p if mask is None else np.where(mask, p, 0.0)


def step_dv_uses_p(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    p = _p(q_i, k_j, lse_i, scale, mask)
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return dk_j + scale * ds.T @ q_i, dv_j + p @ do_i


def step_dk_no_scale(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    p = _p(q_i, k_j, lse_i, scale, mask)
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return dk_j + ds.T @ q_i, dv_j + p.T @ do_i


def step_ds_sign(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    p = _p(q_i, k_j, lse_i, scale, mask)
    ds = p * (d_i[:, None] - do_i @ v_j.T)
    return dk_j + scale * ds.T @ q_i, dv_j + p.T @ do_i


def step_no_d(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    p = _p(q_i, k_j, lse_i, scale, mask)
    ds = p * (do_i @ v_j.T)
    return dk_j + scale * ds.T @ q_i, dv_j + p.T @ do_i


def step_d_from_p(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    p = _p(q_i, k_j, lse_i, scale, mask)
    dp = do_i @ v_j.T
    ds = p * (dp - (p * dp).sum(1, keepdims=True))
    return dk_j + scale * ds.T @ q_i, dv_j + p.T @ do_i


def step_tile_softmax(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    s = scale * q_i @ k_j.T
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    e = np.exp(s - s.max(1, keepdims=True))
    p = e / e.sum(1, keepdims=True)
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return dk_j + scale * ds.T @ q_i, dv_j + p.T @ do_i


def step_forgot_mask(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    return tb.dk_dv_step(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, None)


def step_overwrites(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    p = _p(q_i, k_j, lse_i, scale, mask)
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return scale * ds.T @ q_i, p.T @ do_i


def step_dk_uses_ds(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    p = _p(q_i, k_j, lse_i, scale, mask)
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return dk_j + scale * ds @ q_i, dv_j + p.T @ do_i


def step_swapped_outputs(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    dk, dv = tb.dk_dv_step(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask)
    return dv, dk


@pytest.mark.parametrize("fn", [tb.dk_dv_step, step_in_place, step_transposed])
def test_dk_dv_step_correct_answers_pass(fn):
    assert ch07.check_dk_dv_step(fn) is fn


@pytest.mark.parametrize("fn,cause", [
    (step_dv_uses_p, "dV uses P instead of Pᵀ"),
    (step_dk_no_scale, "the scale is missing from dK"),
    (step_ds_sign, "the sign is wrong in dS"),
    (step_no_d, "the D term is missing"),
    (step_d_from_p, "D was recomputed from this tile's P ∘ dP"),
    (step_tile_softmax, "P was rebuilt with a softmax over this tile alone"),
    (step_forgot_mask, "the causal mask is not applied"),
    (step_overwrites, "the accumulators are overwritten"),
    (step_dk_uses_ds, "dK uses dS instead of dSᵀ"),
    (step_swapped_outputs, None),
])
def test_dk_dv_step_mistakes_are_rejected(fn, cause):
    assert_rejected(ch07.check_dk_dv_step, fn, cause)


def test_in_place_answer_does_not_change_the_cases():
    # step_in_place mutates its dk_j/dv_j: the check hands it copies, so it still passes and a
    # wrong answer checked after it is judged on unchanged inputs.
    ch07.check_dk_dv_step(step_in_place)
    assert_rejected(ch07.check_dk_dv_step, step_dk_no_scale, "the scale is missing from dK")


# ---- every check: not done yet, crashes, garbage ---------------------------------------------

CHECKS = [(ch07.check_compute_d, tb.compute_d), (ch07.check_ds_tile, tb.ds_tile),
          (ch07.check_dk_dv_step, tb.dk_dv_step)]


@pytest.mark.parametrize("check,library", CHECKS)
def test_stub_falls_back_to_the_library(check, library, capsys):
    assert check(stub) is library
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("check,library", CHECKS)
def test_crash_none_and_nan_get_one_line_diagnoses(check, library):
    def crashes(*args, **kwargs):
        return {}["missing"]

    def returns_none(*args, **kwargs):
        return None

    def returns_nan(*args, **kwargs):
        out = library(*args, **kwargs)
        return tuple(np.full_like(x, np.nan) for x in out) if isinstance(out, tuple) else out * np.nan

    assert "KeyError" in assert_rejected(check, crashes, None)
    assert "return" in assert_rejected(check, returns_none, None)
    assert "NaN" in assert_rejected(check, returns_nan, None)


def test_cases_are_irregular():
    # the checks exercise ragged, unequal tiles and d != d_v, not only square ones
    shapes = [c.args[0].shape for c in ch07.ds_cases()]
    assert any(m != n for m, n in shapes)
    steps = ch07.dk_dv_cases()
    assert any(c.args[0].shape[0] != c.args[4].shape[0] for c in steps)  # BLOCK_M != BLOCK_N
    assert any(c.args[9] is not None for c in steps) and any(c.args[9] is None for c in steps)
    assert any(c.args[0].dtype == np.float32 for c in steps)


def test_dk_dv_step_may_accumulate_in_place_but_not_touch_q():
    def in_place(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
        p = tb.recompute_p(q_i, k_j, lse_i, scale, mask)
        dv_j += p.T @ do_i  # accumulating into the running gradients is allowed
        dk_j += scale * (tb.ds_tile(p, do_i @ v_j.T, d_i).T @ q_i)
        return dk_j, dv_j

    assert ch07.check_dk_dv_step(in_place) is in_place

    def scales_q(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
        q_i *= scale  # changes the caller's q tile
        p = tb.recompute_p(q_i, k_j, lse_i, 1.0, mask)
        ds = tb.ds_tile(p, do_i @ v_j.T, d_i)
        return dk_j + ds.T @ q_i, dv_j + p.T @ do_i

    with pytest.raises(ExerciseFailed, match=r"changed its input `q_i` in place"):
        ch07.check_dk_dv_step(scales_q)


# ---- Exercise 7.4: the whole tiled backward in NumPy -----------------------------------------

def learner_backward(q, k, v, o, lse, do, causal, scale, block_m, block_n, bug=None):
    """How a learner might write Exercise 7.4 (mask applied to P after the exp, D by einsum),
    with one mistake switched on by ``bug``."""
    n_q, n_k = len(q), len(k)
    big_d = np.einsum("nd,nd->n", o, do)
    dq = np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    n_tiles_k = n_k // block_n if bug == "drop_tail" else -(-n_k // block_n)
    for j in range(n_tiles_k):
        cols = np.arange(j * block_n, min((j + 1) * block_n, n_k))
        for i in range(-(-n_q // block_m)):
            rows = np.arange(i * block_m, min((i + 1) * block_m, n_q))
            if causal and rows[-1] < cols[0]:
                continue
            s = scale * q[rows] @ k[cols].T
            if bug == "tile_softmax":
                if causal:
                    s = np.where(cols[None, :] <= rows[:, None], s, -np.inf)
                with np.errstate(invalid="ignore"):
                    p = np.exp(s - s.max(1, keepdims=True))
                    p = np.nan_to_num(p / p.sum(1, keepdims=True))
            else:
                p = np.exp(s - lse[rows][:, None])
                if causal and bug != "no_mask":
                    p[cols[None, :] > rows[:, None]] = 0.0
            dp = do[rows] @ v[cols].T
            d_rows = (p * dp).sum(1) if bug == "d_from_tile" else big_d[rows]
            ds = p * (dp - d_rows[:, None])
            dv[cols] += (p @ do[rows]) if bug == "dv_p" else (p.T @ do[rows])
            dk[cols] += (ds.T @ q[rows]) * (1.0 if bug == "dk_no_scale" else scale)
            contribution = (ds @ k[cols]) * (1.0 if bug == "dq_no_scale" else scale)
            if bug == "dq_overwrite":
                dq[rows] = contribution
            else:
                dq[rows] += contribution
    return dq, dk, dv


def backward_with(bug):
    def wrong(q, k, v, o, lse, do, causal, scale, block_m, block_n):
        return learner_backward(q, k, v, o, lse, do, causal, scale, block_m, block_n, bug)
    return wrong


def backward_two_pass(q, k, v, o, lse, do, causal, scale, block_m, block_n):
    """Correct, the library's way: three passes through tb.tiled_backward."""
    return tb.tiled_backward(q, k, v, o, lse, do, causal, scale, block_m, block_n)


@pytest.mark.parametrize("fn", [backward_with(None), backward_two_pass,
                                lambda *a: ch07._backward_variant(*a)])
def test_flash_backward_correct_answers_pass(fn, capsys):
    assert ch07.check_flash_backward(fn) is fn
    assert "✓ Exercise 7.4: passed" in capsys.readouterr().out


@pytest.mark.parametrize("bug,cause", [
    ("dk_no_scale", "the scale is missing from dK"),
    ("dq_no_scale", "the scale is missing from dQ"),
    ("d_from_tile", "D was computed from this tile's P ∘ dP"),
    ("tile_softmax", "P was rebuilt with a softmax over this tile alone"),
    ("dv_p", "dV uses P instead of Pᵀ"),
    ("no_mask", "the causal mask is not applied"),
    ("dq_overwrite", "dQ is overwritten, not accumulated"),
    ("drop_tail", "the last, shorter K/V tile is dropped"),
])
def test_flash_backward_mistakes_are_rejected(bug, cause):
    assert_rejected(ch07.check_flash_backward, backward_with(bug), cause)


def test_flash_backward_diagnosis_names_case_gradient_row_and_tile():
    message = assert_rejected(ch07.check_flash_backward, backward_with("drop_tail"),
                              "the last, shorter K/V tile is dropped")
    assert "case 3 of 5" in message and "N_q=45, N_k=38" in message  # the first ragged case
    # every gradient is wrong from query row 36 on (the dropped keys 36, 37 are visible there)
    assert "dq is wrong" in message and "also wrong: dk, dv" in message
    assert "first bad row 36" in message and "Q tile 2 (rows 32..44, block_m=16)" in message
    assert "Traceback" not in message


def test_flash_backward_stub_and_crash(capsys):
    assert ch07.check_flash_backward(stub) is tb.flash_attention_numpy_backward
    assert "not done yet" in capsys.readouterr().out

    def shape_bug(q, k, v, o, lse, do, causal, scale, block_m, block_n):
        dq, dk, dv = learner_backward(q, k, v, o, lse, do, causal, scale, block_m, block_n)
        return dq, dk  # forgot dv

    assert "expected a tuple of 3 values" in assert_rejected(ch07.check_flash_backward, shape_bug, None)


# ---- Exercise 7.5: the backward kernels ------------------------------------------------------
# A learner's kernels written independently of ch07's answer key: dK/dV in the transposed
# layout (keys along the rows, as the library does), exp2 with the scale folded in. ``BUG``
# switches on one mistake; WithBug binds it at launch, so the check sees an ordinary kernel.


@triton.jit
def learner_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
                 stride_qb, stride_qh, stride_qn, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_don, stride_dod,
                 stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                 n_heads, n_q, n_k, scale,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr = ""):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    keys = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    key_ok = keys < n_k
    k = tl.load(K + b * stride_kb + h * stride_kh + keys[:, None] * stride_kn + d[None, :] * stride_kd,
                mask=key_ok[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + keys[:, None] * stride_vn + d[None, :] * stride_vd,
                mask=key_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    start = 0
    if CAUSAL:
        start = (pid * BLOCK_N // BLOCK_M) * BLOCK_M
    for m0 in range(start, n_q, BLOCK_M):
        qs = m0 + tl.arange(0, BLOCK_M)
        q_ok = qs < n_q
        if BUG == "unmasked_load":
            q = tl.load(Q + b * stride_qb + h * stride_qh + qs[:, None] * stride_qn + d[None, :] * stride_qd)
        else:
            q = tl.load(Q + b * stride_qb + h * stride_qh + qs[:, None] * stride_qn + d[None, :] * stride_qd,
                        mask=q_ok[:, None], other=0.0)
        do = tl.load(DO + b * stride_dob + h * stride_doh + qs[:, None] * stride_don + d[None, :] * stride_dod,
                     mask=q_ok[:, None], other=0.0)
        lse = tl.load(LSE + bh * n_q + qs, mask=q_ok, other=0.0)
        delta = tl.load(DELTA + bh * n_q + qs, mask=q_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q)) * (scale * LOG2_E)  # (BLOCK_N, BLOCK_M), log2 units
        if BUG == "exp2_lse_natural":
            p_t = tl.math.exp2(s_t - lse[None, :])
        else:
            p_t = tl.math.exp2(s_t - lse[None, :] * LOG2_E)
        ok = q_ok[None, :] & key_ok[:, None]
        if CAUSAL:
            if BUG != "no_causal_mask":
                ok = ok & (keys[:, None] <= qs[None, :])
        p_t = tl.where(ok, p_t, 0.0)
        if BUG == "dv_p":
            dv += tl.dot(tl.trans(p_t).to(do.dtype), do)
        else:
            dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        if BUG == "d_from_tile":
            delta = tl.sum(p_t * dp_t, axis=0)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    if BUG != "dk_no_scale":
        dk *= scale
    ptrs = b * stride_dkb + h * stride_dkh + keys[:, None] * stride_dkn + d[None, :] * stride_dkd
    if BUG == "unmasked_store":
        tl.store(DK + ptrs, dk.to(DK.dtype.element_ty))
    else:
        tl.store(DK + ptrs, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def learner_dq(Q, K, V, DO, LSE, DELTA, DQ,
               stride_qb, stride_qh, stride_qn, stride_qd,
               stride_kb, stride_kh, stride_kn, stride_kd,
               stride_vb, stride_vh, stride_vn, stride_vd,
               stride_dob, stride_doh, stride_don, stride_dod,
               stride_dqb, stride_dqh, stride_dqn, stride_dqd,
               n_heads, n_q, n_k, scale,
               HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr = ""):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    qs = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q_ok = qs < n_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + qs[:, None] * stride_qn + d[None, :] * stride_qd,
                mask=q_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + qs[:, None] * stride_don + d[None, :] * stride_dod,
                 mask=q_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh * n_q + qs, mask=q_ok, other=0.0)
    delta = tl.load(DELTA + bh * n_q + qs, mask=q_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    end = n_k
    if CAUSAL:
        end = tl.minimum(n_k, pid * BLOCK_M + BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < n_k
        k = tl.load(K + b * stride_kb + h * stride_kh + keys[:, None] * stride_kn + d[None, :] * stride_kd,
                    mask=key_ok[:, None], other=0.0)
        v = tl.load(V + b * stride_vb + h * stride_vh + keys[:, None] * stride_vn + d[None, :] * stride_vd,
                    mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * (scale * LOG2_E)
        if BUG == "exp2_lse_natural":
            p = tl.math.exp2(s - lse[:, None])
        else:
            p = tl.math.exp2(s - lse[:, None] * LOG2_E)
        ok = q_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            if BUG != "no_causal_mask":
                ok = ok & (keys[None, :] <= qs[:, None])
        p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        if BUG == "d_from_tile":
            delta = tl.sum(p * dp, axis=1)
        ds = p * (dp - delta[:, None])
        if BUG == "dq_overwrite":
            dq = tl.dot(ds.to(k.dtype), k).to(tl.float32)
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    if BUG != "dq_no_scale":
        dq *= scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + qs[:, None] * stride_dqn + d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=q_ok[:, None])


class WithBug:
    """``kernel[grid](...)`` with ``BUG=bug`` added: a learner's kernel with one mistake."""

    def __init__(self, kernel, bug):
        self.kernel, self.bug = kernel, bug

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, BUG=self.bug, **kwargs)


def learner_kernels(bug=""):
    return WithBug(learner_dkdv, bug), WithBug(learner_dq, bug)


@triton.jit
def stub_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
              stride_qb, stride_qh, stride_qn, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_dob, stride_doh, stride_don, stride_dod,
              stride_dkb, stride_dkh, stride_dkn, stride_dkd,
              n_heads, n_q, n_k, scale,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    raise NotImplementedError("Exercise 7.5")


@triton.jit
def stub_dq(Q, K, V, DO, LSE, DELTA, DQ,
            stride_qb, stride_qh, stride_qn, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_dob, stride_doh, stride_don, stride_dod,
            stride_dqb, stride_dqh, stride_dqn, stride_dqd,
            n_heads, n_q, n_k, scale,
            HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    raise NotImplementedError("Exercise 7.5")


def test_backward_kernels_correct_answers_pass(capsys):
    assert ch07.check_backward_kernels(ch07.dkdv_kernel, ch07.dq_kernel) == (ch07.dkdv_kernel, ch07.dq_kernel)
    pair = learner_kernels()
    assert ch07.check_backward_kernels(*pair) == pair
    assert capsys.readouterr().out.count("✓ Exercise 7.5: passed (6 cases)") == 2


def test_backward_kernel_stubs_fall_back(capsys):
    assert ch07.check_backward_kernels(stub_dkdv, stub_dq) == (ch07.dkdv_kernel, ch07.dq_kernel)
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("bug,cause", [
    ("dk_no_scale", "the scale is missing from dK"),
    ("dq_no_scale", "the scale is missing from dQ"),
    ("d_from_tile", "DELTA was recomputed from this tile's P ∘ dP"),
    ("no_causal_mask", "the causal mask is missing in the backward"),
    ("dv_p", "dV uses P instead of Pᵀ"),
    ("dq_overwrite", "dq is overwritten in the K/V loop"),
    ("exp2_lse_natural", "exp2 with the scores in log2 units but lse in natural-log units"),
])
def test_backward_kernel_mistakes_are_rejected(bug, cause):
    assert_rejected(lambda pair: ch07.check_backward_kernels(*pair), learner_kernels(bug), cause)


@pytest.mark.parametrize("bug,expected", [
    ("unmasked_load", "depends on memory outside the inputs"),
    ("unmasked_store", "wrote"),
])
def test_backward_kernel_ragged_tails_are_caught_by_the_guards(bug, expected):
    message = assert_rejected(lambda pair: ch07.check_backward_kernels(*pair), learner_kernels(bug), None)
    assert expected in message and "ragged" in message and "Traceback" not in message


def test_backward_kernel_diagnosis_is_one_short_message():
    message = assert_rejected(lambda pair: ch07.check_backward_kernels(*pair),
                              learner_kernels("no_causal_mask"), "the causal mask is missing")
    assert "case 2 of 6" in message and "causal" in message and "N_q=45" in message
    assert "dq is wrong" in message and "first bad row 0 (batch 0, head 0)" in message
    assert "Q tile 0 (rows 0..15, block_m=16)" in message and "max abs error" in message
    assert len(message.splitlines()) <= 6


# ---- Exercise 7.6: the autograd Function -----------------------------------------------------

class GoodFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ch07.launch_backward(*learner_kernels(), q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


class SwappedGradients(GoodFunction):
    @staticmethod
    def backward(ctx, do):
        dq, dk, dv, _, _ = GoodFunction.backward(ctx, do)
        return dk, dq, dv, None, None


class NoNones(GoodFunction):
    @staticmethod
    def backward(ctx, do):
        return GoodFunction.backward(ctx, do)[:3]


class NoSave(GoodFunction):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.causal, ctx.scale = causal, scale
        return o


class ReturnsLse(GoodFunction):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o, lse


class SavesReshapedO(GoodFunction):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        b, h, n, d = o.shape
        o_bnhd = o.transpose(1, 2).contiguous()  # (B, N, H, d), e.g. to merge the heads
        ctx.save_for_backward(q, k, v, o_bnhd.view(b, h, n, d), lse)  # view, not transpose, back
        ctx.causal, ctx.scale = causal, scale
        return o


class ForgetsCausal(GoodFunction):
    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*ch07.launch_backward(*learner_kernels(), q, k, v, o, lse, do, False, ctx.scale),
                None, None)


class DefaultScale(GoodFunction):
    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*ch07.launch_backward(*learner_kernels(), q, k, v, o, lse, do, ctx.causal,
                                      q.shape[-1] ** -0.5), None, None)


class StubFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        raise NotImplementedError("Exercise 7.6")

    @staticmethod
    def backward(ctx, do):
        raise NotImplementedError("Exercise 7.6")


def test_autograd_function_correct_answer_passes_and_trains(capsys):
    assert ch07.check_autograd_function(GoodFunction) is GoodFunction
    out = capsys.readouterr().out
    assert "✓ Exercise 7.6: passed (5 gradient cases; the tiny LM trains like SDPA" in out


def test_autograd_function_stub_falls_back_to_the_library(capsys):
    assert ch07.check_autograd_function(StubFunction) is FlashAttentionFunction
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("fn_cls,cause", [
    (SwappedGradients, "backward returns the gradients in the wrong order"),
    (SavesReshapedO, "the o saved for backward is not laid out like the forward's"),
    (ForgetsCausal, "backward ignores causal"),
    (DefaultScale, "backward uses 1/√d instead of the forward's scale"),
])
def test_autograd_function_mistakes_are_rejected(fn_cls, cause):
    assert_rejected(ch07.check_autograd_function, fn_cls, cause)


@pytest.mark.parametrize("fn_cls,expected", [
    (NoSave, "no saved tensors found — save them with ctx.save_for_backward"),
    (NoNones, "return dq, dk, dv, None, None"),
    (ReturnsLse, "forward must return o alone"),
])
def test_autograd_function_glue_errors_are_named(fn_cls, expected):
    message = assert_rejected(ch07.check_autograd_function, fn_cls, None)
    assert expected in message and "case 1 of 5" in message and "Traceback" not in message
