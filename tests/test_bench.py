"""course_lib.measure.bench: the recorded results, tables, ratios, plots and the notebook cell (CPU paths)."""

from __future__ import annotations

import statistics

import matplotlib
import pytest

matplotlib.use("Agg")

from course_lib.measure import bench  # noqa: E402

pytestmark = [pytest.mark.ch06, pytest.mark.ch07]

ROW_KEYS = {"impl", "dtype", "d", "N", "causal", "pass", "tflops", "peak_mib"}


def _toy():
    rows = []
    for impl, tf in (("course", 300.0), ("sdpa_flash", 200.0), ("sdpa_cudnn", 400.0)):
        for causal in (False, True):
            rows.append({"impl": impl, "dtype": "float16", "d": 64, "N": 1024, "causal": causal, "pass": "fwd",
                         "tflops": tf / (2 if causal else 1), "peak_mib": 10.0})
    rows.append({"impl": "naive", "dtype": "float16", "d": 64, "N": 1024, "causal": False, "pass": "fwd",
                 "tflops": 20.0, "peak_mib": 5000.0})
    return {"meta": {"gpu": "Toy GPU", "driver": "1.0", "torch": "2.x", "triton": "3.x", "date": "2026-01-01"},
            "rows": rows}


def test_recorded_file_schema():
    data = bench.load_recorded("h100")
    assert data is not None, "course_lib/data/benchmarks/h100.json is missing"
    assert set(data["meta"]) == {"gpu", "driver", "torch", "triton", "date", "timer"}
    assert data["meta"]["timer"] in bench.TIMERS
    assert all(isinstance(data["meta"][key], str) and data["meta"][key] for key in data["meta"])
    assert data["rows"]
    for row in data["rows"]:
        assert set(row) == ROW_KEYS | {"timer"} and row["timer"] in bench.TIMERS, row
        assert row["impl"] in bench.IMPLS and row["pass"] in bench.PASSES
        assert row["dtype"] in ("float16", "bfloat16") and isinstance(row["causal"], bool)
        assert row["tflops"] > 0 and row["peak_mib"] >= 0
    # the full grid, for ours and FlashAttention-2, both passes
    for impl in ("course", "sdpa_flash"):
        for pass_ in bench.PASSES:
            cells = {(r["dtype"], r["d"], r["N"], r["causal"]) for r in data["rows"]
                     if r["impl"] == impl and r["pass"] == pass_}
            assert len(cells) == 24, (impl, pass_, len(cells))


def test_recorded_eager_grid_is_the_grid_timed_as_users_call_it(capsys):
    """``h100_eager.json`` (issue 33): the same grid, timed without CUDA graphs, for ours against
    SDPA's FlashAttention-2 and cuDNN, every row and the meta saying so; the CLI shows it."""
    path = bench.recorded_path("h100", "eager")
    assert path.name == "h100_eager.json" and bench.recorded_path("h100").name == "h100.json"
    data = bench.load_recorded("h100", "eager")
    assert data is not None and data["meta"]["timer"] == "eager"
    assert all(row["timer"] == "eager" for row in data["rows"])
    for impl in ("course", "sdpa_flash", "sdpa_cudnn"):
        for pass_ in bench.PASSES:
            cells = {(r["dtype"], r["d"], r["N"], r["causal"]) for r in data["rows"]
                     if r["impl"] == impl and r["pass"] == pass_}
            assert len(cells) == 24, (impl, pass_, len(cells))
    bench.main(["--show-recorded", "h100", "--timer", "eager"])
    out = capsys.readouterr().out
    assert "timed eagerly" in out and "course ÷ sdpa_cudnn" in out
    with pytest.raises(ValueError, match="timer must be one of"):
        bench.recorded_path("h100", "wall")


def test_load_recorded_missing_gpu():
    assert bench.load_recorded("no_such_gpu") is None


def test_provenance_line():
    line = bench.provenance(_toy())
    assert line == "Measured on Toy GPU (driver 1.0), torch 2.x, triton 3.x, on 2026-01-01"


