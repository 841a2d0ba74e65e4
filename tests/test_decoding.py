"""course_lib.attention.decoding: the cost of a decoding step and split-KV decoding (flash-decoding) —
checked against the repeat-K/V reference and torch SDPA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.attention import decoding as dc
from course_lib.platform.hardware import GPUS, balance_point

pytestmark = pytest.mark.ch08

ATOL = 1e-10  # float64 results of exact algorithms agree to ~1e-15


def _decode_problem(seed, lead, n_heads, n_kv_heads, n, d=8, d_v=6, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=lead + (n_heads, d)).astype(dtype)
    k = (2.0 * rng.normal(size=lead + (n_kv_heads, n, d))).astype(dtype)
    v = rng.normal(size=lead + (n_kv_heads, n, d_v)).astype(dtype)
    return q, k, v


# ------------------------------------------------------------------------------ decoding cost

def test_decoding_is_about_one_flop_per_byte():
    cost = dc.decode_step_cost(4096, 128, "float16", batch=1, heads=32)
    assert cost.flops == 4 * 32 * 4096 * 128
    assert cost.intensity == pytest.approx(1.0, rel=1e-3)
    for gpu in GPUS:
        assert cost.intensity < balance_point(gpu) / 10  # memory-bound everywhere
    gqa = dc.decode_step_cost(4096, 128, "float16", batch=1, heads=32, kv_heads=8)
    assert gqa.intensity == pytest.approx(4.0, rel=1e-2)  # the group size


def test_num_splits_to_fill():
    assert dc.num_splits_to_fill(132, batch=1, heads=32, seq_len=8192, block_n=64) == 5
    assert dc.num_splits_to_fill(132, batch=1, heads=32, seq_len=100, block_n=64) == 2  # capped
    assert dc.num_splits_to_fill(132, batch=8, heads=32, seq_len=8192) == 1


def test_decode_step_cost_errors_name_the_argument():
    with pytest.raises((ValueError, TypeError), match="kv_heads"):
        dc.decode_step_cost(8, 4, heads=6, kv_heads=4)


# ------------------------------------------------------------------------------ split-KV

def test_split_bounds():
    assert dc.split_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert dc.split_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert dc.split_bounds(6, [0, 2, 4]) == [(0, 0), (0, 2), (2, 6)]
    with pytest.raises(ValueError, match="splits"):
        dc.split_bounds(6, [2, 2])
    with pytest.raises(ValueError, match="splits"):
        dc.split_bounds(6, 0)
    with pytest.raises(TypeError, match="splits"):
        dc.split_bounds(6, 2.5)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), data=st.data(), group=st.sampled_from([1, 2, 3]),
       n_kv=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_split_kv_equals_reference_for_any_split(n, data, group, n_kv, seed):
    if data.draw(st.booleans(), label="explicit chunk lengths"):
        cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=6), label="cuts"))
        splits = list(np.diff([0] + cuts + [n]))  # uneven, empty chunks allowed
    else:
        splits = data.draw(st.integers(1, n + 3), label="S")  # S = N: chunks of size 1
    q, k, v = _decode_problem(seed, (2,), n_kv * group, n_kv, n)
    o, lse = dc.flash_decode(q, k, v, splits)
    o_ref, lse_ref = dc.decode_attention_reference(q, k, v)
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    np.testing.assert_allclose(lse, lse_ref, atol=ATOL)
    # the merge order does not matter: reversed chunks give the same answer
    m, l, o_s = dc.split_kv_partials(q, k, v, splits)
    np.testing.assert_allclose(dc.combine_splits(m[::-1], l[::-1], o_s[::-1]), o_ref, atol=ATOL)


def test_partials_are_each_chunks_own_softmax():
    q, k, v = _decode_problem(1, (), 2, 2, 11)
    m, l, o = dc.split_kv_partials(q, k, v, [4, 7])
    assert m.shape == l.shape == (2, 2) and o.shape == (2, 2, 6)
    o_chunk, lse_chunk = dc.decode_attention_reference(q, k[:, 4:], v[:, 4:])
    np.testing.assert_allclose(o[1], o_chunk, atol=ATOL)
    np.testing.assert_allclose(m[1] + np.log(l[1]), lse_chunk, atol=ATOL)


def test_flash_decode_matches_sdpa_with_gqa_and_keeps_float32():
    q, k, v = _decode_problem(2, (3,), 8, 2, 37, d=16, d_v=16, dtype=np.float32)
    o, lse = dc.flash_decode(q, k, v, 5)
    assert o.dtype == np.float32 and o.shape == (3, 8, 16) and lse.shape == (3, 8)
    want = F.scaled_dot_product_attention(torch.from_numpy(q)[..., None, :], torch.from_numpy(k),
                                          torch.from_numpy(v), enable_gqa=True)[..., 0, :]
    np.testing.assert_allclose(o, want.numpy(), atol=2e-6)


def test_decode_with_large_scores_does_not_overflow():
    q, k, v = _decode_problem(3, (), 2, 1, 30)
    o, _ = dc.flash_decode(q, 300.0 * k, v, 4)
    o_ref, _ = dc.decode_attention_reference(q, 300.0 * k, v)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, o_ref, atol=ATOL)


@pytest.mark.parametrize("args, error, match", [
    (lambda q, k, v: (q.tolist(), k, v), TypeError, "q must be a NumPy array"),
    (lambda q, k, v: (q.astype(np.int64), k, v), TypeError, "q must be float32 or float64"),
    (lambda q, k, v: (q, k.astype(np.float32), v), TypeError, "same dtype"),
    (lambda q, k, v: (q, k[..., 0, :], v), ValueError, "k must have shape"),
    (lambda q, k, v: (q, k, v[..., :5, :]), ValueError, "k and v"),
    (lambda q, k, v: (q[..., :3], k, v), ValueError, "head dim"),
    (lambda q, k, v: (q[:, :3], k, v), ValueError, "multiple of the number of K/V heads"),
    (lambda q, k, v: (q[:1], k, v), ValueError, "leading"),
])
def test_decode_errors_name_the_argument(args, error, match):
    q, k, v = _decode_problem(4, (2,), 4, 2, 9)
    with pytest.raises(error, match=match):
        dc.flash_decode(*args(q, k, v), 2)


def test_combine_splits_errors():
    m, l, o = dc.split_kv_partials(*_decode_problem(5, (), 2, 2, 6), 2)
    with pytest.raises(ValueError, match="m, l must have shape"):
        dc.combine_splits(m, l[:, :1], o)
    with pytest.raises(TypeError, match="o must be a NumPy array"):
        dc.combine_splits(m, l, o.tolist())
