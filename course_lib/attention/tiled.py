"""Tiled FlashAttention forward in NumPy, with every HBM read and write countable.

Chapter 04 builds the algorithm with explicit tiles. Arrays passed in play the part of HBM (the
GPU's large, slow memory); a *tile* copied out of them plays the part of SRAM (small, fast,
on-chip). Two loop orders give the same answer and move different amounts of data:

* **FA2 order** (:func:`flash_attention_numpy`, the main implementation): the outer loop walks
  over Q tiles, the inner loop over K/V tiles. The running max ``m_i``, running sum ``l_i`` and
  the unnormalised output ``acc`` stay on chip for the whole inner loop; ``o`` and ``lse`` are
  written once per Q tile.
* **FA1 order** (:func:`flash_attention_numpy_fa1`, the 2022 paper's Algorithm 1): the outer
  loop walks over K/V tiles, the inner loop over Q tiles, so each Q tile's ``o``, ``l`` and ``m``
  are read from HBM, updated and written back for every K/V tile.

Tiles are loaded the way a GPU kernel loads them: always ``BLOCK_M × d`` / ``BLOCK_N × d``, with
the rows past the end filled with zeros (a masked load), and the padded key columns masked to
``-inf`` before the softmax. The causal mask is aligned top-left, as in
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``: query ``i`` sees key ``j``
when ``j <= i``.

**Tile classes.** A mask is given to the loop as a *rule* (:class:`TileRule`) that sorts every
``(Q tile, K/V tile)`` pair into one of three classes: SKIP (the mask hides the whole tile: never
loaded, never computed), PARTIAL (computed with an element mask) or FULL (computed without one).
No mask (:data:`DENSE`) makes every tile FULL; the causal mask (:data:`CAUSAL`) skips the tiles
above the diagonal and masks only those it cuts. Chapter 08's sliding-window and block-sparse
masks are more rules (:mod:`course_lib.attention.masks`) for the same loop. The online-softmax update of
one tile (:func:`online_softmax_step`) and the epilogue (:func:`finish_tile`) are written once,
for both loop orders; chapter 04's checks model wrong answers by swapping in mistaken ones.

Pass an :class:`IOCounter` as ``counter=`` to record the elements read from and written to HBM
(only in-bounds elements, as a masked load reads), the FLOPs, and the sequence of tile events.
The closed-form formulas for all these counts are in :mod:`course_lib.attention.iomodel`.

FLOP convention (shared with :mod:`course_lib.attention.costmodel`): a multiply-add is 2 FLOPs; inside a
tile each score costs ``ONLINE_SOFTMAX_FLOPS_PER_SCORE`` (max, subtract, exp, add to the sum)
plus one select when a mask is on (``TileRule.mask_flops``); see :mod:`course_lib.attention.iomodel` for
the per-row terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real

import numpy as np

from course_lib.constants import MASK_VALUE
from course_lib.attention.costmodel import (
    DROPOUT_FLOPS_PER_ELEMENT, FLOPS_PER_MULTIPLY_ADD, MASK_FLOPS_PER_ELEMENT,
    SOFTMAX_FLOPS_PER_ELEMENT,
)
from course_lib.attention.iomodel import (  # the tile grid and the per-tile FLOP convention
    FA1_O_FLOPS_PER_ELEMENT, FA2_ACC_FLOPS_PER_ELEMENT, LSE_FLOPS_PER_ROW, ROW_UPDATE_FLOPS,
    TileEvent, block_rows, causal_skip_grid, num_blocks, tile_fully_masked, tile_score_flops,
    validate_block_size,
)
from course_lib.attention.reference import (
    NUMPY_FLOAT_DTYPES, causal_mask, default_scale, validate_qkv_numpy,
)
from course_lib.attention.softmax import correction_factor

__all__ = [
    "DEFAULT_BLOCK_M", "DEFAULT_BLOCK_N", "MASK_VALUE", "IOCounter", "TileEvent",
    "validate_block_size", "num_blocks", "block_rows", "load_tile", "tile_fully_masked",
    "causal_skip_grid", "SKIP", "PARTIAL", "FULL", "TILE_CLASS_NAMES", "tile_bounds", "TileRule",
    "Dense", "Causal", "DENSE", "CAUSAL", "empty_state", "online_softmax_step", "state_lse",
    "finish_tile", "softmax_state", "mask_scores", "check_float_array", "resolve_scale",
    "flash_attention_numpy", "flash_attention_numpy_fa1", "standard_attention_numpy",
]

# Default tile sizes: small enough that the learner's CPU runs stay quick, and deliberately not
# equal, so that a mix-up of BLOCK_M and BLOCK_N shows up.
DEFAULT_BLOCK_M = 32  # B_r in the paper: query rows per tile
DEFAULT_BLOCK_N = 16  # B_c in the paper: key/value rows per tile

# ----------------------------------------------------------------------------------------------
# the IO counter
# ----------------------------------------------------------------------------------------------

@dataclass
class IOCounter:
    """Counts elements moved between HBM and SRAM, FLOPs, and tile events.

    ``reads_by`` / ``writes_by`` split the totals by array name (``"q"``, ``"k"``, ``"v"``,
    ``"o"``, ``"l"``, ``"m"``, ``"lse"``, ``"S"``, ``"P"``). Counts are elements, not bytes:
    multiply by the element size for bytes. ``record_events=False`` keeps only the totals.
    """

    reads: int = 0
    writes: int = 0
    flops: int = 0
    reads_by: dict = field(default_factory=dict)
    writes_by: dict = field(default_factory=dict)
    events: list = field(default_factory=list)
    record_events: bool = True

    def read(self, name: str, elements: int) -> None:
        """Record ``elements`` read from HBM into SRAM."""
        self.reads += int(elements)
        self.reads_by[name] = self.reads_by.get(name, 0) + int(elements)

    def write(self, name: str, elements: int) -> None:
        """Record ``elements`` written from SRAM to HBM."""
        self.writes += int(elements)
        self.writes_by[name] = self.writes_by.get(name, 0) + int(elements)

    def flop(self, count: int) -> None:
        """Record ``count`` floating-point operations."""
        self.flops += int(count)

    def event(self, kind: str, q_block: int | None, kv_block: int | None) -> None:
        """Record a tile event with a snapshot of the counters."""
        if self.record_events:
            self.events.append(TileEvent(kind, q_block, kv_block, self.reads, self.writes,
                                         self.flops))

    @property
    def total(self) -> int:
        """Reads plus writes, in elements."""
        return self.reads + self.writes


# ----------------------------------------------------------------------------------------------
# tiles
# ----------------------------------------------------------------------------------------------

def load_tile(x: np.ndarray, start: int, block: int) -> np.ndarray:
    """Rows ``start:start+block`` of ``x`` (..., N, d) as a ``(..., block, d)`` tile.

    Rows past ``N`` are zeros, like a masked GPU load with ``other=0``: the tile always has the
    full block shape, so whoever uses it must mask the padded rows.
    """
    tile = np.zeros(x.shape[:-2] + (block, x.shape[-1]), dtype=x.dtype)  # (..., block, d)
    stop = min(start + block, x.shape[-2])
    tile[..., : stop - start, :] = x[..., start:stop, :]
    return tile


def _prepare(q, k, v, scale, block_m, block_n):
    validate_qkv_numpy(q, k, v, scale)
    block_m = validate_block_size("block_m", block_m)
    block_n = validate_block_size("block_n", block_n)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    scale = default_scale(q.shape[-1]) if scale is None else scale
    return scale, block_m, block_n


def _batch(x: np.ndarray) -> int:
    """Number of independent attention problems (product of the leading dims)."""
    return math.prod(x.shape[:-2])


def _safe(m: np.ndarray) -> np.ndarray:
    """``m`` with ``-inf`` replaced by 0, so ``exp(s - m)`` of an all-masked row is 0, not NaN."""
    return np.where(np.isfinite(m), m, 0.0)


def check_float_array(name: str, x) -> np.ndarray:
    """``x`` if it is a float32/float64 NumPy array; TypeError naming ``name`` otherwise."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if x.dtype.type not in NUMPY_FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64, got dtype {x.dtype}")
    return x


