"""Tests for course_lib.attention.tiled: both loop orders against the float64 reference, causal tile
skipping, the IO counter, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from course_lib.attention import iomodel, tiled
from course_lib.attention.reference import causal_mask, naive_attention_numpy

pytestmark = pytest.mark.ch04

IMPLEMENTATIONS = [tiled.flash_attention_numpy, tiled.flash_attention_numpy_fa1]
ATOL = {np.float64: 1e-11, np.float32: 2e-5}


@st.composite
def problems(draw):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    n_q, n_k = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    d, d_v = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    block_m, block_n = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    causal = draw(st.booleans())
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    spread = draw(st.sampled_from([0.5, 3.0]))
    q = (spread * rng.standard_normal(lead + (n_q, d))).astype(dtype)
    k = (spread * rng.standard_normal(lead + (n_k, d))).astype(dtype)
    v = rng.standard_normal(lead + (n_k, d_v)).astype(dtype)
    return q, k, v, causal, block_m, block_n


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["fa2", "fa1"])
@settings(max_examples=40, deadline=None)
@given(problem=problems())
def test_matches_float64_reference(impl, problem):
    q, k, v, causal, block_m, block_n = problem
    o, lse = impl(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    o_ref, lse_ref = naive_attention_numpy(q.astype(np.float64), k.astype(np.float64),
                                           v.astype(np.float64), causal=causal)
    assert o.shape == o_ref.shape and lse.shape == q.shape[:-1]
    assert o.dtype == q.dtype and lse.dtype == q.dtype
    atol = ATOL[q.dtype.type]
    np.testing.assert_allclose(o, o_ref, atol=atol, rtol=atol)
    np.testing.assert_allclose(lse, lse_ref, atol=atol, rtol=atol)


@settings(max_examples=25, deadline=None)
@given(problem=problems())
def test_lse_is_logsumexp_of_scaled_scores(problem):
    q, k, v, causal, block_m, block_n = problem
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scale = 0.37
    _, lse = tiled.flash_attention_numpy(q, k, v, causal=causal, scale=scale,
                                         block_m=block_m, block_n=block_n)
    s = scale * q @ np.swapaxes(k, -1, -2)
    if causal:
        s = np.where(causal_mask(q.shape[-2], k.shape[-2]), s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    want = top[..., 0] + np.log(np.exp(s - top).sum(axis=-1))
    np.testing.assert_allclose(lse, want, atol=1e-11)


def test_fa1_equals_fa2_and_standard():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (45, 61, 61))
    o2, lse2 = tiled.flash_attention_numpy(q, k, v, causal=True, block_m=7, block_n=9)
    o1, lse1 = tiled.flash_attention_numpy_fa1(q, k, v, causal=True, block_m=7, block_n=9)
    np.testing.assert_allclose(o1, o2, atol=1e-12)
    np.testing.assert_allclose(lse1, lse2, atol=1e-12)
    o_std = tiled.standard_attention_numpy(q, k, v, causal=True)
    np.testing.assert_allclose(o_std, o2, atol=1e-12)


def test_top_left_causal_alignment_like_sdpa():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((3, n, 4)) for n in (11, 23, 23))
    o, _ = tiled.flash_attention_numpy(q, k, v, causal=True, block_m=4, block_n=5)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), is_causal=True).numpy()
    np.testing.assert_allclose(o, want, atol=1e-12)


def test_large_scores_do_not_overflow():
    q = np.full((5, 3), 300.0)
    k = np.full((9, 3), 300.0)
    v = np.arange(27.0).reshape(9, 3)
    o, lse = tiled.flash_attention_numpy(q, k, v, block_m=2, block_n=4)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))


# ---- causal tile skipping ------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["fa2", "fa1"])
@pytest.mark.parametrize("n_q,n_k,block_m,block_n", [(100, 100, 32, 16), (37, 80, 8, 12),
                                                     (64, 20, 16, 16), (5, 5, 1, 1)])
def test_causal_skips_exactly_the_fully_masked_tiles(impl, n_q, n_k, block_m, block_n):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((n, 4)) for n in (n_q, n_k, n_k))
    counter = tiled.IOCounter()
    impl(q, k, v, causal=True, block_m=block_m, block_n=block_n, counter=counter)
    visible = causal_mask(n_q, n_k)
    t_r, t_c = iomodel.num_blocks(n_q, block_m), iomodel.num_blocks(n_k, block_n)
    want_skipped = {(i, j) for i in range(t_r) for j in range(t_c)
                    if not visible[i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n].any()}
    skipped = {(e.q_block, e.kv_block) for e in counter.events if e.kind == "skip"}
    computed = {(e.q_block, e.kv_block) for e in counter.events if e.kind == "compute"}
    assert skipped == want_skipped
    assert computed == {(i, j) for i in range(t_r) for j in range(t_c)} - want_skipped
    grid = tiled.causal_skip_grid(n_q, n_k, block_m, block_n)
    assert {tuple(ij) for ij in np.argwhere(grid)} == want_skipped


def test_non_causal_skips_nothing():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((n, 4)) for n in (30, 30, 30))
    counter = tiled.IOCounter()
    tiled.flash_attention_numpy(q, k, v, block_m=8, block_n=8, counter=counter)
    assert not [e for e in counter.events if e.kind == "skip"]
    assert len([e for e in counter.events if e.kind == "compute"]) == 16


# ---- tile classes: the rule the loop follows ----------------------------------------------

def _brute_force_classes(rule, n_q, n_k, block_m, block_n):
    visible = rule.element_mask(n_q, n_k)
    t_r, t_c = iomodel.num_blocks(n_q, block_m), iomodel.num_blocks(n_k, block_n)
    classes = np.empty((t_r, t_c), dtype=int)
    for i in range(t_r):
        for j in range(t_c):
            tile = visible[i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
            classes[i, j] = (tiled.FULL if tile.all() else
                             tiled.PARTIAL if tile.any() else tiled.SKIP)
    return classes


@settings(max_examples=60, deadline=None)
@given(n_q=st.integers(1, 50), n_k=st.integers(1, 50), block_m=st.integers(1, 13),
       block_n=st.integers(1, 13))
def test_tile_classes_agree_with_brute_force(n_q, n_k, block_m, block_n):
    for rule in (tiled.DENSE, tiled.CAUSAL):
        np.testing.assert_array_equal(rule.tile_classes(n_q, n_k, block_m, block_n),
                                      _brute_force_classes(rule, n_q, n_k, block_m, block_n))
    skipped = tiled.CAUSAL.tile_classes(n_q, n_k, block_m, block_n) == tiled.SKIP
    np.testing.assert_array_equal(skipped, tiled.causal_skip_grid(n_q, n_k, block_m, block_n))


def test_causal_is_a_rule_of_the_same_loop():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, n, 4)) for n in (23, 30, 30))
    by_flag = tiled.flash_attention_numpy(q, k, v, causal=True, block_m=8, block_n=6)
    by_rule = tiled.flash_attention_numpy(q, k, v, block_m=8, block_n=6, rule=tiled.CAUSAL)
    for a, b in zip(by_flag, by_rule):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="causal=True or a rule, not both"):
        tiled.flash_attention_numpy(q, k, v, causal=True, rule=tiled.CAUSAL)


def test_softmax_state_of_no_keys_is_the_empty_state():
    m, l, o = tiled.softmax_state(np.zeros((3, 0)), np.zeros((0, 2)))
    np.testing.assert_array_equal(m, -np.inf)
    np.testing.assert_array_equal(l, 0)
    np.testing.assert_array_equal(o, np.zeros((3, 2)))
    np.testing.assert_array_equal(tiled.state_lse(m, l), -np.inf)


# ---- the counter ---------------------------------------------------------------------------

def test_fa2_reads_each_q_once_and_writes_each_output_once():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, n, 6)) for n in (50, 70, 70))
    c = tiled.IOCounter()
    tiled.flash_attention_numpy(q, k, v, block_m=16, block_n=32, counter=c)
    t_r = iomodel.num_blocks(50, 16)
    assert c.reads_by == {"q": 2 * 50 * 6, "k": 2 * t_r * 70 * 6, "v": 2 * t_r * 70 * 6}
    assert c.writes_by == {"o": 2 * 50 * 6, "lse": 2 * 50}


def test_standard_never_counts_less_than_the_score_matrix_round_trips():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((n, 4)) for n in (10, 12, 12))
    c = tiled.IOCounter()
    tiled.standard_attention_numpy(q, k, v, counter=c)
    assert c.writes_by["S"] + c.writes_by["P"] == 4 * 10 * 12


def test_counter_without_events():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((n, 4)) for n in (10, 12, 12))
    c = tiled.IOCounter(record_events=False)
    tiled.flash_attention_numpy(q, k, v, block_m=4, block_n=4, counter=c)
    assert c.events == [] and c.reads > 0 and c.total == c.reads + c.writes


def test_load_tile_pads_with_zeros():
    x = np.arange(10.0).reshape(5, 2)
    tile = tiled.load_tile(x, 4, 3)
    assert tile.shape == (3, 2)
    np.testing.assert_array_equal(tile, [[8, 9], [0, 0], [0, 0]])


# ---- bad input -----------------------------------------------------------------------------

GOOD = np.zeros((4, 3))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS + [tiled.standard_attention_numpy],
                         ids=["fa2", "fa1", "standard"])
@pytest.mark.parametrize("args,error,match", [
    ((GOOD, np.zeros((4, 5)), GOOD), ValueError, "head dim"),
    ((GOOD, GOOD, np.zeros((6, 3))), ValueError, "k and v"),
    ((np.zeros((2, 4, 3)), np.zeros((3, 4, 3)), np.zeros((3, 4, 3))), ValueError, "leading dims"),
    ((np.zeros((4, 3), dtype=int), GOOD, GOOD), TypeError, "q must be float32 or float64"),
    ((GOOD, GOOD, [[0.0] * 3] * 4), TypeError, "v must be a NumPy array"),
    ((np.zeros(3), GOOD, GOOD), ValueError, "q must have shape"),
])
def test_bad_arrays(impl, args, error, match):
    with pytest.raises(error, match=match):
        impl(*args)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["fa2", "fa1"])
@pytest.mark.parametrize("kwargs,error,match", [
    ({"block_m": 0}, ValueError, "block_m must be a positive int"),
    ({"block_n": -3}, ValueError, "block_n must be a positive int"),
    ({"block_m": 2.0}, TypeError, "block_m must be a positive int"),
    ({"block_n": True}, TypeError, "block_n must be a positive int"),
    ({"scale": float("nan")}, ValueError, "scale"),
])
def test_bad_options(impl, kwargs, error, match):
    with pytest.raises(error, match=match):
        impl(GOOD, GOOD, GOOD, **kwargs)


def test_mixed_dtypes_rejected():
    with pytest.raises(TypeError, match="same dtype"):
        tiled.flash_attention_numpy(GOOD.astype(np.float32), GOOD, GOOD)


def test_public_name_is_the_fa2_implementation():
    import course_lib

    assert course_lib.flash_attention_numpy is tiled.flash_attention_numpy
