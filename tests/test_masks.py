"""course_lib.attention.masks: sliding-window and block-sparse masks as tile rules for chapter 04's loop —
tile classes against brute force, the tiled loop against the masked reference and SDPA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.attention import masks as mk
from course_lib.attention.iomodel import causal_skip_grid
from course_lib.attention.reference import naive_attention_numpy
from course_lib.attention.tiled import IOCounter, flash_attention_numpy

pytestmark = pytest.mark.ch08

ATOL = 1e-10  # float64 results of exact algorithms agree to ~1e-15


def test_sliding_window_mask():
    m = mk.sliding_window_mask(5, 5, 2)
    assert m.astype(int).tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                                      [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert (mk.sliding_window_mask(7, 9, 1) == np.eye(7, 9, dtype=bool)).all()
    causal = np.tril(np.ones((6, 8), dtype=bool))
    assert (mk.sliding_window_mask(6, 8, 8) == causal).all()
    with pytest.raises(ValueError, match="window"):
        mk.sliding_window_mask(4, 4, 0)


@settings(max_examples=150, deadline=None)
@given(n_q=st.integers(1, 70), n_k=st.integers(1, 70), window=st.integers(1, 80),
       block_m=st.integers(1, 17), block_n=st.integers(1, 17))
def test_window_tile_classes_agree_with_brute_force(n_q, n_k, window, block_m, block_n):
    mask = mk.sliding_window_mask(n_q, n_k, window)
    fast = mk.sliding_window_tile_classes(n_q, n_k, window, block_m, block_n)
    np.testing.assert_array_equal(fast, mk.classify_tiles(mask, block_m, block_n))
    # and the brute force is what it says, tile by tile
    for i, j in [(0, 0), (fast.shape[0] - 1, fast.shape[1] - 1), (fast.shape[0] // 2, 0)]:
        tile = mask[i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
        want = mk.FULL if tile.all() else mk.PARTIAL if tile.any() else mk.SKIP
        assert fast[i, j] == want


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 90), block_m=st.integers(1, 20), block_n=st.integers(1, 20))
def test_window_at_least_n_skips_exactly_the_causal_tiles(n, block_m, block_n):
    classes = mk.sliding_window_tile_classes(n, n, n, block_m, block_n)
    np.testing.assert_array_equal(classes == mk.SKIP, causal_skip_grid(n, n, block_m, block_n))


def test_skipped_fraction_grows_with_n_for_a_fixed_window():
    fractions = [mk.skipped_fraction(mk.sliding_window_tile_classes(n, n, 64, 32, 32))
                 for n in (256, 1024, 4096)]
    assert fractions[0] < fractions[1] < fractions[2] < 1
    # each Q tile computes at most 3 K/V tiles (window 64 with 32-wide tiles)
    assert mk.tile_counts(mk.sliding_window_tile_classes(4096, 4096, 64, 32, 32))["skipped"] >= \
        128 * 128 - 3 * 128
    with pytest.raises(ValueError, match="classes"):
        mk.skipped_fraction(np.zeros((0, 0)))


@settings(max_examples=30, deadline=None)
@given(n_q=st.integers(1, 40), n_k=st.integers(1, 40), window=st.integers(1, 45),
       block_m=st.integers(1, 12), block_n=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_windowed_tiled_attention_equals_masked_reference(n_q, n_k, window, block_m, block_n,
                                                          seed):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, n_q, 8)), rng.normal(size=(2, n_k, 8))
    v = rng.normal(size=(2, n_k, 5))
    counter = IOCounter()
    o, lse = mk.sliding_window_attention_numpy(q, k, v, window, block_m=block_m, block_n=block_n,
                                               counter=counter)
    o_ref, lse_ref = mk.masked_attention_numpy(q, k, v, mk.sliding_window_mask(n_q, n_k, window))
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    np.testing.assert_allclose(lse, lse_ref, atol=ATOL)
    counts = mk.tile_counts(mk.sliding_window_tile_classes(n_q, n_k, window, block_m, block_n))
    kinds = [e.kind for e in counter.events]
    assert kinds.count("skip") == counts["skipped"]
    assert kinds.count("compute") == counts["partial"] + counts["full"]


def test_masked_reference_agrees_with_causal_reference_and_sdpa():
    rng = np.random.default_rng(8)
    q, k, v = rng.normal(size=(3, 2, 21, 8))
    o, lse = mk.masked_attention_numpy(q, k, v, np.tril(np.ones((21, 21), dtype=bool)))
    o_ref, lse_ref = naive_attention_numpy(q, k, v, causal=True)
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    mask = mk.sliding_window_mask(21, 21, 4)
    want = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                          attn_mask=torch.from_numpy(mask))
    np.testing.assert_allclose(mk.masked_attention_numpy(q, k, v, mask)[0], want.numpy(),
                               atol=ATOL)


def test_block_sparse_layout_skips_its_false_tiles():
    rng = np.random.default_rng(9)
    n, bm, bn = 45, 16, 8
    layout = rng.random((3, 6)) < 0.5
    layout[1, :] = False  # Q tile 1 sees nothing: its rows get o = 0, lse = -inf
    mask = mk.block_sparse_mask(layout, n, n, bm, bn)
    classes = mk.classify_tiles(mask, bm, bn)
    np.testing.assert_array_equal(classes == mk.SKIP, ~layout)
    assert set(np.unique(classes)) <= {mk.SKIP, mk.FULL}  # whole tiles: no partial ones
    q, k, v = rng.normal(size=(3, 2, n, 8))
    o, lse = mk.flash_attention_numpy_masked(q, k, v, mask, block_m=bm, block_n=bn)
    o_ref, lse_ref = mk.masked_attention_numpy(q, k, v, mask)
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    np.testing.assert_array_equal(lse[:, 16:32], -np.inf)
    np.testing.assert_array_equal(o[:, 16:32], 0)
    with pytest.raises(ValueError, match="layout must be a boolean array of shape"):
        mk.block_sparse_mask(layout[:2], n, n, bm, bn)


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: mk.masked_attention_numpy(q, k, v, np.ones((4, 4))), "mask must be a 2-D boolean"),
    (lambda q, k, v: mk.masked_attention_numpy(q, k, v, np.ones((4, 5), bool)), r"mask must have shape \(N_q, N_k\)"),
    (lambda q, k, v: mk.masked_attention_numpy(q, k[..., :3], v, np.ones((4, 4), bool)), "do not fit"),
    (lambda q, k, v: mk.flash_attention_numpy_masked(q, k, v, np.ones((4, 4), bool), block_m=0), "block_m"),
    (lambda q, k, v: mk.flash_attention_numpy_masked(q, k, v, np.ones((4, 4), bool), classes=np.zeros((9, 9))), "classes"),
    (lambda q, k, v: mk.sliding_window_attention_numpy(q, k, v, 0), "window"),
    (lambda q, k, v: mk.sliding_window_attention_numpy(q, k, v, 2, scale=float("nan")), "scale"),
])
def test_mask_errors_name_the_argument(call, match):
    q, k, v = np.random.default_rng(10).normal(size=(3, 4, 4))
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, k, v)


def test_block_sparse_rule_equals_its_element_mask():
    rng = np.random.default_rng(12)
    n, bm, bn = 45, 16, 8
    layout = rng.random((3, 6)) < 0.5
    q, k, v = rng.normal(size=(3, 2, n, 8))
    counter = IOCounter()
    o, lse = mk.block_sparse_attention_numpy(q, k, v, layout, block_m=bm, block_n=bn,
                                             counter=counter)
    o_ref, lse_ref = mk.masked_attention_numpy(q, k, v, mk.block_sparse_mask(layout, n, n, bm, bn))
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    np.testing.assert_allclose(lse, lse_ref, atol=ATOL)
    assert [e.kind for e in counter.events].count("skip") == (~layout).sum()
    with pytest.raises(ValueError, match="the layout is given for tiles of 16×8"):
        flash_attention_numpy(q, k, v, block_m=bm, block_n=bn + 1,
                              rule=mk.BlockSparse(layout, bm, bn))


@pytest.mark.parametrize("rule", [mk.SlidingWindow(5), mk.BlockSparse(np.eye(3, dtype=bool), 8, 8),
                                  mk.ElementMask(np.tri(20, 24, -2, dtype=bool))],
                         ids=["window", "block-sparse", "element"])
def test_each_rule_drives_chapter_04s_loop(rule):
    rng = np.random.default_rng(13)
    q, k, v = rng.normal(size=(2, 20, 4)), rng.normal(size=(2, 24, 4)), rng.normal(size=(2, 24, 3))
    o, lse = flash_attention_numpy(q, k, v, block_m=8, block_n=8, rule=rule)
    o_ref, lse_ref = mk.masked_attention_numpy(q, k, v, rule.element_mask(20, 24))
    np.testing.assert_allclose(o, o_ref, atol=ATOL)
    np.testing.assert_allclose(lse, lse_ref, atol=ATOL)  # rows that see nothing: -inf in both
