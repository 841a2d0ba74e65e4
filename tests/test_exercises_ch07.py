"""Exercise checks of chapter 07, NumPy exercises 7.1–7.4: correct answers in several styles
pass, stubs fall back, and realistic wrong answers are rejected with the right cause named or
no cause at all — never a wrong one (issue 19's corpus; 7.5 and 7.6 are in
test_exercises_ch07_kernels.py).

The wrong answers here are written independently of ch07's mistake models (loops, other NumPy
idioms, masks applied after the exp, ...), so a named cause means the check recognised the
mistake, not its own code."""

from __future__ import annotations

import numpy as np
import pytest

from corpus_checks import assert_rejected  # noqa: E402
from course_lib.platform import runtime

runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

import time  # noqa: E402

from course_lib.attention import tiled_backward as tb  # noqa: E402
from course_lib.teaching.checks import ExerciseFailed  # noqa: E402
from course_lib.teaching.exercises import ch07  # noqa: E402

pytestmark = pytest.mark.ch07


def stub(*args, **kwargs):
    raise NotImplementedError("Exercise 7.x")


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


def d_do_squared(o, do):
    return (do ** 2).sum(axis=-1)


def d_sum_times_sum(o, do):
    return o.sum(-1) * do.sum(-1)


def d_in_place(o, do):
    do *= o  # reuses the caller's array
    return do.sum(axis=-1)


def d_float32(o, do):
    return np.sum(o * do, axis=-1).astype(np.float32)


def d_scalar(o, do):
    return float(np.vdot(o, do))


def d_vdot_rows(o, do):
    """Correct: one np.dot per row, over any leading dims."""
    out = np.empty(o.shape[:-1], dtype=np.result_type(o, do))
    for idx in np.ndindex(*o.shape[:-1]):
        out[idx] = np.dot(o[idx], do[idx])
    return out


def d_matmul_diag(o, do):
    """Correct: the diagonal of dO Oᵀ per head (wasteful, but right)."""
    return np.diagonal(do @ np.swapaxes(o, -1, -2), axis1=-2, axis2=-1).copy()


@pytest.mark.parametrize("fn", [tb.compute_d, d_einsum, d_loop, d_vdot_rows, d_matmul_diag])
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
    (d_do_squared, "multiplied dO by itself"),
    (d_sum_times_sum, "D is the product of two row sums"),
    (d_in_place, None),  # "changed its input `do` in place"
    (d_float32, None),  # dtype float32 where float64 is expected
    (d_scalar, None),
])
def test_compute_d_mistakes_are_rejected(fn, cause):
    message = assert_rejected(ch07.check_compute_d, fn, cause)
    if cause is None:
        assert any(word in message for word in ("shape", "in place", "dtype", "expected an array")), message


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


def ds_in_place(p, dp, d):
    dp -= d[:, None]  # edits the caller's dp
    return p * dp


def ds_einsum(p, dp, d):
    """Correct: the broadcast written as an outer product with a row of ones."""
    return p * (dp - np.outer(d, np.ones(dp.shape[1], dtype=dp.dtype)))


def ds_loop(p, dp, d):
    """Correct: row by row."""
    out = np.empty_like(p)
    for r in range(p.shape[0]):
        out[r] = p[r] * (dp[r] - d[r])
    return out


def ds_mean_d(p, dp, d):
    return p * (dp - d.mean())


@pytest.mark.parametrize("fn", [tb.ds_tile, ds_expanded, ds_einsum, ds_loop])
def test_ds_tile_correct_answers_pass(fn):
    assert ch07.check_ds_tile(fn) is fn


