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
``N``, ``causal``, forward ``tflops`` (FLOPs as in :mod:`course_lib.bench`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from course_lib.bench import RECORDED_DIR, timer_note

RECORDED_FILE = RECORDED_DIR / "h100_fa3.json"
# The timers of the tools that wrote the files, whose headers name none: tools/fa3_ablation.py
# times with triton.testing.do_bench; tools/gluon_forward.py and tools/gluon_backward.py with
# course_lib.bench's CUDA-graph timer. The loaders fill them in (a file that names one keeps it).
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
    path = Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    data["meta"].setdefault("timer", GLUON_TIMER)
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


def gluon_table(data: dict) -> str:
    """The Gluon forward's recorded speed as a text table: a provenance line, then per cell the
    four designs, the Triton TMA forward and cuDNN (TFLOP/s) and the ratios of :func:`gluon_rows`."""
    head = (f"{'dtype':<9} {'N':>6} {'causal':>6} |" + "".join(f"{label:>12}" for label, _ in GLUON_COLUMNS)
            + f" | {'pp ÷ TMA':>9} {'pp ÷ cuDNN':>10}")
    lines = [provenance(data),
             "forward TFLOP/s, d=128, 16 heads, B·N = 16k tokens; pp = d: pingpong",
             head, "-" * len(head)]
    fmt = lambda x, width, spec: f"{x:>{width}{spec}}" if x is not None else f"{'-':>{width}}"  # noqa: E731
    for row in gluon_rows(data):
        lines.append(f"{row['dtype']:<9} {row['N']:>6} {str(row['causal']):>6} |"
                     + "".join(fmt(row[impl], 12, ".1f") for _, impl in GLUON_COLUMNS)
                     + f" | {fmt(row['vs_tma'], 9, '.2f')} {fmt(row['vs_cudnn'], 10, '.2f')}")
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
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", prog, json.dumps(args)], capture_output=True, text=True, cwd=root,
                          env=env, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"the child process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
