"""course_lib.decoding: KV-cache size, split-KV decoding, GQA/MQA, sliding-window and block-sparse
tiles — checked against references, torch SDPA and brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib import decoding as dc
from course_lib.hardware import GPUS, balance_point
from course_lib.iomodel import causal_skip_grid
from course_lib.reference import naive_attention_numpy
from course_lib.tiled import IOCounter

pytestmark = pytest.mark.ch08

ATOL = 1e-10  # float64 results of exact algorithms agree to ~1e-15


def _decode_problem(seed, lead, n_heads, n_kv_heads, n, d=8, d_v=6, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=lead + (n_heads, d)).astype(dtype)
    k = (2.0 * rng.normal(size=lead + (n_kv_heads, n, d))).astype(dtype)
    v = rng.normal(size=lead + (n_kv_heads, n, d_v)).astype(dtype)
    return q, k, v


# ------------------------------------------------------------------------------ KV-cache size

def test_kv_cache_formula_and_the_readings_numbers():
    # Llama-2-70B shape counted as multi-head (the reading's assumption): 32 KiB per token/layer
    per_token_layer = dc.kv_cache_bytes(1, layers=1, kv_heads=64, head_dim=128)
    assert per_token_layer == 32 * 1024
    seq = dc.kv_cache_bytes(4096, layers=80, kv_heads=64, head_dim=128)
    assert seq == 10_737_418_240  # 10.7 GB = 10.0 GiB (the reading's "10.5 GB" mixes units)
    big = dc.kv_cache_bytes(2048, layers=80, kv_heads=64, head_dim=128, batch=512)
    assert big / 1e12 == pytest.approx(2.75, abs=0.01)  # "~2.7 TB"
    # GQA with 8 K/V heads: 8 times less
    assert dc.MODELS["70B, GQA with 8 KV heads (Llama-2-70B shape)"].kv_bytes(4096) == seq // 8
    assert dc.kv_cache_bytes(10, layers=2, kv_heads=3, head_dim=4, batch=5, dtype="float32") == \
        2 * 2 * 3 * 4 * 10 * 5 * 4
    assert dc.kv_cache_bytes(10, layers=2, kv_heads=3, head_dim=4, dtype="fp8") == 2 * 2 * 3 * 4 * 10


def test_max_cached_tokens():
    per_token = dc.kv_cache_bytes_per_token(layers=32, kv_heads=32, head_dim=128)
    assert per_token == 512 * 1024
    assert dc.max_cached_tokens(10 * per_token + 5, layers=32, kv_heads=32, head_dim=128) == 10
    assert dc.max_cached_tokens(10 * per_token, layers=32, kv_heads=32, head_dim=128,
                                reserved_bytes=11 * per_token) == 0


@pytest.mark.parametrize("call, match", [
    (lambda: dc.kv_cache_bytes(0, layers=1, kv_heads=1, head_dim=1), "seq_len"),
    (lambda: dc.kv_cache_bytes(8, layers=-1, kv_heads=1, head_dim=1), "layers"),
    (lambda: dc.kv_cache_bytes(8, layers=1, kv_heads=0, head_dim=1), "kv_heads"),
    (lambda: dc.kv_cache_bytes(8, layers=1, kv_heads=1, head_dim=1, batch=0), "batch"),
    (lambda: dc.kv_cache_bytes(8, layers=1, kv_heads=1, head_dim=1, dtype="int4"), "dtype"),
    (lambda: dc.max_cached_tokens(0, layers=1, kv_heads=1, head_dim=1), "memory_bytes"),
    (lambda: dc.decode_step_cost(8, 4, heads=6, kv_heads=4), "kv_heads"),
])
def test_size_errors_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_model_presets_are_consistent():
    for shape in dc.MODELS.values():
        assert shape.n_heads % shape.n_kv_heads == 0 and shape.source
        assert shape.group == shape.n_heads // shape.n_kv_heads


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


# ------------------------------------------------------------------------------ GQA / MQA

def test_kv_head_index():
    assert dc.kv_head_index(np.arange(8), 8, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dc.kv_head_index(5, 32, 8) == 1 and isinstance(dc.kv_head_index(5, 32, 8), int)
    assert (dc.kv_head_index(np.arange(6), 6, 1) == 0).all()  # MQA
    assert dc.kv_head_index(np.arange(6), 6, 6).tolist() == list(range(6))  # MHA
    with pytest.raises(ValueError, match="n_heads must be a multiple of n_kv_heads"):
        dc.kv_head_index(0, 6, 4)
    with pytest.raises(ValueError, match=r"h must be in \[0, n_heads=6\)"):
        dc.kv_head_index(6, 6, 3)
    with pytest.raises(TypeError, match="h must be an integer"):
        dc.kv_head_index(1.0, 6, 3)


def test_repeat_kv_copies_and_index_map_does_not():
    k = np.arange(2 * 5 * 3, dtype=np.float64).reshape(2, 5, 3)  # (H_kv, N, d)
    r = dc.repeat_kv(k, 6)
    assert r.shape == (6, 5, 3) and not np.shares_memory(r, k)
    for h in range(6):
        np.testing.assert_array_equal(r[h], k[dc.kv_head_index(h, 6, 2)])
        assert np.shares_memory(k[dc.kv_head_index(h, 6, 2)], k)  # a view: no copy
    with pytest.raises(ValueError, match="n_heads must be a multiple"):
        dc.repeat_kv(k, 5)
    with pytest.raises(ValueError, match="x must have shape"):
        dc.repeat_kv(k[0], 4)


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
    o, lse = dc.gqa_attention(q, k, v, causal)
    o_ref, lse_ref = naive_attention_numpy(q, dc.repeat_kv(k, h), dc.repeat_kv(v, h), causal)
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    np.testing.assert_allclose(lse, lse_ref, atol=ATOL)


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_matches_sdpa_enable_gqa(causal):
    rng = np.random.default_rng(7)
    q = rng.normal(size=(2, 12, 19, 16)).astype(np.float32)
    k, v = rng.normal(size=(2, 2, 3, 23, 16)).astype(np.float32)
    o, _ = dc.gqa_attention(q, k, v, causal)
    want = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                          is_causal=causal, enable_gqa=True)
    np.testing.assert_allclose(o, want.numpy(), atol=2e-6)


# ------------------------------------------------------------------------------ masks and tiles

def test_sliding_window_mask():
    m = dc.sliding_window_mask(5, 5, 2)
    assert m.astype(int).tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                                      [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert (dc.sliding_window_mask(7, 9, 1) == np.eye(7, 9, dtype=bool)).all()
    causal = np.tril(np.ones((6, 8), dtype=bool))
    assert (dc.sliding_window_mask(6, 8, 8) == causal).all()
    with pytest.raises(ValueError, match="window"):
        dc.sliding_window_mask(4, 4, 0)


@settings(max_examples=150, deadline=None)
@given(n_q=st.integers(1, 70), n_k=st.integers(1, 70), window=st.integers(1, 80),
       block_m=st.integers(1, 17), block_n=st.integers(1, 17))
def test_window_tile_classes_agree_with_brute_force(n_q, n_k, window, block_m, block_n):
    mask = dc.sliding_window_mask(n_q, n_k, window)
    fast = dc.sliding_window_tile_classes(n_q, n_k, window, block_m, block_n)
    np.testing.assert_array_equal(fast, dc.classify_tiles(mask, block_m, block_n))
    # and the brute force is what it says, tile by tile
    for i, j in [(0, 0), (fast.shape[0] - 1, fast.shape[1] - 1), (fast.shape[0] // 2, 0)]:
        tile = mask[i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
        want = dc.FULL if tile.all() else dc.PARTIAL if tile.any() else dc.SKIP
        assert fast[i, j] == want


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 90), block_m=st.integers(1, 20), block_n=st.integers(1, 20))
def test_window_at_least_n_skips_exactly_the_causal_tiles(n, block_m, block_n):
    classes = dc.sliding_window_tile_classes(n, n, n, block_m, block_n)
    np.testing.assert_array_equal(classes == dc.SKIP, causal_skip_grid(n, n, block_m, block_n))


def test_skipped_fraction_grows_with_n_for_a_fixed_window():
    fractions = [dc.skipped_fraction(dc.sliding_window_tile_classes(n, n, 64, 32, 32))
                 for n in (256, 1024, 4096)]
    assert fractions[0] < fractions[1] < fractions[2] < 1
    # each Q tile computes at most 3 K/V tiles (window 64 with 32-wide tiles)
    assert dc.tile_counts(dc.sliding_window_tile_classes(4096, 4096, 64, 32, 32))["skipped"] >= \
        128 * 128 - 3 * 128
    with pytest.raises(ValueError, match="classes"):
        dc.skipped_fraction(np.zeros((0, 0)))


@settings(max_examples=30, deadline=None)
@given(n_q=st.integers(1, 40), n_k=st.integers(1, 40), window=st.integers(1, 45),
       block_m=st.integers(1, 12), block_n=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_windowed_tiled_attention_equals_masked_reference(n_q, n_k, window, block_m, block_n,
                                                          seed):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, n_q, 8)), rng.normal(size=(2, n_k, 8))
    v = rng.normal(size=(2, n_k, 5))
    counter = IOCounter()
    o, lse = dc.sliding_window_attention_numpy(q, k, v, window, block_m=block_m, block_n=block_n,
                                               counter=counter)
    o_ref, lse_ref = dc.masked_attention_numpy(q, k, v, dc.sliding_window_mask(n_q, n_k, window))
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    np.testing.assert_allclose(lse, lse_ref, atol=ATOL)
    counts = dc.tile_counts(dc.sliding_window_tile_classes(n_q, n_k, window, block_m, block_n))
    kinds = [e.kind for e in counter.events]
    assert kinds.count("skip") == counts["skipped"]
    assert kinds.count("compute") == counts["partial"] + counts["full"]


def test_masked_reference_agrees_with_causal_reference_and_sdpa():
    rng = np.random.default_rng(8)
    q, k, v = rng.normal(size=(3, 2, 21, 8))
    o, lse = dc.masked_attention_numpy(q, k, v, np.tril(np.ones((21, 21), dtype=bool)))
    o_ref, lse_ref = naive_attention_numpy(q, k, v, causal=True)
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    mask = dc.sliding_window_mask(21, 21, 4)
    want = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                          attn_mask=torch.from_numpy(mask))
    np.testing.assert_allclose(dc.masked_attention_numpy(q, k, v, mask)[0], want.numpy(),
                               atol=ATOL)


def test_block_sparse_layout_skips_its_false_tiles():
    rng = np.random.default_rng(9)
    n, bm, bn = 45, 16, 8
    layout = rng.random((3, 6)) < 0.5
    layout[1, :] = False  # Q tile 1 sees nothing: its rows get o = 0, lse = -inf
    mask = dc.block_sparse_mask(layout, n, n, bm, bn)
    classes = dc.classify_tiles(mask, bm, bn)
    np.testing.assert_array_equal(classes == dc.SKIP, ~layout)
    assert set(np.unique(classes)) <= {dc.SKIP, dc.FULL}  # whole tiles: no partial ones
    q, k, v = rng.normal(size=(3, 2, n, 8))
    o, lse = dc.flash_attention_numpy_masked(q, k, v, mask, block_m=bm, block_n=bn)
    o_ref, lse_ref = dc.masked_attention_numpy(q, k, v, mask)
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    np.testing.assert_array_equal(lse[:, 16:32], -np.inf)
    np.testing.assert_array_equal(o[:, 16:32], 0)
    with pytest.raises(ValueError, match="layout must be a boolean array of shape"):
        dc.block_sparse_mask(layout[:2], n, n, bm, bn)


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: dc.masked_attention_numpy(q, k, v, np.ones((4, 4))), "mask must be a 2-D boolean"),
    (lambda q, k, v: dc.masked_attention_numpy(q, k, v, np.ones((4, 5), bool)), r"mask must have shape \(N_q, N_k\)"),
    (lambda q, k, v: dc.masked_attention_numpy(q, k[..., :3], v, np.ones((4, 4), bool)), "do not fit"),
    (lambda q, k, v: dc.flash_attention_numpy_masked(q, k, v, np.ones((4, 4), bool), block_m=0), "block_m"),
    (lambda q, k, v: dc.flash_attention_numpy_masked(q, k, v, np.ones((4, 4), bool), classes=np.zeros((9, 9))), "classes"),
    (lambda q, k, v: dc.sliding_window_attention_numpy(q, k, v, 0), "window"),
    (lambda q, k, v: dc.sliding_window_attention_numpy(q, k, v, 2, scale=float("nan")), "scale"),
])
def test_mask_errors_name_the_argument(call, match):
    q, k, v = np.random.default_rng(10).normal(size=(3, 4, 4))
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, k, v)
