"""Benchmark the course's FlashAttention kernel against PyTorch's attention backends (ch. 06-07).

Run ``python -m course_lib.measure.bench --help``. On a GPU it times, for each cell of the grid
dtype × head dim d × sequence length N × causal, and for each pass (forward, forward+backward):

- ``course``        ``course_lib.flash_attention`` (our Triton kernels)
- ``sdpa_flash``    ``scaled_dot_product_attention`` with the FLASH backend (FlashAttention-2)
- ``sdpa_cudnn``    ... with the CUDNN backend
- ``sdpa_mem_eff``  ... with the memory-efficient backend
- ``naive``         q kᵀ, softmax in fp32, p v, all materialised (skipped when it cannot fit)

Each cell uses ``batch · N = 16k`` tokens and ``heads · d = 2048`` (the design doc's grid), random
normal inputs (never zeros), the median time of the call (``--timer``: ``cudagraph``, the default,
replays the call captured in a CUDA graph, so the time is the GPU's alone; ``events`` is
``triton.testing.do_bench``, which also counts the Python launch overhead, up to a third of an
N = 1k call, and varies with the CPU; ``eager`` times a loop of calls made one after another as a
training loop makes them, wall clock with ``torch.cuda.synchronize()`` only before and after the
loop, so the host's work per call counts wherever the GPU would wait for it), and the FLOP convention
of the FlashAttention papers (:func:`course_lib.attention.costmodel.attention_flops`): ``4·B·H·N²·d``
forward, halved when causal, and 3.5× that for forward+backward (the backward counts 2.5×).
Peak memory is ``torch.cuda.max_memory_allocated`` during one call, minus what was allocated
before it (the inputs).

Results are a dict, saved as JSON::

    {"meta": {"gpu", "driver", "torch", "triton", "date"},
     "rows": [{"impl", "dtype", "d", "N", "causal", "pass", "tflops", "peak_mib"}, ...]}

The notebooks call :func:`notebook_cell`: live numbers on a GPU, the recorded ones
(``course_lib/data/benchmarks/<gpu>.json``) with their provenance on CPU.

``--overhead`` measures something else: the cost of one eager call at tiny shapes (B=1, H=4,
N in {128, 512}), where a call is mostly host work (checks, dispatch, launches), in microseconds
per call for each implementation, as users call it (:func:`run_overhead`, the ``eager`` timer).
Results: ``course_lib/data/benchmarks/<gpu>_overhead.json``, rows ``{"impl", "pass", "us_per_call",
"dtype", "d", "N", "causal", "batch", "heads", "calls"}``; :func:`format_overhead` and
:func:`overhead_cell` show them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path

from course_lib.attention.costmodel import attention_flops

IMPLS = ("course", "sdpa_flash", "sdpa_cudnn", "sdpa_mem_eff", "naive")
PASSES = ("fwd", "fwd+bwd")
BASELINE = "sdpa_flash"  # FlashAttention-2, the yardstick
RATIO_IMPLS = ("sdpa_flash", "sdpa_cudnn")  # the table shows course ÷ each of these
GRID = {"dtype": ("float16", "bfloat16"), "d": (64, 128), "N": (1024, 4096, 16384), "causal": (False, True)}
TOKENS = 16 * 1024  # batch · N
MODEL_DIM = 2048  # heads · d
# The naive version materialises (B, H, N, N) fp32 scores and probabilities (and their
# gradients): above this many score entries it would not fit in an 80 GB H100, so it is skipped.
NAIVE_MAX_SCORE_ENTRIES = 2**31
RECORDED_DIR = Path(__file__).resolve().parent.parent / "data" / "benchmarks"
_PASS_TO_COSTMODEL = {"fwd": "fwd", "fwd+bwd": "fwd_bwd"}
MIB = 2**20


# ----------------------------------------------------------------------------------------------
# Measuring (GPU only)


def add_grid_arguments(parser) -> None:
    """The grid options the GPU sweep tools share (comma-separated, the whole grid by default):
    ``--dtypes``, ``--head-dims``, ``--seq-lens``, ``--causal`` (0 and/or 1)."""
    parser.add_argument("--dtypes", default=",".join(GRID["dtype"]))
    parser.add_argument("--head-dims", default=",".join(map(str, GRID["d"])))
    parser.add_argument("--seq-lens", default=",".join(map(str, GRID["N"])))
    parser.add_argument("--causal", default="0,1")


def problem_shape(n: int, d: int, tokens: int = TOKENS, model_dim: int = MODEL_DIM):
    """(batch, heads) for one grid cell: batch · N = tokens, heads · d = model_dim."""
    return max(1, tokens // n), max(1, model_dim // d)


def flops(batch, heads, n, d, causal, pass_) -> float:
    return attention_flops(batch, heads, n, d, causal=causal, pass_=_PASS_TO_COSTMODEL[pass_])


def _sdpa_backend(impl: str):
    """The ``SDPBackend`` an ``sdpa_*`` implementation pins."""
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_mem_eff": SDPBackend.EFFICIENT_ATTENTION}[impl]


def _attention_fn(impl: str, pin_backend: bool = True):
    """A callable (q, k, v, causal) -> o for one implementation. ``pin_backend=False``: an SDPA
    implementation's call without its ``sdpa_kernel`` context (the caller holds it)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if impl == "course":
        from course_lib.kernels.api import flash_attention
        return lambda q, k, v, causal: flash_attention(q, k, v, causal=causal)
    if impl == "naive":
        from course_lib.attention.reference import naive_attention_torch
        return lambda q, k, v, causal: naive_attention_torch(q, k, v, causal=causal)[0]
    backend = _sdpa_backend(impl)

    def run(q, k, v, causal):
        if not pin_backend:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _inputs_and_step(impl: str, shape, torch_dtype, device: str, causal: bool, needs_grad: bool,
                     pin_backend: bool = True):
    """Random normal q, k, v ``shape`` (requiring grad when ``needs_grad``) and dO, and a step: one
    call of ``impl``, forward under ``torch.no_grad`` or forward+backward (``o.backward(dO)``);
    ``pin_backend``: as :func:`_attention_fn`."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, device=device, dtype=torch_dtype, generator=gen).requires_grad_(needs_grad)
               for _ in range(3))
    do = torch.randn(shape, device=device, dtype=torch_dtype, generator=gen)
    fn = _attention_fn(impl, pin_backend)
    if needs_grad:
        def step():
            fn(q, k, v, causal).backward(do)
    else:
        def step():
            with torch.no_grad():
                fn(q, k, v, causal)
    return q, k, v, do, step


TIMERS = ("cudagraph", "events", "eager")
# The eager timer: loops of back-to-back calls after a warm-up; each loop runs about this long (at
# least EAGER_MIN_CALLS calls), and the median of EAGER_REPEATS loops is kept.
EAGER_LOOP_MS = 100
EAGER_MIN_CALLS = 10
EAGER_WARMUP = 5
EAGER_REPEATS = 5


def time_eager_loops(step, calls: int | None = None, warmup: int = EAGER_WARMUP, repeats: int = EAGER_REPEATS,
                     grads=None, sync=None) -> list[float]:
    """Microseconds per call of ``step()`` made as users make it, once per loop: ``warmup`` calls,
    then ``repeats`` loops of ``calls`` calls back to back (None: as many as fill
    :data:`EAGER_LOOP_MS`), wall clock, ``sync()`` (``torch.cuda.synchronize`` on a GPU) only
    before and after each loop. ``grads``: tensors whose ``.grad`` is set to None after each call
    (``zero_grad(set_to_none=True)``, part of the timed step as in a training loop).

    Returns each loop's mean time per call.
    """
    sync = sync or (lambda: None)

    def call():
        step()
        for x in grads or ():
            x.grad = None

    for _ in range(warmup):
        call()
    sync()
    if calls is None:  # size the loops from one timed call (the warm-up ran the compiles)
        start = time.perf_counter()
        call()
        sync()
        calls = max(EAGER_MIN_CALLS, int(EAGER_LOOP_MS * 1e-3 / max(time.perf_counter() - start, 1e-9)))
    loops = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        loops.append((time.perf_counter() - start) / calls * 1e6)
    return loops


def time_eager_us(step, **kwargs) -> float:
    """The median loop of :func:`time_eager_loops` (same arguments): microseconds per eager call."""
    return statistics.median(time_eager_loops(step, **kwargs))


def _time_ms(step, timer: str, grads) -> tuple[float, str]:
    """Median milliseconds of ``step()`` and the timer that measured it: in a CUDA graph
    (falls back to events, saying why, when the call cannot be captured), with events, or
    eagerly (:func:`time_eager_us`)."""
    import triton

    if timer == "eager":
        import torch

        return time_eager_us(step, grads=grads, sync=torch.cuda.synchronize) / 1e3, timer
    if timer == "cudagraph":
        import torch

        try:
            return triton.testing.do_bench_cudagraph(step, rep=100, grad_to_none=grads, return_mode="median"), timer
        except RuntimeError as err:  # a backend that syncs with the CPU, or allocates outside the pool
            print(f"  cannot capture in a CUDA graph ({str(err).splitlines()[0][:80]}): timing with events")
            torch.cuda.synchronize()
    return triton.testing.do_bench(step, grad_to_none=grads, return_mode="median"), "events"


def measure(impl: str, dtype: str, d: int, n: int, causal: bool, pass_: str,
            tokens: int = TOKENS, model_dim: int = MODEL_DIM, timer: str = "cudagraph") -> dict | None:
    """Time one implementation on one cell; return a result row, or None if it cannot run."""
    import torch

    batch, heads = problem_shape(n, d, tokens, model_dim)
    if impl == "naive" and batch * heads * n * n > NAIVE_MAX_SCORE_ENTRIES:
        return None
    needs_grad = pass_ == "fwd+bwd"
    q, k, v, do, step = _inputs_and_step(impl, (batch, heads, n, d), getattr(torch, dtype), "cuda", causal, needs_grad)
    try:
        step()  # compile / autotune / warm up, and find out whether the backend supports this
        torch.cuda.synchronize()
        for x in (q, k, v):
            x.grad = None
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        ms, timer = _time_ms(step, timer, [q, k, v] if needs_grad else None)
    except (RuntimeError, torch.OutOfMemoryError) as err:  # backend refuses the shape, or OOM
        print(f"  {impl} {dtype} d={d} N={n} causal={causal} {pass_}: not run ({str(err).splitlines()[0][:80]})")
        return None
    finally:
        del q, k, v, do
        torch.cuda.empty_cache()
    return {"impl": impl, "dtype": dtype, "d": d, "N": n, "causal": causal, "pass": pass_,
            "tflops": round(flops(batch, heads, n, d, causal, pass_) / (ms * 1e-3) / 1e12, 2),
            "peak_mib": round(peak / MIB, 1), "timer": timer}


def machine_meta() -> dict:
    """GPU name (``none (CPU, ...)`` without one), driver, torch and triton versions, today's date (UTC)."""
    import torch
    import triton

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        driver = "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU, Triton interpreter)"
    return {"gpu": gpu, "driver": driver, "torch": torch.__version__,
            "triton": triton.__version__, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


def run_grid(dtypes=GRID["dtype"], head_dims=GRID["d"], seq_lens=GRID["N"], causals=GRID["causal"],
             passes=PASSES, impls=IMPLS, tokens: int = TOKENS, model_dim: int = MODEL_DIM,
             progress: bool = True, on_row=None, timer: str = "cudagraph") -> dict:
    """Measure every (cell, pass, impl) on this GPU; return ``{"meta", "rows"}``.

    ``on_row(data)``, if given, is called after each measurement with the results so far (the
    command line uses it to save partial results).
    """
    import torch
    from tqdm.auto import tqdm

    if not torch.cuda.is_available():
        raise RuntimeError("run_grid needs a CUDA GPU; on CPU use load_recorded()")
    cells = [(dt, d, n, c, p, impl) for dt in dtypes for d in head_dims for n in seq_lens
             for c in causals for p in passes for impl in impls]
    data = {"meta": {**machine_meta(), "timer": timer}, "rows": []}
    for dt, d, n, c, p, impl in tqdm(cells, desc="benchmark", disable=not progress):
        row = measure(impl, dt, d, n, c, p, tokens, model_dim, timer)
        if row is not None:
            data["rows"].append(row)
            if on_row is not None:
                on_row(data)
    return data


# ----------------------------------------------------------------------------------------------
# Reading, tables and plots (CPU or GPU)


def recorded_path(gpu: str = "h100", timer: str = "cudagraph") -> Path:
    """Where the grid measured on ``gpu`` with ``timer`` is recorded: ``<gpu>.json`` for the
    default timer (CUDA graphs), ``<gpu>_<timer>.json`` for another (``h100_eager.json``: the grid
    as a training loop calls it, issue 33)."""
    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {TIMERS}, got {timer!r}")
    return RECORDED_DIR / (f"{gpu.lower()}.json" if timer == "cudagraph" else f"{gpu.lower()}_{timer}.json")


def load_recorded(gpu: str = "h100", timer: str = "cudagraph") -> dict | None:
    """The results recorded in the repository for ``gpu`` with ``timer``, or None when there are none."""
    path = recorded_path(gpu, timer)
    if not path.exists():
        return None
    return json.loads(path.read_text())


# What each timer of TIMERS counts, as every printed result says it (issue 33: a benchmark names its timer).
TIMER_NOTES = {
    "cudagraph": "timed in CUDA graphs: GPU time only",
    "events": "timed with triton.testing.do_bench: CUDA events, Python launch overhead included",
    "eager": "timed eagerly (loops of back-to-back calls, no CUDA graph: host work per call included)",
}


def timer_note(meta: dict, default: str | None = None) -> str:
    """One phrase of :data:`TIMER_NOTES`: the timer that measured a recorded file.

    Args:
        meta: the file's provenance header; its ``"timer"`` names the timer.
        default: the timer of the tool that wrote the file, for files recorded before the tools
            wrote ``"timer"`` (the reader that knows the tool passes it).

    Returns:
        e.g. ``"timed in CUDA graphs: GPU time only"``; ValueError when no timer of
        :data:`TIMERS` is named.
    """
    timer = meta.get("timer", default)
    if timer not in TIMER_NOTES:
        raise ValueError(f"meta['timer'] must be one of {TIMERS} (or a default given), got {timer!r}")
    return TIMER_NOTES[timer]


def timer_summary(data: dict) -> str:
    """The timers of a recorded file, in words: the one its ``meta`` names (:func:`timer_note`), then
    how many rows another one measured (a call that no CUDA graph could capture was timed with
    events, and its row says so). Empty when neither the meta nor a row names a timer."""
    meta_timer = data["meta"].get("timer")
    others = Counter(r["timer"] for r in data["rows"] if r.get("timer", meta_timer) != meta_timer)
    parts = [timer_note(data["meta"])] if meta_timer is not None else []
    parts += [f"{count} of {len(data['rows'])} rows {timer_note({'timer': t})}" for t, count in sorted(others.items())]
    return "; ".join(parts)


def provenance(data: dict) -> str:
    """One line: where and when the numbers were measured, and with which timer (when recorded)."""
    m = data["meta"]
    timers = timer_summary(data)
    return (f"Measured on {m['gpu']} (driver {m['driver']}), torch {m['torch']}, triton {m['triton']}, "
            f"on {m['date']}{', ' + timers if timers else ''}")


def _cells(data: dict, pass_: str) -> dict:
    """{(dtype, d, N, causal): {impl: row}} for one pass."""
    cells: dict = {}
    for row in data["rows"]:
        if row["pass"] == pass_:
            cells.setdefault((row["dtype"], row["d"], row["N"], row["causal"]), {})[row["impl"]] = row
    return dict(sorted(cells.items()))


def ratios(data: dict, pass_: str, impl: str = "course", baseline: str = BASELINE) -> list[float]:
    """TFLOP/s of ``impl`` divided by ``baseline``'s, for every cell where both ran."""
    return [c[impl]["tflops"] / c[baseline]["tflops"] for c in _cells(data, pass_).values()
            if impl in c and baseline in c and c[baseline]["tflops"] > 0]


def format_table(data: dict, pass_: str) -> str:
    """A text table: TFLOP/s per impl for each cell, course ÷ sdpa_flash and ÷ sdpa_cudnn, and a
    summary line (median and minimum of each ratio)."""
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    cells = _cells(data, pass_)
    impls = [i for i in IMPLS if any(i in c for c in cells.values())]
    head = (f"{'dtype':<9}{'d':>4}{'N':>7}{'causal':>7} | " + "".join(f"{i:>13}" for i in impls)
            + " | " + "".join(f"{'÷' + r[5:]:>8}" for r in RATIO_IMPLS))
    lines = [f"TFLOP/s, {pass_}", head, "-" * len(head)]
    for (dtype, d, n, causal), row in cells.items():
        vals = "".join(f"{row[i]['tflops']:>13.1f}" if i in row else f"{'-':>13}" for i in impls)
        rats = "".join(f"{row['course']['tflops'] / row[r]['tflops']:>8.2f}"
                       if "course" in row and r in row else f"{'-':>8}" for r in RATIO_IMPLS)
        lines.append(f"{dtype:<9}{d:>4}{n:>7}{str(causal):>7} | {vals} | {rats}")
    for r in RATIO_IMPLS:
        rs = ratios(data, pass_, "course", r)
        if rs:
            lines.append(f"course ÷ {r}: median {statistics.median(rs):.2f}, min {min(rs):.2f} "
                         f"over {len(rs)} cells")
    return "\n".join(lines)


def format_memory(data: dict, pass_: str = "fwd+bwd") -> str:
    """Peak memory above the inputs (MiB) per impl, for each cell."""
    cells = _cells(data, pass_)
    impls = [i for i in IMPLS if any(i in c for c in cells.values())]
    head = f"{'dtype':<9}{'d':>4}{'N':>7}{'causal':>7} | " + "".join(f"{i:>13}" for i in impls)
    lines = [f"peak MiB above inputs, {pass_}", head, "-" * len(head)]
    for (dtype, d, n, causal), row in cells.items():
        lines.append(f"{dtype:<9}{d:>4}{n:>7}{str(causal):>7} | "
                     + "".join(f"{row[i]['peak_mib']:>13.0f}" if i in row else f"{'-':>13}" for i in impls))
    return "\n".join(lines)


# How the benchmark plot is laid out: drawn at its natural size in a notebook (about 900 px wide),
# so its text stays readable; the legend goes below the panels, where it hides no line.
PLOT_COLUMNS = 2  # panels per row
PLOT_PANEL_SIZE = (4.5, 3.0)  # inches per panel
PLOT_LEGEND_HEIGHT = 0.9  # inches below the panels for the legend
PLOT_FONTSIZE = 11  # points: tick labels, axis labels and legend
IMPL_LABELS = {"course": "course kernel (ours)", "sdpa_flash": "SDPA FlashAttention-2",
               "sdpa_cudnn": "SDPA cuDNN", "sdpa_mem_eff": "SDPA memory-efficient",
               "naive": "naive (N×N in HBM)"}


def plot(data: dict, pass_: str):
    """TFLOP/s against N, one panel per (dtype, d), two panels a row; solid lines non-causal, dashed
    causal; one legend for all panels, below them."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    cells = _cells(data, pass_)
    panels = sorted({(dt, d) for dt, d, _, _ in cells}) or [("", 0)]
    cols = min(PLOT_COLUMNS, len(panels))
    rows = -(-len(panels) // cols)
    width, height = PLOT_PANEL_SIZE
    with plt.rc_context({"font.size": PLOT_FONTSIZE, "axes.titlesize": PLOT_FONTSIZE + 1}):
        fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + PLOT_LEGEND_HEIGHT),
                                 squeeze=False, sharey=True, layout="constrained")
        flat = list(axes.ravel())
        for ax in flat[len(panels):]:
            ax.set_visible(False)
        handles = {}
        for ax, (dt, d) in zip(flat, panels):
            for j, impl in enumerate(IMPLS):
                for causal, style in ((False, "-"), (True, "--")):
                    pts = sorted((n, row[impl]["tflops"]) for (dt2, d2, n, c), row in cells.items()
                                 if dt2 == dt and d2 == d and c == causal and impl in row)
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", color=f"C{j}",
                                label=IMPL_LABELS.get(impl, impl) if not causal else None)
                        handles.setdefault(impl, Line2D([], [], color=f"C{j}", marker="o",
                                                        label=IMPL_LABELS.get(impl, impl)))
            ax.set_xscale("log", base=2)
            seq_lens = sorted({n for dt2, d2, n, _ in cells if (dt2, d2) == (dt, d)})
            ax.set_xticks(seq_lens, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in seq_lens])
            ax.minorticks_off()
            ax.set_title(f"{dt}, d={d}")
            ax.grid(True, alpha=0.3)
            ax.tick_params(labelsize=PLOT_FONTSIZE)  # ticks are made at draw time: set it here
        for ax in axes[-1]:
            ax.set_xlabel("sequence length N", fontsize=PLOT_FONTSIZE)
        for ax in axes[:, 0]:
            ax.set_ylabel(f"TFLOP/s ({pass_})", fontsize=PLOT_FONTSIZE)
        styles = [Line2D([], [], color="0.3", linestyle="-", label="solid: non-causal"),
                  Line2D([], [], color="0.3", linestyle="--", label="dashed: causal")]
        fig.legend(handles=[handles[i] for i in IMPLS if i in handles] + styles,
                   loc="outside lower center", ncol=3, frameon=False, fontsize=PLOT_FONTSIZE)
        title = f"attention {pass_}"
        if "meta" in data:
            title += f" — {data['meta']['gpu']}, {data['meta']['date']}"
        fig.suptitle(title, fontsize=PLOT_FONTSIZE + 2)
    return fig


def notebook_cell(pass_: str = "fwd"):
    """What chapters 06/07 run: live on a GPU (small subset), recorded results on CPU.

    Returns the dict shown (or None when nothing is recorded).
    """
    from course_lib.platform import runtime

    rt = runtime.current()
    if rt.on_gpu:
        data = run_grid(dtypes=("float16",), head_dims=(64,), seq_lens=(1024, 4096), causals=(False, True),
                        passes=(pass_,), impls=("course", "sdpa_flash", "sdpa_cudnn", "naive"))
        print("Live run: " + provenance(data))
    else:
        data = load_recorded("h100")
        if data is None:
            print("No GPU results recorded yet (course_lib/data/benchmarks/h100.json is missing).")
            return None
        print("No GPU here: showing recorded results. " + provenance(data))
    print(format_table(data, pass_))
    plot(data, pass_)
    return data


# ----------------------------------------------------------------------------------------------
# Per-call cost at tiny shapes (issue 33): microseconds per eager call


OVERHEAD_IMPLS = ("course", "sdpa_flash", "sdpa_cudnn", "sdpa_mem_eff")
OVERHEAD_GRID = {"dtype": ("bfloat16", "float16"), "d": (64, 128), "N": (128, 512), "causal": (False, True)}
# The shape: one sequence of 4 heads, where a call is almost all host work and launches.
OVERHEAD_BATCH, OVERHEAD_HEADS = 1, 4
OVERHEAD_CALLS = 200  # calls per timed loop
OVERHEAD_ROUNDS = 11  # timed loops per implementation and cell, taken in turns; the fastest is kept
# Issue 33's target: course at most 1.5x SDPA's FlashAttention-2 per call, forward and forward+backward.
OVERHEAD_TARGET = 1.5
OVERHEAD_ROW_KEYS = frozenset({"impl", "pass", "us_per_call", "dtype", "d", "N", "causal", "batch", "heads",
                               "calls"})
_META_KEYS = frozenset({"gpu", "driver", "torch", "triton", "date", "timer"})


def overhead_path(gpu: str = "h100") -> Path:
    """Where the per-call costs measured on ``gpu`` are recorded."""
    return RECORDED_DIR / f"{gpu.lower()}_overhead.json"


def gpu_tag(name: str) -> str:
    """A short file-name tag for a GPU: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``, ``"NVIDIA L4"`` ->
    ``"l4"``; a name without a model number is kept whole, in lower case with ``_`` for the rest."""
    found = re.search(r"\b([a-z]{1,2}\d{1,4})\b", name.lower())
    return found.group(1) if found else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _overhead_runner(impl: str, dtype: str, d: int, n: int, causal: bool, pass_: str, batch: int, heads: int,
                     device: str):
    """``(time_loop, grads)``: ``time_loop(timer, **kwargs)`` runs ``timer(step, **kwargs)`` with
    SDPA's backend pinned (once around the loop, not per call: a call then costs what
    ``F.scaled_dot_product_attention`` costs when its dispatcher picks that backend); ``grads``: the
    tensors whose ``.grad`` a fwd+bwd step resets (None for fwd)."""
    import contextlib

    import torch
    from torch.nn.attention import sdpa_kernel

    needs_grad = pass_ == "fwd+bwd"
    q, k, v, _, step = _inputs_and_step(impl, (batch, heads, n, d), getattr(torch, dtype), device, causal, needs_grad,
                                        pin_backend=False)

    def time_loop(timer, **kwargs):
        with sdpa_kernel([_sdpa_backend(impl)]) if impl.startswith("sdpa") else contextlib.nullcontext():
            return timer(step, **kwargs)

    return time_loop, ((q, k, v) if needs_grad else None)


def measure_overhead_cell(impls, dtype: str, d: int, n: int, causal: bool, pass_: str,
                          batch: int = OVERHEAD_BATCH, heads: int = OVERHEAD_HEADS, calls: int = OVERHEAD_CALLS,
                          rounds: int = OVERHEAD_ROUNDS, warmup: int = EAGER_WARMUP, device: str | None = None,
                          timer=time_eager_us) -> list[dict]:
    """Microseconds per eager call of each implementation at one (tiny) shape, one row each (none
    for an implementation that cannot run it).

    The implementations take turns: ``rounds`` rounds, each one timed loop of ``calls`` calls per
    implementation, and each keeps its fastest loop. A per-call cost this small is host time, and
    what else the machine does only ever adds to it; taking turns puts the machine's drift on
    every implementation alike (on the H100 machine, one loop per implementation in a row gave
    SDPA's own cost 144-238 µs in one run and 186-287 µs in the next).

    Args:
        impls: names from :data:`OVERHEAD_IMPLS`; pass_: ``"fwd"`` (under ``torch.no_grad``) or
            ``"fwd+bwd"`` (``o.backward(do)``, gradients set to None after each call).
        batch, heads, n, d, dtype, causal: the inputs ``(batch, heads, n, d)``, random normal.
        calls, rounds, warmup: the timed loops (``warmup`` calls before the first). device: default
            ``cuda`` when there is a GPU, else ``cpu`` (the Triton interpreter: the row format only).
        timer: :func:`time_eager_us` or a stand-in with its signature (tests).

    Returns:
        ``[{"impl", "pass", "us_per_call", "dtype", "d", "N", "causal", "batch", "heads", "calls"}]``.
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device == "cuda" else None
    runners, best = {}, {}
    for impl in impls:
        try:
            runners[impl] = _overhead_runner(impl, dtype, d, n, causal, pass_, batch, heads, device)
        except RuntimeError as err:
            print(f"  {impl} {dtype} d={d} N={n} causal={causal} {pass_}: not run ({str(err).splitlines()[0][:80]})")
    for round_ in range(rounds):
        for impl, (time_loop, grads) in list(runners.items()):
            try:
                us = time_loop(timer, calls=calls, warmup=warmup if round_ == 0 else 0, repeats=1, grads=grads,
                               sync=sync)
            except RuntimeError as err:  # a backend that does not take this shape, dtype or device
                print(f"  {impl} {dtype} d={d} N={n} causal={causal} {pass_}: not run "
                      f"({str(err).splitlines()[0][:80]})")
                del runners[impl]
                best.pop(impl, None)
                continue
            best[impl] = min(us, best.get(impl, us))
    return [{"impl": impl, "pass": pass_, "us_per_call": round(best[impl], 1), "dtype": dtype, "d": d, "N": n,
             "causal": causal, "batch": batch, "heads": heads, "calls": calls} for impl in impls if impl in best]


def measure_overhead(impl: str, *args, **kwargs) -> dict | None:
    """:func:`measure_overhead_cell` for one implementation: its row, or None when it cannot run."""
    rows = measure_overhead_cell((impl,), *args, **kwargs)
    return rows[0] if rows else None


def run_overhead(impls=OVERHEAD_IMPLS, dtypes=OVERHEAD_GRID["dtype"], head_dims=OVERHEAD_GRID["d"],
                 seq_lens=OVERHEAD_GRID["N"], causals=OVERHEAD_GRID["causal"], passes=PASSES,
                 progress: bool = True, on_row=None, warm_first: bool = True, **kwargs) -> dict:
    """:func:`measure_overhead_cell` for every cell and pass (the implementations of a cell take
    turns); returns ``{"meta", "rows"}`` (``meta``: :func:`machine_meta`, ``"timer": "eager"`` and
    ``"statistic"``). ``kwargs`` go to :func:`measure_overhead_cell`; ``on_row(data)`` is called
    after each cell. ``warm_first``: first call every implementation once in every cell, untimed,
    so that every kernel is compiled and loaded before the first timed loop."""
    from tqdm.auto import tqdm

    cells = [(dt, d, n, c, p) for dt in dtypes for d in head_dims for n in seq_lens for c in causals
             for p in passes]
    rounds = kwargs.get("rounds", OVERHEAD_ROUNDS)
    data = {"meta": {**machine_meta(), "timer": "eager",
                     "statistic": f"fastest of {rounds} loops, the implementations taking turns"}, "rows": []}
    if warm_first:  # every cell once, untimed: each kernel compiles before any loop is timed
        warm = {**kwargs, "rounds": 1, "calls": 1}
        for dt, d, n, c, p in tqdm(cells, desc="warm-up", disable=not progress):
            measure_overhead_cell(impls, dt, d, n, c, p, **warm)
    for dt, d, n, c, p in tqdm(cells, desc="per-call cost", disable=not progress):
        data["rows"] += measure_overhead_cell(impls, dt, d, n, c, p, **kwargs)
        if on_row is not None:
            on_row(data)
    return data


def validate_overhead(data: dict) -> dict:
    """``data`` if it is a per-call cost record (:func:`run_overhead`'s format), else ValueError
    saying what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) or not isinstance(data.get("rows"), list):
        raise ValueError("a per-call cost record is {'meta': {...}, 'rows': [...]}")
    if not _META_KEYS <= set(data["meta"]) or data["meta"]["timer"] != "eager":
        raise ValueError(f"meta must have {sorted(_META_KEYS)} with timer 'eager', got {data['meta']}")
    for row in data["rows"]:
        if set(row) != OVERHEAD_ROW_KEYS:
            raise ValueError(f"a row must have the keys {sorted(OVERHEAD_ROW_KEYS)}, got {sorted(row)}")
        if row["impl"] not in OVERHEAD_IMPLS or row["pass"] not in PASSES or not row["us_per_call"] > 0:
            raise ValueError(f"a row needs impl in {OVERHEAD_IMPLS}, pass in {PASSES}, us_per_call > 0: {row}")
    return data


def load_overhead(gpu: str = "h100", path: Path | None = None) -> dict | None:
    """The per-call costs recorded for ``gpu`` (or at ``path``), checked; None when there are none."""
    path = path or overhead_path(gpu)
    if not path.exists():
        return None
    return validate_overhead(json.loads(path.read_text()))


def overhead_ratios(data: dict, pass_: str, baseline: str = BASELINE) -> list[float]:
    """course's µs per call divided by ``baseline``'s, for every cell where both ran (lower is better)."""
    cells: dict = {}
    for row in data["rows"]:
        if row["pass"] == pass_:
            cells.setdefault((row["dtype"], row["d"], row["N"], row["causal"]), {})[row["impl"]] = row["us_per_call"]
    return [c["course"] / c[baseline] for c in cells.values() if "course" in c and baseline in c]


def format_overhead(data: dict) -> str:
    """A text table: µs per eager call for each cell, pass and implementation, course ÷ SDPA
    FlashAttention-2 and ÷ cuDNN (lower is better), and per pass the largest and median ratio to
    FlashAttention-2 against issue 33's target (:data:`OVERHEAD_TARGET`)."""
    impls = [i for i in OVERHEAD_IMPLS if any(r["impl"] == i for r in data["rows"])]
    shapes = sorted({(r["batch"], r["heads"]) for r in data["rows"]})
    head = (f"{'pass':<8}{'dtype':<9}{'d':>4}{'N':>6}{'causal':>7} | " + "".join(f"{i:>13}" for i in impls)
            + " | " + "".join(f"{'÷' + r[5:]:>8}" for r in RATIO_IMPLS))
    lines = [f"µs per eager call, (B, H) = {', '.join(map(str, shapes))}, lower is better", head, "-" * len(head)]
    cells: dict = {}
    for row in data["rows"]:
        cells.setdefault((PASSES.index(row["pass"]), row["dtype"], row["d"], row["N"], row["causal"]),
                         {})[row["impl"]] = row["us_per_call"]
    for (p, dtype, d, n, causal), c in sorted(cells.items()):
        vals = "".join(f"{c[i]:>13.1f}" if i in c else f"{'-':>13}" for i in impls)
        rats = "".join(f"{c['course'] / c[r]:>8.2f}" if "course" in c and r in c else f"{'-':>8}" for r in RATIO_IMPLS)
        lines.append(f"{PASSES[p]:<8}{dtype:<9}{d:>4}{n:>6}{str(causal):>7} | {vals} | {rats}")
    for pass_ in PASSES:
        rs = overhead_ratios(data, pass_)
        if rs:
            lines.append(f"course ÷ {BASELINE}, {pass_}: max {max(rs):.2f}, median {statistics.median(rs):.2f} over "
                         f"{len(rs)} cells (target: at most {OVERHEAD_TARGET})")
    return "\n".join(lines)


def overhead_cell(gpu: str = "h100"):
    """What a notebook runs: on a GPU a live measurement at the issue's shape (bf16, d=64, N=128,
    causal, both passes); on CPU the recorded per-call costs with their provenance. Returns the
    dict shown (None when nothing is recorded)."""
    from course_lib.platform import runtime

    if runtime.current().on_gpu:
        data = run_overhead(dtypes=("bfloat16",), head_dims=(64,), seq_lens=(128,), causals=(True,), progress=False)
        print("Live run: " + provenance(data))
    else:
        data = load_overhead(gpu)
        if data is None:
            print(f"No per-call costs recorded yet ({overhead_path(gpu)} is missing; on the GPU: "
                  f"python -m course_lib.measure.bench --overhead).")
            return None
        print("No GPU here: showing recorded results. " + provenance(data))
    print(format_overhead(data))
    return data


# ----------------------------------------------------------------------------------------------
# Command line


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "causal"):
        return True
    if s.lower() in ("0", "false", "no", "noncausal", "non-causal"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m course_lib.measure.bench", description=__doc__.splitlines()[0])
    # the grid's defaults are GRID's (with --overhead, OVERHEAD_GRID's)
    p.add_argument("--dtype", nargs="+", default=None, choices=["float16", "bfloat16"])
    p.add_argument("--head-dim", nargs="+", type=int, default=None)
    p.add_argument("--seq-len", nargs="+", type=int, default=None)
    p.add_argument("--causal", nargs="+", type=_bool, default=None)
    p.add_argument("--pass", dest="passes", nargs="+", default=list(PASSES), choices=PASSES)
    p.add_argument("--impl", nargs="+", default=None, choices=IMPLS)
    p.add_argument("--tokens", type=int, default=TOKENS, help="batch · N (default 16k)")
    p.add_argument("--timer", default="cudagraph", choices=TIMERS,
                   help="cudagraph: GPU time of the call replayed in a CUDA graph (default); "
                        "events: triton.testing.do_bench, Python launch overhead included; "
                        "eager: loops of back-to-back calls, wall clock, as a training loop calls")
    p.add_argument("--overhead", action="store_true",
                   help="instead of the grid: microseconds per eager call at tiny shapes (B=1, H=4, N 128 and "
                        "512), course against SDPA's backends; written to --out, by default "
                        "course_lib/data/benchmarks/<gpu>_overhead.json")
    p.add_argument("--out", type=Path, help="write the results JSON here")
    p.add_argument("--plot", type=Path, help="write a plot (one figure per pass, suffixed) here")
    p.add_argument("--show-recorded", default=None, metavar="GPU",
                   help="print the recorded table for GPU (e.g. h100) instead of measuring")
    args = p.parse_args(argv)
    grid, impls = (OVERHEAD_GRID, OVERHEAD_IMPLS) if args.overhead else (GRID, IMPLS)
    for name, key in (("dtype", "dtype"), ("head_dim", "d"), ("seq_len", "N"), ("causal", "causal")):
        if getattr(args, name) is None:
            setattr(args, name, list(grid[key]))
    args.impl = args.impl or list(impls)
    if args.overhead:
        return _overhead_main(args)
    if args.show_recorded:  # with --timer eager: the grid recorded without CUDA graphs
        data = load_recorded(args.show_recorded, args.timer)
        if data is None:
            raise SystemExit(f"no results recorded for {args.show_recorded} at "
                             f"{recorded_path(args.show_recorded, args.timer)}")
    else:
        def save(data):
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(data, indent=1) + "\n")

        data = run_grid(args.dtype, args.head_dim, args.seq_len, args.causal, args.passes, args.impl,
                        tokens=args.tokens, on_row=save, timer=args.timer)
        save(data)
    print(provenance(data))
    for pass_ in PASSES:
        if any(r["pass"] == pass_ for r in data["rows"]):
            print()
            print(format_table(data, pass_))
    if any(r["pass"] == "fwd+bwd" for r in data["rows"]):
        print()
        print(format_memory(data, "fwd+bwd"))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        for pass_ in PASSES:
            if any(r["pass"] == pass_ for r in data["rows"]):
                out = args.plot.with_name(f"{args.plot.stem}_{pass_.replace('+', '_')}{args.plot.suffix}")
                plot(data, pass_).savefig(out, dpi=120)
    return data


