"""course_lib.bench: the recorded results, tables, ratios, plots and the notebook cell (CPU paths)."""

from __future__ import annotations

import statistics

import matplotlib
import pytest

matplotlib.use("Agg")

from course_lib import bench  # noqa: E402

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
    from course_lib import runtime

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

    from course_lib import bench

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

    from course_lib import bench

    parser = argparse.ArgumentParser()
    bench.add_grid_arguments(parser)
    args = parser.parse_args([])
    assert args.dtypes.split(",") == list(bench.GRID["dtype"])
    assert list(map(int, args.head_dims.split(","))) == list(bench.GRID["d"])
    assert list(map(int, args.seq_lens.split(","))) == list(bench.GRID["N"])
    assert parser.parse_args(["--causal", "1"]).causal == "1"
