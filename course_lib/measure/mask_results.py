"""Chapter 10's recorded H100 measurements: masked attention — the course's kernel against
FlexAttention and FlashAttention-2's varlen function, as the density of the mask falls.

The numbers come from one run of ``tools/bench_masks.py`` on an H100 and live in
``course_lib/data/benchmarks/h100_masks.json``, in that tool's format. This module only reads,
checks, summarises and plots them, so that chapter 10 shows the same results on a CPU machine.
When the file is absent, :func:`recorded` returns None and :func:`status` says so.

File format (written by ``tools/bench_masks.py``)::

    {"meta": {"gpu": ..., "torch": ..., "triton": ..., "date": ..., ...},
     "rows": [{"impl": "course" | "course_dense" | "course_varlen" | "flex" | "fa2_varlen",
               "dtype": "float16" | "bfloat16", "N": tokens per sequence,
               "pattern": "full" | "causal" | "window" | "documents" | "random",
               "label": e.g. "window 20% of N", "param": the pattern's parameter,
               "density": fraction of the score matrix visible, in (0, 1],
               "tile_density": fraction of the course's tiles visited, in (0, 1],
               "pass": "fwd" | "fwd+bwd", "ms": median time, ...}]}

One *cell* is one (dtype, N, label, pass): the same mask measured by each implementation.
Rows may carry more keys (d, batch, heads, tflops); these functions ignore them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from course_lib.measure.bench import RECORDED_DIR, timer_summary

RECORDED_FILE = RECORDED_DIR / "h100_masks.json"

IMPLS = {"course": "the course's masked kernel",
         "course_dense": "the course's dense / causal kernel (chapters 06-09)",
         "course_varlen": "the course's varlen kernel (packed documents)",
         "flex": "FlexAttention (torch.compile)", "fa2_varlen": "FlashAttention-2 varlen"}
PATTERNS = ("full", "causal", "window", "documents", "random")
PASSES = ("fwd", "fwd+bwd")
PASS_NAMES = {"fwd": "forward", "fwd+bwd": "forward + backward"}
DTYPES = ("float16", "bfloat16")
DEFAULT_DTYPE = "float16"
BASELINES = ("flex", "fa2_varlen")
META_KEYS = ("gpu", "torch", "triton", "date")
ROW_KEYS = ("impl", "dtype", "N", "pattern", "label", "density", "tile_density", "pass", "ms")
NOT_RECORDED = ("No H100 results are recorded yet for chapter 10 "
                "(course_lib/data/benchmarks/h100_masks.json is absent): the plot appears once "
                "tools/bench_masks.py has been run on an H100 and its file committed.")


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
    choices = {"impl": tuple(IMPLS), "dtype": DTYPES, "pattern": PATTERNS, "pass": PASSES}
    for i, row in enumerate(rows):
        lacking = [key for key in ROW_KEYS if key not in row]
        if lacking:
            raise ValueError(f"data['rows'][{i}] lacks {', '.join(lacking)}")
        for key, allowed in choices.items():
            if row[key] not in allowed:
                raise ValueError(f"data['rows'][{i}]['{key}'] must be one of "
                                 f"{', '.join(allowed)}, got {row[key]!r}")
        for key in ("density", "tile_density"):
            if not 0 < row[key] <= 1:
                raise ValueError(f"data['rows'][{i}]['{key}'] must be in (0, 1], got "
                                 f"{row[key]!r}")
        if not row["ms"] > 0:
            raise ValueError(f"data['rows'][{i}]['ms'] must be a positive time, got {row['ms']!r}")
    return data


def load(path: Path | str = RECORDED_FILE) -> dict:
    """The recorded measurements, validated. FileNotFoundError naming ``path`` when absent."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no recorded chapter 10 results at {path}; run "
                                f"tools/bench_masks.py on an H100")
    return validate(json.loads(path.read_text()))


def recorded(path: Path | str = RECORDED_FILE) -> dict | None:
    """:func:`load`, or None when the file is absent (a malformed file still raises)."""
    try:
        return load(path)
    except FileNotFoundError:
        return None


