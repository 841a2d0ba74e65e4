"""Every benchmark cell of the notebooks names its timer (issue 33, item 2).

Timings in this course come from different clocks that count different things: CUDA graphs (GPU
time only), ``triton.testing.do_bench`` (CUDA events around each call: Python launch overhead
included), eager loops of back-to-back calls (wall clock, host work per call included) and plain
wall-clock loops (a training loop, the ring's calls between barriers). A number without its timer
cannot be compared with another, so every cell that measures time or shows recorded timings must
say which one its numbers come from, in what it prints.

A *benchmark cell* is a code cell that calls one of :data:`TIMING_CALLS`. It names its timer when
a string literal of its source (what it prints; comments do not count) holds one of
:data:`TIMER_PHRASES`, or when it calls one of :data:`STATES_TIMER`: library functions whose
output names the timer (:func:`test_library_functions_state_their_timer` checks each of them on
the recorded files). The notebook test reads only the notebooks' JSON.
"""

from __future__ import annotations

import io
import json
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("solutions", "notebooks")

# What makes a cell a benchmark cell: the calls that time something, or that return or show
# recorded timings (times, TFLOP/s, tokens/s measured on a GPU). Readers that only load a file
# (``bench.load_recorded``, ``hopper_results.load_gluon``) are left out: a cell that loads and then
# shows numbers is caught by the function that shows them.
TIMING_CALLS = {
    # measuring
    "triton.testing.do_bench(_cudagraph)": r"\bdo_bench(_cudagraph)?\(",
    "a host clock (time.perf_counter, time.time, time.monotonic)": r"\btime\.(perf_counter|time|monotonic)(_ns)?\(",
    "torch.cuda.Event": r"\bcuda\.Event\(",
    "timeit": r"\btimeit\b",
    "course_lib.measure.bench's timers and grid": r"\bbench\.(notebook_cell|overhead_cell|run_grid|run_overhead"
                                                  r"|measure\w*|time_eager\w*|_time_ms)\(",
    "model_bench's training timer": r"\bmodel_bench\.(measure_grid|measure_training)\(",
    # showing recorded timings
    "course_lib.measure.bench's tables, ratios and plots": r"\bbench\.(one_pass_table|format_table|format_overhead"
                                                           r"|ratios|overhead_ratios|plot)\(",
    "decoding's recorded benchmark": r"\bdecoding_results\.format_recorded_bench\(",
    "hopper_results' timings": r"\bhopper_results\.(format_ablation|plot_ablation|ablation|tflops|best_config"
                               r"|two_stage_gain|pipeline_depth|ratio_summary|fp8_speedup|cells|gluon_table"
                               r"|gluon_plot|gluon_rows|gluon_tflops|gluon_backward_table|gluon_backward_rows)\(",
    "mask_results' timings": r"\bmask_results\.(speedup_summary|plot_density|format_proportionality|series"
                             r"|time_for)\(",
    "ring_results' timings": r"\bring_results\.(format_table|plot_scaling|versus_context_parallel|strong_scaling"
                             r"|weak_scaling|model|disagreements)\(",
    "model_bench's recorded training": r"\bmodel_bench\.(table|plot)\(",
    "a recorded timing read by its key": r"\[\s*['\"](ms|step_ms|us_per_call|tflops|tflops_per_gpu|tokens_per_s"
                                         r"|compute_s|wait_s)['\"]\s*\]",
}

# How a printed line names a timer (one phrase per timer, as the library prints them).
TIMER_PHRASES = (
    "CUDA graph",        # course_lib.measure.bench's default timer
    "do_bench",          # triton.testing.do_bench
    "CUDA events",       # do_bench's clock, and the ring's per-step trace on a GPU
    "timed eagerly",     # course_lib.measure.bench's eager timer
    "wall clock",        # loops timed by the host's clock: training, the ring's calls
    "host clock",        # the ring's per-step trace on CPU
)

# Library calls whose output names the timer of what they show; each one is checked below.
STATES_TIMER = (
    "bench.notebook_cell", "bench.overhead_cell", "bench.provenance", "bench.timer_note", "bench.one_pass_table",
    "decoding_results.format_recorded_bench",
    "hopper_results.provenance", "hopper_results.gluon_table", "hopper_results.gluon_backward_table",
    "hopper_results.plot_ablation", "hopper_results.gluon_plot",
    "mask_results.status", "mask_results.plot_density",
    "ring_results.format_table", "ring_results.plot_scaling", "ring_results.timer_note",
    "model_bench.status", "model_bench.measure_grid",
)


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return src if isinstance(src, str) else "".join(src)