def resolve_scale(scale, head_dim: int) -> float:
    """``scale`` as a float, ``1/sqrt(head_dim)`` when None; ValueError unless finite."""
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    return float(scale)


# ----------------------------------------------------------------------------------------------
# tile classes: which (Q tile, K/V tile) pairs a mask skips, cuts or leaves whole
# ----------------------------------------------------------------------------------------------

SKIP, PARTIAL, FULL = 0, 1, 2  # fully masked, partly masked, fully visible
TILE_CLASS_NAMES = {SKIP: "skipped (fully masked)", PARTIAL: "partial (needs a mask)",
                    FULL: "full (no mask)"}


def tile_bounds(n_q: int, n_k: int, block_m: int, block_n: int):
    """First and last *real* query row and key column of every tile, ``((r0, r1), (c0, c1))``.

    ``r0``, ``r1`` are ``(T_r, 1)``, ``c0``, ``c1`` are ``(1, T_c)``, so that a comparison of them
    broadcasts to the ``(T_r, T_c)`` grid. The padding of a ragged last tile is left out: it is
    masked anyway, whatever the rule.
    """
    i = np.arange(num_blocks(n_q, block_m))[:, None]  # (T_r, 1)
    j = np.arange(num_blocks(n_k, block_n))[None, :]  # (1, T_c)
    r0, r1 = i * block_m, np.minimum((i + 1) * block_m, n_q) - 1
    c0, c1 = j * block_n, np.minimum((j + 1) * block_n, n_k) - 1
    return (r0, r1), (c0, c1)


