"""Block masks (chapter 10): tile classes against the element masks they stand for, the tile lists,
and the named errors. Pure torch on the CPU: no kernel runs here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from course_lib.attention import blockmask as bm
from course_lib.attention.masks import FULL, PARTIAL, SKIP, sliding_window_tile_classes

pytestmark = pytest.mark.ch10


def expected_classes(mask: torch.Tensor, block_m: int, block_n: int, len_q=None) -> torch.Tensor:
    """Brute force, the module's convention: ``mask`` ``(B, H, n_q, n_k)``; columns past ``n_k`` are
    hidden, rows past ``n_q`` (or past ``len_q[b]``) are ignored."""
    nb, nh, n_q, n_k = mask.shape
    t_q, t_k = math.ceil(n_q / block_m), math.ceil(n_k / block_n)
    out = torch.empty((nb, nh, t_q, t_k), dtype=torch.int8)
    for b in range(nb):
        rows_real = n_q if len_q is None else int(len_q[b])
        for h in range(nh):
            for i in range(t_q):
                r0, r1 = i * block_m, min((i + 1) * block_m, rows_real)
                for j in range(t_k):
                    c0 = j * block_n
                    tile = torch.zeros((max(r1 - r0, 0), block_n), dtype=torch.bool)
                    cols = mask[b, h, r0:r1, c0:c0 + block_n]
                    tile[:, :cols.shape[1]] = cols
                    if tile.numel() == 0 or not tile.any():
                        out[b, h, i, j] = SKIP
                    elif tile.all():
                        out[b, h, i, j] = FULL
                    else:
                        out[b, h, i, j] = PARTIAL
    return out


def band_mask(n_q, n_k, window=None, causal=False, len_q=None, len_k=None, batch=1):
    """The element mask of FlashAttention-2's window (bottom-right) + top-left causal + lengths."""
    out = torch.zeros((batch, 1, n_q, n_k), dtype=torch.bool)
    for b in range(batch):
        lq = n_q if len_q is None else int(len_q[b])
        lk = n_k if len_k is None else int(len_k[b])
        i = torch.arange(n_q)[:, None]
        j = torch.arange(n_k)[None, :]
        m = (i < lq) & (j < lk)
        off = lk - lq
        if window is not None:
            left, right = window
            if left >= 0:
                m &= j >= i + off - left
            if right >= 0:
                m &= j <= i + off + right
        if causal:
            m &= j <= i
        out[b, 0] = m
    return out


@pytest.mark.parametrize("n_q, n_k", [(70, 70), (45, 90), (90, 45), (64, 64)])
@pytest.mark.parametrize("window, causal", [(None, True), ((5, 0), False), ((5, 0), True), ((3, 7), False),
                                            ((-1, 4), False), ((10, -1), True), ((0, 0), False)])
def test_band_classes_are_exact(n_q, n_k, window, causal):
    lo, hi = bm.window_band(window, n_q, n_k, causal)
    got = bm.band_tile_classes(n_q, n_k, 16, 32, lo=lo, hi=hi)
    assert torch.equal(got, expected_classes(band_mask(n_q, n_k, window, causal), 16, 32))


def test_length_classes_are_exact_and_ignore_padding_rows():
    len_q, len_k = torch.tensor([50, 0, 64, 17]), torch.tensor([33, 5, 64, 64])
    for causal, window in ((False, None), (True, None), (False, (6, 2))):
        lo, hi = bm.window_band(window, len_q.long(), len_k.long(), causal)
        got = bm.band_tile_classes(64, 64, 16, 16, lo=lo, hi=hi, len_q=len_q, len_k=len_k)
        mask = band_mask(64, 64, window, causal, len_q, len_k, batch=4)
        assert torch.equal(got, expected_classes(mask, 16, 16, len_q=len_q))
    # a tile of real rows 48..49 and padding rows 50..63 can be FULL: the padding is ignored
    lengths = bm.length_block_mask(len_q, len_k, 64, 64, 16, 16)
    assert lengths.classes[0, 0, 3, 0] == FULL
    assert lengths.classes[1].eq(SKIP).all()  # an empty sample visits nothing