def provenance(data: dict) -> str:
    """One line: GPU, versions, date and the timers (:func:`course_lib.measure.bench.timer_summary`)."""
    m = data["meta"]
    driver = f" (driver {m['driver']})" if "driver" in m else ""
    timers = timer_summary(data) or "timer not recorded"
    return f"{m['gpu']}{driver}, torch {m['torch']}, triton {m['triton']}, measured {m['date']}, {timers}"


def status(path: Path | str = RECORDED_FILE) -> str:
    """One line: where the recorded results come from, or that none are recorded yet."""
    data = recorded(path)
    return NOT_RECORDED if data is None else f"recorded on {provenance(data)}"


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def lengths(data: dict) -> list[int]:
    """Every sequence length measured, ascending."""
    return sorted({row["N"] for row in data["rows"]})


def rows_of(data: dict, impl: str, pass_: str = "fwd", dtype: str | None = DEFAULT_DTYPE,
            n: int | None = None, pattern: str | None = None) -> list[dict]:
    """The rows of ``impl`` for one pass (and dtype, length, pattern when given; None: all)."""
    _check_choice("impl", impl, tuple(IMPLS))
    _check_choice("pass_", pass_, PASSES)
    return [row for row in data["rows"] if row["impl"] == impl and row["pass"] == pass_
            and (dtype is None or row["dtype"] == dtype) and (n is None or row["N"] == n)
            and (pattern is None or row["pattern"] == pattern)]


def series(data: dict, impl: str, n: int, pass_: str = "fwd", pattern: str | None = None,
           dtype: str = DEFAULT_DTYPE) -> list[tuple[float, float]]:
    """``[(density, ms), ...]`` of ``impl`` at length ``n``, by density (one pattern, or all)."""
    return sorted((row["density"], row["ms"])
                  for row in rows_of(data, impl, pass_, dtype, n, pattern))


def time_for(data: dict, pattern: str, n: int, pass_: str = "fwd", impl: str = "course",
             tile_density: float | None = None, dtype: str = DEFAULT_DTYPE) -> dict | None:
    """The recorded row of ``impl`` for ``pattern`` at length ``n`` and ``dtype`` (the one whose
    fraction of visited tiles is closest to ``tile_density``, when given), or None when that was
    not measured."""
    _check_choice("pattern", pattern, PATTERNS)
    rows = rows_of(data, impl, pass_, dtype, n, pattern)
    if not rows:
        return None
    if tile_density is None:
        return rows[0]
    return min(rows, key=lambda row: abs(row["tile_density"] - tile_density))


def cell(data: dict, impl: str, row: dict) -> dict | None:
    """The row of ``impl`` measured on the same cell (dtype, N, label, pass) as ``row``."""
    for other in data["rows"]:
        if other["impl"] == impl and all(other[key] == row[key]
                                         for key in ("dtype", "N", "label", "pass")):
            return other
    return None


def speedups(data: dict, pass_: str = "fwd", baseline: str = "flex",
             dtype: str | None = None) -> list[float]:
    """``baseline time / our time`` on every cell measured by both (both dtypes by default).

    Ours is the masked kernel (``course``); against FA2 varlen it is the faster of ``course`` and
    ``course_varlen`` on each cell (packed documents are what a varlen kernel is for), as in
    ``tools/bench_masks.py``'s summary.
    """
    _check_choice("baseline", baseline, BASELINES)
    ours = ("course",) if baseline == "flex" else ("course", "course_varlen")
    ratios = []
    for row in rows_of(data, baseline, pass_, dtype):
        times = [r["ms"] for impl in ours if (r := cell(data, impl, row)) is not None]
        if times:
            ratios.append(row["ms"] / min(times))
    return ratios


def speedup_summary(data: dict, pass_: str = "fwd", baseline: str = "flex",
                    dtype: str | None = None) -> dict | None:
    """``{"median", "min", "max", "n"}`` of :func:`speedups`, None when no cell has both."""
    ratios = speedups(data, pass_, baseline, dtype)
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "n": len(ratios)}


