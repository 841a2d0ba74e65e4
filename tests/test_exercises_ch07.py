"""Exercise checks of chapter 07: correct answers pass, stubs fall back, and realistic wrong
answers are rejected with their likely cause named (issue 9's corpus for the backward pass)."""

from __future__ import annotations

import numpy as np
import pytest

from course_lib import tiled_backward as tb
from course_lib.checks import ExerciseFailed
from course_lib.exercises import ch07

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
