"""Sliding-window and block-sparse masks as tile rules (chapter 08).

Chapter 04's loop (:func:`course_lib.attention.tiled.flash_attention_numpy`) takes any mask as a
:class:`course_lib.attention.tiled.TileRule`: for each ``(Q tile, K/V tile)`` pair the rule says SKIP
(fully masked: never loaded, never computed), PARTIAL (computed with an element mask) or FULL
(computed without one). The causal mask is one rule; this module adds three more, for the same
loop:

* :class:`SlidingWindow` — query ``i`` sees key ``j`` when ``i − W < j ≤ i`` (window ``W``,
  top-left aligned like the causal mask); its tile classes come from indices alone
  (:func:`sliding_window_tile_classes`), as a kernel computes its loop bounds.
* :class:`BlockSparse` — a ``(T_r, T_c)`` boolean layout says which tiles attend at all; every
  tile is SKIP or FULL.
* :class:`ElementMask` — any boolean ``(N_q, N_k)`` mask, its tile classes found by brute force
  (:func:`classify_tiles`).

:func:`sliding_window_attention_numpy`, :func:`block_sparse_attention_numpy` and
:func:`flash_attention_numpy_masked` are the tiled loop with these rules;
:func:`masked_attention_numpy` is the untiled float64 reference. A query row that sees no key
gets ``o = 0`` and ``lse = -inf`` (the policy of :mod:`course_lib.attention.softmax`).
"""

from __future__ import annotations

import numpy as np

from course_lib.constants import MASK_VALUE
from course_lib.attention.iomodel import num_blocks
from course_lib.attention.iomodel import validate_block_size as _positive_int
from course_lib.attention.tiled import (
    DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, FULL, PARTIAL, SKIP, TILE_CLASS_NAMES, IOCounter, TileRule,
    check_float_array, flash_attention_numpy, resolve_scale, softmax_state, state_lse,
    tile_bounds,
)

__all__ = [
    "SKIP", "PARTIAL", "FULL", "TILE_CLASS_NAMES", "SlidingWindow", "BlockSparse", "ElementMask",
    "sliding_window_mask", "block_sparse_mask", "classify_tiles", "sliding_window_tile_classes",
    "tile_counts", "skipped_fraction", "masked_attention_numpy", "flash_attention_numpy_masked",
    "sliding_window_attention_numpy", "block_sparse_attention_numpy",
]


def _grid_shape(n_q: int, n_k: int, block_m: int, block_n: int) -> tuple[int, int]:
    return num_blocks(n_q, block_m), num_blocks(n_k, block_n)


def _lookup(table: np.ndarray, rows, cols) -> np.ndarray:
    """``table[rows, cols]`` broadcast, False outside the table (the padding of a ragged tile)."""
    inside = (rows < table.shape[0]) & (cols < table.shape[1])
    last_row, last_col = table.shape[0] - 1, table.shape[1] - 1
    return inside & table[np.minimum(rows, last_row), np.minimum(cols, last_col)]


# ----------------------------------------------------------------------------------------------
# sliding window
# ----------------------------------------------------------------------------------------------

def sliding_window_tile_classes(n_q: int, n_k: int, window: int, block_m: int,
                                block_n: int) -> np.ndarray:
    """The same classes as :func:`classify_tiles` of :func:`sliding_window_mask`, from indices.

    A tile covers real query rows ``r0..r1`` and key columns ``c0..c1``. Row ``i`` sees the keys
    ``i−W+1 .. i``, so the rows together see ``r0−W+1 .. r1``:

    * nothing visible (SKIP) when ``c0 > r1`` (above the diagonal, as causal) or
      ``c1 < r0 − W + 1`` (entirely older than the window of the tile's first row);
    * everything visible (FULL) when ``c1 ≤ r0`` (left of the diagonal for every row) and
      ``c0 ≥ r1 − W + 1`` (inside the window of the tile's last row);
    * otherwise PARTIAL.

    This is the test a kernel makes to choose its K/V loop bounds and where to apply a mask.
    """
    n_q, n_k = _positive_int("n_q", n_q), _positive_int("n_k", n_k)
    window = _positive_int("window", window)
    block_m, block_n = _positive_int("block_m", block_m), _positive_int("block_n", block_n)
    (r0, r1), (c0, c1) = tile_bounds(n_q, n_k, block_m, block_n)  # (T_r, 1), (1, T_c)
    none_visible = (c0 > r1) | (c1 < r0 - window + 1)
    all_visible = (c1 <= r0) & (c0 >= r1 - window + 1)
    return np.where(none_visible, SKIP, np.where(all_visible, FULL, PARTIAL))


class SlidingWindow(TileRule):
    """Query ``i`` sees key ``j`` when ``i − window < j ≤ i``; ``window ≥ N_k`` is causal."""

    def __init__(self, window: int):
        self.window = _positive_int("window", window)

    def visible(self, q_idx, k_idx):
        return (k_idx <= q_idx) & (k_idx > q_idx - self.window)

    def tile_classes(self, n_q, n_k, block_m, block_n):
        return sliding_window_tile_classes(n_q, n_k, self.window, block_m, block_n)