class TileRule:
    """A mask, as the tiled loop uses it: the class of each tile and, inside a PARTIAL tile,
    which scores are visible.

    A rule answers two questions. :meth:`tile_classes` — for the whole ``(T_r, T_c)`` grid, SKIP,
    PARTIAL or FULL, from tile indices alone, as a kernel chooses its loop bounds;
    :meth:`visible` — for query positions ``q_idx`` ``(BLOCK_M, 1)`` and key positions ``k_idx``
    ``(1, BLOCK_N)``, True where query ``i`` may see key ``j``. ``mask_flops`` is what the FLOP
    convention charges each score of a computed tile for the select (:mod:`course_lib.attention.iomodel`).
    """

    mask_flops = MASK_FLOPS_PER_ELEMENT

    def visible(self, q_idx: np.ndarray, k_idx: np.ndarray) -> np.ndarray:
        """Boolean, broadcast of ``q_idx`` (BLOCK_M, 1) and ``k_idx`` (1, BLOCK_N)."""
        raise NotImplementedError

    def tile_classes(self, n_q: int, n_k: int, block_m: int, block_n: int) -> np.ndarray:
        """``(T_r, T_c)`` integer grid of SKIP / PARTIAL / FULL."""
        raise NotImplementedError

    def tile_mask(self, q_idx: np.ndarray, k_idx: np.ndarray, n_k: int) -> np.ndarray:
        """The element mask of a tile: visible, and a real key (not the padding past ``n_k``)."""
        return (k_idx < n_k) & self.visible(q_idx, k_idx)

    def element_mask(self, n_q: int, n_k: int) -> np.ndarray:
        """The whole ``(n_q, n_k)`` boolean mask, True = visible."""
        visible = self.visible(np.arange(n_q)[:, None], np.arange(n_k)[None, :])
        return np.broadcast_to(visible, (n_q, n_k)).copy()


class Dense(TileRule):
    """No mask: every tile FULL (only the ragged last K/V tile masks its padding)."""

    mask_flops = 0

    def visible(self, q_idx, k_idx):
        return np.ones(np.broadcast_shapes(np.shape(q_idx), np.shape(k_idx)), dtype=bool)

    def tile_classes(self, n_q, n_k, block_m, block_n):
        return np.full((num_blocks(n_q, block_m), num_blocks(n_k, block_n)), FULL)


