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
when ``j <= i``. Tiles that the causal mask hides completely are skipped: never loaded, never
computed.

Pass an :class:`IOCounter` as ``counter=`` to record the elements read from and written to HBM
(only in-bounds elements, as a masked load reads), the FLOPs, and the sequence of tile events.
The closed-form formulas for all these counts are in :mod:`course_lib.iomodel`.

FLOP convention (shared with :mod:`course_lib.costmodel`): a multiply-add is 2 FLOPs; inside a
tile each score costs ``ONLINE_SOFTMAX_FLOPS_PER_SCORE`` (max, subtract, exp, add to the sum)
plus one select when the causal mask is on; see :mod:`course_lib.iomodel` for the per-row terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from course_lib.costmodel import (
    DROPOUT_FLOPS_PER_ELEMENT, FLOPS_PER_MULTIPLY_ADD, MASK_FLOPS_PER_ELEMENT,
    SOFTMAX_FLOPS_PER_ELEMENT,
)
from course_lib.iomodel import (  # the tile grid and the per-tile FLOP convention
    FA1_O_FLOPS_PER_ELEMENT, FA2_ACC_FLOPS_PER_ELEMENT, LSE_FLOPS_PER_ROW, ROW_UPDATE_FLOPS,
    TileEvent, block_rows, causal_skip_grid, num_blocks, tile_fully_masked, tile_score_flops,
    validate_block_size,
)
from course_lib.reference import causal_mask, default_scale, validate_qkv_numpy

__all__ = [
    "DEFAULT_BLOCK_M", "DEFAULT_BLOCK_N", "MASK_VALUE", "IOCounter", "TileEvent",
    "validate_block_size", "num_blocks", "block_rows", "load_tile", "tile_fully_masked",
    "causal_skip_grid", "flash_attention_numpy", "flash_attention_numpy_fa1",
    "standard_attention_numpy",
]

# Default tile sizes: small enough that the learner's CPU runs stay quick, and deliberately not
# equal, so that a mix-up of BLOCK_M and BLOCK_N shows up.
DEFAULT_BLOCK_M = 32  # B_r in the paper: query rows per tile
DEFAULT_BLOCK_N = 16  # B_c in the paper: key/value rows per tile

# Masked scores become -inf, so exp() turns them into exact zeros (no "-1e9" approximations).
MASK_VALUE = -np.inf


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


def _tile_mask(q_start: int, k_start: int, block_m: int, block_n: int, n_k: int,
               causal: bool) -> np.ndarray:
    """``(BLOCK_M, BLOCK_N)`` boolean: True where the score is real and visible."""
    q_idx = q_start + np.arange(block_m)[:, None]  # (BLOCK_M, 1) query positions
    k_idx = k_start + np.arange(block_n)[None, :]  # (1, BLOCK_N) key positions
    visible = k_idx < n_k  # padded key columns of the ragged last tile are not keys
    if causal:
        visible = visible & (k_idx <= q_idx)
    return visible


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


