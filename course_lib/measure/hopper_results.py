"""Chapter 09's recorded H100 measurements: the ablation of FlashAttention-3 ideas, FP8's speed
and accuracy, and where the course's kernel stands against FlashAttention-2 and cuDNN.

The numbers come from ``python tools/fa3_ablation.py`` on an H100 (provenance in the file's
``meta``: GPU, driver, torch, triton, date) and live in
``course_lib/data/benchmarks/h100_fa3.json``. This module only reads and formats them, so the
notebook shows the same tables on a CPU machine; on a GPU the notebook can re-measure one cell.

Row format (``data["rows"]``): ``variant`` (``course``: chapter 06's pointer-load kernel at its
measured config; ``tma``: the descriptor kernel; ``tma_ws``: with warp specialization;
``tma_one_stage``: every tile through the masked loop; ``fp8``: the FP8 kernel on already
quantized inputs; ``fp8_e2e``: quantization and rotation included; ``sdpa_flash``,
``sdpa_cudnn``), ``config`` ``[BLOCK_M, BLOCK_N, num_warps, num_stages]``, ``dtype``, ``d``,
``N``, ``causal``, forward ``tflops`` (FLOPs as in :mod:`course_lib.measure.bench`).

Section 7's Gluon forward and backward have records of their own (``h100_gluon.json``,
``h100_gluon_backward.json``), and so does section 8's ablation of FlashAttention-4's two tricks
in the Gluon forward (``h100_fa4_ablation.json``, trimmed from a run of ``tools/gluon_ablation.py``
by its ``--record``): :func:`load_fa4`, :func:`fa4_summary_table`, :func:`fa4_cell_table`,
:func:`fa4_accuracy_table`; and so does its ablation of the Gluon backward's overlap and persistent
grid (``h100_gluon_bwd_overlap.json``, from ``tools/gluon_bwd_ablation.py --record``):
:func:`load_bwd_overlap`, :func:`bwd_overlap_summary_table`, :func:`bwd_overlap_cell_table`,
:func:`bwd_overlap_facts_table`. :func:`cudnn_standing_table` sets the recorded grids beside issue
35's targets.
"""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path

from course_lib.measure import bench
from course_lib.measure.bench import RECORDED_DIR, timer_note
from course_lib.attention.fp_emulation import EXP2_POLY_DEGREE

RECORDED_FILE = RECORDED_DIR / "h100_fa3.json"
# The timers of the tools that wrote the files, whose headers name none: tools/fa3_ablation.py
# times with triton.testing.do_bench; tools/gluon_forward.py and tools/gluon_backward.py with
# course_lib.measure.bench's CUDA-graph timer. The loaders fill them in (a file that names one keeps it).
FA3_TIMER = "events"
GLUON_TIMER = "cudagraph"

# The ablation's steps: (label, variant, config or None for "best of the variant"). Each adds one
# idea to the one before, at the cell's dtype/d/N; the last two are the yardsticks.
POINTER_CONFIG = (128, 64, 8, 3)  # chapter 06's measured config at d=128 (tuning.gpu_default)
TMA_WIDE_CONFIG = (128, 128, 8, 3)
ABLATION_STEPS = (
    ("ch06 kernel: pointer loads, 128x64 tiles", "course", None),
    ("+ TMA descriptor loads (same tiles)", "tma", POINTER_CONFIG),
    ("+ 128x128 tiles (registers freed by TMA)", "tma", TMA_WIDE_CONFIG),
    ("+ warp specialization (tl.range)", "tma_ws", TMA_WIDE_CONFIG),
)
DEEPER_PIPELINE = ((128, 64, 8, 3), (128, 64, 8, 4))  # num_stages 3 -> 4, same tiles
BASELINES = (("FlashAttention-2", "sdpa_flash"), ("cuDNN", "sdpa_cudnn"))