class Causal(TileRule):
    """Top-left aligned causal mask (query ``i`` sees key ``j <= i``, as SDPA's ``is_causal``).

    A tile is SKIP when its first key comes after its last real query (chapter 04's skip test,
    :func:`course_lib.attention.iomodel.causal_skip_grid`), FULL when its last real key is at or before
    its first query, PARTIAL (cut by the diagonal) otherwise.
    """

    def visible(self, q_idx, k_idx):
        return k_idx <= q_idx

    def tile_classes(self, n_q, n_k, block_m, block_n):
        (r0, _), (_, c1) = tile_bounds(n_q, n_k, block_m, block_n)
        skip = causal_skip_grid(n_q, n_k, block_m, block_n)  # (T_r, T_c)
        return np.where(skip, SKIP, np.where(c1 <= r0, FULL, PARTIAL))


DENSE, CAUSAL = Dense(), Causal()


def _rule(causal: bool, rule: TileRule | None) -> TileRule:
    if rule is None:
        return CAUSAL if causal else DENSE
    if causal:
        raise ValueError("pass causal=True or a rule, not both (the rule already says what is "
                         "visible)")
    return rule


def mask_scores(s, rule: TileRule, tile_class: int, q_start: int, k_start: int, n_k: int):
    """The scores ``s`` ``(..., BLOCK_M, BLOCK_N)`` of a computed tile, ``-inf`` where masked.

    Only a PARTIAL tile, or the ragged last K/V tile (its padding is not keys), needs the
    element mask; a FULL tile is returned as it is.
    """
    block_m, block_n = s.shape[-2:]
    if tile_class == FULL and k_start + block_n <= n_k:
        return s
    q_idx = q_start + np.arange(block_m)[:, None]  # (BLOCK_M, 1) query positions
    k_idx = k_start + np.arange(block_n)[None, :]  # (1, BLOCK_N) key positions
    return np.where(rule.tile_mask(q_idx, k_idx, n_k), s, MASK_VALUE)


# ----------------------------------------------------------------------------------------------
# the online-softmax state of a Q tile: start, update with one K/V tile, finish
# ----------------------------------------------------------------------------------------------

def empty_state(rows: tuple, d_v: int, dtype):
    """The state before any key: ``m = -inf``, ``l = 0`` ``rows``; ``acc = 0`` ``rows + (d_v,)``."""
    return (np.full(rows, -np.inf, dtype=dtype), np.zeros(rows, dtype=dtype),
            np.zeros(rows + (d_v,), dtype=dtype))


def online_softmax_step(m_i, l_i, acc, s, v_tile):
    """Fold one tile of scores into the running state: a new max rescales everything so far.

    Args:
        m_i, l_i: running max and sum ``(..., BLOCK_M)``; acc: unnormalised output
            ``(..., BLOCK_M, d_v)``; s: scaled scores ``(..., BLOCK_M, BLOCK_N)``, ``-inf`` where
            masked; v_tile: ``(..., BLOCK_N, d_v)``.

    Returns:
        The updated ``(m_i, l_i, acc)``.
    """
    m_new = np.maximum(m_i, np.max(s, axis=-1, initial=-np.inf))  # (..., BLOCK_M)
    alpha = correction_factor(m_i, m_new)  # (..., BLOCK_M) exp(m_old - m_new): old state to new max
    p = np.exp(s - _safe(m_new)[..., None])  # (..., BLOCK_M, BLOCK_N)
    return m_new, alpha * l_i + p.sum(axis=-1), alpha[..., None] * acc + p @ v_tile


def state_lse(m, l):
    """``lse = m + log l``, and ``-inf`` for the empty state (``l = 0``)."""
    has_keys = l > 0
    with np.errstate(divide="ignore"):
        return np.where(has_keys, m + np.log(np.where(has_keys, l, 1)), -np.inf)


def finish_tile(m_i, l_i, acc):
    """Epilogue of a Q tile: ``(o, lse)`` with ``o = acc / l``; ``o = 0``, ``lse = -inf`` for a
    row that saw no key (the policy of :mod:`course_lib.attention.softmax`)."""
    has_keys = (l_i > 0)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(has_keys, acc / np.where(has_keys, l_i[..., None], 1), 0)
    return o, state_lse(m_i, l_i)


