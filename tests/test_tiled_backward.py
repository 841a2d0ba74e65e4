"""The NumPy tiled backward (course_lib.attention.tiled_backward) against torch.autograd in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import course_lib
from course_lib.attention import tiled_backward as tb
from course_lib.attention.reference import naive_attention_numpy, naive_attention_torch

pytestmark = pytest.mark.ch07

# float64 work agrees with autograd to rounding (~1e-15 here); float32 keeps ~7 digits, and the
# gradients below are O(1), so 1e-4 absolute is ~100x the float32 error and far below any bug.
F64_TOL = dict(atol=1e-10, rtol=1e-8)
F32_TOL = dict(atol=1e-4, rtol=1e-3)


def autograd_reference(q, k, v, do, causal, scale=None):
    """(dq, dk, dv) from torch.autograd through naive attention, all in float64."""
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    o, _ = naive_attention_torch(tq, tk, tv, causal, scale)
    o.backward(torch.tensor(do, dtype=torch.float64))
    return tuple(t.grad.numpy() for t in (tq, tk, tv))


def make_inputs(rng, lead, n_q, n_k, d, d_v, dtype=np.float64):
    q = rng.standard_normal(lead + (n_q, d)).astype(dtype)
    k = rng.standard_normal(lead + (n_k, d)).astype(dtype)
    v = rng.standard_normal(lead + (n_k, d_v)).astype(dtype)
    do = rng.standard_normal(lead + (n_q, d_v)).astype(dtype)
    return q, k, v, do


def forward(q, k, v, causal, scale=None):
    o, lse = naive_attention_numpy(q, k, v, causal, scale)
    return o.astype(q.dtype), lse


shapes = st.fixed_dictionaries({
    "lead": st.sampled_from([(), (2,), (2, 3)]),
    "n_q": st.integers(1, 70),
    "n_k": st.integers(1, 70),
    "d": st.integers(1, 20),
    "d_v": st.integers(1, 12),
    "block_m": st.integers(1, 40),
    "block_n": st.integers(1, 40),
    "causal": st.booleans(),
    "seed": st.integers(0, 2**31 - 1),
})


def _check_tiled_against_autograd(c, dtype, tol):
    rng = np.random.default_rng(c["seed"])
    q, k, v, do = make_inputs(rng, c["lead"], c["n_q"], c["n_k"], c["d"], c["d_v"], dtype)
    o, lse = forward(q, k, v, c["causal"])
    got = course_lib.flash_attention_numpy_backward(q, k, v, o, lse.astype(dtype), do, c["causal"],
                                                    block_m=c["block_m"], block_n=c["block_n"])
    want = autograd_reference(q, k, v, do, c["causal"])
    for name, g, w, x in zip("qkv", got, want, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype, name
        np.testing.assert_allclose(g, w, **tol, err_msg=f"d{name}")


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_tiled_backward_matches_autograd_float64(c):
    _check_tiled_against_autograd(c, np.float64, F64_TOL)


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_tiled_backward_float32_close_to_float64_reference(c):
    _check_tiled_against_autograd(c, np.float32, F32_TOL)


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_full_matrix_formulas_match_autograd(c):
    rng = np.random.default_rng(c["seed"])
    q, k, v, do = make_inputs(rng, c["lead"], c["n_q"], c["n_k"], c["d"], c["d_v"])
    got = tb.attention_backward_numpy(q, k, v, do, c["causal"])
    want = autograd_reference(q, k, v, do, c["causal"])
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, **F64_TOL, err_msg=f"d{name}")


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_d_equals_rowsum_of_p_times_dp(c):
    # The identity that lets the backward compute D from O and dO alone, without P.
    rng = np.random.default_rng(c["seed"])
    q, k, v, do = make_inputs(rng, c["lead"], c["n_q"], c["n_k"], c["d"], c["d_v"])
    o, lse = forward(q, k, v, c["causal"])
    s = (q @ np.swapaxes(k, -1, -2)) / np.sqrt(c["d"])
    if c["causal"]:
        s = np.where(np.tri(c["n_q"], c["n_k"], dtype=bool), s, -np.inf)
    p = np.exp(s - lse[..., None])
    dp = do @ np.swapaxes(v, -1, -2)
    np.testing.assert_allclose(tb.compute_d(o, do), np.sum(p * dp, axis=-1), **F64_TOL)


def test_custom_scale_is_used():
    q, k, v, do = make_inputs(np.random.default_rng(1), (2,), 19, 23, 8, 5)
    o, lse = forward(q, k, v, True, scale=0.3)
    got = tb.flash_attention_numpy_backward(q, k, v, o, lse, do, True, 0.3, 4, 8)
    for g, w in zip(got, autograd_reference(q, k, v, do, True, scale=0.3)):
        np.testing.assert_allclose(g, w, **F64_TOL)
    default = tb.flash_attention_numpy_backward(q, k, v, o, lse, do, True, None, 4, 8)
    assert not np.allclose(default[0], got[0])  # the scale really changes the answer


def test_block_sizes_do_not_change_the_gradients():
    q, k, v, do = make_inputs(np.random.default_rng(2), (3,), 45, 31, 16, 16)
    o, lse = forward(q, k, v, True)
    one_tile = tb.flash_attention_numpy_backward(q, k, v, o, lse, do, True, block_m=64, block_n=64)
    for bm, bn in ((1, 1), (8, 16), (13, 7)):
        for a, b in zip(tb.flash_attention_numpy_backward(q, k, v, o, lse, do, True, None, bm, bn),
                        one_tile):
            np.testing.assert_allclose(a, b, **F64_TOL)


def test_non_contiguous_inputs():
    # (B, N, H, d) arrays viewed as (B, H, N, d), as attention heads usually are
    rng = np.random.default_rng(8)
    q, k, v, do = (np.swapaxes(x, 1, 2) for x in make_inputs(rng, (2, 17), 3, 3, 8, 6))
    assert not q.flags.c_contiguous
    o, lse = forward(q, k, v, True)
    got = tb.flash_attention_numpy_backward(q, k, v, o, lse, do, True, None, 4, 8)
    for g, w in zip(got, autograd_reference(q, k, v, do, True)):
        np.testing.assert_allclose(g, w, **F64_TOL)


def test_inputs_are_not_modified():
    arrays = make_inputs(np.random.default_rng(3), (), 20, 20, 8, 8)
    q, k, v, do = arrays
    o, lse = forward(q, k, v, False)
    copies = [x.copy() for x in (q, k, v, o, lse, do)]
    tb.flash_attention_numpy_backward(q, k, v, o, lse, do, block_m=6, block_n=6)
    for before, after in zip(copies, (q, k, v, o, lse, do)):
        np.testing.assert_array_equal(before, after)


def test_uses_the_tiled_forward_outputs():
    tiled = pytest.importorskip("course_lib.attention.tiled", reason="chapter 04's tiled forward not present")
    q, k, v, do = make_inputs(np.random.default_rng(4), (2,), 50, 37, 16, 16)
    o, lse = tiled.flash_attention_numpy(q, k, v, causal=True, block_m=16, block_n=8)
    got = tb.flash_attention_numpy_backward(q, k, v, o, lse, do, True, block_m=8, block_n=16)
    for g, w in zip(got, autograd_reference(q, k, v, do, True)):
        np.testing.assert_allclose(g, w, **F64_TOL)


# --------------------------------------------------------------------------- causal tile skipping

def _visible(q_start, q_end, k_start, k_end):
    return k_start <= q_end - 1  # some key j <= some query i in the tile


@pytest.mark.parametrize("n_q,n_k,bm,bn", [(100, 100, 32, 32), (37, 90, 8, 16), (90, 37, 16, 8),
                                           (64, 64, 64, 64), (5, 50, 7, 3)])
def test_causal_schedule_visits_exactly_the_visible_tiles(n_q, n_k, bm, bn):
    sched = tb.tile_schedule(n_q, n_k, bm, bn, causal=True)
    expected = set()
    for q_start in range(0, n_q, bm):
        for k_start in range(0, n_k, bn):
            if _visible(q_start, min(q_start + bm, n_q), k_start, min(k_start + bn, n_k)):
                expected.add((q_start, k_start))
    assert {(qs, ks) for ks, qs, _ in sched["dk_dv"]} == expected
    assert {(qs, ks) for qs, ks, _ in sched["dq"]} == expected
    if n_q > bm or n_k > bn:  # with more than one tile, causal skips some
        assert len(expected) < sched["total"]
    # only tiles that straddle the diagonal carry a mask
    for q_start, k_start, masked in sched["dq"]:
        straddles = min(k_start + bn, n_k) - 1 > q_start
        assert masked == straddles


def test_square_causal_grid_visits_the_lower_triangle():
    n_tiles = 8
    sched = tb.tile_schedule(n_tiles * 16, n_tiles * 16, 16, 16, causal=True)
    assert len(sched["dq"]) == len(sched["dk_dv"]) == n_tiles * (n_tiles + 1) // 2
    assert sum(masked for *_, masked in sched["dq"]) == n_tiles  # the diagonal tiles
    assert tb.tile_schedule(50, 60, 16, 16, causal=False)["dq"].__len__() == 4 * 4


def test_backward_never_builds_more_than_a_tile():
    q, k, v, do = make_inputs(np.random.default_rng(5), (), 40, 40, 8, 8)
    o, lse = forward(q, k, v, True)
    seen = []

    def spy(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
        seen.append((q_i.shape[0], k_j.shape[0], mask is not None))
        return tb.dk_dv_step(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask)

    tb.tiled_backward(q, k, v, o, lse, do, True, None, 16, 8, dk_dv_step=spy)
    assert all(m <= 16 and n <= 8 for m, n, _ in seen)
    assert len(seen) == len(tb.tile_schedule(40, 40, 16, 8, True)["dk_dv"])


# --------------------------------------------------------------------------- bad input

@pytest.fixture
def good():
    q, k, v, do = make_inputs(np.random.default_rng(6), (2,), 12, 10, 4, 3)
    o, lse = forward(q, k, v, False)
    return dict(q=q, k=k, v=v, o=o, lse=lse, do=do)


@pytest.mark.parametrize("name,bad,error,match", [
    ("o", np.zeros((2, 12, 4)), ValueError, r"o must have shape \(2, 12, 3\)"),
    ("do", np.zeros((2, 11, 3)), ValueError, r"do must have shape \(2, 12, 3\)"),
    ("lse", np.zeros((2, 12, 1)), ValueError, r"lse must have shape \(2, 12\)"),
    ("lse", np.full((2, 12), np.nan), ValueError, "lse must be finite"),
    ("do", np.zeros((2, 12, 3), dtype=np.int64), TypeError, "do must be float32 or float64"),
    ("o", [[0.0]], TypeError, "o must be a NumPy array"),
    ("q", np.zeros((2, 12, 5)), ValueError, "same head dim"),
    ("k", np.zeros((12,)), ValueError, "k must have shape"),
])
def test_bad_arrays_are_named(good, name, bad, error, match):
    good[name] = bad
    with pytest.raises(error, match=match):
        tb.flash_attention_numpy_backward(**good)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(block_m=0), ValueError, "block_m must be a positive int"),
    (dict(block_n=2.5), TypeError, "block_n must be a positive int"),
    (dict(block_m=True), TypeError, "block_m must be a positive int"),
    (dict(causal="yes"), TypeError, "causal must be True or False"),
    (dict(scale=float("inf")), ValueError, "scale must be a finite number"),
])
def test_bad_options_are_named(good, kwargs, error, match):
    with pytest.raises(error, match=match):
        tb.flash_attention_numpy_backward(**good, **kwargs)


def test_public_name_is_exported():
    assert course_lib.flash_attention_numpy_backward is tb.flash_attention_numpy_backward