def load(path: Path | str = RECORDED_FILE) -> dict:
    """The recorded measurements (``meta["timer"]`` filled in: :data:`FA3_TIMER`). Raises
    FileNotFoundError naming ``path`` if missing."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no recorded chapter 09 results at {path}; run tools/fa3_ablation.py on a Hopper GPU")
    data = json.loads(path.read_text())
    data["meta"].setdefault("timer", FA3_TIMER)
    return data


def provenance(data: dict) -> str:
    """One line: GPU (and driver, where recorded), torch, triton, date of the run, and its timer."""
    m = data["meta"]
    driver = f" (driver {m['driver']})" if "driver" in m else ""
    return f"{m['gpu']}{driver}, torch {m['torch']}, triton {m['triton']}, measured {m['date']}, {timer_note(m)}"


def tflops(data: dict, variant: str, dtype: str, d: int, n: int, causal: bool, config=None,
           run: int | None = 1) -> float | None:
    """The recorded TFLOP/s of ``variant`` on one cell: at ``config``, or the best over configs.

    ``run``: which run of the file (``data["runs"]`` says what each measured); None: any.
    """
    found = [r["tflops"] for r in data["rows"]
             if r["variant"] == variant and r["dtype"] == dtype and r["d"] == d and r["N"] == n
             and r["causal"] == causal and (config is None or tuple(r["config"] or ()) == tuple(config))
             and (run is None or r.get("run", 1) == run)]
    return max(found) if found else None


def best_config(data: dict, variant: str, dtype: str, d: int, n: int, causal: bool):
    rows = [r for r in data["rows"] if r["variant"] == variant and r["dtype"] == dtype and r["d"] == d
            and r["N"] == n and r["causal"] == causal]
    return tuple(max(rows, key=lambda r: r["tflops"])["config"]) if rows else None


def ablation(data: dict, dtype: str = "float16", d: int = 128, n: int = 16384) -> list[dict]:
    """One row per step of :data:`ABLATION_STEPS`, then FP8 and the baselines:
    ``{"step", "non-causal", "causal"}`` in TFLOP/s (None where not measured)."""
    rows = [{"step": label, **{name: tflops(data, variant, dtype, d, n, causal, config)
                               for name, causal in (("non-causal", False), ("causal", True))}}
            for label, variant, config in ABLATION_STEPS]
    rows.append({"step": "FP8 e4m3 q, k, v, P (best config)",
                 **{name: tflops(data, "fp8", dtype, d, n, causal, run=None) for name, causal in (("non-causal", False), ("causal", True))}})
    for label, impl in BASELINES:
        rows.append({"step": label, **{name: tflops(data, impl, dtype, d, n, causal)
                                       for name, causal in (("non-causal", False), ("causal", True))}})
    return rows


def format_ablation(data: dict, dtype: str = "float16", d: int = 128, n: int = 16384) -> str:
    """The ablation as a text table: TFLOP/s and the gain of each step over the one before."""
    rows = ablation(data, dtype, d, n)
    lines = [f"forward, {dtype}, d={d}, N={n} (TFLOP/s; gain over the row above)",
             f"{'step':<44} {'non-causal':>16} {'causal':>16}"]
    prev = {}
    for i, row in enumerate(rows):
        cells = []
        for key in ("non-causal", "causal"):
            t = row[key]
            gain = f"({t / prev[key]:.2f}x)" if t and prev.get(key) and i < len(ABLATION_STEPS) else ""
            cells.append(f"{t:7.1f} {gain:>8}" if t else f"{'-':>7} {'':>8}")
            if i < len(ABLATION_STEPS):
                prev[key] = t
        lines.append(f"{row['step']:<44} {cells[0]:>16} {cells[1]:>16}")
    return "\n".join(lines)


def two_stage_gain(data: dict, config=TMA_WIDE_CONFIG) -> list[tuple]:
    """``(dtype, d, N, one-stage TFLOP/s, two-stage TFLOP/s)`` for every causal cell measured."""
    out = []
    for r in data["rows"]:
        if r["variant"] == "tma_one_stage" and tuple(r["config"]) == tuple(config) and r.get("run", 1) == 1:
            two = tflops(data, "tma", r["dtype"], r["d"], r["N"], True, config)
            out.append((r["dtype"], r["d"], r["N"], r["tflops"], two))
    return out


def pipeline_depth(data: dict) -> list[tuple]:
    """``(dtype, d, N, causal, stages-3 TFLOP/s, stages-4 TFLOP/s)`` for every cell."""
    three, four = DEEPER_PIPELINE
    out = []
    for r in data["rows"]:
        if r["variant"] == "tma" and tuple(r["config"]) == three and r.get("run", 1) == 1:
            out.append((r["dtype"], r["d"], r["N"], r["causal"], r["tflops"],
                        tflops(data, "tma", r["dtype"], r["d"], r["N"], r["causal"], four)))
    return out


def cells(data: dict, variant: str = "sdpa_cudnn", run: int | None = 1) -> list[tuple]:
    """Every (dtype, d, N, causal) cell where ``variant`` was measured, in the file's order."""
    seen = []
    for r in data["rows"]:
        if run is not None and r.get("run", 1) != run:
            continue
        key = (r["dtype"], r["d"], r["N"], r["causal"])
        if r["variant"] == variant and key not in seen:
            seen.append(key)
    return seen


def ratio_summary(data: dict, variant: str, baseline: str, head_dims=None) -> dict:
    """Median and minimum of ``variant`` (best config) ÷ ``baseline`` over the measured cells."""
    ratios = [tflops(data, variant, *c) / tflops(data, baseline, *c) for c in cells(data, baseline)
              if (head_dims is None or c[1] in head_dims) and tflops(data, variant, *c)]
    return {"median": statistics.median(ratios), "min": min(ratios), "n": len(ratios)}


def fp8_speedup(data: dict, d: int = 128, min_n: int = 4096) -> list[tuple]:
    """``(N, causal, fp16 best, fp8 best, fp8 / fp16)`` at head dim ``d``, N >= ``min_n``.

    The fp16 side is the best descriptor-kernel config of either run (the conservative choice:
    the higher fp16 figure), the FP8 side the best FP8 config.
    """
    out = []
    for dtype, dd, n, causal in cells(data, "fp8", run=None):
        if dd == d and n >= min_n:
            f16 = tflops(data, "tma", dtype, d, n, causal, run=None)
            f8 = tflops(data, "fp8", dtype, d, n, causal, run=None)
            out.append((n, causal, f16, f8, f8 / f16))
    return out