def softmax_state(s, v):
    """Softmax state of a block of scores, as one step from the empty state: ``(m, l, o)``.

    ``s`` ``(..., R, C)`` holds ``-inf`` where masked (``C`` may be 0); ``v`` ``(..., C, d_v)``.
    ``o`` ``(..., R, d_v)`` is *normalised* (chapter 03's convention for merging states); an
    all-masked row is the empty state ``m = -inf, l = 0, o = 0``.
    """
    dtype = np.result_type(s, v)
    m, l, acc = online_softmax_step(*empty_state(s.shape[:-1], v.shape[-1], dtype), s, v)
    return m, l, finish_tile(m, l, acc)[0]


# ----------------------------------------------------------------------------------------------
# FA2 loop order: outer over Q tiles, inner over K/V tiles
# ----------------------------------------------------------------------------------------------

def flash_attention_numpy(q, k, v, causal: bool = False, scale: float | None = None,
                          block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                          counter: IOCounter | None = None, *, rule: TileRule | None = None,
                          step=online_softmax_step, finish=finish_tile):
    """FlashAttention forward, FA2 loop order (outer Q tiles, inner K/V tiles), in NumPy.

    Args:
        q: ``(..., N_q, d)``; k: ``(..., N_k, d)``; v: ``(..., N_k, d_v)``; float32 or float64,
            all the same dtype, same leading dims.
        causal: hide key ``j > i`` from query ``i`` (top-left aligned, as SDPA's ``is_causal``);
            tiles the mask hides completely are skipped.
        scale: score scale, default ``1/sqrt(d)``.
        block_m: query rows per tile (B_r, ``BLOCK_M``). block_n: key rows per tile (B_c,
            ``BLOCK_N``). Any positive ints; N need not be a multiple of them.
        counter: optional :class:`IOCounter` that records HBM traffic, FLOPs and tile events.
        rule: any other mask as a :class:`TileRule` (sliding window, block-sparse:
            :mod:`course_lib.attention.masks`), instead of ``causal``.
        step, finish: the online-softmax update of one tile and the epilogue of a Q tile, as
            :func:`online_softmax_step` and :func:`finish_tile` (chapter 04's checks swap in
            mistaken ones to model wrong answers).

    Returns:
        ``(o, lse)``: ``o`` ``(..., N_q, d_v)`` and ``lse`` ``(..., N_q)`` (natural-log
        log-sum-exp of each query's scaled scores), both in the input dtype. A query that sees
        no key gets ``o = 0``, ``lse = -inf``.
    """
    scale, block_m, block_n = _prepare(q, k, v, scale, block_m, block_n)
    rule = _rule(causal, rule)
    n_q, n_k, d, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    batch = _batch(q)
    lead = q.shape[:-2]
    dtype = q.dtype
    classes = rule.tile_classes(n_q, n_k, block_m, block_n)  # (T_r, T_c) SKIP / PARTIAL / FULL
    o = np.empty(lead + (n_q, d_v), dtype=dtype)  # (..., N_q, d_v), "in HBM"
    lse = np.empty(lead + (n_q,), dtype=dtype)  # (..., N_q)

    for i in range(num_blocks(n_q, block_m)):
        q_start, rows = i * block_m, block_rows(i, n_q, block_m)
        q_tile = load_tile(q, q_start, block_m)  # (..., BLOCK_M, d)
        if counter:
            counter.read("q", batch * rows * d)
        # running max m_i, running sum l_i (relative to m_i), unnormalised output acc
        m_i, l_i, acc = empty_state(lead + (block_m,), d_v, dtype)
        for j in range(num_blocks(n_k, block_n)):
            if classes[i, j] == SKIP:
                if counter:
                    counter.event("skip", i, j)
                continue  # a GPU kernel would stop its loop here; we go on to show the skips
            k_start, cols = j * block_n, block_rows(j, n_k, block_n)
            k_tile = load_tile(k, k_start, block_n)  # (..., BLOCK_N, d)
            v_tile = load_tile(v, k_start, block_n)  # (..., BLOCK_N, d_v)
            s = scale * (q_tile @ np.swapaxes(k_tile, -1, -2))  # (..., BLOCK_M, BLOCK_N)
            s = mask_scores(s, rule, classes[i, j], q_start, k_start, n_k)
            # the online-softmax update: a new max rescales everything summed so far
            m_i, l_i, acc = step(m_i, l_i, acc, s, v_tile)
            if counter:
                counter.read("k", batch * cols * d)
                counter.read("v", batch * cols * d_v)
                counter.flop(batch * tile_score_flops(rows, cols, d, d_v, rule.mask_flops))
                counter.flop(batch * rows * (ROW_UPDATE_FLOPS + FA2_ACC_FLOPS_PER_ELEMENT * d_v))
                counter.event("compute", i, j)
        o_tile, lse_tile = finish(m_i, l_i, acc)  # (..., BLOCK_M, d_v), (..., BLOCK_M)
        o[..., q_start:q_start + rows, :] = o_tile[..., :rows, :]
        lse[..., q_start:q_start + rows] = lse_tile[..., :rows]
        if counter:
            counter.write("o", batch * rows * d_v)
            counter.write("lse", batch * rows)
            counter.flop(batch * rows * (d_v + LSE_FLOPS_PER_ROW))
            counter.event("store", i, None)
    return o, lse