def test_ratios_and_table():
    data = _toy()
    assert bench.ratios(data, "fwd") == [1.5, 1.5]
    assert bench.ratios(data, "fwd", baseline="sdpa_cudnn") == [0.75, 0.75]
    table = bench.format_table(data, "fwd")
    lines = table.splitlines()
    assert lines[0] == "TFLOP/s, fwd"
    assert "course" in lines[1] and "÷flash" in lines[1] and "÷cudnn" in lines[1]
    assert "naive" in lines[1] and "sdpa_mem_eff" not in lines[1]  # only impls that were measured
    row = next(line for line in lines if "False |" in line)
    assert "300.0" in row and "200.0" in row and "1.50" in row and "0.75" in row
    assert "course ÷ sdpa_flash: median 1.50, min 1.50 over 2 cells" in table
    with pytest.raises(ValueError, match="pass_ must be one of"):
        bench.format_table(data, "bwd")


def test_recorded_meets_targets_table():
    """The recorded run's summary line is what the issue's targets are read from."""
    data = bench.load_recorded("h100")
    fwd = bench.ratios(data, "fwd")
    assert f"median {statistics.median(fwd):.2f}" in bench.format_table(data, "fwd")


def test_memory_table():
    text = bench.format_memory(_toy(), "fwd")
    assert "peak MiB above inputs, fwd" in text and "5000" in text


def test_plot_has_one_line_per_impl_and_causality():
    fig = bench.plot(_toy(), "fwd")
    lines = fig.axes[0].get_lines()
    assert len(lines) == 3 * 2 + 1  # three impls × (causal, not) + naive non-causal
    assert "Toy GPU" in fig._suptitle.get_text()


def test_flops_convention():
    # 4·B·H·N²·d forward, halved when causal, 3.5x for forward+backward (FA papers)
    assert bench.flops(1, 1, 1024, 64, False, "fwd") == 4 * 1024 * 1024 * 64
    assert bench.flops(1, 1, 1024, 64, True, "fwd") == 2 * 1024 * 1024 * 64
    assert bench.flops(1, 1, 1024, 64, False, "fwd+bwd") == 3.5 * 4 * 1024 * 1024 * 64
    assert bench.problem_shape(4096, 128) == (4, 16)


def test_notebook_cell_on_cpu(capsys, monkeypatch, tmp_path):
    from course_lib.platform import runtime

    if runtime.current().on_gpu:
        pytest.skip("the CPU path shows recorded results")
    data = bench.notebook_cell("fwd+bwd")
    out = capsys.readouterr().out
    assert data is not None and "No GPU here: showing recorded results. Measured on" in out
    assert "TFLOP/s, fwd+bwd" in out
    monkeypatch.setattr(bench, "RECORDED_DIR", tmp_path)
    assert bench.notebook_cell("fwd") is None
    assert "No GPU results recorded yet" in capsys.readouterr().out


def test_cli_show_recorded(capsys, tmp_path):
    plot_path = tmp_path / "p.png"
    bench.main(["--show-recorded", "h100", "--plot", str(plot_path)])
    out = capsys.readouterr().out
    assert "TFLOP/s, fwd" in out and "TFLOP/s, fwd+bwd" in out and "peak MiB" in out
    assert (tmp_path / "p_fwd.png").exists() and (tmp_path / "p_fwd_bwd.png").exists()


def test_run_grid_refuses_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench.run_grid()


def test_one_pass_table_shows_each_recorded_cell_and_its_ratio(tmp_path):
    """Chapter 07's table: one line per cell with all three variants, the ratio computed from the
    recorded numbers, and the provenance; a cell missing a variant is left out."""
    import json

    from course_lib.measure import bench

    meta = {"gpu": "GPU X", "driver": "1", "torch": "2", "triton": "3", "date": "2026-01-02"}
    rows = [{"dtype": "float16", "d": 64, "N": 4096, "causal": True, "variant": v, "config": None, "tflops": t}
            for v, t in (("two-kernel", 200.0), ("one-pass tma", 250.0), ("one-pass atomic", 210.0))]
    rows.append({"dtype": "float16", "d": 128, "N": 4096, "causal": False, "variant": "two-kernel",
                 "config": None, "tflops": 300.0})
    rows.append({"dtype": "float16", "d": 64, "N": 4096, "causal": True, "variant": "one-pass tma",
                 "config": [64, 64, 4, 3], "tflops": 999.0})  # a swept config, not the library's
    path = tmp_path / "bwd.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    lines = bench.one_pass_table(path).splitlines()
    assert len(lines) == 4 and "GPU X" in lines[-1] and "2026-01-02" in lines[-1]
    assert lines[2].split()[-1] == "1.25x" and "999" not in lines[2]
    assert len(bench.one_pass_table().splitlines()) == 3 + 24  # the recorded H100 grid