def sliding_window_mask(n_q: int, n_k: int, window: int) -> np.ndarray:
    """``(n_q, n_k)`` boolean, True where query ``i`` sees key ``j``: ``i − window < j ≤ i``.

    ``window = 1`` keeps only the diagonal; ``window ≥ n_k`` is the causal mask.
    """
    n_q, n_k = _positive_int("n_q", n_q), _positive_int("n_k", n_k)
    return SlidingWindow(window).element_mask(n_q, n_k)


# ----------------------------------------------------------------------------------------------
# block-sparse
# ----------------------------------------------------------------------------------------------

class BlockSparse(TileRule):
    """A ``(T_r, T_c)`` boolean layout at tile size ``(block_m, block_n)``: ``layout[i, j]`` says
    whether Q tile ``i`` attends to K/V tile ``j`` at all. Every tile is SKIP or FULL."""

    def __init__(self, layout, block_m: int, block_n: int):
        self.layout = np.asarray(layout)
        self.block_m = _positive_int("block_m", block_m)
        self.block_n = _positive_int("block_n", block_n)
        if self.layout.dtype != bool or self.layout.ndim != 2:
            raise ValueError(f"layout must be a boolean array of shape (T_r, T_c), got "
                             f"{self.layout.dtype} {self.layout.shape}")

    def visible(self, q_idx, k_idx):
        return _lookup(self.layout, q_idx // self.block_m, k_idx // self.block_n)

    def tile_classes(self, n_q, n_k, block_m, block_n):
        expected = _grid_shape(n_q, n_k, self.block_m, self.block_n)
        if self.layout.shape != expected:
            raise ValueError(f"layout must be a boolean array of shape (T_r, T_c) = {expected} "
                             f"for n_q={n_q}, n_k={n_k}, block_m={self.block_m}, "
                             f"block_n={self.block_n}; got {self.layout.dtype} "
                             f"{self.layout.shape}")
        if (block_m, block_n) != (self.block_m, self.block_n):
            raise ValueError(f"the layout is given for tiles of {self.block_m}×{self.block_n}; "
                             f"run with block_m={self.block_m}, block_n={self.block_n}, got "
                             f"{block_m}×{block_n}")
        return np.where(self.layout, FULL, SKIP)


def block_sparse_mask(layout, n_q: int, n_k: int, block_m: int, block_n: int) -> np.ndarray:
    """Expand a ``(T_r, T_c)`` boolean block layout to the ``(n_q, n_k)`` element mask.

    ``layout[i, j]`` says whether Q tile ``i`` attends to K/V tile ``j`` at all (every entry of a
    True tile is visible, every entry of a False one masked).
    """
    n_q, n_k = _positive_int("n_q", n_q), _positive_int("n_k", n_k)
    rule = BlockSparse(layout, block_m, block_n)
    rule.tile_classes(n_q, n_k, block_m, block_n)  # checks the layout's shape
    return rule.element_mask(n_q, n_k)


# ----------------------------------------------------------------------------------------------
# any element mask
# ----------------------------------------------------------------------------------------------

def _check_mask(mask) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.ndim != 2:
        raise ValueError(f"mask must be a 2-D boolean array (n_q, n_k), True = visible; got "
                         f"{mask.dtype} with shape {mask.shape}")
    return mask


def classify_tiles(mask, block_m: int, block_n: int) -> np.ndarray:
    """Brute force, for any mask: ``(T_r, T_c)`` of SKIP / PARTIAL / FULL.

    Only real entries count (the padding of a ragged last tile is masked anyway, as in every
    kernel): a tile is FULL when all its real entries are visible, SKIP when none is.
    """
    mask = _check_mask(mask)
    block_m, block_n = _positive_int("block_m", block_m), _positive_int("block_n", block_n)
    n_q, n_k = mask.shape
    t_r, t_c = _grid_shape(n_q, n_k, block_m, block_n)

    def tiles(pad_value):  # (T_r, BLOCK_M, T_c, BLOCK_N), the padding set to pad_value
        padded = np.full((t_r * block_m, t_c * block_n), pad_value)
        padded[:n_q, :n_k] = mask
        return padded.reshape(t_r, block_m, t_c, block_n)

    any_visible = tiles(False).any(axis=(1, 3))
    all_visible = tiles(True).all(axis=(1, 3))
    return np.where(all_visible, FULL, np.where(any_visible, PARTIAL, SKIP))


class ElementMask(TileRule):
    """Any boolean ``(N_q, N_k)`` mask (True = visible). Its tile classes are ``classes`` when
    given (a kernel derives them from indices), else :func:`classify_tiles` of the mask."""

    def __init__(self, mask, classes=None):
        self.mask = _check_mask(mask)
        self.classes = None if classes is None else np.asarray(classes)

    def visible(self, q_idx, k_idx):
        return _lookup(self.mask, q_idx, k_idx)

    def tile_classes(self, n_q, n_k, block_m, block_n):
        if self.mask.shape != (n_q, n_k):
            raise ValueError(f"mask must have shape (N_q, N_k) = {(n_q, n_k)}, got "
                             f"{self.mask.shape}")
        if self.classes is None:
            return classify_tiles(self.mask, block_m, block_n)
        expected = _grid_shape(n_q, n_k, block_m, block_n)
        if self.classes.shape != expected:
            raise ValueError(f"classes must have shape (T_r, T_c) = {expected}, got "
                             f"{self.classes.shape}")
        return self.classes


def tile_counts(classes) -> dict[str, int]:
    """``{"skipped": …, "partial": …, "full": …, "total": …}`` of a tile-class grid."""
    classes = np.asarray(classes)
    return {"skipped": int((classes == SKIP).sum()), "partial": int((classes == PARTIAL).sum()),
            "full": int((classes == FULL).sum()), "total": int(classes.size)}


def skipped_fraction(classes) -> float:
    """Fraction of the tiles that are never loaded nor computed."""
    classes = np.asarray(classes)
    if classes.size == 0:
        raise ValueError("classes must hold at least one tile")
    return float((classes == SKIP).mean())


# ----------------------------------------------------------------------------------------------
# attention with a mask: the reference and the tiled loop
# ----------------------------------------------------------------------------------------------

def _check_masked_inputs(q, k, v, mask, scale):
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_array(name, x)
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape (..., N, d), got shape {x.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1] or q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q (..., N_q, d), k (..., N_k, d) and v (..., N_k, d_v) do not fit "
                         f"together: q {q.shape}, k {k.shape}, v {v.shape}")
    mask = _check_mask(mask)
    if mask.shape != (q.shape[-2], k.shape[-2]):
        raise ValueError(f"mask must have shape (N_q, N_k) = {(q.shape[-2], k.shape[-2])}, "
                         f"got {mask.shape}")
    return mask, resolve_scale(scale, q.shape[-1])


