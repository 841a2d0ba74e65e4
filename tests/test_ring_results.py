"""Chapter 11's recorded multi-GPU results (course_lib/measure/ring_results.py) and the tool that records
them (tools/bench_ring.py): the reader on a small hand-made fixture (its numbers are chosen to be
checked by hand, not measured), the tool's arguments, grid, budget and JSON, and one end-to-end
run of the tool on CPU (gloo, the Triton interpreter, tiny sizes)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from course_lib.integrations import ring
from course_lib.measure import ring_results as rr

pytestmark = pytest.mark.ch11

ROOT = Path(__file__).resolve().parent.parent


def _row(impl, world, n, causal, pass_, ms, **extra):
    tflops = 4.0 * 8 * n * n * 128 * (0.5 if causal else 1.0) * (3.5 if pass_ == "fwd+bwd" else 1.0)
    return {"impl": impl, "world": world, "N": n, "causal": causal, "pass": pass_, "ms": ms,
            "tflops_per_gpu": tflops / world / (ms * 1e-3) / 1e12, "peak_mib": [1024.0] * world,
            "inputs_mib": [512.0] * world, "wait_fraction": None, "bytes_per_step": None, **extra}


def fixture_data() -> dict:
    """Hand-made, not measured: 1 and 2 GPUs at N = 32k and 64k, non-causal."""
    rows = [_row("course", 1, 32768, False, "fwd", 10.0), _row("course", 1, 32768, False, "fwd+bwd", 40.0),
            _row("course", 2, 32768, False, "fwd", 6.25, wait_fraction=0.02, bytes_per_step=2**26),
            _row("course", 2, 32768, False, "fwd+bwd", 25.0, wait_fraction=0.05, bytes_per_step=3 * 2**26),
            _row("course", 1, 65536, False, "fwd+bwd", 160.0),
            _row("course", 2, 65536, False, "fwd+bwd", 88.0, wait_fraction=0.01, bytes_per_step=3 * 2**27),
            _row("sdpa", 1, 32768, False, "fwd", 8.0),
            _row("context_parallel", 2, 32768, False, "fwd", 5.0)]
    return {"meta": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 2, "driver": "580.1",
                     "link": "GPU0 X NV18", "torch": "2.11.0", "triton": "3.6.0", "nccl": "2.27.5",
                     "date": "2026-11-26",
                     "config": {"dtype": "bfloat16", "d": 128, "heads": 8, "batch": 1,
                                "layout": "zigzag"}},
            "rows": rows,
            "skipped": [{"impl": "course", "world": 1, "N": 524288, "causal": False,
                         "pass": "fwd+bwd", "reason": "estimated 80 s, over --max-point-s 60 s"}],
            "correctness": [{"impl": "course", "world": 2, "N": 32768, "causal": True,
                             "max_rel_err": {"o": 0.004, "dq": 0.006, "dk": 0.005, "dv": 0.003},
                             "error": None},
                            {"impl": "context_parallel", "world": 2, "N": 32768, "causal": False,
                             "max_rel_err": None, "error": "RuntimeError: boom"}]}


# ---------------------------------------------------------------- the reader


def test_fixture_validates_and_the_recorded_file_is_either_valid_or_absent():
    assert rr.validate(fixture_data())
    data = rr.recorded()
    if data is None:  # nothing recorded yet: the chapter says so, in one line
        assert rr.status() == rr.NOT_RECORDED
        assert rr.NOT_RECORDED.startswith("No multi-GPU results are recorded yet")
    else:
        assert rr.status().startswith("recorded on ") and data["rows"]


def test_absent_and_present_files(tmp_path):
    assert rr.recorded(tmp_path / "none.json") is None
    assert rr.status(tmp_path / "none.json") == rr.NOT_RECORDED
    with pytest.raises(FileNotFoundError, match="run tools/bench_ring.py"):
        rr.load(tmp_path / "none.json")
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(fixture_data()))
    assert rr.status(path) == ("recorded on 2 × NVIDIA H100 80GB HBM3, driver 580.1, torch 2.11.0, "
                               "triton 3.6.0, NCCL 2.27.5, measured 2026-11-26")


def _broken(change):
    data = copy.deepcopy(fixture_data())
    change(data)
    return data


@pytest.mark.parametrize("change, message", [
    (lambda d: d["meta"].pop("link"), r"data\['meta'\] lacks link"),
    (lambda d: d["meta"]["config"].pop("heads"), r"data\['meta'\]\['config'\] lacks heads"),
    (lambda d: d["meta"]["config"].update(dtype="int8"), "dtype'\\] must be one of bfloat16"),
    (lambda d: d.update(rows=[]), r"data\['rows'\] must be a non-empty list"),
    (lambda d: d["rows"][0].pop("ms"), r"data\['rows'\]\[0\] lacks ms"),
    (lambda d: d["rows"][1].update(impl="flash"), r"\['impl'\] must be one of course"),
    (lambda d: d["rows"][1].update({"pass": "bwd"}), r"\['pass'\] must be one of fwd, fwd\+bwd"),
    (lambda d: d["rows"][2].update(ms=0), "must be a positive time, got 0"),
    (lambda d: d["rows"][2].update(world=0), r"\['world'\] must be a positive int, got 0"),
    (lambda d: d["rows"][2].update(causal="yes"), "must be true or false, got 'yes'"),
    (lambda d: d["rows"][2].update(wait_fraction=1.5), r"must be in \[0, 1\] or None, got 1.5"),
    (lambda d: d["rows"][2].update(peak_mib=3.0), "must be a list"),
    (lambda d: d["skipped"][0].pop("reason"), r"data\['skipped'\]\[0\] lacks reason"),
    (lambda d: d["correctness"][0]["max_rel_err"].update(lse=1.0), "expected some of o, dq, dk, dv"),
])
def test_validate_names_what_is_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        rr.validate(_broken(change))


def test_strong_and_weak_scaling_by_hand():
    data = fixture_data()
    # t1 / (W tW): 10 / (2 · 6.25) = 0.8 forward; 40 / 50 = 0.8 and 160 / 176 forward+backward
    assert rr.strong_scaling(data, "course", False, "fwd") == [{"world": 2, "N": 32768, "efficiency": 0.8}]
    both = rr.strong_scaling(data, "course", False, "fwd+bwd")
    assert [(p["N"], round(p["efficiency"], 4)) for p in both] == [(32768, 0.8), (65536, 0.9091)]
    # weak: 64k on 2 GPUs against 32k on one, per-GPU rates: (4·160/2/88) / (40/40) ...
    weak = rr.weak_scaling(data, "course", False, "fwd+bwd")
    assert [(p["world"], p["tokens_per_gpu"]) for p in weak] == [(2, 32768)]
    assert weak[0]["efficiency"] == pytest.approx((4 * 40.0 / 2 / 88.0) / 1.0)
    # context_parallel's W = 1 is SDPA: 8 / (2 · 5) = 0.8; and it is 5 / 6.25 of our time
    assert rr.strong_scaling(data, "context_parallel", False, "fwd")[0]["efficiency"] == pytest.approx(0.8)
    assert rr.versus_context_parallel(data, False, "fwd") == [{"world": 2, "N": 32768, "ratio": 0.8}]
    assert rr.strong_scaling(data, "course", True, "fwd") == []  # nothing causal measured


def test_the_cost_model_by_hand():
    data = fixture_data()
    kv = ring.step_bytes(1, 8, 16384, 128, 2, "bwd", grad_bytes=4)
    transfer = kv["kv"] / ring.NVLINK_H100_BYTES_PER_S * 1e3  # ms, 67 MB over 450 GB/s
    m = rr.model(data, 2, 32768, False, "fwd")
    assert m["compute_ms"] == 10.0 / 4 and m["transfer_ms"] == pytest.approx(transfer)
    # 2.5 ms of compute hides 0.15 ms of transfer: the model's ring is perfectly efficient
    assert m["ms"] == pytest.approx(5.0) and m["efficiency"] == pytest.approx(1.0)
    assert m["wait_fraction"] == 0.0
    slow = copy.deepcopy(data)
    rr.row(slow, "course", 1, 32768, False, "fwd")["ms"] = 0.2  # compute 0.05 ms a step < transfer
    m = rr.model(slow, 2, 32768, False, "fwd")
    assert m["ms"] == pytest.approx(transfer + 0.05)
    assert m["efficiency"] == pytest.approx(0.2 / (2 * (transfer + 0.05)))
    assert m["wait_fraction"] == pytest.approx((transfer - 0.05) / (transfer + 0.05))
    both = rr.model(data, 2, 32768, False, "fwd+bwd")  # backward: (40 - 10) / 4 ms a step
    assert both["ms"] == pytest.approx(5.0 + 2 * 7.5) and both["efficiency"] == pytest.approx(1.0)
    assert rr.model(data, 2, 65536, False, "fwd") is None  # no one-GPU forward at 64k


def test_disagreements_and_tables():
    data = fixture_data()
    found = rr.disagreements(data, threshold=0.1)  # measured 0.8 against the model's 1.0
    assert {(d["N"], d["pass"]) for d in found} == {(32768, "fwd"), (32768, "fwd+bwd")}
    assert rr.disagreements(data, threshold=0.5) == []
    table = rr.format_table(data).splitlines()
    assert table[0].split()[:4] == ["W", "N", "causal", "pass"]
    two = next(line for line in table if line.split()[:4] == ["2", "32768", "False", "fwd"])
    assert two.split()[6:11] == ["0.80", "1.00", "2%", "0%", "64.0"]
    assert two.split()[-2:] == ["5.00", "0.80"]  # context_parallel's ms and its time over ours
    assert "course ring, W = 2, N = 32,768, causal: max relative error o 4.00e-03" in rr.format_correctness(data)
    assert "context_parallel, W = 2, N = 32,768, not causal: not checked (RuntimeError: boom)" \
        in rr.format_correctness(data)
    assert rr.format_skipped(data) == ("course W = 1 N = 524,288 not causal fwd+bwd: estimated "
                                       "80 s, over --max-point-s 60 s")


def test_plot_draws_measured_and_modelled_curves():
    import matplotlib

    matplotlib.use("Agg")
    fig = rr.plot_scaling(fixture_data())
    fwd, both, weak = fig.axes[:3]
    measured, modelled, guide = fwd.lines  # W = 2 not causal, its model, the line at 1
    assert list(measured.get_ydata()) == [0.8] and list(modelled.get_ydata()) == [pytest.approx(1.0)]
    assert list(guide.get_ydata()) == [1.0, 1.0]
    assert [round(y, 4) for y in both.lines[0].get_ydata()] == [0.8, 0.9091]
    assert list(weak.lines[0].get_xdata()) == [1, 2]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_bad_choices_are_named():
    with pytest.raises(ValueError, match="impl must be one of course"):
        rr.row(fixture_data(), "flash", 1, 1, False, "fwd")
    with pytest.raises(ValueError, match=r"pass_ must be one of fwd, fwd\+bwd"):
        rr.model(fixture_data(), 2, 32768, False, "bwd")


# ---------------------------------------------------------------- the tool


@pytest.fixture
def tool(monkeypatch):
    """tools/bench_ring.py as a module; its folder on sys.path, which spawned ranks inherit."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    sys.modules.pop("bench_ring", None)
    import bench_ring

    return bench_ring