def test_grid_arguments_default_to_the_whole_grid():
    import argparse

    from course_lib.measure import bench

    parser = argparse.ArgumentParser()
    bench.add_grid_arguments(parser)
    args = parser.parse_args([])
    assert args.dtypes.split(",") == list(bench.GRID["dtype"])
    assert list(map(int, args.head_dims.split(","))) == list(bench.GRID["d"])
    assert list(map(int, args.seq_lens.split(","))) == list(bench.GRID["N"])
    assert parser.parse_args(["--causal", "1"]).causal == "1"


# ----------------------------------------------------------------------------------------------
# Per-call cost (issue 33): the eager timer, the overhead runner, its record and its table


def _toy_overhead():
    rows = []
    for impl, fwd, fwd_bwd in (("course", 45.0, 240.0), ("sdpa_flash", 35.0, 187.0), ("sdpa_cudnn", 39.0, 212.0)):
        for pass_, us in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            rows.append({"impl": impl, "pass": pass_, "us_per_call": us, "dtype": "bfloat16", "d": 64, "N": 128,
                         "causal": True, "batch": 1, "heads": 4, "calls": 300})
    meta = {"gpu": "Toy GPU", "driver": "1.0", "torch": "2.x", "triton": "3.x", "date": "2026-01-01",
            "timer": "eager"}
    return {"meta": meta, "rows": rows}


def test_eager_timer_counts_calls_and_clears_grads():
    """Warm-up calls, then ``repeats`` loops of ``calls`` calls, synchronised only around each loop,
    gradients set to None after every call; the result is time per call."""
    import torch

    x = torch.zeros(1, requires_grad=True)
    counts = {"step": 0, "sync": 0, "grad_seen": 0}

    def step():
        counts["grad_seen"] += x.grad is not None
        counts["step"] += 1
        x.grad = torch.ones(1)

    def sync():
        counts["sync"] += 1

    us = bench.time_eager_us(step, calls=7, warmup=2, repeats=3, grads=(x,), sync=sync)
    assert counts["step"] == 2 + 3 * 7 and counts["grad_seen"] == 0 and x.grad is None
    assert counts["sync"] == 1 + 2 * 3 and us > 0
    counts["step"] = 0
    bench.time_eager_us(step, calls=None, warmup=0, repeats=1, sync=sync)  # sized from one timed call
    assert counts["step"] >= 1 + bench.EAGER_MIN_CALLS


def test_grid_timer_eager_is_the_eager_loop(monkeypatch):
    """``--timer eager`` times the grid's cells with :func:`time_eager_us` (milliseconds out)."""
    seen = {}

    def fake(step, grads=None, sync=None, **kwargs):
        seen.update(grads=grads, sync=sync)
        return 2500.0

    monkeypatch.setattr(bench, "time_eager_us", fake)
    assert bench._time_ms(lambda: None, "eager", ["g"]) == (2.5, "eager")
    assert seen["grads"] == ["g"] and seen["sync"] is not None
    assert "eager" in bench.TIMERS
    data = _toy()
    data["meta"]["timer"] = "eager"
    assert bench.provenance(data).endswith("timed eagerly (loops of back-to-back calls, no CUDA graph: host work "
                                           "per call included)")


def test_overhead_row_on_cpu_in_the_interpreter():
    """The runner's row for the course kernel, measured for real in the interpreter at a tiny shape
    (its number means nothing off the GPU; its format is the record's)."""
    from course_lib.platform import runtime

    if runtime.current().on_gpu:
        pytest.skip("the CPU path; on a GPU the lead's run records the real numbers")
    for pass_ in bench.PASSES:
        row = bench.measure_overhead("course", "float32", 16, 16, True, pass_, batch=1, heads=1, calls=1, rounds=1,
                                     warmup=0)
        assert set(row) == bench.OVERHEAD_ROW_KEYS and row["us_per_call"] > 0
        assert (row["impl"], row["pass"], row["d"], row["N"], row["causal"], row["batch"], row["heads"], row["calls"]) \
            == ("course", pass_, 16, 16, True, 1, 1, 1)