def plot_ablation(data: dict, dtype: str = "float16", d: int = 128, n: int = 16384):
    """A bar chart of :func:`ablation`: one group per step, non-causal and causal bars."""
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in ablation(data, dtype, d, n)]
    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    y = np.arange(len(rows))
    for offset, key in ((-0.2, "non-causal"), (0.2, "causal")):
        ax.barh(y + offset, [r[key] or 0 for r in rows], height=0.4, label=key)
    ax.set_yticks(y, [r["step"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("forward TFLOP/s")
    ax.set_title(f"FlashAttention-3 ideas, one at a time ({dtype}, d={d}, N={n}, H100)\n{timer_note(data['meta'])}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: the bars reach both edges
    fig.tight_layout()
    return fig


# The constexpr arguments at the end of each kernel's signature, in order (the cache key lists
# them last): chapter 06's pointer kernel and the descriptor kernel.
_TRAILING_CONSTEXPRS = {
    "pointer": ("HEAD_DIM_REAL", "HEAD_DIM", "CAUSAL", "ACC_DTYPE", "DOT_PRECISION", "BLOCK_M", "BLOCK_N"),
    "tma": ("HEAD_DIM", "CAUSAL", "ACC_DTYPE", "DOT_PRECISION", "BLOCK_M", "BLOCK_N", "TWO_STAGE",
            "WARP_SPECIALIZE", "FP8"),
}


def resources(data: dict, head_dim: int = 128, num_warps: int = 8) -> list[dict]:
    """What the compiler gave each forward kernel at ``head_dim`` and ``num_warps`` (run 2, fp16
    timing and the checks): one row per (kernel, BLOCK_M, BLOCK_N, num_stages) with the range of
    registers per thread, spilled registers and shared memory over its compilations (causal or
    not, one or two stages)."""
    import re

    groups: dict = {}
    for r in data.get("resources", []):
        if "error" in r or r["num_warps"] != num_warps:
            continue
        names = _TRAILING_CONSTEXPRS[r["kernel"]]
        values = re.findall(r"\('constexpr', ([^)]*)\)", r["key"])[-len(names):]
        consts = dict(zip(names, values))
        if consts.get("HEAD_DIM") != str(head_dim) or consts.get("FP8") == "True":
            continue
        key = (r["kernel"], int(consts["BLOCK_M"]), int(consts["BLOCK_N"]), r["num_stages"])
        groups.setdefault(key, []).append(r)
    out = []
    for (kernel, bm, bn, stages), rs in sorted(groups.items()):
        span = lambda f: (min(f(r) for r in rs), max(f(r) for r in rs))  # noqa: E731
        out.append({"kernel": kernel, "block_m": bm, "block_n": bn, "num_stages": stages,
                    "n_regs": span(lambda r: r["n_regs"]), "n_spills": span(lambda r: r["n_spills"]),
                    "shared_kib": span(lambda r: round(r["shared_bytes"] / 1024))})
    return out


def fp8_accuracy(data: dict) -> dict:
    """Mean RMSE against float64 over the recorded seeds: ``{"fp16", "fp8", "fp8_rotated"}``."""
    rows = data["fp8_accuracy"]
    return {key: statistics.mean(r[key] for r in rows) for key in ("fp16", "fp8", "fp8_rotated")}


# ---------------------------------------------------------------- the Gluon forward (section 7)

GLUON_FILE = RECORDED_DIR / "h100_gluon.json"
# The columns of the Gluon table: label and the ``impl`` of the rows in ``data["speed"]``. The four
# designs of course_lib/kernels/gluon_hopper.py, then the two kernels they are compared with.
GLUON_COLUMNS = (("a: tma", "gluon_tma"), ("b: overlap", "gluon_overlap"), ("c: ws", "gluon_ws"),
                 ("d: pingpong", "gluon_pingpong"), ("Triton TMA", "tma"), ("cuDNN", "sdpa_cudnn"))


def load_gluon(path: Path | str = GLUON_FILE) -> dict | None:
    """The recorded run of ``tools/gluon_forward.py`` on an H100 (keys ``meta``, ``compile``,
    ``errors``, ``speed``), or None if ``path`` does not exist.

    ``speed`` rows: ``impl`` (``gluon_<variant>``, ``tma``: the Triton descriptor forward,
    ``sdpa_cudnn``), ``dtype``, ``N``, ``causal``, forward ``tflops`` (d=128, 16 heads,
    B·N = 16k tokens, CUDA-graph median; ``meta["timer"]`` filled in: :data:`GLUON_TIMER`)."""
    return _load_or_none(path, GLUON_TIMER)


def _load_or_none(path: Path | str, timer: str) -> dict | None:
    """A recorded JSON file with ``meta["timer"]`` filled in (``timer`` where the file names none),
    or None if ``path`` does not exist."""
    path = Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    data["meta"].setdefault("timer", timer)
    return data


def gluon_tflops(data: dict, impl: str, dtype: str, n: int, causal: bool) -> float | None:
    """The recorded TFLOP/s of ``impl`` on one cell, or None if it was not measured."""
    found = [r["tflops"] for r in data["speed"]
             if r["impl"] == impl and r["dtype"] == dtype and r["N"] == n and r["causal"] == causal]
    return found[0] if found else None


def gluon_rows(data: dict) -> list[dict]:
    """One row per measured (dtype, N, causal) cell, in the file's order: ``{"dtype", "N",
    "causal", <impl>: TFLOP/s for every impl of GLUON_COLUMNS, "vs_tma", "vs_cudnn"}`` (the
    ping-pong kernel's TFLOP/s divided by the Triton TMA forward's and by cuDNN's)."""
    cells = []
    for r in data["speed"]:
        key = (r["dtype"], r["N"], r["causal"])
        if key not in cells:
            cells.append(key)
    rows = []
    for dtype, n, causal in cells:
        row = {"dtype": dtype, "N": n, "causal": causal,
               **{impl: gluon_tflops(data, impl, dtype, n, causal) for _, impl in GLUON_COLUMNS}}
        pp, tma, cudnn = row["gluon_pingpong"], row["tma"], row["sdpa_cudnn"]
        row["vs_tma"] = pp / tma if pp and tma else None
        row["vs_cudnn"] = pp / cudnn if pp and cudnn else None
        rows.append(row)
    return rows


def _fmt(x, width: int, spec: str) -> str:
    """``x`` right-aligned in ``width`` with format ``spec``, or ``-`` if it is None (not measured)."""
    return f"{x:>{width}{spec}}" if x is not None else f"{'-':>{width}}"


def gluon_table(data: dict) -> str:
    """The Gluon forward's recorded speed as a text table: a provenance line, then per cell the
    four designs, the Triton TMA forward and cuDNN (TFLOP/s) and the ratios of :func:`gluon_rows`."""
    head = (f"{'dtype':<9} {'N':>6} {'causal':>6} |" + "".join(f"{label:>12}" for label, _ in GLUON_COLUMNS)
            + f" | {'pp ÷ TMA':>9} {'pp ÷ cuDNN':>10}")
    lines = [provenance(data),
             "forward TFLOP/s, d=128, 16 heads, B·N = 16k tokens; pp = d: pingpong",
             head, "-" * len(head)]
    for row in gluon_rows(data):
        lines.append(f"{row['dtype']:<9} {row['N']:>6} {str(row['causal']):>6} |"
                     + "".join(_fmt(row[impl], 12, ".1f") for _, impl in GLUON_COLUMNS)
                     + f" | {_fmt(row['vs_tma'], 9, '.2f')} {_fmt(row['vs_cudnn'], 10, '.2f')}")
    return "\n".join(lines)


def gluon_plot(data: dict):
    """A bar chart of :func:`gluon_rows`: one group of bars per cell, one bar per column."""
    import matplotlib.pyplot as plt
    import numpy as np

    rows = gluon_rows(data)
    fig, ax = plt.subplots(figsize=(11, 4), dpi=100)
    x = np.arange(len(rows))
    width = 0.8 / len(GLUON_COLUMNS)
    for i, (label, impl) in enumerate(GLUON_COLUMNS):
        ax.bar(x + (i - (len(GLUON_COLUMNS) - 1) / 2) * width, [r[impl] or 0 for r in rows], width, label=label)
    ax.set_xticks(x, [f"{r['dtype'].replace('float', 'fp').replace('bfp', 'bf')}\nN={r['N']}"
                      f"{' causal' if r['causal'] else ''}" for r in rows], fontsize=8)
    ax.set_ylabel("forward TFLOP/s")
    ax.set_title(f"The Gluon forward's four designs against the Triton TMA forward and cuDNN (d=128, "
                 f"{data['meta']['gpu']})\n{timer_note(data['meta'])}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


GLUON_BACKWARD_FILE = RECORDED_DIR / "h100_gluon_backward.json"
# (column label, impl in the file): the library with chapter 09's Gluon backward, with chapter
# 07's Triton backward (COURSE_LIB_GLUON_BACKWARD=0), and SDPA's cuDNN backend.
GLUON_BACKWARD_COLUMNS = (("Gluon", "course_gluon_bwd"), ("Triton (ch07)", "course_triton_bwd"),
                          ("cuDNN", "sdpa_cudnn"))


def load_gluon_backward(path: Path | str = GLUON_BACKWARD_FILE) -> dict | None:
    """The recorded run of ``tools/gluon_backward.py`` on an H100 (keys ``meta``, ``compile``,
    ``errors``, ``speed``), or None if ``path`` does not exist. ``speed`` rows: ``impl`` (see
    :data:`GLUON_BACKWARD_COLUMNS`), ``dtype``, ``N``, ``causal`` and the TFLOP/s of ``fwd``,
    ``fwd+bwd`` and ``bwd`` (forward+backward minus forward; d=128, B·N = 16k tokens, CUDA graphs)."""
    return load_gluon(path)


def gluon_backward_rows(data: dict) -> list[dict]:
    """One row per (dtype, N, causal) cell: ``{"dtype", "N", "causal", "bwd": {impl: TFLOP/s},
    "fwd+bwd": {impl: TFLOP/s}}`` for every impl of :data:`GLUON_BACKWARD_COLUMNS` (None where
    it was not measured)."""
    rows: dict = {}
    for r in data["speed"]:
        row = rows.setdefault((r["dtype"], r["N"], r["causal"]),
                              {"dtype": r["dtype"], "N": r["N"], "causal": r["causal"], "bwd": {}, "fwd+bwd": {}})
        row["bwd"][r["impl"]] = r["bwd"]
        row["fwd+bwd"][r["impl"]] = r["fwd+bwd"]
    return list(rows.values())


def gluon_backward_table(data: dict) -> str:
    """The recorded backward speed as text: a provenance line, then per cell the backward's TFLOP/s
    of each column, the Gluon backward ÷ the Triton one and ÷ cuDNN's, and forward+backward ÷ cuDNN."""
    head = (f"{'dtype':<9} {'N':>6} {'causal':>6} |" + "".join(f"{label:>14}" for label, _ in GLUON_BACKWARD_COLUMNS)
            + f" | {'÷ Triton':>8} {'÷ cuDNN':>8} | {'fwd+bwd ÷ cuDNN':>15}")
    lines = [provenance(data), "backward TFLOP/s (forward+backward minus forward), d=128, B·N = 16k tokens",
             head, "-" * len(head)]
    ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
    for row in gluon_backward_rows(data):
        bwd, both = row["bwd"], row["fwd+bwd"]
        lines.append(f"{row['dtype']:<9} {row['N']:>6} {str(row['causal']):>6} |"
                     + "".join(f"{bwd.get(impl) or '-':>14}" for _, impl in GLUON_BACKWARD_COLUMNS)
                     + f" | {ratio(bwd.get('course_gluon_bwd'), bwd.get('course_triton_bwd')):>8}"
                     f" {ratio(bwd.get('course_gluon_bwd'), bwd.get('sdpa_cudnn')):>8} |"
                     f" {ratio(both.get('course_gluon_bwd'), both.get('sdpa_cudnn')):>15}")
    return "\n".join(lines)


# ---------------------------------------------------------------- FlashAttention-4's two tricks (section 8)

FA4_FILE = RECORDED_DIR / "h100_fa4_ablation.json"
# tools/gluon_ablation.py times with course_lib.measure.bench's CUDA-graph timer and writes it into meta.
FA4_TIMER = "cudagraph"
FA4_BASELINE = "baseline"  # the config with both switches off: the kernel as the library runs it
FA4_CUDNN = "sdpa_cudnn"  # impl prefix of the yardstick rows: sdpa_cudnn/<d>
FA4_LIBRARY = "course"  # impl prefix of the library as users call it: course/<d>


def load_fa4(path: Path | str = FA4_FILE) -> dict | None:
    """The recorded ablation of FlashAttention-4's tricks on an H100 (``tools/gluon_ablation.py
    --record``), or None if ``path`` does not exist.

    Keys: ``meta`` (GPU, driver, versions, date, timer, configs and their switches, groups),
    ``compile`` (``"variant/d/config"`` -> registers, spills, ``ex2``, ``poly_fma``, ...), ``speed``
    (``cells``: ``[dtype, N, causal]``; ``tflops``: impl -> one forward TFLOP/s per cell, None where
    not timed), ``summary`` (``speed`` and ``accuracy`` per impl), ``skipped``, ``failed``, ``excluded``.
    """
    return _load_or_none(path, FA4_TIMER)


def fa4_rows(data: dict) -> list[dict]:
    """The record's speed as rows ``{"impl", "d", "dtype", "N", "causal", "tflops"}`` (the full
    run's format; the cells not timed are left out). ``impl``: ``variant/d/config``,
    ``sdpa_cudnn/d`` or ``course/d``."""
    speed = data["speed"]
    return [{"impl": impl, "d": int(impl.split("/")[1]), "dtype": dtype, "N": n, "causal": causal, "tflops": t}
            for impl, values in speed["tflops"].items()
            for (dtype, n, causal), t in zip(speed["cells"], values) if t is not None]


def fa4_cells(rows: list[dict]) -> dict:
    """``{(impl, dtype, N, causal): tflops}`` of the rows that were timed."""
    return {(r["impl"], r["dtype"], r["N"], r["causal"]): r["tflops"] for r in rows if r.get("tflops")}


def fa4_ratios(rows: list[dict], impl: str, baseline: str) -> list[float]:
    """``impl``'s TFLOP/s over ``baseline``'s in every cell both have, in the rows' order."""
    cells = fa4_cells(rows)
    return [t / cells[(baseline, *key[1:])] for key, t in cells.items()
            if key[0] == impl and (baseline, *key[1:]) in cells]


def fa4_baseline(impl: str) -> str | None:
    """The baseline of a ``variant/d/config`` impl (the same variant and d, both switches off);
    None for the yardsticks (``sdpa_cudnn/d``, ``course/d``)."""
    parts = impl.split("/")
    return "/".join(parts[:2] + [FA4_BASELINE]) if len(parts) == 3 else None


def fa4_speed_summary(rows: list[dict]) -> dict:
    """Per timed impl (cuDNN left out): ``{"cells", "median_x_cudnn", "min_x_cudnn",
    "median_x_baseline"}``, ratios over the cells both were timed in, rounded to 3 digits (None
    where there is nothing to divide by)."""
    out = {}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        if impl.startswith(FA4_CUDNN):
            continue
        vs_cudnn = fa4_ratios(rows, impl, f"{FA4_CUDNN}/{impl.split('/')[1]}")
        vs_base = fa4_ratios(rows, impl, fa4_baseline(impl)) if fa4_baseline(impl) else []
        out[impl] = {"cells": len(vs_cudnn),
                     "median_x_cudnn": round(statistics.median(vs_cudnn), 3) if vs_cudnn else None,
                     "min_x_cudnn": round(min(vs_cudnn), 3) if vs_cudnn else None,
                     "median_x_baseline": round(statistics.median(vs_base), 3) if vs_base else None}
    return out


def fa4_label(data: dict, config: str) -> str:
    """A config's switches in a few words: ``baseline``, ``τ=8``, ``exp2 1/4``, ``τ=8 + exp2 1/4``,
    ``exp2 2/4 deg 5`` (conditional rescaling's threshold; how many of every ``exp2_pack``
    exponentials run on the FMA units, and the polynomial's degree when it is not the default)."""
    switches = data["meta"]["configs"][config]
    parts = []
    if switches.get("rescale_tau"):
        parts.append(f"τ={switches['rescale_tau']:g}")
    if switches.get("exp2_emulated"):
        degree = switches.get("exp2_degree", EXP2_POLY_DEGREE)
        parts.append(f"exp2 {switches['exp2_emulated']}/{data['meta']['exp2_pack']}"
                     + (f" deg {degree}" if degree != EXP2_POLY_DEGREE else ""))
    return " + ".join(parts) or FA4_BASELINE


def _fa4_group_configs(data: dict, variant: str, d: int) -> list[str]:
    """The configs of one (variant, d) group that were timed or checked, in the order of the run's configs."""
    prefix = f"{variant}/{d}/"
    seen = set(data["speed"]["tflops"]) | set(data["summary"]["accuracy"])
    return [c for c in data["meta"]["configs"] if prefix + c in seen]


def _fa4_grid_line(data: dict) -> str:
    m = data["meta"]
    cells = data["speed"]["cells"]
    return (f"forward, B·N = {m['tokens'] // 1024}k tokens, H·d = {m['model_dim']}, {len(cells)} cells "
            f"({'/'.join(sorted({c[0] for c in cells}))} × N {'/'.join(str(n) for n in m['seq_lens'])}"
            " × causal or not)")


def fa4_summary_table(data: dict) -> str:
    """The ablation in one table: a provenance line, the grid, then per (variant, d, config) what
    the compiled kernel holds (``ex2.approx`` count, the polynomial's FMAs, registers, spilled
    bytes) and its speed: median and min ÷ cuDNN over the cells, median ÷ the group's baseline.
    The library's Triton forward closes each head dim it was timed at."""
    head = (f"{'variant':<9}{'d':>4}  {'config':<16}|{'ex2':>5}{'poly FMA':>9}{'regs':>6}{'spill':>6} |"
            f"{'÷ cuDNN median':>15}{'min':>6} |{'÷ baseline':>11}")
    lines = [provenance(data), _fa4_grid_line(data), head, "-" * len(head)]
    summary = data["summary"]["speed"]
    for d in dict.fromkeys(d for _, d in data["meta"]["groups"]):
        for variant, gd in data["meta"]["groups"]:
            if gd != d:
                continue
            for config in _fa4_group_configs(data, variant, d):
                name = f"{variant}/{d}/{config}"
                facts, s = data["compile"].get(name, {}), summary.get(name, {})
                lines.append(f"{variant:<9}{d:>4}  {fa4_label(data, config):<16}|{_fmt(facts.get('ex2'), 5, 'd')}"
                             f"{_fmt(facts.get('poly_fma'), 9, 'd')}{_fmt(facts.get('registers'), 6, 'd')}"
                             f"{_fmt(facts.get('spill_bytes'), 6, 'd')} |{_fmt(s.get('median_x_cudnn'), 15, '.3f')}"
                             f"{_fmt(s.get('min_x_cudnn'), 6, '.3f')} |{_fmt(s.get('median_x_baseline'), 11, '.3f')}")
        library = summary.get(f"{FA4_LIBRARY}/{d}")
        if library:
            lines.append(f"{'Triton forward (the library)':<31}|{'':>26} |{_fmt(library['median_x_cudnn'], 15, '.3f')}"
                         f"{_fmt(library['min_x_cudnn'], 6, '.3f')} |{'-':>11}")
    return "\n".join(lines)


def fa4_cell_table(data: dict, variant: str, d: int) -> str:
    """One group's speed per cell: the baseline's TFLOP/s and its ratio to cuDNN, every other
    config's TFLOP/s ÷ the baseline's in the same cell, then the library's forward (when timed at
    this d) and cuDNN in TFLOP/s. A provenance line first."""
    if [variant, d] not in [list(g) for g in data["meta"]["groups"]]:
        raise ValueError(f"(variant, d) must be one of the recorded groups {data['meta']['groups']}, "
                         f"got ({variant!r}, {d!r})")
    cells = fa4_cells(fa4_rows(data))
    configs = [c for c in _fa4_group_configs(data, variant, d) if f"{variant}/{d}/{c}" in data["speed"]["tflops"]]
    others = [c for c in configs if c != FA4_BASELINE]
    library = f"{FA4_LIBRARY}/{d}" if f"{FA4_LIBRARY}/{d}" in data["speed"]["tflops"] else None
    labels = [fa4_label(data, c) for c in others]
    width = max([len(label) for label in labels] + [9]) + 1
    head = (f"{'dtype':<9}{'N':>6}{'causal':>7} |{'baseline':>9}{'÷ cuDNN':>8} |"
            + "".join(f"{label:>{width}}" for label in labels)
            + " |" + (f"{'library':>9}" if library else "") + f"{'cuDNN':>8}")
    lines = [provenance(data), f"forward TFLOP/s, {variant}, d={d}; each config ÷ the baseline in the same cell",
             head, "-" * len(head)]
    for dtype, n, causal in data["speed"]["cells"]:
        get = lambda impl: cells.get((impl, dtype, n, causal))  # noqa: E731
        base, cudnn = get(f"{variant}/{d}/{FA4_BASELINE}"), get(f"{FA4_CUDNN}/{d}")
        ratio = lambda a, b: f"{a / b:.3f}" if a and b else "-"  # noqa: E731
        lines.append(f"{dtype:<9}{n:>6}{str(causal):>7} |{base or '-':>9}{ratio(base, cudnn):>8} |"
                     + "".join(f"{ratio(get(f'{variant}/{d}/{c}'), base):>{width}}" for c in others)
                     + " |" + (f"{get(library) or '-':>9}" if library else "") + f"{cudnn or '-':>8}")
    return "\n".join(lines)


def fa4_accuracy_table(data: dict) -> str:
    """Per checked config: cases within the rule (``meta["rule"]``) on ordinary inputs and on the
    fuzz (logits up to ±``meta["fuzz_logit"]``), the worst errors as multiples of SDPA's, and the
    median fraction of rescales conditional rescaling skipped on each kind of input."""
    m = data["meta"]
    kinds = ("ordinary", "fuzz")
    head = (f"{'variant':<9}{'d':>4}  {'config':<16}| {'passed: ordinary':>16}{'fuzz':>6} |"
            f"{'worst o ÷ SDPA':>15}{'lse ÷ SDPA':>11} | {'rescales skipped: ordinary':>26}{'fuzz':>8}")
    lines = [provenance(data), f"accuracy: {m['rule']}; fuzz: logits up to ±{m['fuzz_logit']:g}",
             head, "-" * len(head)]
    for name, a in data["summary"]["accuracy"].items():
        variant, d, config = name.split("/")
        by = a["by_inputs"]
        passed = [f"{by[k]['passed']}/{by[k]['cases']}" if k in by else "-" for k in kinds]
        skipped = [f"{a['rescale_skipped'][k]['median']:.2%}" if k in a.get("rescale_skipped", {}) else "-"
                   for k in kinds]
        lines.append(f"{variant:<9}{d:>4}  {fa4_label(data, config):<16}| {passed[0]:>16}{passed[1]:>6} |"
                     f"{a['worst_o_x_sdpa']:>15.2f}{a['worst_lse_x_sdpa']:>11.2f} | {skipped[0]:>26}{skipped[1]:>8}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the backward's overlap and persistent grid (section 8)

BWD_OVERLAP_FILE = RECORDED_DIR / "h100_gluon_bwd_overlap.json"
BWD_IMPL = "bwd"  # impl prefix of tools/gluon_bwd_ablation.py's configs: bwd/<d>/<config>
BWD_PASSES = ("bwd", "fwd+bwd")  # the backward alone (forward+backward minus forward), and both
BWD_GRADS = ("dq", "dk", "dv")


def load_bwd_overlap(path: Path | str = BWD_OVERLAP_FILE) -> dict | None:
    """The recorded ablation of the Gluon backward's overlap and persistent grid on an H100
    (``tools/gluon_bwd_ablation.py --record``), or None, with a warning naming ``path`` and the
    tool that makes it, if ``path`` does not exist.

    Keys as :func:`load_fa4`'s, but ``speed["cells"]`` are ``[dtype, d, N, causal]`` and
    ``speed["tflops"]`` and ``summary["speed"]`` hold one entry per pass of :data:`BWD_PASSES`;
    ``compile`` (``"bwd/d/config"``) has ``dq_overlap``: per run of dQ atomics in the PTX, the
    ``wgmma`` instructions in flight (:func:`course_lib.kernels.gluon_backward.dq_overlap`)."""
    data = _load_or_none(path, FA4_TIMER)  # the same timer as the forward ablation: bench's CUDA graphs
    if data is None:
        warnings.warn(f"no recorded backward ablation at {path}: run tools/gluon_bwd_ablation.py --out on a "
                      "Hopper GPU, then tools/gluon_bwd_ablation.py --record on its output", stacklevel=2)
    return data


def bwd_overlap_rows(data: dict, pass_: str) -> list[dict]:
    """One pass's timed cells as :func:`fa4_rows` gives the forward's: ``{"impl", "d", "dtype", "N",
    "causal", "tflops"}``, so that :func:`fa4_speed_summary` and :func:`fa4_cells` read them.
    Raises ValueError naming ``pass_`` if the record has no such pass."""
    speed = data["speed"]
    if pass_ not in speed["tflops"]:
        raise ValueError(f"pass_ must be one of {sorted(speed['tflops'])}, got {pass_!r}")
    return [{"impl": impl, "d": d, "dtype": dtype, "N": n, "causal": causal, "tflops": t}
            for impl, values in speed["tflops"][pass_].items()
            for (dtype, d, n, causal), t in zip(speed["cells"], values) if t is not None]


def bwd_overlap_configs(data: dict, d: int) -> list[str]:
    """The configs timed (in either pass) or checked at head dim ``d``, in the order of the run's configs."""
    summary = data["summary"]
    seen = set(summary["accuracy"]).union(*(summary["speed"].get(p, {}) for p in BWD_PASSES))
    return [c for c in data["meta"]["configs"] if f"{BWD_IMPL}/{d}/{c}" in seen]


def bwd_overlap_switches(data: dict, config: str) -> str:
    """A config's switches of ``gluon_backward.CONFIG`` as the run set them: ``-`` (none: the library's
    kernel), ``PIPELINE=1``, ``PERSISTENT + PIPELINE=1``, ..."""
    switches = data["meta"]["configs"][config]
    return " + ".join(k if v is True else f"{k}={v}" for k, v in sorted(switches.items())) or "-"


def _bwd_head_dims(data: dict) -> list[int]:
    return list(dict.fromkeys(d for _, d, _, _ in data["speed"]["cells"]))


def _bwd_partial_line(data: dict) -> str:
    """Which configs were timed on part of the grid only, and at which N (the persistent grid
    where the kernel runs it); empty if every config was timed everywhere."""
    rows = bwd_overlap_rows(data, BWD_PASSES[0])
    grid = sorted({n for _, _, n, _ in data["speed"]["cells"]})
    partial: dict = {}
    for config in data["meta"]["configs"]:
        seq_lens = sorted({r["N"] for r in rows if r["impl"].split("/")[2:] == [config]})
        if seq_lens and seq_lens != grid:
            partial.setdefault(tuple(seq_lens), []).append(config)
    return "; ".join(f"{', '.join(configs)} timed at N = {'/'.join(map(str, ns))} only"
                     for ns, configs in partial.items())


def bwd_overlap_summary_table(data: dict) -> str:
    """The ablation in one table: a provenance line, the grid, then per (d, config) the cells timed and,
    for the backward and for forward+backward, the median and min ÷ cuDNN over those cells and the
    median ÷ the baseline (the library's kernel, every switch off) in the same cells."""
    m, cells = data["meta"], data["speed"]["cells"]
    grid = f"{'/'.join(sorted({c[0] for c in cells}))} × N {'/'.join(str(n) for n in m['seq_lens'])} × causal or not"
    passes = "".join(f" | {p + ' ÷ cuDNN median':>22}{'min':>6}{'÷ baseline':>11}" for p in BWD_PASSES)
    head = f"{'d':>4}  {'config':<19}{'switches':<23}{'cells':>5}" + passes
    lines = [provenance(data), f"Gluon backward, B·N = {m['tokens'] // 1024}k tokens, H·d = {m['model_dim']}, {grid}",
             *filter(None, [_bwd_partial_line(data)]), head, "-" * len(head)]
    for d in _bwd_head_dims(data):
        for config in bwd_overlap_configs(data, d):
            name = f"{BWD_IMPL}/{d}/{config}"
            s = {p: data["summary"]["speed"].get(p, {}).get(name, {}) for p in BWD_PASSES}
            lines.append(f"{d:>4}  {config:<19}{bwd_overlap_switches(data, config):<23}"
                         f"{_fmt(s[BWD_PASSES[0]].get('cells'), 5, 'd')}"
                         + "".join(f" | {_fmt(s[p].get('median_x_cudnn'), 22, '.3f')}{_fmt(s[p].get('min_x_cudnn'), 6, '.3f')}"
                                   f"{_fmt(s[p].get('median_x_baseline'), 11, '.3f')}" for p in BWD_PASSES))
    return "\n".join(lines)


def bwd_overlap_cell_table(data: dict, pass_: str = "bwd") -> str:
    """One pass cell by cell: the baseline's TFLOP/s and its ratio to cuDNN's, then every other
    config's TFLOP/s ÷ the baseline's in the same cell (``-`` where it was not timed). A provenance
    line first. Raises ValueError naming ``pass_`` if the record has no such pass."""
    cells = fa4_cells(bwd_overlap_rows(data, pass_))
    others = [c for c in data["meta"]["configs"] if c != FA4_BASELINE]
    width = max(len(c) for c in others) + 2
    head = (f"{'d':>4} {'dtype':<9}{'N':>6}{'causal':>7} |{'baseline':>9}{'÷ cuDNN':>8} |"
            + "".join(f"{c:>{width}}" for c in others))
    lines = [provenance(data), f"{pass_} TFLOP/s; each config ÷ the baseline in the same cell", head, "-" * len(head)]
    ratio = lambda a, b: f"{a / b:.3f}" if a and b else "-"  # noqa: E731
    for dtype, d, n, causal in data["speed"]["cells"]:
        get = lambda impl: cells.get((impl, dtype, n, causal))  # noqa: E731
        base = get(f"{BWD_IMPL}/{d}/{FA4_BASELINE}")
        lines.append(f"{d:>4} {dtype:<9}{n:>6}{str(causal):>7} |{base or '-':>9}{ratio(base, get(f'{FA4_CUDNN}/{d}')):>8} |"
                     + "".join(f"{ratio(get(f'{BWD_IMPL}/{d}/{c}'), base):>{width}}" for c in others))
    return "\n".join(lines)


def bwd_overlap_facts_table(data: dict) -> str:
    """Per config and head dim: what its compiled kernel holds (spilled bytes, shared memory, the
    ``wgmma`` instructions in flight at each run of dQ atomics) and its accuracy (cases within the
    rule on ordinary inputs and on the fuzz, each gradient's worst error ÷ SDPA's)."""
    m = data["meta"]
    triton = sorted({f.get("triton", "?") for f in data["compile"].values()})
    head = (f"{'d':>4}  {'config':<19}| {'spill B':>7}{'shared KiB':>11}  {'wgmma in flight at dQ adds':<27}|"
            f" {'passed: ordinary':>16}{'fuzz':>6} | {'worst ÷ SDPA: dq':>16}" + "".join(f"{g:>5}" for g in BWD_GRADS[1:]))
    lines = [provenance(data),
             f"compiled kernel: the checks' fp16 causal N = 1024 one, Triton {', '.join(triton)}",
             f"accuracy: {m['rule']}; fuzz: logits up to ±{m['fuzz_logit']:g}", head, "-" * len(head)]
    kinds = ("ordinary", "fuzz")
    for d in _bwd_head_dims(data):
        for config in bwd_overlap_configs(data, d):
            name = f"{BWD_IMPL}/{d}/{config}"
            f, a = data["compile"].get(name, {}), data["summary"]["accuracy"].get(name, {})
            facts = (f"{f['spill_bytes']:>7}{f['shared_bytes'] / 1024:>11.1f}  {str(f['dq_overlap']):<27}"
                     if "spill_bytes" in f else f"{f.get('error', 'not compiled')[:47]:<47}")
            by = a.get("by_inputs", {})
            passed = [f"{by[k]['passed']}/{by[k]['cases']}" if k in by else "-" for k in kinds]
            worst = [a.get(f"worst_{g}_x_sdpa") for g in BWD_GRADS]
            lines.append(f"{d:>4}  {config:<19}| {facts}| {passed[0]:>16}{passed[1]:>6} |{_fmt(worst[0], 17, '.2f')}"
                         + "".join(_fmt(w, 5, ".2f") for w in worst[1:]))
    return "\n".join(lines)


# Issue 35's targets for the library ÷ cuDNN over the benchmark grid (forward and forward+backward):
# in CUDA graphs a median of at least 1.0 and no cell below 0.9; timed as users call it (eagerly),
# no cell below 0.85. Keys: bench's timers; a bound the issue does not set is absent.
CUDNN_TARGETS = {"cudagraph": {"median": 1.0, "min": 0.9}, "eager": {"min": 0.85}}


def cudnn_standing(gpu: str = "h100") -> list[dict]:
    """Where the library stands against cuDNN in the recorded grids, beside issue 35's targets.

    Returns one row per (timer of :data:`CUDNN_TARGETS` that has a recorded grid, pass):
    ``{"timer", "pass", "cells", "median", "min", "target_median", "target_min", "provenance"}``
    (a target None where the issue sets none)."""
    rows = []
    for timer, targets in CUDNN_TARGETS.items():
        grid = bench.load_recorded(gpu, timer)
        if grid is None:
            continue
        for pass_ in bench.PASSES:
            r = bench.ratios(grid, pass_, baseline=FA4_CUDNN)
            rows.append({"timer": timer, "pass": pass_, "cells": len(r), "median": statistics.median(r),
                         "min": min(r), "target_median": targets.get("median"), "target_min": targets.get("min"),
                         "provenance": bench.provenance(grid)})
    return rows


def cudnn_standing_table(gpu: str = "h100") -> str:
    """:func:`cudnn_standing` as text: each grid's provenance line once, then per timer and pass the
    median and min ÷ cuDNN with the target in parentheses."""
    lines, seen = [], set()
    target = lambda x: f"(≥ {x:.2f})" if x is not None else "(no target)"  # noqa: E731
    for row in cudnn_standing(gpu):
        if row["provenance"] not in seen:
            seen.add(row["provenance"])
            lines.append(row["provenance"])
        lines.append(f"  {row['pass']:<8} ÷ cuDNN over {row['cells']} cells: median {row['median']:.2f} "
                     f"{target(row['target_median']):<12} min {row['min']:.2f} {target(row['target_min'])}")
    return "\n".join(lines)


def source_excerpt(fn, start: str, end: str | None = None) -> str:
    """The lines of ``fn``'s source (a Python or ``@gluon.jit``/``@triton.jit`` function) from the
    first one containing ``start`` through the first one after it containing ``end`` (all of the
    function from ``start`` if ``end`` is None), each prefixed by its line number in the file.

    The notebook shows the kernel's code this way, read from the file: it cannot drift from it.
    Raises ValueError naming ``start`` or ``end`` if the text is not in the function.
    """
    import inspect

    lines, first = inspect.getsourcelines(getattr(fn, "fn", fn))
    i = next((k for k, line in enumerate(lines) if start in line), None)
    if i is None:
        raise ValueError(f"start {start!r} is not in {fn.__name__}'s source")
    j = len(lines) - 1 if end is None else next((k for k in range(i, len(lines)) if end in lines[k]), None)
    if j is None:
        raise ValueError(f"end {end!r} is not in {fn.__name__}'s source after {start!r}")
    name = Path(inspect.getsourcefile(getattr(fn, "fn", fn))).name
    import textwrap

    shown = textwrap.dedent("".join(lines[i:j + 1])).splitlines()
    return "\n".join(f"{name}:{first + i + k:<4} {line.rstrip()}" for k, line in enumerate(shown))


def gluon_kernel_facts(variants=("overlap", "pingpong"), head_dim: int = 128, causal: bool = True) -> dict:
    """``{variant: gluon_hopper.kernel_facts}`` of each variant cross-compiled for sm_90 (fp16,
    N = 1000), in a child Python process (see :func:`in_fresh_process`)."""
    code = ("from course_lib.kernels import gluon_hopper as gh\n"
            "result = {v: gh.cross_compile(v, head_dim=args['d'], dtype=torch.float16, causal=args['causal'],"
            " n=1000) for v in args['variants']}\n")
    return in_fresh_process(code, {"variants": list(variants), "d": head_dim, "causal": bool(causal)})


def in_fresh_process(code: str, args=None, timeout_s: int = 600):
    """Run ``code`` in a child Python process and return the JSON value it leaves in ``result``
    (``args``, any JSON value, is given to it as ``args``; ``json``, ``sys`` and ``torch`` are imported).

    For Gluon compiles: once the Triton interpreter has run a kernel in this process (the
    notebooks and many tests do), ``triton.language`` stays patched for interpretation and Gluon's
    compiler fails on ``gl.program_id``; a fresh process compiles cleanly (~3 s on a CPU)."""
    import os
    import subprocess
    import sys

    prog = ("import json, sys, torch\nargs = json.loads(sys.argv[1])\n" + code
            + "\nprint(json.dumps(result))\n")
    root = Path(__file__).resolve().parent.parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", prog, json.dumps(args)], capture_output=True, text=True, cwd=root,
                          env=env, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"the child process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