def _config(tool, *argv):
    return tool.config_from_args(tool.parser().parse_args(list(argv)))


def test_default_grid_is_strong_and_weak_scaling_on_1_2_4_gpus(tool):
    c = _config(tool)
    assert (c.worlds, c.strong_n, c.weak_tokens) == ((1, 2, 4), (32768, 131072, 262144), (32768, 65536))
    assert (c.dtype, c.d, c.heads, c.batch, c.layout) == ("bfloat16", 128, 8, 1, "zigzag")
    points = tool.points(c)
    # strong: every N on every W; weak: 32k and 64k per GPU on W = 1, 2, 4 (4 × 64k = 262k)
    assert set(points) == ({(w, n) for w in (1, 2, 4) for n in (32768, 131072, 262144)}
                           | {(1, 65536), (2, 65536)})
    costs = [n * n / w for w, n in points]
    assert costs == sorted(costs)  # cheapest first: the budget drops the largest
    kinds = {(m.impl, m.world > 1) for m in tool.measurements(c)}
    assert kinds == {("course", False), ("course", True), ("sdpa", False), ("context_parallel", True)}
    assert len(tool.measurements(c)) == len(points) * 2 * 2 * 2


@pytest.mark.parametrize("argv, message", [
    (["--strong-n", "1004"], r"N = 1004 .* must be a multiple of 2·W = 8 for W = 4"),
    (["--worlds", "0", "2"], "--worlds must be positive, got 0"),
    (["--repeats", "0"], "--repeats must be positive, got 0"),
    (["--budget-s", "-1"], "--budget-s must be positive"),
    (["--verify-n", "-3"], "--verify-n must be 0 .* got -3"),
    (["--verify-n", "100"], "--verify-n 100 must be a multiple of 2·W"),
])
def test_bad_arguments_name_the_flag(tool, argv, message, capsys):
    with pytest.raises(ValueError, match=message):
        _config(tool, *argv)
    with pytest.raises(SystemExit) as info:
        tool.main([*argv, "--dry-run"])
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