@pytest.mark.parametrize("fn,cause", [
    (ds_sign, "the sign is wrong"),
    (ds_no_d, "the D term is missing"),
    (ds_tile_local_d, "D was recomputed from this tile's P ∘ dP"),
    (ds_row_broadcast, "D is broadcast along the wrong axis"),
    (ds_no_p, "the product with P is missing"),
    (ds_matmul, "used a matrix product"),
    (ds_in_place, None),  # changed its input `dp` in place
    (ds_mean_d, None),
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


def step_mask_inverted(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    s = scale * q_i @ k_j.T
    if mask is not None:
        s = np.where(mask, -np.inf, s)  # the visible entries hidden
    p = np.exp(s - lse_i[:, None])
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return dk_j + scale * ds.T @ q_i, dv_j + p.T @ do_i


def step_overwrites(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    p = _p(q_i, k_j, lse_i, scale, mask)
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return scale * ds.T @ q_i, p.T @ do_i


def step_dk_uses_ds(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    p = _p(q_i, k_j, lse_i, scale, mask)
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return dk_j + scale * ds @ q_i, dv_j + p.T @ do_i


def step_unscaled_scores(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    p = np.exp(q_i @ k_j.T - lse_i[:, None])  # forgot the scale inside the exp
    if mask is not None:
        p = p * mask
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return dk_j + scale * ds.T @ q_i, dv_j + p.T @ do_i


def step_softmax_nan_to_num(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    s = scale * q_i @ k_j.T
    if mask is not None:
        s[~mask] = -np.inf
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=1)[:, None])
        p = np.nan_to_num(e / e.sum(axis=1)[:, None])
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return dk_j + scale * ds.T @ q_i, dv_j + p.T @ do_i


def step_exp_of_difference(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    """Correct: exp(s) / exp(lse) is the same number — until the scores are in the hundreds."""
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp(scale * q_i @ k_j.T) / np.exp(lse_i)[:, None]
    if mask is not None:
        p = np.where(mask, p, 0.0)
    ds = p * (do_i @ v_j.T - d_i[:, None])
    return dk_j + scale * ds.T @ q_i, dv_j + p.T @ do_i


def step_loops(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    """Correct: one (query, key) pair at a time."""
    dk, dv = dk_j.copy(), dv_j.copy()
    for r in range(q_i.shape[0]):
        for c in range(k_j.shape[0]):
            if mask is not None and not mask[r, c]:
                continue
            p = np.exp(scale * q_i[r] @ k_j[c] - lse_i[r])
            dv[c] += p * do_i[r]
            ds = p * (do_i[r] @ v_j[c] - d_i[r])
            dk[c] += scale * ds * q_i[r]
    return dk, dv


def step_swapped_outputs(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
    dk, dv = tb.dk_dv_step(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask)
    return dv, dk


@pytest.mark.parametrize("fn", [tb.dk_dv_step, step_in_place, step_transposed, step_loops,
                                step_exp_of_difference])
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
    (step_mask_inverted, "the mask is applied the other way round"),
    (step_overwrites, "the accumulators are overwritten"),
    (step_dk_uses_ds, "dK uses dS instead of dSᵀ"),
    (step_swapped_outputs, None),
    (step_unscaled_scores, "the scores are not scaled when P is rebuilt"),
    (step_softmax_nan_to_num, "rows that see none of the tile's keys set to 0"),
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
            if bug == "skip_by_index":
                if causal and j > i:
                    continue
            elif bug == "skip_straddling":
                if causal and rows[0] < cols[0]:
                    continue
            elif causal and rows[-1] < cols[0]:
                continue
            s = (1.0 if bug == "unscaled" else scale) * q[rows] @ k[cols].T
            if bug in ("tile_softmax", "tile_softmax_nan"):
                if causal:
                    s = np.where(cols[None, :] <= rows[:, None], s, -np.inf)
                with np.errstate(invalid="ignore"):
                    p = np.exp(s - s.max(1, keepdims=True))
                    p = p / p.sum(1, keepdims=True)
                    if bug == "tile_softmax":
                        p = np.nan_to_num(p)
            else:
                with np.errstate(over="ignore"):
                    p = np.exp(s) if bug == "no_lse" else np.exp(s - lse[rows][:, None])
                if causal and bug == "tril":
                    p = p * np.tril(np.ones_like(p))
                elif causal and bug != "no_mask":
                    p[cols[None, :] > rows[:, None]] = 0.0
            dp = do[rows] @ v[cols].T
            if bug == "dv_from_o":
                dv[cols] += p.T @ o[rows] - p.T @ do[rows]  # dO and O mixed up
            d_rows = (p * dp).sum(1) if bug == "d_from_tile" else big_d[rows]
            ds = p * (d_rows[:, None] - dp) if bug == "ds_sign" else p * (dp - d_rows[:, None])
            if bug == "dkdv_assign":
                dv[cols] = p.T @ do[rows]
                dk[cols] = (ds.T @ q[rows]) * scale
            else:
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


def backward_q_outer(q, k, v, o, lse, do, causal, scale, block_m, block_n):
    """Correct, FlashAttention-1's order: Q tiles outside, dk and dv added into full arrays,
    exp2 with log2-unit scores, the mask built with np.triu."""
    log2e = 1.0 / np.log(2.0)
    n_q, n_k = q.shape[0], k.shape[0]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    delta = (o * do).sum(axis=1)
    for q0 in range(0, n_q, block_m):
        q1 = min(q0 + block_m, n_q)
        for k0 in range(0, n_k, block_n):
            k1 = min(k0 + block_n, n_k)
            if causal and k0 > q1 - 1:
                break  # every later tile is further right
            s2 = (q[q0:q1] @ k[k0:k1].T) * (scale * log2e)
            if causal:
                hidden = np.triu(np.ones((q1 - q0, k1 - k0), dtype=bool), k=q0 - k0 + 1)
                s2[hidden] = -np.inf
            p = np.exp2(s2 - lse[q0:q1, None] * log2e)
            dv[k0:k1] += p.T @ do[q0:q1]
            ds = p * (do[q0:q1] @ v[k0:k1].T - delta[q0:q1, None])
            dq[q0:q1] += scale * ds @ k[k0:k1]
            dk[k0:k1] += scale * ds.T @ q[q0:q1]
    return dq, dk, dv


def backward_untiled_rows(q, k, v, o, lse, do, causal, scale, block_m, block_n):
    """Right numbers, but ignores the tiles: whole rows of P at once, the hidden tiles too."""
    s = scale * q @ k.T
    if causal:
        s = np.where(np.arange(k.shape[0])[None, :] <= np.arange(q.shape[0])[:, None], s, -np.inf)
    p = np.exp(s - lse[:, None])
    ds = p * (do @ v.T - np.einsum("ij,ij->i", o, do)[:, None])
    return (scale * ds @ k).astype(q.dtype), (scale * ds.T @ q).astype(k.dtype), (p.T @ do).astype(v.dtype)


@pytest.mark.parametrize("fn", [backward_with(None), backward_two_pass, backward_q_outer,
                                lambda *a: ch07._backward_variant(*a)])
def test_flash_backward_correct_answers_pass(fn, capsys):
    assert ch07.check_flash_backward(fn) is fn
    assert "✓ Exercise 7.4: passed" in capsys.readouterr().out


def learner_backward_no_skip(q, k, v, o, lse, do, causal, scale, block_m, block_n):
    """Tiled, masked, but never skips a tile: the hidden tiles are computed and masked to 0."""
    n_q, n_k = len(q), len(k)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    big_d = np.sum(o * do, axis=1)
    for k0 in range(0, n_k, block_n):
        k1 = min(k0 + block_n, n_k)
        for q0 in range(0, n_q, block_m):
            q1 = min(q0 + block_m, n_q)
            s = scale * q[q0:q1] @ k[k0:k1].T
            if causal:
                s = np.where(np.arange(k0, k1)[None, :] <= np.arange(q0, q1)[:, None], s, -np.inf)
            p = np.exp(s - lse[q0:q1, None])
            ds = p * (do[q0:q1] @ v[k0:k1].T - big_d[q0:q1, None])
            dv[k0:k1] += p.T @ do[q0:q1]
            dk[k0:k1] += scale * ds.T @ q[q0:q1]
            dq[q0:q1] += scale * ds @ k[k0:k1]
    return dq, dk, dv


@pytest.mark.parametrize("fn, line", [(backward_untiled_rows, "s = scale * q @ k.T"),
                                      (learner_backward_no_skip, "s = scale * q[q0:q1] @ k[k0:k1].T")])
def test_flash_backward_that_computes_hidden_tiles_is_rejected(fn, line):
    """Issue 32: 7.4 counts the (Q tile, K/V tile) pairs an answer computes, as 4.4 counts loads:
    right numbers from a backward that computes the tiles the causal mask hides is wasted work."""
    message = assert_rejected(ch07.check_flash_backward, fn, None)
    assert "right numbers, but hidden tiles computed on case 2 of 6" in message, message
    assert line in message and "Q tile 0 × K/V tile 1" in message, message
    assert "q_end − 1 < k_start" in message


@pytest.mark.parametrize("bug,cause", [
    ("dk_no_scale", "the scale is missing from dK"),
    ("dq_no_scale", "the scale is missing from dQ"),
    ("d_from_tile", "D was computed from this tile's P ∘ dP"),
    ("tile_softmax", "rows that see none of the tile's keys set to 0"),
    ("dv_p", "dV uses P instead of Pᵀ"),
    ("no_mask", "the causal mask is not applied"),
    ("dq_overwrite", "dQ is overwritten, not accumulated"),
    ("drop_tail", "the last, shorter K/V tile is dropped"),
    ("tile_softmax_nan", "P was rebuilt with a softmax over this tile alone: the tile"),
    ("skip_by_index", "tiles are skipped by comparing tile numbers"),
    ("unscaled", "the scores are not scaled when P is rebuilt"),
    ("no_lse", "P = exp(S) without subtracting the saved lse"),
    ("tril", "the causal mask is the tile's own lower triangle"),
    ("ds_sign", "the sign of dS is flipped"),
    ("dkdv_assign", "dk_j, dv_j are overwritten in the Q loop"),
    ("skip_straddling", "tiles that straddle the diagonal are skipped too"),
    ("dv_from_o", None),
])
def test_flash_backward_mistakes_are_rejected(bug, cause):
    assert_rejected(ch07.check_flash_backward, backward_with(bug), cause)


def test_flash_backward_diagnosis_names_case_gradient_row_and_tile():
    message = assert_rejected(ch07.check_flash_backward, backward_with("drop_tail"),
                              "the last, shorter K/V tile is dropped")
    assert "case 3 of 6" in message and "N_q=45, N_k=38" in message  # the first ragged case
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