# ----------------------------------------------------------------------------------------------
# FA1 loop order: outer over K/V tiles, inner over Q tiles, o/l/m round-trip through HBM
# ----------------------------------------------------------------------------------------------

def flash_attention_numpy_fa1(q, k, v, causal: bool = False, scale: float | None = None,
                              block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                              counter: IOCounter | None = None, *,
                              rule: TileRule | None = None, step=online_softmax_step,
                              finish=finish_tile):
    """FlashAttention forward, FA1 loop order (the 2022 paper's Algorithm 1), in NumPy.

    The outer loop loads one K/V tile; the inner loop visits every Q tile and, for each, reads
    ``q``, the *normalised* output ``o`` and the softmax state ``l``, ``m`` from HBM, folds the
    new tile in, and writes ``o``, ``l``, ``m`` back. ``o``, ``l``, ``m`` start in HBM as 0, 0 and
    -inf (counted as writes); a last pass reads ``m`` and ``l`` and writes ``lse = m + log l``.

    Arguments and return value as :func:`flash_attention_numpy` (``rule``, ``step`` and
    ``finish`` too: chapter 04's checks swap in mistaken ones to model wrong FA1 answers).
    """
    scale, block_m, block_n = _prepare(q, k, v, scale, block_m, block_n)
    n_q, n_k, d, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    batch = _batch(q)
    lead = q.shape[:-2]
    dtype = q.dtype
    rule = _rule(causal, rule)
    classes = rule.tile_classes(n_q, n_k, block_m, block_n)  # (T_r, T_c) SKIP / PARTIAL / FULL
    t_r = num_blocks(n_q, block_m)

    # Step 2 of Algorithm 1: initialise o, l, m in HBM.
    o = np.zeros(lead + (n_q, d_v), dtype=dtype)  # (..., N_q, d_v), normalised output
    l_hbm = np.zeros(lead + (n_q,), dtype=dtype)  # (..., N_q)
    m_hbm = np.full(lead + (n_q,), -np.inf, dtype=dtype)  # (..., N_q)
    if counter:
        counter.write("o", batch * n_q * d_v)
        counter.write("l", batch * n_q)
        counter.write("m", batch * n_q)

    for j in range(num_blocks(n_k, block_n)):
        k_start, cols = j * block_n, block_rows(j, n_k, block_n)
        visible_q_blocks = [i for i in range(t_r) if classes[i, j] != SKIP]
        if visible_q_blocks:  # a K/V tile no query can see is never loaded
            k_tile = load_tile(k, k_start, block_n)  # (..., BLOCK_N, d)
            v_tile = load_tile(v, k_start, block_n)  # (..., BLOCK_N, d_v)
            if counter:
                counter.read("k", batch * cols * d)
                counter.read("v", batch * cols * d_v)
        for i in range(t_r):
            if i not in visible_q_blocks:
                if counter:
                    counter.event("skip", i, j)
                continue
            q_start, rows = i * block_m, block_rows(i, n_q, block_m)
            rows_here = slice(q_start, q_start + rows)
            q_tile = load_tile(q, q_start, block_m)  # (..., BLOCK_M, d)
            o_old = o[..., rows_here, :]  # (..., rows, d_v), read from HBM
            l_old, m_old = l_hbm[..., rows_here], m_hbm[..., rows_here]  # (..., rows)
            s = scale * (q_tile @ np.swapaxes(k_tile, -1, -2))  # (..., BLOCK_M, BLOCK_N)
            s = mask_scores(s, rule, classes[i, j], q_start, k_start, n_k)[..., :rows, :]
            # o in HBM is normalised by l_old: undo that (acc = l·o), fold the new tile in with
            # the same online-softmax update as FA2, normalise by l_new again.
            m_new, l_new, acc = step(m_old, l_old, l_old[..., None] * o_old, s, v_tile)
            o[..., rows_here, :] = finish(m_new, l_new, acc)[0]
            l_hbm[..., rows_here], m_hbm[..., rows_here] = l_new, m_new
            if counter:
                counter.read("q", batch * rows * d)
                for name, per_row in (("o", d_v), ("l", 1), ("m", 1)):
                    counter.read(name, batch * rows * per_row)
                    counter.write(name, batch * rows * per_row)
                counter.flop(batch * tile_score_flops(rows, cols, d, d_v, rule.mask_flops))
                counter.flop(batch * rows * (ROW_UPDATE_FLOPS + FA1_O_FLOPS_PER_ELEMENT * d_v))
                counter.event("compute", i, j)

    # Final pass: lse = m + log l, for the backward (chapter 07).
    lse = state_lse(m_hbm, l_hbm)  # (..., N_q)
    if counter:
        counter.read("l", batch * n_q)
        counter.read("m", batch * n_q)
        counter.write("lse", batch * n_q)
        counter.flop(batch * n_q * LSE_FLOPS_PER_ROW)
        counter.event("finish", None, None)
    return o, lse.astype(dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# standard attention, five kernels, each a round trip of the N_q × N_k matrix through HBM
# ----------------------------------------------------------------------------------------------

def standard_attention_numpy(q, k, v, causal: bool = False, scale: float | None = None,
                             counter: IOCounter | None = None):
    """Standard attention as five separate kernels, counting the traffic of each.

    ``S = scale·q kᵀ`` → mask → softmax → dropout → ``o = P v``, each step reading its input
    from HBM and writing its output back, as unfused framework code does (chapter 02's five
    steps). Dropout runs with p = 0 so the output stays comparable; the mask step runs even
    when ``causal`` is False (a padding mask would use the same pass). Counts follow
    :func:`course_lib.attention.costmodel.step_costs`.

    Args:
        q: ``(..., N_q, d)``; k: ``(..., N_k, d)``; v: ``(..., N_k, d_v)``.

    Returns:
        ``o`` ``(..., N_q, d_v)`` in the input dtype (standard attention keeps no ``lse``).
    """
    validate_qkv_numpy(q, k, v, scale)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    n_q, n_k, d, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    batch = _batch(q)
    scores = batch * n_q * n_k
    c = counter if counter is not None else IOCounter(record_events=False)

    s = scale * (q @ np.swapaxes(k, -1, -2))  # (..., N_q, N_k)
    c.read("q", batch * n_q * d), c.read("k", batch * n_k * d), c.write("S", scores)
    c.flop(FLOPS_PER_MULTIPLY_ADD * scores * d)
    if causal:
        s = np.where(causal_mask(n_q, n_k), s, MASK_VALUE)
    c.read("S", scores), c.write("S", scores), c.flop(MASK_FLOPS_PER_ELEMENT * scores)
    m = s.max(axis=-1, keepdims=True)  # (..., N_q, 1)
    p = np.exp(s - _safe(m))
    p = p / p.sum(axis=-1, keepdims=True)  # (..., N_q, N_k)
    c.read("S", scores), c.write("P", scores), c.flop(SOFTMAX_FLOPS_PER_ELEMENT * scores)
    # dropout with p = 0: multiply by a keep-mask of ones, scaled by 1/(1-p) = 1
    c.read("P", scores), c.write("P", scores), c.flop(DROPOUT_FLOPS_PER_ELEMENT * scores)
    o = p @ v  # (..., N_q, d_v)
    c.read("P", scores), c.read("v", batch * n_k * d_v), c.write("o", batch * n_q * d_v)
    c.flop(FLOPS_PER_MULTIPLY_ADD * scores * d_v)
    return o.astype(q.dtype, copy=False)