def _overhead_main(args) -> dict:
    """``--overhead``: measure on this GPU and write the record, or show a recorded one."""
    import torch

    if args.show_recorded:
        data = load_overhead(args.show_recorded)
        if data is None:
            raise SystemExit(f"no per-call costs recorded for {args.show_recorded} at "
                             f"{overhead_path(args.show_recorded)}")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--overhead measures on a GPU; on CPU, --overhead --show-recorded h100 shows the record")
        out = args.out or overhead_path(gpu_tag(torch.cuda.get_device_name()))

        def save(data):
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1) + "\n")

        data = run_overhead([i for i in args.impl if i in OVERHEAD_IMPLS], args.dtype, args.head_dim, args.seq_len,
                            args.causal, args.passes, on_row=save)
        save(data)
        print(f"written to {out}")
    print(provenance(data))
    print(format_overhead(data))
    return data


if __name__ == "__main__":
    main()


# ----------------------------------------------------------------------------------------------
# Chapter 07: the one-pass backward against the two-kernel backward (tools/bench_backward.py)


# tools/bench_backward.py times with triton.testing.do_bench; its file names no timer.
ONE_PASS_TIMER = "events"


def one_pass_table(path: Path | None = None) -> str:
    """The recorded backward-only timings (``tools/bench_backward.py``, the library's own configs):
    TFLOP/s of the two-kernel backward and of the one-pass backward with TMA reduce-adds and with
    atomic adds, per cell, and one-pass (TMA) ÷ two-kernel. Ends with the provenance line."""
    data = json.loads((path or RECORDED_DIR / "h100_backward.json").read_text())
    cells: dict = {}
    for r in data["rows"]:
        variant = {"two-kernel": "two", "one-pass tma": "tma", "one-pass atomic": "atomic"}.get(r["variant"])
        if variant is not None and r["config"] is None:
            cells.setdefault((r["dtype"], r["d"], r["N"], r["causal"]), {})[variant] = r["tflops"]
    lines = ["backward alone, TFLOP/s (2.5 x the forward's FLOPs)",
             f"{'dtype':<9} {'d':>4} {'N':>6} {'causal':>6} {'two-kernel':>10} {'one-pass TMA':>12} "
             f"{'one-pass atomic':>15} {'TMA / two':>9}"]
    for (dtype, d, n, causal), t in sorted(cells.items()):
        if {"two", "tma", "atomic"} <= t.keys():
            lines.append(f"{dtype:<9} {d:>4} {n:>6} {str(causal):>6} {t['two']:>10.0f} {t['tma']:>12.0f} "
                         f"{t['atomic']:>15.0f} {t['tma'] / t['two']:>8.2f}x")
    m = data["meta"]
    lines.append(f"Measured on {m['gpu']} (driver {m['driver']}), torch {m['torch']}, triton {m['triton']}, "
                 f"on {m['date']} (tools/bench_backward.py --configs table), {timer_note(m, ONE_PASS_TIMER)}")
    return "\n".join(lines)
