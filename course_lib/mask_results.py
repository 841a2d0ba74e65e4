"""Chapter 10's recorded H100 measurements: masked attention — the course's kernel against
FlexAttention and FlashAttention-2's varlen function, as the density of visited tiles falls.

The numbers come from one benchmark run on an H100 and live in
``course_lib/data/benchmarks/h100_masks.json``. This module only reads, checks and shows them,
so that chapter 10 draws the same plot on a CPU machine. Until the file exists, :func:`recorded`
returns None and :func:`status` says plainly that nothing is recorded yet.

File format::

    {"meta": {"gpu": ..., "torch": ..., "triton": ..., "date": ..., ...},
     "rows": [{"impl": "ours" | "flex" | "fa2_varlen", "pattern": "full" | "causal" |
               "sliding_window" | "document" | "block_sparse" | "random_block",
               "density": fraction of the (Q tile, K/V tile) pairs visited, in (0, 1],
               "N": tokens per sequence, "pass": "fwd" | "fwd_bwd", "ms": median time, ...}]}

Rows may carry more keys (dtype, d, batch, heads, block sizes); these functions ignore them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from course_lib.bench import RECORDED_DIR

RECORDED_FILE = RECORDED_DIR / "h100_masks.json"

IMPLS = {"ours": "the course's kernel", "flex": "FlexAttention (torch.compile)",
         "fa2_varlen": "FlashAttention-2 varlen"}
PATTERNS = ("full", "causal", "sliding_window", "document", "block_sparse", "random_block")
PASSES = ("fwd", "fwd_bwd")
META_KEYS = ("gpu", "torch", "triton", "date")
ROW_KEYS = ("impl", "pattern", "density", "N", "pass", "ms")
NOT_RECORDED = ("No H100 results are recorded yet for chapter 10 "
                "(course_lib/data/benchmarks/h100_masks.json is absent): the plot appears once "
                "the benchmark has been run on an H100 and its file committed.")


def validate(data) -> dict:
    """``data`` when it has the format above; else ValueError naming what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict):
        raise ValueError("data must be a dict with a 'meta' dict (the provenance header)")
    missing = [key for key in META_KEYS if key not in data["meta"]]
    if missing:
        raise ValueError(f"data['meta'] lacks {', '.join(missing)} (provenance: "
                         f"{', '.join(META_KEYS)})")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError("data['rows'] must be a non-empty list of measurements")
    for i, row in enumerate(rows):
        lacking = [key for key in ROW_KEYS if key not in row]
        if lacking:
            raise ValueError(f"data['rows'][{i}] lacks {', '.join(lacking)}")
        if row["impl"] not in IMPLS:
            raise ValueError(f"data['rows'][{i}]['impl'] must be one of {', '.join(IMPLS)}, "
                             f"got {row['impl']!r}")
        if row["pattern"] not in PATTERNS:
            raise ValueError(f"data['rows'][{i}]['pattern'] must be one of "
                             f"{', '.join(PATTERNS)}, got {row['pattern']!r}")
        if row["pass"] not in PASSES:
            raise ValueError(f"data['rows'][{i}]['pass'] must be 'fwd' or 'fwd_bwd', got "
                             f"{row['pass']!r}")
        if not 0 < row["density"] <= 1:
            raise ValueError(f"data['rows'][{i}]['density'] must be in (0, 1], got "
                             f"{row['density']!r}")
        if not row["ms"] > 0:
            raise ValueError(f"data['rows'][{i}]['ms'] must be a positive time, got {row['ms']!r}")
    return data


def load(path: Path | str = RECORDED_FILE) -> dict:
    """The recorded measurements, validated. FileNotFoundError naming ``path`` when absent."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no recorded chapter 10 results at {path}; run the masks "
                                f"benchmark on an H100")
    return validate(json.loads(path.read_text()))


def recorded(path: Path | str = RECORDED_FILE) -> dict | None:
    """:func:`load`, or None when the file is absent (a malformed file still raises)."""
    try:
        return load(path)
    except FileNotFoundError:
        return None


def provenance(data: dict) -> str:
    m = data["meta"]
    driver = f" (driver {m['driver']})" if "driver" in m else ""
    return f"{m['gpu']}{driver}, torch {m['torch']}, triton {m['triton']}, measured {m['date']}"


def status(path: Path | str = RECORDED_FILE) -> str:
    """One line: where the recorded results come from, or that none are recorded yet."""
    data = recorded(path)
    return NOT_RECORDED if data is None else f"recorded on {provenance(data)}"


def lengths(data: dict) -> list[int]:
    """Every sequence length measured, ascending."""
    return sorted({row["N"] for row in data["rows"]})


def series(data: dict, impl: str, n: int, pass_: str = "fwd", pattern: str | None = None):
    """``[(density, ms), ...]`` of ``impl`` at length ``n``, by density (one pattern, or all)."""
    points = [(row["density"], row["ms"]) for row in data["rows"]
              if row["impl"] == impl and row["N"] == n and row["pass"] == pass_
              and (pattern is None or row["pattern"] == pattern)]
    return sorted(points)


def time_for(data: dict, pattern: str, n: int, pass_: str = "fwd", impl: str = "ours",
             density: float | None = None) -> dict | None:
    """The recorded row of ``impl`` for ``pattern`` at length ``n`` (the one whose density is
    closest to ``density``, when given), or None when that was not measured."""
    rows = [row for row in data["rows"] if row["impl"] == impl and row["pattern"] == pattern
            and row["N"] == n and row["pass"] == pass_]
    if not rows:
        return None
    if density is None:
        return rows[0]
    return min(rows, key=lambda row: abs(row["density"] - density))


def speedups(data: dict, pass_: str = "fwd", baseline: str = "flex") -> list[float]:
    """``baseline time / our time`` on every (pattern, density, N) measured for both."""
    ours = {(r["pattern"], r["density"], r["N"]): r["ms"] for r in data["rows"]
            if r["impl"] == "ours" and r["pass"] == pass_}
    return [r["ms"] / ours[key] for r in data["rows"]
            if r["impl"] == baseline and r["pass"] == pass_
            and (key := (r["pattern"], r["density"], r["N"])) in ours]


def speedup_summary(data: dict, pass_: str = "fwd", baseline: str = "flex") -> dict | None:
    """Median and minimum of :func:`speedups` (``{"median", "min", "n"}``), None when none."""
    ratios = speedups(data, pass_, baseline)
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "n": len(ratios)}


def plot_density(data: dict, n: int | None = None, pass_: str = "fwd"):
    """Time against density at length ``n`` (default: the longest measured): ours and
    FlexAttention, each point one (pattern, density), and the line "dense time × density" that a
    kernel whose time is proportional to its visited tiles follows."""
    import matplotlib.pyplot as plt

    n = max(lengths(data)) if n is None else n
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100, layout="constrained")
    for impl, marker in (("ours", "o"), ("flex", "s")):
        points = series(data, impl, n, pass_)
        if points:
            ax.plot(*zip(*points), marker=marker, linestyle="none", label=IMPLS[impl])
    full = time_for(data, "full", n, pass_)
    if full is not None:
        ax.plot([0, 1], [0, full["ms"]], "k--", linewidth=1,
                label="dense time × density (proportional to the visited tiles)")
    ax.set_xlabel("density (fraction of tiles visited)")
    ax.set_ylabel("time (ms)")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{'forward' if pass_ == 'fwd' else 'forward + backward'}, N = {n:,} "
                 f"({data['meta']['gpu']})", fontsize=10)
    ax.legend(fontsize=8)
    return fig
