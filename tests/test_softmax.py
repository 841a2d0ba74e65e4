"""Tests of course_lib.attention.softmax: safe/online softmax, state updates and merges (chapter 03)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from course_lib.attention import softmax as S

pytestmark = pytest.mark.ch03

LOGIT = 50.0  # property-test scores lie in [-LOGIT, LOGIT] unless a test says otherwise
ATOL64 = 1e-12  # float64 agreement of exact algorithms (rounding only)
RTOL64 = 1e-10


def softmax64(x):
    """Independent oracle: float64 softmax with Python's math (no course_lib code)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    s = e.sum(axis=-1, keepdims=True)
    return np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0)


rows = hnp.arrays(np.float64, st.tuples(st.integers(1, 5), st.integers(1, 40)),
                  elements=st.floats(-LOGIT, LOGIT))
block_sizes = st.integers(1, 45)


# ---- the reading's worked examples -----------------------------------------------------------

def test_reading_example_scores_2_5_3():
    steps = S.trace_online_softmax([2.0, 5.0, 3.0], 2)
    assert [s.m_new for s in steps] == [5.0, 5.0]
    assert steps[1].correction == 1.0
    assert steps[0].l_new == pytest.approx(math.exp(-3) + 1.0)
    assert steps[1].l_new == pytest.approx(math.exp(-3) + 1.0 + math.exp(-2))
    assert round(steps[1].l_new, 2) == 1.19


def test_reading_example_row_in_tiles_of_two():
    x = np.array([1.0, 2.0, 0.5, 0.1])
    m, l = S.online_softmax_stats(x, 2)
    assert m == 2.0 and round(float(l), 3) == 1.741
    w = S.online_softmax(x, 2)
    # the exact weights; the reading's 0.574 for the second is 1/1.741 (its rounded l)
    np.testing.assert_allclose(np.round(w, 3), [0.211, 0.575, 0.128, 0.086])
    assert round(1 / 1.741, 3) == 0.574


# ---- whole-row softmax -----------------------------------------------------------------------

def test_naive_softmax_overflows_where_safe_does_not():
    for dtype in (np.float32, np.float16):
        t = S.overflow_threshold(dtype)
        x = np.array([0.0, math.ceil(t)], dtype=dtype)
        assert np.isnan(S.naive_softmax(x)).any(), dtype
    x32 = np.array([0.0, 89.0], dtype=np.float32)
    np.testing.assert_allclose(S.safe_softmax(x32), softmax64(x32), rtol=1e-6)
    assert np.isfinite(S.online_softmax(x32, 1)).all()


def test_overflow_thresholds():
    assert S.overflow_threshold(np.float32) == pytest.approx(88.72, abs=0.01)
    assert S.overflow_threshold(np.float16) == pytest.approx(11.09, abs=0.01)
    assert np.isfinite(np.exp(np.float32(88.7)))
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(np.float32(88.8)))


@pytest.mark.parametrize("fn", [S.safe_softmax, lambda x: S.online_softmax(x, 3)])
def test_keeps_dtype_and_shape(fn):
    x = np.random.default_rng(0).normal(size=(2, 3, 7)).astype(np.float32)
    y = fn(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, softmax64(x), rtol=1e-5, atol=1e-7)


def test_fully_masked_row_gives_zeros():
    x = np.array([[-np.inf] * 5, [0.0, -np.inf, 1.0, -np.inf, 2.0]])
    for y in (S.safe_softmax(x), S.online_softmax(x, 2)):
        assert np.all(y[0] == 0.0)
        assert y[1, 1] == 0.0 and y[1, 3] == 0.0
        assert y[1].sum() == pytest.approx(1.0)
    m, l = S.online_softmax_stats(x, 2)
    assert m[0] == -np.inf and l[0] == 0.0


def test_empty_last_axis():
    assert S.online_softmax(np.zeros((3, 0)), 4).shape == (3, 0)


# ---- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [0, -3])
def test_block_size_must_be_positive(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        S.online_softmax(np.zeros(4), block_size)


@pytest.mark.parametrize("block_size", [2.0, "2", True, None])
def test_block_size_must_be_int(block_size):
    with pytest.raises(TypeError, match="block_size must be a positive int"):
        S.online_softmax(np.zeros(4), block_size)


def test_numpy_integer_block_size_is_fine():
    np.testing.assert_allclose(S.online_softmax(np.zeros(4), np.int64(3)), 0.25)


@pytest.mark.parametrize("x, match", [
    (np.arange(4), "x must be a float32 or float64 array, got dtype int64"),
    (np.zeros(4, dtype=np.float16), "x must be a float32 or float64 array"),
    ([1.0, 2.0], "x must be a NumPy array"),
])
def test_x_type_errors(x, match):
    with pytest.raises(TypeError, match=match):
        S.online_softmax(x, 2)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_plus_inf_rejected(bad):
    with pytest.raises(ValueError, match="x contains NaN or \\+inf"):
        S.online_softmax(np.array([0.0, bad]), 1)
    with pytest.raises(ValueError, match="x contains NaN"):
        S.safe_softmax(np.array([0.0, bad]))


def test_zero_dim_rejected():
    with pytest.raises(ValueError, match="at least one dimension"):
        S.online_softmax(np.array(1.0), 1)


def test_trace_rejects_2d_rows():
    with pytest.raises(ValueError, match="row must be 1-D"):
        S.trace_online_softmax(np.zeros((2, 2)), 1)


def test_torch_tensors_round_trip():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 11, dtype=torch.float32)
    y = S.online_softmax(x, 4)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, torch.softmax(x, dim=-1))
    h = S.online_softmax(x.half(), 4)
    assert h.dtype == torch.float16
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        S.online_softmax(torch.arange(4), 2)