def test_dry_run_prints_the_plan_and_launches_nothing(tool, capsys):
    assert tool.main(["--dry-run", "--worlds", "1", "2", "--strong-n", "4096", "--weak-tokens", "2048"]) is None
    out = capsys.readouterr().out
    assert out.startswith("24 measurements, budget 360 s")
    assert "context_parallel W=2 N=   4096 causal fwd+bwd" in out and "total ~" in out


def test_budget_skips_with_the_reason(tool):
    import time

    c = _config(tool, "--max-point-s", "30", "--budget-s", "100")
    budget = tool.Budget(c, start=time.perf_counter() - 99.9)  # as if 99.9 s had gone by
    big = tool.Measurement("course", 1, 262144, False, "fwd+bwd")
    assert "over --max-point-s 30 s" in budget.reason_to_skip(big)
    small = tool.Measurement("course", 2, 32768, True, "fwd")
    assert "left of --budget-s 100 s" in budget.reason_to_skip(small)
    fresh = tool.Budget(c)
    before = fresh.estimate_s(big)
    fresh.measured(tool.Measurement("course", 1, 32768, False, "fwd+bwd"), ms=1.0)  # a fast kernel
    assert fresh.estimate_s(big) < before and fresh.reason_to_skip(small) is None


def test_rows_and_checks_are_assembled_from_every_rank(tool):
    c = _config(tool, "--cpu")
    m = tool.Measurement("course", 2, 32, True, "fwd")
    trace = {"fwd": {"compute_ms": 3.0, "wait_ms": 1.0, "wait_fraction": 0.25, "bytes_per_step": 100}}
    other = {"fwd": {"compute_ms": 1.0, "wait_ms": 1.0, "wait_fraction": 0.5, "bytes_per_step": 80}}
    parts = [{"ms": 2.0, "peak_mib": 5.0, "inputs_mib": 1.0, "trace": trace},
             {"ms": 2.1, "peak_mib": 6.0, "inputs_mib": 1.0, "trace": other}, None]
    row = tool.assemble(c, m, parts)
    assert row["ms"] == 2.0 and row["peak_mib"] == [5.0, 6.0]  # rank 0's time: after the barrier
    assert row["trace"]["fwd"]["wait_fraction"] == 0.375 and row["bytes_per_step"] == 100
    assert row["wait_fraction"] == pytest.approx(1.0 / 3.0)  # mean wait 1 ms of 3 ms a step
    checks = tool.combine_checks(2, 32, True, [
        {"course": {"o": (0.1, 2.0), "dq": (0.0, 1.0), "dk": (0.2, 4.0), "dv": (0.3, 3.0)},
         "context_parallel": "NotImplementedError: no rule"},
        {"course": {"o": (0.3, 1.0), "dq": (0.1, 2.0), "dk": (0.1, 1.0), "dv": (0.0, 1.0)},
         "context_parallel": "NotImplementedError: no rule"}])
    assert checks[0]["max_rel_err"] == pytest.approx({"o": 0.15, "dq": 0.05, "dk": 0.05, "dv": 0.1})
    assert checks[1] == {"impl": "context_parallel", "world": 2, "N": 32, "causal": True,
                         "max_rel_err": None, "error": "NotImplementedError: no rule"}
    assert rr.validate({**fixture_data(), "rows": [row], "correctness": checks})