def test_band_matches_chapter08_sliding_window():
    """Chapter 08's window W (i − W < j ≤ i) is FlashAttention-2's (W − 1, 0) with causal."""
    for n, w in ((128, 20), (96, 7), (64, 64)):
        lo, hi = bm.window_band((w - 1, 0), n, n, causal=True)
        got = bm.band_tile_classes(n, n, 32, 32, lo=lo, hi=hi)[0, 0].numpy()
        np.testing.assert_array_equal(got, sliding_window_tile_classes(n, n, w, 32, 32))


def test_from_mask_mod_is_exact_and_keeps_the_mask():
    def mask_mod(b, h, q, kv):
        return ((q + 2 * kv) % 5 == 0) | ((b == 1) & (kv < 20)) | ((h == 0) & (q >= kv))

    m = bm.BlockMask.from_mask_mod(mask_mod, 2, 2, 50, 70, 16, 32)
    b, h = torch.arange(2)[:, None, None, None], torch.arange(2)[None, :, None, None]
    dense = mask_mod(b, h, torch.arange(50)[None, None, :, None], torch.arange(70)[None, None, None, :])
    assert torch.equal(m.mask, dense)
    assert torch.equal(m.classes, expected_classes(dense, 16, 32))
    assert m.shape == (2, 2, 4, 3) and m.block_size == (16, 32)


def test_mask_mods_match_the_band_and_lengths():
    n_q, n_k = 40, 56
    win = bm.BlockMask.from_mask_mod(bm.and_masks(bm.sliding_window_mask_mod((4, 3), n_q, n_k),
                                                  bm.causal_mask_mod), None, None, n_q, n_k, 16, 16)
    assert torch.equal(win.mask, band_mask(n_q, n_k, (4, 3), True))
    len_q, len_k = torch.tensor([10, 40]), torch.tensor([56, 3])
    lens = bm.BlockMask.from_mask_mod(bm.length_mask_mod(len_q, len_k), 2, None, n_q, n_k, 16, 16)
    assert torch.equal(lens.mask, band_mask(n_q, n_k, None, False, len_q, len_k, batch=2))


def test_document_classes_are_exact():
    docs = torch.tensor([[0] * 20 + [1] * 40 + [2] * 5 + [3] * 35, [0] * 100])
    for causal in (False, True):
        m = bm.document_block_mask(docs, 16, 32, causal=causal)
        dense = (docs[:, :, None] == docs[:, None, :])[:, None]
        if causal:
            dense = dense & torch.ones(100, 100, dtype=torch.bool).tril()
            # the intersection is conservative: sound, and exact here except on mixed tiles
            exp = expected_classes(dense, 16, 32)
            assert not ((m.classes == FULL) & (exp != FULL)).any()
            assert not ((m.classes == SKIP) & (exp != SKIP)).any()
        else:
            assert torch.equal(m.classes, expected_classes(dense, 16, 32))
        assert torch.equal(m.document_ids[0], docs.to(torch.int32))
    mm = bm.BlockMask.from_mask_mod(bm.document_mask_mod(docs), 2, None, 100, 100, 16, 32)
    assert torch.equal(mm.classes, bm.document_block_mask(docs, 16, 32).classes)


def test_layout_and_ragged_last_tile():
    layout = torch.tensor([[True, False, True], [False, True, True]])
    m = bm.BlockMask.from_layout(layout, 40, 70, 32, 32)  # the last K/V tile holds 6 real keys
    assert m.classes[0, 0].tolist() == [[FULL, SKIP, PARTIAL], [SKIP, FULL, PARTIAL]]
    m = bm.BlockMask.from_layout(layout, 40, 96, 32, 32)
    assert m.classes[0, 0].tolist() == [[FULL, SKIP, FULL], [SKIP, FULL, FULL]]