def test_public_name():
    import course_lib

    assert course_lib.online_softmax is S.online_softmax


# ---- update, correction and merge ------------------------------------------------------------

def test_correction_factor_cases():
    assert S.correction_factor(-np.inf, 3.0) == 0.0
    assert S.correction_factor(-np.inf, -np.inf) == 0.0  # empty + empty: nothing to rescale
    assert S.correction_factor(2.0, 2.0) == 1.0
    assert S.correction_factor(1.0, 3.0) == pytest.approx(math.exp(-2.0))


def test_update_from_empty_state_with_all_masked_tile():
    m, l = S.online_update(np.array([-np.inf]), np.array([0.0]), np.array([[-np.inf, -np.inf]]))
    assert m[0] == -np.inf and l[0] == 0.0


def test_trace_records_rescale_when_max_grows():
    steps = S.trace_online_softmax([0.0, 1.0, 3.0, 2.0, 5.0], 2)
    assert [s.max_changed for s in steps] == [True, True, True]
    assert steps[1].correction == pytest.approx(math.exp(1.0 - 3.0))
    for s in steps:
        assert s.l_new == pytest.approx(s.l_old * s.correction + s.tile_sum)


def test_merge_with_output_matches_attention_on_the_union():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 9)) * 3  # (rows, keys)
    v = rng.normal(size=(9, 4))  # (keys, d)
    split = 4

    def partial(xs, vs):
        m, l = S.online_softmax_stats(xs, 2)
        return m, l, S.safe_softmax(xs) @ vs

    m, l, o = S.merge_states_with_output(*partial(x[:, :split], v[:split]),
                                         *partial(x[:, split:], v[split:]))
    np.testing.assert_allclose(o, softmax64(x) @ v, rtol=RTOL64, atol=ATOL64)
    m_all, l_all = S.online_softmax_stats(x, 9)
    np.testing.assert_allclose(m, m_all)
    np.testing.assert_allclose(l, l_all, rtol=RTOL64)


def test_merge_with_empty_parts():
    d = 3
    empty = (np.array([-np.inf]), np.array([0.0]), np.zeros((1, d)))
    full = (np.array([1.5]), np.array([2.0]), np.ones((1, d)))
    m, l, o = S.merge_states_with_output(*empty, *full)
    assert m[0] == 1.5 and l[0] == 2.0 and np.all(o == 1.0)
    m, l, o = S.merge_states_with_output(*empty, *empty)
    assert m[0] == -np.inf and l[0] == 0.0 and np.all(o == 0.0)


# ---- properties ------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(rows, block_sizes)
def test_online_equals_softmax_for_any_blocking(x, block_size):
    np.testing.assert_allclose(S.online_softmax(x, block_size), softmax64(x),
                               rtol=RTOL64, atol=ATOL64)


@settings(max_examples=100, deadline=None)
@given(rows, st.lists(st.integers(1, 39), max_size=6), st.randoms(use_true_random=False))
def test_merge_order_does_not_matter(x, cuts, random):
    """Split each row at arbitrary points, merge the parts' states in a random order."""
    n = x.shape[-1]
    edges = sorted({0, n, *[c for c in cuts if c < n]})
    parts = [S.online_softmax_stats(x[:, a:b], 3) for a, b in zip(edges, edges[1:])]
    random.shuffle(parts)
    m, l = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
    for pm, pl in parts:
        m, l = S.merge_states(m, l, pm, pl)
    m_ref, l_ref = S.online_softmax_stats(x, n)
    np.testing.assert_array_equal(m, m_ref)
    np.testing.assert_allclose(l, l_ref, rtol=RTOL64)


@settings(max_examples=100, deadline=None)
@given(rows, block_sizes, st.floats(-1e3, 1e3))
def test_adding_a_constant_changes_nothing(x, block_size, c):
    np.testing.assert_allclose(S.online_softmax(x + c, block_size),
                               S.online_softmax(x, block_size), rtol=1e-9, atol=1e-11)


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 30)),
                  elements=st.floats(1e3, 5e3, width=32)), block_sizes)
def test_no_inf_or_nan_for_logits_in_the_thousands(x, block_size):
    y = S.online_softmax(x, block_size)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y.sum(axis=-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(y, softmax64(x), atol=1e-5)


@settings(max_examples=100, deadline=None)
@given(rows, block_sizes, st.data())
def test_minus_inf_entries_are_handled(x, block_size, data):
    mask = data.draw(hnp.arrays(np.bool_, x.shape))
    x = np.where(mask, -np.inf, x)
    y = S.online_softmax(x, block_size)
    assert np.isfinite(y).all()
    assert np.all(y[mask] == 0.0)
    np.testing.assert_allclose(y, softmax64(x), rtol=RTOL64, atol=ATOL64)
    live = ~mask.all(axis=-1)
    np.testing.assert_allclose(y[live].sum(axis=-1), 1.0)
    assert np.all(y[~live] == 0.0)
