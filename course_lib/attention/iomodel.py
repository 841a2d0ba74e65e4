"""The IO model of attention: exact HBM reads, writes and FLOPs of each algorithm, in closed form.

Chapter 04 counts every element :mod:`course_lib.attention.tiled` moves between HBM and SRAM (with its
``IOCounter``) and checks the counts against the formulas here, which must match **exactly**,
for ragged sizes (N not a multiple of the tile sizes), N_q ≠ N_k and causal masking.

Notation (paper symbol → code name):

========  ==============  ====================================================
paper     code            meaning
========  ==============  ====================================================
N         ``n_q``/``n_k``  sequence length (queries / keys)
d         ``d``            head dim (``HEAD_DIM``); ``d_v`` for values, default d
B_r       ``block_m``      query rows per tile (``BLOCK_M``)
B_c       ``block_n``      key/value rows per tile (``BLOCK_N``)
T_r       ``t_r``          number of Q tiles, ⌈N_q / B_r⌉
T_c       ``t_c``          number of K/V tiles, ⌈N_k / B_c⌉
M         ``sram``         on-chip memory, in elements
========  ==============  ====================================================

Counts are in elements (multiply by bytes per element for bytes), summed over ``batch``
independent heads. Only in-bounds elements count: a masked load of a ragged last tile reads only
the rows that exist.

Per-head formulas (``rows_i`` = rows of Q tile i, ``cols_j`` = rows of K/V tile j):

* standard attention (five kernels, see :mod:`course_lib.attention.costmodel`):
  reads ``N_q d + N_k d + 4 N_q N_k + N_k d_v``, writes ``4 N_q N_k + N_q d_v``;
* FA2 order: reads ``N_q d + Σ_i keys_i (d + d_v)``, writes ``N_q (d_v + 1)`` — ``keys_i`` is
  ``N_k`` without a mask, and the keys of the first ``c_i`` K/V tiles with a causal one;
* FA1 order: reads ``Σ_j cols_j (d + d_v) + Σ_j qrows_j (d + d_v + 2) + 2 N_q``, writes
  ``N_q (d_v + 2) + Σ_j qrows_j (d_v + 2) + N_q`` — ``qrows_j`` is ``N_q`` without a mask (so
  the o/l/m traffic grows with T_c), the query rows that can see K/V tile j with one.

The causal sums run over T_r (or T_c) terms, each in closed form. Without a mask they collapse to
fully closed forms, e.g. FA2 reads ``N_q d + T_r N_k (d + d_v)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from course_lib.attention.costmodel import (
    BYTES_PER_ELEMENT, DROPOUT_FLOPS_PER_ELEMENT, FLOPS_PER_MULTIPLY_ADD, MASK_FLOPS_PER_ELEMENT,
    SOFTMAX_FLOPS_PER_ELEMENT,
)

__all__ = [
    "ONLINE_SOFTMAX_FLOPS_PER_SCORE", "ROW_UPDATE_FLOPS", "FA2_ACC_FLOPS_PER_ELEMENT",
    "FA1_O_FLOPS_PER_ELEMENT", "LSE_FLOPS_PER_ROW", "SRAM_TILES", "IOCount", "TileEvent",
    "validate_block_size", "num_blocks", "block_rows", "tile_fully_masked", "causal_skip_grid",
    "kv_tiles_visited", "tile_score_flops", "standard_io", "fa2_io", "fa1_io", "tile_events",
    "block_sizes", "standard_asymptotic", "flash_asymptotic", "ALGORITHMS", "io_counts",
    "output_traffic",
]

# ---- FLOP convention inside a tile (the standard-attention constants are costmodel's) --------
# Each score of a computed tile: max-compare, subtract the max, exp, add to the row sum. The
# softmax's division moves out of the loop (once per output element, at the end).
ONLINE_SOFTMAX_FLOPS_PER_SCORE = SOFTMAX_FLOPS_PER_ELEMENT - 1
# Each row of a computed tile: alpha = exp(m_old - m_new) (2) and l = alpha·l + rowsum (2).
ROW_UPDATE_FLOPS = 4
# FA2, each element of acc per tile: acc·alpha (1) + (P V) (1).
FA2_ACC_FLOPS_PER_ELEMENT = 2
# FA1, each element of o per tile: (alpha·l_old)·o (2), + (P V) (1), / l_new (1).
FA1_O_FLOPS_PER_ELEMENT = 4
# Each output row at the end: lse = m + log(l) (2). FA2 also divides acc by l (d_v per row).
LSE_FLOPS_PER_ROW = 2

# The block-size rule's 4: SRAM must hold tiles of Q, K, V and O at once (paper, Algorithm 1).
SRAM_TILES = 4

ALGORITHMS = ("standard", "fa1", "fa2")


@dataclass(frozen=True)
class IOCount:
    """HBM traffic (elements) and FLOPs of one run."""

    reads: int
    writes: int
    flops: int

    @property
    def total(self) -> int:
        """Reads plus writes, elements."""
        return self.reads + self.writes

    def bytes(self, dtype="float16") -> int:
        """Total traffic in bytes for elements of ``dtype`` (a name in BYTES_PER_ELEMENT)."""
        return self.total * BYTES_PER_ELEMENT[str(dtype).replace("torch.", "")]


@dataclass(frozen=True)
class TileEvent:
    """One step of a tiled run, with the counters as they stand after it.

    ``kind`` is ``"compute"`` (tile ``(q_block, kv_block)`` was computed in SRAM), ``"skip"``
    (the causal mask hides the whole tile: nothing loaded, nothing computed), ``"store"`` (FA2
    wrote Q tile ``q_block``'s ``o`` and ``lse``; ``kv_block`` is None) or ``"finish"`` (FA1's
    last pass, turning ``m`` and ``l`` into ``lse``; both blocks None).
    """

    kind: str
    q_block: int | None
    kv_block: int | None
    reads: int
    writes: int
    flops: int


# ----------------------------------------------------------------------------------------------
# the tile grid
# ----------------------------------------------------------------------------------------------

def validate_block_size(name: str, value) -> int:
    """Return ``value`` as an int; TypeError/ValueError naming ``name`` unless a positive int."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def num_blocks(n: int, block: int) -> int:
    """How many tiles of ``block`` rows cover ``n`` rows (T_r or T_c): ⌈n / block⌉."""
    return -(-n // block)


def block_rows(index: int, n: int, block: int) -> int:
    """Rows of tile ``index`` inside ``n``: ``block``, or fewer for a ragged last tile."""
    return max(0, min(block, n - index * block))


def tile_fully_masked(q_block: int, kv_block: int, block_m: int, block_n: int, n_q: int) -> bool:
    """True when the causal mask (top-left aligned) hides every score of the tile.

    The tile's first key, ``kv_block·BLOCK_N``, comes after its last real query row,
    ``min((q_block+1)·BLOCK_M, n_q) − 1``; no query of the tile may look that far ahead.
    """
    last_query = min((q_block + 1) * block_m, n_q) - 1
    return kv_block * block_n > last_query


def causal_skip_grid(n_q: int, n_k: int, block_m: int, block_n: int):
    """Boolean NumPy array ``(T_r, T_c)``: True where a causal run skips tile ``(i, j)``."""
    import numpy as np

    block_m = validate_block_size("block_m", block_m)
    block_n = validate_block_size("block_n", block_n)
    t_r, t_c = num_blocks(n_q, block_m), num_blocks(n_k, block_n)
    i = np.arange(t_r)[:, None]
    j = np.arange(t_c)[None, :]
    last_query = np.minimum((i + 1) * block_m, n_q) - 1  # (T_r, 1)
    return j * block_n > last_query  # (T_r, T_c)


def kv_tiles_visited(q_block: int, n_q: int, n_k: int, block_m: int, block_n: int,
                     causal: bool) -> int:
    """How many K/V tiles Q tile ``q_block`` computes (they are always a prefix, 0..c-1)."""
    t_c = num_blocks(n_k, block_n)
    if not causal:
        return t_c
    last_query = min((q_block + 1) * block_m, n_q) - 1
    return min(t_c, last_query // block_n + 1)


def _q_rows_visiting(kv_block: int, n_q: int, block_m: int, block_n: int, causal: bool) -> int:
    """Query rows (in whole Q tiles) that FA1 updates with K/V tile ``kv_block``."""
    if not causal:
        return n_q
    k_start = kv_block * block_n
    if k_start > n_q - 1:
        return 0
    first_block = k_start // block_m  # the Q tile holding row k_start, the first that sees it
    return n_q - first_block * block_m


def tile_score_flops(rows: int, cols: int, d: int, d_v: int, mask_flops: int) -> int:
    """FLOPs of the score part of one ``rows × cols`` tile: the two matmuls (``Q Kᵀ``, ``P V``),
    the online softmax, and ``mask_flops`` per score for the causal select."""
    per_score = FLOPS_PER_MULTIPLY_ADD * (d + d_v) + ONLINE_SOFTMAX_FLOPS_PER_SCORE + mask_flops
    return rows * cols * per_score


def _check_sizes(n_q, n_k, d, d_v, batch):
    n_q, n_k = _count("n_q", n_q), _count("n_k", n_k)
    d = validate_block_size("d", d)
    d_v = d if d_v is None else validate_block_size("d_v", d_v)
    batch = validate_block_size("batch", batch)
    return n_q, n_k, d, d_v, batch


# ----------------------------------------------------------------------------------------------
# the three algorithms
# ----------------------------------------------------------------------------------------------

def standard_io(n_q: int, n_k: int, d: int, *, d_v: int | None = None, batch: int = 1) -> IOCount:
    """Standard attention's five kernels (QKᵀ, mask, softmax, dropout, PV), each a round trip of
    the ``N_q × N_k`` matrix through HBM. Agrees with :func:`course_lib.attention.costmodel.step_costs`.

    Args:
        n_q, n_k: sequence lengths. d: head dim of q, k. d_v: of v (default d). batch: heads.
    """
    n_q, n_k, d, d_v, batch = _check_sizes(n_q, n_k, d, d_v, batch)
    nm = n_q * n_k
    reads = n_q * d + n_k * d + 4 * nm + n_k * d_v
    writes = 4 * nm + n_q * d_v
    flops = (FLOPS_PER_MULTIPLY_ADD * nm * (d + d_v)
             + (MASK_FLOPS_PER_ELEMENT + SOFTMAX_FLOPS_PER_ELEMENT + DROPOUT_FLOPS_PER_ELEMENT) * nm)
    return IOCount(batch * reads, batch * writes, batch * flops)


def fa2_io(n_q: int, n_k: int, d: int, block_m: int, block_n: int, causal: bool = False, *,
           d_v: int | None = None, batch: int = 1) -> IOCount:
    """FA2 loop order (outer Q, inner K/V): each Q tile read once, K and V read once per Q tile
    (only the tiles it does not skip), ``o`` and ``lse`` written once.

    Args: as :func:`standard_io`, plus block_m (B_r), block_n (B_c) and causal.
    """
    n_q, n_k, d, d_v, batch = _check_sizes(n_q, n_k, d, d_v, batch)
    block_m = validate_block_size("block_m", block_m)
    block_n = validate_block_size("block_n", block_n)
    mask_flops = MASK_FLOPS_PER_ELEMENT if causal else 0
    t_r = num_blocks(n_q, block_m)
    if not causal:  # fully closed form
        reads = n_q * d + t_r * n_k * (d + d_v)
        flops = (tile_score_flops(n_q, n_k, d, d_v, 0)
                 + num_blocks(n_k, block_n) * n_q * (ROW_UPDATE_FLOPS + FA2_ACC_FLOPS_PER_ELEMENT * d_v))
    else:
        reads, flops = n_q * d, 0
        for i in range(t_r):
            rows = block_rows(i, n_q, block_m)
            tiles = kv_tiles_visited(i, n_q, n_k, block_m, block_n, causal)
            keys = min(n_k, tiles * block_n)  # keys of the visited prefix of K/V tiles
            reads += keys * (d + d_v)
            flops += (tile_score_flops(rows, keys, d, d_v, mask_flops)
                      + tiles * rows * (ROW_UPDATE_FLOPS + FA2_ACC_FLOPS_PER_ELEMENT * d_v))
    writes = n_q * (d_v + 1)  # o and lse
    flops += n_q * (d_v + LSE_FLOPS_PER_ROW)  # o = acc / l, lse = m + log l
    return IOCount(batch * reads, batch * writes, batch * flops)


def fa1_io(n_q: int, n_k: int, d: int, block_m: int, block_n: int, causal: bool = False, *,
           d_v: int | None = None, batch: int = 1) -> IOCount:
    """FA1 loop order (outer K/V, inner Q): K and V read once; for every computed tile, q, o, l
    and m read and o, l, m written back; o, l, m initialised in HBM first and a last pass turns
    m and l into lse.

    Args: as :func:`fa2_io`.
    """
    n_q, n_k, d, d_v, batch = _check_sizes(n_q, n_k, d, d_v, batch)
    block_m = validate_block_size("block_m", block_m)
    block_n = validate_block_size("block_n", block_n)
    mask_flops = MASK_FLOPS_PER_ELEMENT if causal else 0
    row_flops = ROW_UPDATE_FLOPS + FA1_O_FLOPS_PER_ELEMENT * d_v
    t_c = num_blocks(n_k, block_n)
    if not causal:  # fully closed form
        kv_reads = n_k * (d + d_v) if n_q else 0
        q_rows = t_c * n_q  # Σ_j qrows_j
        score_flops = tile_score_flops(n_q, n_k, d, d_v, 0)
    else:
        kv_reads, q_rows, score_flops = 0, 0, 0
        for j in range(t_c):
            cols = block_rows(j, n_k, block_n)
            rows = _q_rows_visiting(j, n_q, block_m, block_n, causal)
            if rows:
                kv_reads += cols * (d + d_v)
            q_rows += rows
            score_flops += tile_score_flops(rows, cols, d, d_v, mask_flops)
    olm = d_v + 2  # one row of o, l and m
    reads = kv_reads + q_rows * (d + olm) + 2 * n_q  # ... + the last pass reads l and m
    writes = n_q * olm + q_rows * olm + n_q  # init, write-backs, lse
    flops = score_flops + q_rows * row_flops + n_q * LSE_FLOPS_PER_ROW
    return IOCount(batch * reads, batch * writes, batch * flops)


def io_counts(algorithm: str, n_q: int, n_k: int, d: int, block_m: int = 1, block_n: int = 1,
              causal: bool = False, *, d_v: int | None = None, batch: int = 1) -> IOCount:
    """Dispatch on ``algorithm`` (one of ``ALGORITHMS``); block sizes are ignored by standard."""
    if algorithm == "standard":
        return standard_io(n_q, n_k, d, d_v=d_v, batch=batch)
    if algorithm == "fa1":
        return fa1_io(n_q, n_k, d, block_m, block_n, causal, d_v=d_v, batch=batch)
    if algorithm == "fa2":
        return fa2_io(n_q, n_k, d, block_m, block_n, causal, d_v=d_v, batch=batch)
    raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")


# ----------------------------------------------------------------------------------------------
# the event list (what the tiling simulator replays), without doing any arithmetic on arrays
# ----------------------------------------------------------------------------------------------

def tile_events(n_q: int, n_k: int, d: int, block_m: int, block_n: int, causal: bool = False,
                order: str = "fa2", *, d_v: int | None = None, batch: int = 1) -> list[TileEvent]:
    """The events :class:`course_lib.attention.tiled.IOCounter` records for a run, computed by a dry run
    that only adds up counts (fast enough for grids of thousands of tiles).

    Args: as :func:`fa2_io`; ``order`` is ``"fa1"`` or ``"fa2"``.
    """
    n_q, n_k, d, d_v, batch = _check_sizes(n_q, n_k, d, d_v, batch)
    block_m = validate_block_size("block_m", block_m)
    block_n = validate_block_size("block_n", block_n)
    if order not in ("fa1", "fa2"):
        raise ValueError(f"order must be 'fa1' or 'fa2', got {order!r}")
    mask_flops = MASK_FLOPS_PER_ELEMENT if causal else 0
    t_r, t_c = num_blocks(n_q, block_m), num_blocks(n_k, block_n)
    reads = writes = flops = 0
    events: list[TileEvent] = []

    def skipped(i, j):
        return causal and tile_fully_masked(i, j, block_m, block_n, n_q)

    if order == "fa2":
        for i in range(t_r):
            rows = block_rows(i, n_q, block_m)
            reads += batch * rows * d
            for j in range(t_c):
                if skipped(i, j):
                    events.append(TileEvent("skip", i, j, reads, writes, flops))
                    continue
                cols = block_rows(j, n_k, block_n)
                reads += batch * cols * (d + d_v)
                flops += batch * (tile_score_flops(rows, cols, d, d_v, mask_flops)
                                  + rows * (ROW_UPDATE_FLOPS + FA2_ACC_FLOPS_PER_ELEMENT * d_v))
                events.append(TileEvent("compute", i, j, reads, writes, flops))
            writes += batch * rows * (d_v + 1)
            flops += batch * rows * (d_v + LSE_FLOPS_PER_ROW)
            events.append(TileEvent("store", i, None, reads, writes, flops))
        return events

    olm = d_v + 2
    writes += batch * n_q * olm
    for j in range(t_c):
        cols = block_rows(j, n_k, block_n)
        if any(not skipped(i, j) for i in range(t_r)):
            reads += batch * cols * (d + d_v)
        for i in range(t_r):
            if skipped(i, j):
                events.append(TileEvent("skip", i, j, reads, writes, flops))
                continue
            rows = block_rows(i, n_q, block_m)
            reads += batch * rows * (d + olm)
            writes += batch * rows * olm
            flops += batch * (tile_score_flops(rows, cols, d, d_v, mask_flops)
                              + rows * (ROW_UPDATE_FLOPS + FA1_O_FLOPS_PER_ELEMENT * d_v))
            events.append(TileEvent("compute", i, j, reads, writes, flops))
    reads += batch * 2 * n_q
    writes += batch * n_q
    flops += batch * n_q * LSE_FLOPS_PER_ROW
    events.append(TileEvent("finish", None, None, reads, writes, flops))
    return events


# ----------------------------------------------------------------------------------------------
# the paper's analysis: block sizes from the SRAM size, and the asymptotics
# ----------------------------------------------------------------------------------------------

def block_sizes(sram: int, d: int) -> tuple[int, int]:
    """The paper's block-size rule: ``B_c = ⌈M / 4d⌉``, ``B_r = min(⌈M / 4d⌉, d)``.

    SRAM must hold four tiles at once — Q_i, K_j, V_j and O_i, each ``block × d`` — so a block
    gets about a quarter of it: ``4·B·d ≈ M``. Capping B_r at d keeps the score tile
    ``B_r × B_c ≤ d·M/4d = M/4`` from outgrowing SRAM.

    Args:
        sram: M, on-chip memory in elements. d: head dim.

    Returns:
        ``(block_m, block_n)`` = ``(B_r, B_c)``.
    """
    sram = validate_block_size("sram", sram)
    d = validate_block_size("d", d)
    b_c = -(-sram // (SRAM_TILES * d))
    return min(b_c, d), b_c


def standard_asymptotic(n: int, d: int) -> float:
    """Θ(N d + N²): standard attention's HBM accesses, without constants (paper, Theorem 2)."""
    return float(n * d + n * n)


def flash_asymptotic(n: int, d: int, sram: int) -> float:
    """Θ(N² d² / M): FlashAttention's HBM accesses, without constants (paper, Theorem 2)."""
    return float(n) * n * d * d / sram


def output_traffic(algorithm: str, n_q: int, n_k: int, d: int, block_m: int, block_n: int,
                   causal: bool = False, *, d_v: int | None = None, batch: int = 1) -> int:
    """Elements of ``o``, ``l``, ``m`` and ``lse`` moved (read + written) by FA1 or FA2.

    This is where the two loop orders differ: FA2 writes ``o`` and ``lse`` once,
    ``N_q (d_v + 1)``; FA1 initialises ``o, l, m`` (``N_q (d_v + 2)``), reads and writes them back
    for every computed tile (``2 Σ_j qrows_j (d_v + 2)``, i.e. ``2 T_c N_q (d_v + 2)`` without a
    mask) and ends with a pass that reads ``l, m`` and writes ``lse`` (``3 N_q``).

    Args: as :func:`fa2_io`; ``algorithm`` is ``"fa1"`` or ``"fa2"``.
    """
    n_q, n_k, d, d_v, batch = _check_sizes(n_q, n_k, d, d_v, batch)
    block_m = validate_block_size("block_m", block_m)
    block_n = validate_block_size("block_n", block_n)
    if algorithm == "fa2":
        return batch * n_q * (d_v + 1)
    if algorithm != "fa1":
        raise ValueError(f"algorithm must be 'fa1' or 'fa2', got {algorithm!r}")
    q_rows = sum(_q_rows_visiting(j, n_q, block_m, block_n, causal)
                 for j in range(num_blocks(n_k, block_n)))
    olm = d_v + 2
    return batch * (n_q * olm + 2 * q_rows * olm + 3 * n_q)


# ------------------------------------------------------------------------------------------------
# The model against a real GPU: DRAM bytes measured with Nsight Compute (tools/ncu_hbm.py).

MEASURED_TRAFFIC_FILE = "{gpu}_hbm_traffic.json"  # in course_lib/data/benchmarks/


def load_measured_traffic(gpu: str = "h100") -> dict | None:
    """The DRAM traffic recorded for ``gpu`` (with its provenance), or None when none is recorded."""
    import json
    from pathlib import Path

    path = Path(__file__).parent.parent / "data" / "benchmarks" / MEASURED_TRAFFIC_FILE.format(gpu=gpu)
    return json.loads(path.read_text()) if path.exists() else None


def measured_vs_model(data: dict) -> list[dict]:
    """One row per implementation: measured DRAM MB (read, written) next to what the model counts.

    The naive run measured is ``q kᵀ``, a separate scale kernel, softmax and ``P v`` (no mask,
    no dropout), so its model is those four round trips; the course kernel's model is
    :func:`fa2_io` with the tile sizes it ran with. ``compulsory`` is reading q, k, v and writing o once.
    """
    s = data["meta"]["setting"]
    heads, n, d = s["batch"] * s["heads"], s["N"], s["d"]
    nbytes = BYTES_PER_ELEMENT[s["dtype"]]
    nn = heads * n * n  # elements of all heads' N×N matrices
    qkvo = heads * n * d
    model = {
        # qk: read q, k, write S; scale and softmax: read and write N×N; pv: read P, v, write o
        "naive": (2 * qkvo + nn + 2 * nn + 2 * nn + nn + 2 * qkvo) * nbytes,
        "course": fa2_io(n, n, d, s["course_blocks"]["block_m"], s["course_blocks"]["block_n"],
                         s["causal"], batch=heads).bytes(s["dtype"]),
    }
    rows = []
    for impl in ("naive", "course"):
        kernels = [r for r in data["rows"] if r["impl"] == impl]
        read = sum(r["dram_bytes_read"] for r in kernels)
        written = sum(r["dram_bytes_written"] for r in kernels)
        rows.append({"impl": impl, "kernels": len(kernels), "read_mb": read / 1e6,
                     "written_mb": written / 1e6, "measured_mb": (read + written) / 1e6,
                     "model_mb": model[impl] / 1e6, "compulsory_mb": 4 * qkvo * nbytes / 1e6})
    return rows