def _finish(acc, l_i, m_i, dtype):
    """Epilogue of a Q tile: ``o = acc / l``, ``lse = m + log l`` (0 and -inf for empty rows)."""
    has_keys = l_i > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(has_keys[..., None], acc / np.where(has_keys, l_i, 1)[..., None], 0)
        lse = np.where(has_keys, m_i + np.log(np.where(has_keys, l_i, 1)), -np.inf)
    return o.astype(dtype, copy=False), lse.astype(dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# FA2 loop order: outer over Q tiles, inner over K/V tiles
# ----------------------------------------------------------------------------------------------

def flash_attention_numpy(q, k, v, causal: bool = False, scale: float | None = None,
                          block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                          counter: IOCounter | None = None):
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

    Returns:
        ``(o, lse)``: ``o`` ``(..., N_q, d_v)`` and ``lse`` ``(..., N_q)`` (natural-log
        log-sum-exp of each query's scaled scores), both in the input dtype.
    """
    scale, block_m, block_n = _prepare(q, k, v, scale, block_m, block_n)
    n_q, n_k, d, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    batch = _batch(q)
    lead = q.shape[:-2]
    dtype = q.dtype
    o = np.empty(lead + (n_q, d_v), dtype=dtype)  # (..., N_q, d_v), "in HBM"
    lse = np.empty(lead + (n_q,), dtype=dtype)  # (..., N_q)
    mask_flops = 1 if causal else 0

    for i in range(num_blocks(n_q, block_m)):
        q_start, rows = i * block_m, block_rows(i, n_q, block_m)
        q_tile = load_tile(q, q_start, block_m)  # (..., BLOCK_M, d)
        if counter:
            counter.read("q", batch * rows * d)
        m_i = np.full(lead + (block_m,), -np.inf, dtype=dtype)  # running max, (..., BLOCK_M)
        l_i = np.zeros(lead + (block_m,), dtype=dtype)  # running sum, relative to m_i
        acc = np.zeros(lead + (block_m, d_v), dtype=dtype)  # unnormalised output
        for j in range(num_blocks(n_k, block_n)):
            if causal and tile_fully_masked(i, j, block_m, block_n, n_q):
                if counter:
                    counter.event("skip", i, j)
                continue  # a GPU kernel would stop its loop here; we go on to show the skips
            k_start, cols = j * block_n, block_rows(j, n_k, block_n)
            k_tile = load_tile(k, k_start, block_n)  # (..., BLOCK_N, d)
            v_tile = load_tile(v, k_start, block_n)  # (..., BLOCK_N, d_v)
            s = scale * (q_tile @ np.swapaxes(k_tile, -1, -2))  # (..., BLOCK_M, BLOCK_N)
            s = np.where(_tile_mask(q_start, k_start, block_m, block_n, n_k, causal), s,
                         MASK_VALUE)
            # The online-softmax update: a new max rescales everything summed so far.
            m_new = np.maximum(m_i, s.max(axis=-1))  # (..., BLOCK_M)
            alpha = np.exp(m_i - _safe(m_new))  # (..., BLOCK_M) correction of the old state
            p = np.exp(s - _safe(m_new)[..., None])  # (..., BLOCK_M, BLOCK_N)
            l_i = alpha * l_i + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ v_tile  # (..., BLOCK_M, d_v)
            m_i = m_new
            if counter:
                counter.read("k", batch * cols * d)
                counter.read("v", batch * cols * d_v)
                counter.flop(batch * tile_score_flops(rows, cols, d, d_v, mask_flops))
                counter.flop(batch * rows * (ROW_UPDATE_FLOPS + FA2_ACC_FLOPS_PER_ELEMENT * d_v))
                counter.event("compute", i, j)
        o_tile, lse_tile = _finish(acc, l_i, m_i, dtype)
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
                              counter: IOCounter | None = None):
    """FlashAttention forward, FA1 loop order (the 2022 paper's Algorithm 1), in NumPy.

    The outer loop loads one K/V tile; the inner loop visits every Q tile and, for each, reads
    ``q``, the *normalised* output ``o`` and the softmax state ``l``, ``m`` from HBM, folds the
    new tile in, and writes ``o``, ``l``, ``m`` back. ``o``, ``l``, ``m`` start in HBM as 0, 0 and
    -inf (counted as writes); a last pass reads ``m`` and ``l`` and writes ``lse = m + log l``.

    Arguments and return value as :func:`flash_attention_numpy`.
    """
    scale, block_m, block_n = _prepare(q, k, v, scale, block_m, block_n)
    n_q, n_k, d, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    batch = _batch(q)
    lead = q.shape[:-2]
    dtype = q.dtype
    mask_flops = 1 if causal else 0
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
        visible_q_blocks = [i for i in range(t_r)
                            if not (causal and tile_fully_masked(i, j, block_m, block_n, n_q))]
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
            s = np.where(_tile_mask(q_start, k_start, block_m, block_n, n_k, causal), s,
                         MASK_VALUE)[..., :rows, :]  # (..., rows, BLOCK_N)
            m_new = np.maximum(m_old, s.max(axis=-1))  # (..., rows)
            alpha = np.exp(m_old - _safe(m_new))  # (..., rows)
            p = np.exp(s - _safe(m_new)[..., None])  # (..., rows, BLOCK_N)
            l_new = alpha * l_old + p.sum(axis=-1)
            # o in HBM is normalised by l_old: undo that, rescale to the new max, add the new
            # tile, normalise by l_new again.
            with np.errstate(divide="ignore", invalid="ignore"):
                o_new = ((alpha * l_old)[..., None] * o_old + p @ v_tile) / l_new[..., None]
            o[..., rows_here, :] = np.where(l_new[..., None] > 0, o_new, 0)
            l_hbm[..., rows_here], m_hbm[..., rows_here] = l_new, m_new
            if counter:
                counter.read("q", batch * rows * d)
                for name, per_row in (("o", d_v), ("l", 1), ("m", 1)):
                    counter.read(name, batch * rows * per_row)
                    counter.write(name, batch * rows * per_row)
                counter.flop(batch * tile_score_flops(rows, cols, d, d_v, mask_flops))
                counter.flop(batch * rows * (ROW_UPDATE_FLOPS + FA1_O_FLOPS_PER_ELEMENT * d_v))
                counter.event("compute", i, j)

    # Final pass: lse = m + log l, for the backward (chapter 07).
    has_keys = l_hbm > 0
    with np.errstate(divide="ignore"):
        lse = np.where(has_keys, m_hbm + np.log(np.where(has_keys, l_hbm, 1)), -np.inf)
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
    :func:`course_lib.costmodel.step_costs`.

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