def _tokens(source: str) -> tuple[list[str], list]:
    """The source's lines (IPython magics and shell escapes blanked: they are not Python) and its
    tokens."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    return lines, list(tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline))


def _string_literals(source: str) -> str:
    """The text of the source's string literals (f-strings' literal parts included), joined:
    what the cell can print, without its comments."""
    kinds = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return "\n".join(tok.string for tok in _tokens(source)[1] if tok.type in kinds)


def _without_comments(source: str) -> str:
    """The source with its comments cut out (each comment runs to the end of its line)."""
    lines, tokens = _tokens(source)
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return "\n".join(lines)


def timing_calls(source: str) -> list[str]:
    """The names of :data:`TIMING_CALLS` that ``source`` makes (comments left out)."""
    code = _without_comments(source)
    return [name for name, pattern in TIMING_CALLS.items() if re.search(pattern, code)]


def names_its_timer(source: str) -> bool:
    """True when the cell prints a timer phrase itself or calls a library function that does."""
    literals = _string_literals(source)
    if any(phrase in literals for phrase in TIMER_PHRASES):
        return True
    code = _without_comments(source)
    return any(re.search(rf"\b{re.escape(call)}\(", code) for call in STATES_TIMER)


def unnamed_timers(nb: dict) -> list[str]:
    """``"<cell id>: <timing calls>"`` for every benchmark cell of ``nb`` that names no timer."""
    found = []
    for cell in nb["cells"]:
        if cell.get("cell_type") != "code":
            continue
        source = _source(cell)
        calls = timing_calls(source)
        if calls and not names_its_timer(source):
            found.append(f"{cell.get('id')}: {', '.join(calls)}")
    return found


NOTEBOOKS = sorted(p.relative_to(ROOT).as_posix() for folder in FOLDERS for p in (ROOT / folder).glob("*.ipynb"))


def test_every_chapter_is_scanned():
    """Both folders hold chapters 00-12: a glob that finds nothing would make the test below empty."""
    for folder in FOLDERS:
        chapters = {Path(n).name[:2] for n in NOTEBOOKS if n.startswith(folder + "/")}
        assert chapters >= {f"{i:02d}" for i in range(13)}, (folder, sorted(chapters))


# Cells an earlier audit found timing without naming the timer (issue 33), by notebook: the
# detector must keep seeing them as benchmark cells. (c09-023, between them, is the compiler's
# resource report: registers and spills, no timings.)
AUDITED = {
    "07_backward.ipynb": ("f3e54ef1",),
    "08_beyond.ipynb": ("2552f7da",),
    "09_flashattention3_hopper.ipynb": ("c09-020", "c09-021", "c09-025", "c09-027", "c09-029", "c09-048",
                                        "c09-g14", "c09-g15", "c09-g20"),
}


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_audited_cells_are_benchmark_cells(folder):
    for name, ids in AUDITED.items():
        cells = {c.get("id"): c for c in json.loads((ROOT / folder / name).read_text(encoding="utf-8"))["cells"]}
        for cell_id in ids:
            assert cell_id in cells, f"{folder}/{name}: no cell {cell_id}"
            assert timing_calls(_source(cells[cell_id])), f"{folder}/{name} {cell_id}: not seen as a benchmark cell"


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_every_benchmark_cell_names_its_timer(notebook):
    nb = json.loads((ROOT / notebook).read_text(encoding="utf-8"))
    missing = unnamed_timers(nb)
    assert not missing, (f"{notebook}: these cells time something or show recorded timings without "
                         f"saying which timer measured them (print one of {TIMER_PHRASES}, or call a "
                         f"library function that does: {', '.join(STATES_TIMER)}):\n  " + "\n  ".join(missing))


# ---------------------------------------------------------------- the detector itself

@pytest.mark.parametrize("source, is_benchmark, named", [
    ("t = do_bench(fn)\nprint(f'{t:.3f} ms')", True, False),
    ("t = do_bench(fn)  # triton.testing.do_bench: launch overhead included\nprint(t)", True, False),  # a comment
    ("t = do_bench(fn)\nprint(f'{t:.3f} ms (triton.testing.do_bench)')", True, True),
    ("start = time.perf_counter()\ntrain()\nprint(f'{time.perf_counter() - start:.1f} s of wall clock')", True, True),
    ("best = max(r['tflops'] for r in grid['rows'])\nprint(best)", True, False),
    ("best = max(r['tflops'] for r in grid['rows'])\nprint(bench.timer_note(grid['meta']), best)", True, True),
    ("print(hopper_results.two_stage_gain(fa3))", True, False),
    ("print(bench.one_pass_table())", True, True),
    ("print(h100.fp16_tflops)  # a datasheet figure, no measurement", False, False),
    ("%matplotlib inline\nprint(1)", False, False),
])
def test_the_detector_finds_benchmark_cells_and_their_timer(source, is_benchmark, named):
    assert bool(timing_calls(source)) is is_benchmark
    assert names_its_timer(source) is named
    cell = {"cell_type": "code", "id": "x", "source": source}
    assert bool(unnamed_timers({"cells": [cell]})) is (is_benchmark and not named)


# ---------------------------------------------------------------- the library calls in STATES_TIMER

def _figure_text(fig) -> str:
    """The figure's titles: where a plot names its timer."""
    import matplotlib.pyplot as plt

    suptitle = fig._suptitle.get_text() if fig._suptitle is not None else ""
    titles = [ax.get_title(loc) for ax in fig.axes for loc in ("left", "center", "right")]
    plt.close(fig)
    return "\n".join([suptitle, *titles])