def test_lists_and_transposed_lists():
    classes = torch.tensor([[FULL, SKIP, PARTIAL, FULL], [SKIP, SKIP, SKIP, PARTIAL], [PARTIAL, FULL, FULL, FULL]])
    m = bm.BlockMask(classes, 48, 64, 16, 16)
    assert m.full_kv_num_blocks[0, 0].tolist() == [2, 0, 3]
    assert m.kv_num_blocks[0, 0].tolist() == [1, 1, 1]
    assert m.full_kv_indices[0, 0, 0, :2].tolist() == [0, 3]
    assert m.full_kv_indices[0, 0, 2, :3].tolist() == [1, 2, 3]
    assert m.kv_indices[0, 0, 1, :1].tolist() == [3]
    assert m.full_q_num_blocks[0, 0].tolist() == [1, 1, 1, 2]
    assert m.q_num_blocks[0, 0].tolist() == [1, 0, 1, 1]
    assert m.full_q_indices[0, 0, 3, :2].tolist() == [0, 2]
    assert m.q_indices[0, 0, 0, :1].tolist() == [2]
    for x in (m.full_kv_indices, m.kv_indices, m.full_q_num_blocks):
        assert x.dtype == torch.int32
    assert m.counts() == {"skipped": 4, "partial": 3, "full": 5, "total": 12}
    assert m.density() == pytest.approx(8 / 12)
    assert "full=5" in repr(m)


def test_combine_classes():
    a = torch.tensor([SKIP, PARTIAL, FULL, FULL, PARTIAL])
    b = torch.tensor([FULL, FULL, FULL, PARTIAL, SKIP])
    assert bm.combine_classes(a, b).tolist() == [SKIP, PARTIAL, FULL, PARTIAL, SKIP]


def test_named_errors():
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        bm.BlockMask(torch.zeros(3, 3), 48, 48, 24, 16)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        bm.causal_block_mask(48, 48, 16, 8)
    with pytest.raises(TypeError, match="block_m must be an int"):
        bm.causal_block_mask(48, 48, 16.0, 16)
    with pytest.raises(ValueError, match="n_q must be >= 1"):
        bm.causal_block_mask(0, 48, 16, 16)
    with pytest.raises(ValueError, match=r"classes must have shape .* \(3, 2\)"):
        bm.BlockMask(torch.zeros(3, 3), 48, 32, 16, 16)
    with pytest.raises(TypeError, match="classes must be an integer tensor"):
        bm.BlockMask(torch.zeros(3, 3), 48, 48, 16, 16)
    with pytest.raises(ValueError, match="mask must be a boolean"):
        bm.BlockMask(torch.zeros(3, 3, dtype=torch.int8), 48, 48, 16, 16,
                     mask=torch.ones(1, 1, 48, 40, dtype=torch.bool))
    with pytest.raises(ValueError, match="document_ids must be"):
        bm.BlockMask(torch.zeros(3, 3, dtype=torch.int8), 48, 48, 16, 16,
                     document_ids=(torch.zeros(1, 48), torch.zeros(1, 47)))
    with pytest.raises(ValueError, match="document_ids must be non-decreasing"):
        bm.document_block_mask(torch.tensor([0, 0, 1, 0]), 16, 16)
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        bm.document_block_mask(torch.zeros(4), 16, 16)
    with pytest.raises(ValueError, match="document_ids_k must have shape"):
        bm.document_block_mask(torch.zeros(4, dtype=torch.int64), 16, 16,
                               document_ids_k=torch.zeros(1, 1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="window sizes must be >= -1"):
        bm.sliding_window_block_mask(32, 32, (-2, 0), 16, 16)
    with pytest.raises(TypeError, match="window must be a pair"):
        bm.validate_window(3)
    with pytest.raises(TypeError, match="window must be a pair"):
        bm.validate_window((1.5, 0))
    with pytest.raises(TypeError, match="mask_mod must return booleans"):
        bm.BlockMask.from_mask_mod(lambda b, h, q, kv: q - kv, None, None, 16, 16, 16, 16)
    with pytest.raises(TypeError, match="layout must be a boolean tensor"):
        bm.BlockMask.from_layout(torch.ones(2, 2), 32, 32, 16, 16)