def test_overhead_backend_that_cannot_run_gives_no_row(capsys):
    """An SDPA backend that refuses the device or shape gives None and says why (cuDNN on CPU)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("cuDNN runs on a GPU")
    assert bench.measure_overhead("sdpa_cudnn", "float32", 16, 16, False, "fwd", calls=1, rounds=1, warmup=0) is None
    assert "sdpa_cudnn float32 d=16 N=16 causal=False fwd: not run" in capsys.readouterr().out


def test_run_overhead_record_with_a_stand_in_timer(tmp_path):
    """Every (cell, pass, impl) gets a row; the implementations of a cell take turns, round after
    round, and each keeps its fastest loop; the meta says the timer and the statistic, and the
    record reads back."""
    import json

    calls = []
    times = iter([14.0, 30.0, 12.5, 31.0, 13.0, 29.5] * 2 * len(bench.PASSES))

    def timer(step, **kwargs):
        calls.append(kwargs)
        return next(times)

    data = bench.run_overhead(impls=("course", "sdpa_flash"), dtypes=("float32",), head_dims=(16,), seq_lens=(16, 32),
                              causals=(False,), progress=False, timer=timer, device="cpu", heads=1, rounds=3,
                              warm_first=False)
    assert data["meta"]["timer"] == "eager" and "fastest of 3" in data["meta"]["statistic"]
    assert len(data["rows"]) == 2 * 2 * len(bench.PASSES) and len(calls) == 3 * len(data["rows"])
    assert {r["N"] for r in data["rows"]} == {16, 32}
    assert {r["impl"]: r["us_per_call"] for r in data["rows"][:2]} == {"course": 12.5, "sdpa_flash": 29.5}
    assert [c["warmup"] > 0 for c in calls[:6]] == [True, True, False, False, False, False]
    assert [c["grads"] is not None for c in calls[::6]] == [p == "fwd+bwd" for p in bench.PASSES] * 2
    path = tmp_path / "toy_overhead.json"
    path.write_text(json.dumps(data))
    assert bench.load_overhead(path=path) == data


def test_run_overhead_warms_every_cell_before_timing_any():
    """The warm-up pass calls every implementation of every cell once (one call, one loop) before the
    first timed loop, and only the timed loops make rows."""
    calls = []

    def timer(step, **kwargs):
        calls.append(kwargs["calls"])
        return 10.0

    data = bench.run_overhead(impls=("course", "sdpa_flash"), dtypes=("float32",), head_dims=(16,), seq_lens=(16, 32),
                              causals=(False,), progress=False, timer=timer, device="cpu", heads=1, rounds=2, calls=50)
    cells = 2 * len(bench.PASSES)
    assert calls == [1] * 2 * cells + [50] * 2 * 2 * cells and len(data["rows"]) == 2 * cells


def test_overhead_reader_refuses_a_broken_record(tmp_path):
    import json

    assert bench.load_overhead("no_such_gpu") is None
    for broken, message in (({"rows": []}, "a per-call cost record is"),
                            ({**_toy_overhead(), "meta": {**_toy_overhead()["meta"], "timer": "cudagraph"}},
                             "timer 'eager'"),
                            ({**_toy_overhead(), "rows": [{"impl": "course"}]}, "a row must have the keys"),
                            ({**_toy_overhead(), "rows": [{**_toy_overhead()["rows"][0], "us_per_call": 0}]},
                             "us_per_call > 0")):
        path = tmp_path / "x_overhead.json"
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            bench.load_overhead(path=path)


def test_overhead_table_and_ratios():
    data = _toy_overhead()
    assert bench.overhead_ratios(data, "fwd") == [45.0 / 35.0]
    assert bench.overhead_ratios(data, "fwd+bwd", baseline="sdpa_cudnn") == [240.0 / 212.0]
    lines = bench.format_overhead(data).splitlines()
    assert lines[0] == "µs per eager call, (B, H) = (1, 4), lower is better"
    assert "course" in lines[1] and "sdpa_cudnn" in lines[1] and "sdpa_mem_eff" not in lines[1]
    fwd = next(line for line in lines if line.startswith("fwd "))
    assert "45.0" in fwd and "35.0" in fwd and f"{45 / 35:.2f}" in fwd and f"{45 / 39:.2f}" in fwd
    assert lines[-2] == (f"course ÷ sdpa_flash, fwd: max {45 / 35:.2f}, median {45 / 35:.2f} over 1 cells "
                         "(target: at most 1.5)")
    assert lines[-1].startswith("course ÷ sdpa_flash, fwd+bwd: max 1.28")


def test_overhead_cell_and_cli_show_the_record(capsys, monkeypatch, tmp_path):
    """On CPU the notebook cell and ``--overhead --show-recorded`` print the record with its
    provenance (the timer included); without one, the cell says how to make it."""
    import json

    from course_lib.platform import runtime

    if runtime.current().on_gpu:
        pytest.skip("the CPU path shows recorded results")
    monkeypatch.setattr(bench, "RECORDED_DIR", tmp_path)
    assert bench.overhead_cell() is None
    assert "No per-call costs recorded yet" in capsys.readouterr().out
    (tmp_path / "h100_overhead.json").write_text(json.dumps(_toy_overhead()))
    assert bench.overhead_cell() == _toy_overhead()
    out = capsys.readouterr().out
    assert "No GPU here: showing recorded results. Measured on Toy GPU" in out and "timed eagerly" in out
    assert "µs per eager call" in out
    bench.main(["--overhead", "--show-recorded", "h100"])
    assert "course ÷ sdpa_flash, fwd: max" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="measures on a GPU"):
        bench.main(["--overhead"])


def test_gpu_tag_names_the_record():
    assert bench.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert bench.gpu_tag("NVIDIA L4") == "l4"
    assert bench.overhead_path("H100").name == "h100_overhead.json"


def test_recorded_overhead_file():
    """The H100 record, once the lead has made it (``python -m course_lib.measure.bench --overhead`` on the
    H100): readable, and it holds issue 33's cell for course and SDPA's FlashAttention-2."""
    data = bench.load_overhead("h100")
    if data is None:
        pytest.skip(f"not recorded yet: {bench.overhead_path('h100')} (run python -m course_lib.measure.bench "
                    "--overhead on the H100)")
    for impl in ("course", "sdpa_flash"):
        for pass_ in bench.PASSES:
            assert any(r["impl"] == impl and r["pass"] == pass_ and (r["dtype"], r["d"], r["N"], r["causal"])
                       == ("bfloat16", 64, 128, True) for r in data["rows"]), (impl, pass_)


def test_profile_overhead_tool_on_cpu(tmp_path):
    """tools/profile_overhead.py: per-call µs and own-time leaders with the launches as no-ops (the
    interpreter's launch put back afterwards), written as JSON."""
    import importlib.util
    import json
    from pathlib import Path

    from course_lib.platform import runtime

    if runtime.current().on_gpu:
        pytest.skip("the CPU run; on the GPU the lead runs the tool itself")
    from triton.runtime.interpreter import InterpretedFunction

    path = Path(__file__).resolve().parents[1] / "tools" / "profile_overhead.py"
    spec = importlib.util.spec_from_file_location("profile_overhead", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    original = InterpretedFunction.run
    with tool.no_launches():
        assert InterpretedFunction.run is not original
    assert InterpretedFunction.run is original
    out = tmp_path / "profile.json"
    tool.main(["--shape", "1,2,32,16", "--launches", "noop", "--pass", "fwd", "fwd+bwd", "--calls", "3",
               "--repeats", "2", "--warmup", "1", "--top", "5", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["launches"], r["pass"]) for r in rows] == [("noop", "fwd"), ("noop", "fwd+bwd")]
    assert all(r["us_per_call"] > 0 and len(r["leaders"]) == 5 for r in rows)
    for row in rows:  # the leaders: most own time first, each named by function and file
        own = [leader["own_us"] for leader in row["leaders"]]
        assert own == sorted(own, reverse=True) and all("(" in leader["function"] for leader in row["leaders"])