def test_the_tool_runs_end_to_end_on_cpu(tool, tmp_path, capsys, monkeypatch):
    """Two gloo ranks in the interpreter: W = 1 and 2, causal, forward+backward, the correctness
    check, context_parallel's failure on CPU recorded with its reason, a valid JSON file."""
    out = tmp_path / "ring.json"
    for name in tool.MULTICAST_OFF:  # the tool sets them in this process: undone after the test
        monkeypatch.delenv(name, raising=False)
    data = tool.main(["--cpu", "--causal", "yes", "--passes", "fwd+bwd", "--strong-n", "64",
                      "--weak-tokens", "32", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data)) and rr.validate(data)
    assert data["meta"]["env"] == tool.MULTICAST_OFF and "partial" not in data["meta"]
    got = {(r["impl"], r["world"], r["N"]) for r in data["rows"]}
    assert got == {("course", 1, 32), ("sdpa", 1, 32), ("course", 1, 64), ("sdpa", 1, 64),
                   ("course", 2, 64)}  # strong: 64 on 1 and 2 ranks; weak: 32 per rank
    ring_row = rr.row(data, "course", 2, 64, True, "fwd+bwd")
    assert set(ring_row["trace"]) == {"fwd", "bwd"} and 0 <= ring_row["wait_fraction"] <= 1
    # backward steps send K, V (float32 here) and the float32 dK, dV: 4 tensors of 32 × 16
    assert ring_row["bytes_per_step"] == sum(ring.step_bytes(1, 1, 32, 16, 4, "bwd").values())
    course = next(c for c in data["correctness"] if c["impl"] == "course")
    assert course["world"] == 2 and max(course["max_rel_err"].values()) < 1e-5
    assert all(s["impl"] == "context_parallel" and "sharding" in s["reason"] for s in data["skipped"])
    assert "wrote" in capsys.readouterr().out


@pytest.mark.gpu
def test_the_tool_runs_on_two_gpus_gpu(tool, tmp_path):
    """A small grid on 2 GPUs (NCCL): the lead's 4-GPU recording in miniature."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for NCCL ranks, this machine has {torch.cuda.device_count()}: "
                    f"run tools/bench_ring.py on a multi-GPU machine")
    data = tool.main(["--worlds", "1", "2", "--strong-n", "8192", "--weak-tokens", "4096",
                      "--verify-n", "4096", "--out", str(tmp_path / "ring.json")])
    assert rr.validate(data) and data["meta"]["gpu_count"] >= 2
    assert all(max(c["max_rel_err"].values()) < 0.02 for c in data["correctness"]
               if c["max_rel_err"] is not None)
    assert rr.row(data, "course", 2, 8192, True, "fwd+bwd") is not None
    assert rr.row(data, "context_parallel", 2, 8192, False, "fwd") is not None  # load balancing off
