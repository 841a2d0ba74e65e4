"""course_lib.attention.gqa: the GQA/MQA head mapping, the naive repeat and attention by index mapping —
checked against the explicit repeat and torch SDPA's enable_gqa."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.attention import gqa
from course_lib.attention.reference import naive_attention_numpy

pytestmark = pytest.mark.ch08

ATOL = 1e-10  # float64 results of exact algorithms agree to ~1e-15


def test_kv_head_index():
    assert gqa.kv_head_index(np.arange(8), 8, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert gqa.kv_head_index(5, 32, 8) == 1 and isinstance(gqa.kv_head_index(5, 32, 8), int)
    assert (gqa.kv_head_index(np.arange(6), 6, 1) == 0).all()  # MQA
    assert gqa.kv_head_index(np.arange(6), 6, 6).tolist() == list(range(6))  # MHA
    with pytest.raises(ValueError, match="n_heads must be a multiple of n_kv_heads"):
        gqa.kv_head_index(0, 6, 4)
    with pytest.raises(ValueError, match=r"h must be in \[0, n_heads=6\)"):
        gqa.kv_head_index(6, 6, 3)
    with pytest.raises(TypeError, match="h must be an integer"):
        gqa.kv_head_index(1.0, 6, 3)


def test_repeat_kv_copies_and_index_map_does_not():
    k = np.arange(2 * 5 * 3, dtype=np.float64).reshape(2, 5, 3)  # (H_kv, N, d)
    r = gqa.repeat_kv(k, 6)
    assert r.shape == (6, 5, 3) and not np.shares_memory(r, k)
    for h in range(6):
        np.testing.assert_array_equal(r[h], k[gqa.kv_head_index(h, 6, 2)])
        assert np.shares_memory(k[gqa.kv_head_index(h, 6, 2)], k)  # a view: no copy
    with pytest.raises(ValueError, match="n_heads must be a multiple"):
        gqa.repeat_kv(k, 5)
    with pytest.raises(ValueError, match="x must have shape"):
        gqa.repeat_kv(k[0], 4)


@settings(max_examples=40, deadline=None)
@given(n_kv=st.integers(1, 3), group=st.integers(1, 4), n_q=st.integers(1, 20),
       n_k=st.integers(1, 20), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_gqa_equals_explicit_repeat(n_kv, group, n_q, n_k, causal, seed):
    rng = np.random.default_rng(seed)
    h = n_kv * group
    q = rng.normal(size=(2, h, n_q, 8))
    k, v = rng.normal(size=(2, 2, n_kv, n_k, 8))
    if causal and n_q > n_k:
        n_q = n_k  # top-left alignment: a query past the last key would see no key at all
        q = q[..., :n_q, :]
    o, lse = gqa.gqa_attention(q, k, v, causal)
    o_ref, lse_ref = naive_attention_numpy(q, gqa.repeat_kv(k, h), gqa.repeat_kv(v, h), causal)
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    np.testing.assert_allclose(lse, lse_ref, atol=ATOL)


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_matches_sdpa_enable_gqa(causal):
    rng = np.random.default_rng(7)
    q = rng.normal(size=(2, 12, 19, 16)).astype(np.float32)
    k, v = rng.normal(size=(2, 2, 3, 23, 16)).astype(np.float32)
    o, _ = gqa.gqa_attention(q, k, v, causal)
    want = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                          is_causal=causal, enable_gqa=True)
    np.testing.assert_allclose(o, want.numpy(), atol=2e-6)