def _recorded_or_skip(data, what: str):
    if data is None:
        pytest.skip(f"{what} is not recorded in this checkout: its cell shows no timings")
    return data


def _printed_on_cpu(call, capsys) -> str:
    """What ``call()`` prints on this CPU machine (the recorded results); closes its figures."""
    import matplotlib.pyplot as plt

    from course_lib.platform import runtime

    if runtime.current().on_gpu:
        pytest.skip("on a GPU this cell measures live; its CPU path shows the recorded results")
    call()
    plt.close("all")
    return capsys.readouterr().out


def _witnesses() -> dict:
    """For each name of STATES_TIMER, a function of ``capsys`` returning the text that call shows
    on the files recorded in the repository."""
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.measure import bench, decoding_results, hopper_results, mask_results, model_bench, ring_results

    def bench_provenance(capsys):
        return "\n".join(bench.provenance(_recorded_or_skip(bench.load_recorded("h100", timer), f"the {timer} grid"))
                         for timer in ("cudagraph", "eager"))

    def measure_grid_log(capsys):
        lines = []  # no context lengths: it logs its timer and measures nothing (no GPU needed)
        assert model_bench.measure_grid((), impls=("sdpa",), log=lines.append) == []
        return "\n".join(lines)

    fa3 = hopper_results.load
    gluon = lambda: _recorded_or_skip(hopper_results.load_gluon(), "the Gluon forward")  # noqa: E731
    masks = lambda: _recorded_or_skip(mask_results.recorded(), "chapter 10's masks")  # noqa: E731
    rings = lambda: _recorded_or_skip(ring_results.recorded(), "chapter 11's ring")  # noqa: E731
    return {
        "bench.notebook_cell": lambda capsys: _printed_on_cpu(lambda: bench.notebook_cell("fwd"), capsys),
        "bench.overhead_cell": lambda capsys: _printed_on_cpu(bench.overhead_cell, capsys),
        "bench.provenance": bench_provenance,
        "bench.timer_note": lambda capsys: "\n".join(bench.timer_note({"timer": t}) for t in bench.TIMERS),
        "bench.one_pass_table": lambda capsys: bench.one_pass_table(),
        "decoding_results.format_recorded_bench": lambda capsys: decoding_results.format_recorded_bench(
            decoding_results.load_recorded_bench()),
        "hopper_results.provenance": lambda capsys: hopper_results.provenance(fa3()),
        "hopper_results.gluon_table": lambda capsys: hopper_results.gluon_table(gluon()),
        "hopper_results.gluon_backward_table": lambda capsys: hopper_results.gluon_backward_table(
            _recorded_or_skip(hopper_results.load_gluon_backward(), "the Gluon backward")),
        "hopper_results.plot_ablation": lambda capsys: _figure_text(hopper_results.plot_ablation(fa3())),
        "hopper_results.gluon_plot": lambda capsys: _figure_text(hopper_results.gluon_plot(gluon())),
        "mask_results.status": lambda capsys: masks() and mask_results.status(),
        "mask_results.plot_density": lambda capsys: _figure_text(mask_results.plot_density(masks())),
        "ring_results.format_table": lambda capsys: ring_results.format_table(rings()),
        "ring_results.plot_scaling": lambda capsys: _figure_text(ring_results.plot_scaling(rings())),
        "ring_results.timer_note": lambda capsys: ring_results.timer_note(rings()),
        "model_bench.status": lambda capsys: _recorded_or_skip(model_bench.recorded(), "chapter 12's training")
        and model_bench.status(),
        "model_bench.measure_grid": measure_grid_log,
    }


def test_a_recorded_file_names_its_timer_and_the_rows_another_one_measured():
    """A row that no CUDA graph could capture was timed with events: the summary says how many."""
    from course_lib.measure import bench

    rows = [{"timer": "cudagraph"}, {"timer": "events"}, {}]  # the last one: the meta's timer
    assert bench.timer_summary({"meta": {"timer": "cudagraph"}, "rows": rows}) == (
        f"{bench.TIMER_NOTES['cudagraph']}; 1 of 3 rows {bench.TIMER_NOTES['events']}")
    assert bench.timer_summary({"meta": {}, "rows": [{}]}) == ""
    assert bench.timer_note({}, default="events") == bench.TIMER_NOTES["events"]
    with pytest.raises(ValueError, match="meta\\['timer'\\] must be one of"):
        bench.timer_note({"timer": "stopwatch"})
    with pytest.raises(ValueError, match="got None"):
        bench.timer_note({})


def test_every_call_trusted_to_state_a_timer_is_checked():
    assert set(_witnesses()) == set(STATES_TIMER)


@pytest.mark.parametrize("call", sorted(STATES_TIMER))
def test_library_functions_state_their_timer(call, capsys):
    """Each call the notebook test trusts shows a timer phrase, on the files recorded here."""
    text = _witnesses()[call](capsys)
    assert any(phrase in text for phrase in TIMER_PHRASES), f"{call} shows no timer:\n{text}"