def proportionality(data: dict, pass_: str = "fwd", dtype: str = DEFAULT_DTYPE,
                    n: int | None = None) -> list[dict]:
    """Is the masked kernel's time proportional to the work? For each ``course`` row, its time
    against predictions at the same length: *dense time × density* with the chapters 06-09
    kernel on the full matrix (``course_dense``), the same with the fraction of *tiles* visited
    (the work the kernel does: a partial tile costs a full one), and *own full time × density*
    with the masked kernel itself on the full mask (``course``, pattern ``full``).

    Returns ``[{"N", "label", "density", "tile_density", "ms", "predicted_ms", "ratio",
    "ratio_tiles", "ratio_own"}, ...]``: ``ratio`` = ms ÷ (dense time × density), ``ratio_tiles``
    = ms ÷ (dense time × tile density), ``ratio_own`` = ms ÷ (own full time × density); 1.0 is
    exactly proportional, above 1 slower than the visited work suggests. Rows whose length lacks
    a full-mask measurement are left out.
    """
    out = []
    for row in rows_of(data, "course", pass_, dtype, n):
        dense = time_for(data, "full", row["N"], pass_, "course_dense", dtype=dtype)
        own = time_for(data, "full", row["N"], pass_, "course", dtype=dtype)
        if dense is None or own is None:
            continue
        predicted = dense["ms"] * row["density"]
        out.append({"N": row["N"], "label": row["label"], "density": row["density"],
                    "tile_density": row["tile_density"], "ms": row["ms"], "predicted_ms": predicted,
                    "ratio": row["ms"] / predicted, "ratio_tiles": row["ms"] / (dense["ms"] * row["tile_density"]),
                    "ratio_own": row["ms"] / (own["ms"] * row["density"])})
    return out


def format_proportionality(data: dict, pass_: str = "fwd", dtype: str = DEFAULT_DTYPE,
                           n: int | None = None) -> str:
    """:func:`proportionality` as a text table, one line per cell."""
    lines = [f"{PASS_NAMES[pass_]}, {dtype}: our time against the work it visits",
             f"{'N':>6} {'pattern':<20} {'density':>7} {'tiles':>6} {'ms':>8} {'dense x dens.':>13} "
             f"{'ratio':>6} {'ratio (tiles)':>13} {'ratio to own full x dens.':>26}"]
    for p in proportionality(data, pass_, dtype, n):
        lines.append(f"{p['N']:>6} {p['label']:<20} {p['density']:>7.1%} {p['tile_density']:>6.1%} {p['ms']:>8.3f} "
                     f"{p['predicted_ms']:>13.3f} {p['ratio']:>6.2f} {p['ratio_tiles']:>13.2f} "
                     f"{p['ratio_own']:>26.2f}")
    return "\n".join(lines)


def plot_density(data: dict, n: int | None = None, dtype: str = DEFAULT_DTYPE):
    """Time against density at length ``n`` (default: the longest measured), forward and
    forward + backward side by side: ours and FlexAttention, each point one mask, and the line
    "dense time × density" that a kernel whose time is proportional to its work follows."""
    import matplotlib.pyplot as plt

    _check_choice("dtype", dtype, DTYPES)
    n = max(lengths(data)) if n is None else n
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=100, layout="constrained")
    for ax, pass_ in zip(axes, PASSES):
        for impl, marker, name in (("course", "o", "ours (masked kernel)"),
                                   ("flex", "s", IMPLS["flex"])):
            points = series(data, impl, n, pass_, dtype=dtype)
            if points:
                ax.plot(*zip(*points), marker=marker, linestyle="none", label=name)
        dense = time_for(data, "full", n, pass_, "course_dense", dtype=dtype)
        if dense is not None:
            ax.plot([0, 1], [0, dense["ms"]], "k--", linewidth=1,
                    label="dense kernel (ch. 06-09) time × density")
        ax.set_xlabel("density (fraction of the score matrix visible)")
        ax.set_ylabel("time (ms)")
        ax.set_xlim(0, 1.05)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{PASS_NAMES[pass_]}, N = {n:,}, {dtype}", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"Masked attention, {provenance(data)}", fontsize=10)
    return fig