def masked_attention_numpy(q, k, v, mask, scale: float | None = None):
    """Reference attention with any boolean ``(N_q, N_k)`` mask (True = visible), float64 inside.

    Args:
        q: ``(..., N_q, d)``; k: ``(..., N_k, d)``; v: ``(..., N_k, d_v)``; same leading dims.
        mask: ``(N_q, N_k)`` boolean, shared by all leading dims.

    Returns:
        ``(o, lse)``: ``(..., N_q, d_v)`` in the input dtype, ``(..., N_q)`` float64; a row that
        sees no key gets ``o = 0``, ``lse = -inf``.
    """
    mask, scale = _check_masked_inputs(q, k, v, mask, scale)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = np.where(mask, scale * (q64 @ np.swapaxes(k64, -1, -2)), MASK_VALUE)  # (..., N_q, N_k)
    m, l, o = softmax_state(s, v64)
    return o.astype(q.dtype), state_lse(m, l)


def flash_attention_numpy_masked(q, k, v, mask, scale: float | None = None,
                                 block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                                 counter: IOCounter | None = None, classes=None):
    """Tiled attention (FA2 order) with any mask: skip SKIP tiles, mask only PARTIAL ones.

    Chapter 04's loop with an :class:`ElementMask` rule.

    Args:
        q, k, v, mask, scale: as :func:`masked_attention_numpy`.
        block_m, block_n: tile sizes (BLOCK_M, BLOCK_N).
        counter: optional :class:`course_lib.attention.tiled.IOCounter`: reads of q, k, v and writes of
            o, lse (elements), FLOPs, and a "compute" or "skip" event per tile.
        classes: the ``(T_r, T_c)`` tile classes if already known (a kernel derives them from
            indices, e.g. :func:`sliding_window_tile_classes`); default :func:`classify_tiles`.

    Returns:
        ``(o, lse)``: ``(..., N_q, d_v)`` and ``(..., N_q)`` in the input dtype.
    """
    mask, scale = _check_masked_inputs(q, k, v, mask, scale)
    return flash_attention_numpy(q, k, v, scale=scale, block_m=block_m, block_n=block_n,
                                 counter=counter, rule=ElementMask(mask, classes))


def sliding_window_attention_numpy(q, k, v, window: int, scale: float | None = None,
                                   block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                                   counter: IOCounter | None = None):
    """Sliding-window attention (query ``i`` sees keys ``i−W < j ≤ i``), tiled, with the tiles
    outside the band skipped: chapter 04's loop with a :class:`SlidingWindow` rule. Returns
    ``(o, lse)`` as :func:`flash_attention_numpy_masked`."""
    return flash_attention_numpy(q, k, v, scale=scale, block_m=block_m, block_n=block_n,
                                 counter=counter, rule=SlidingWindow(window))


def block_sparse_attention_numpy(q, k, v, layout, scale: float | None = None,
                                 block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                                 counter: IOCounter | None = None):
    """Block-sparse attention: Q tile ``i`` attends to K/V tile ``j`` only where
    ``layout[i, j]``; chapter 04's loop with a :class:`BlockSparse` rule (tiles of
    ``block_m × block_n``). Returns ``(o, lse)`` as :func:`flash_attention_numpy_masked`."""
    return flash_attention_numpy(q, k, v, scale=scale, block_m=block_m, block_n=block_n,
                                 counter=counter, rule=BlockSparse(layout, block_m, block_n))
