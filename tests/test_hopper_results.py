"""Chapter 09's recorded H100 results: the file is there, complete, and read the way the notebook
says (ablation steps, two-stage gain, FP8 speed and accuracy, compiler resources); the Gluon
forward's and backward's runs; FlashAttention-4's ablation (its record, the tables the notebook
prints from it, and tools/gluon_ablation.py --record, which trims a full run into it)."""

from __future__ import annotations

import pytest

from course_lib.measure import bench, decoding_results, hopper_results as hr

pytestmark = [pytest.mark.ch09]


@pytest.fixture(scope="module")
def data():
    return hr.load()


def test_recorded_file_has_provenance_and_every_grid_cell(data):
    assert "H100" in hr.provenance(data) and "triton" in hr.provenance(data)
    cells = hr.cells(data, "sdpa_cudnn")
    assert len(cells) == 24  # fp16/bf16 x d 64/128 x N 1k/4k/16k x causal
    for cell in cells:
        for variant in ("course", "tma", "tma_ws", "sdpa_flash"):
            assert hr.tflops(data, variant, *cell) > 0, (variant, cell)
    assert not data.get("failures")


def test_ablation_has_every_step_and_the_gains_are_ratios_of_its_rows(data):
    rows = hr.ablation(data, "float16", 128, 16384)
    assert [r["step"] for r in rows[:len(hr.ABLATION_STEPS)]] == [s[0] for s in hr.ABLATION_STEPS]
    assert all(r["non-causal"] and r["causal"] for r in rows)
    text = hr.format_ablation(data, "float16", 128, 16384)
    first, second = rows[0]["non-causal"], rows[1]["non-causal"]
    assert f"({second / first:.2f}x)" in text


def test_two_stage_and_pipeline_rows_pair_the_right_measurements(data):
    gains = hr.two_stage_gain(data)
    assert len(gains) == 12 and all(one > 0 and two > 0 for *_, one, two in gains)
    depth = hr.pipeline_depth(data)
    assert len(depth) == 24 and all(a > 0 and b > 0 for *_, a, b in depth)


def test_fp8_rows(data):
    speed = hr.fp8_speedup(data)
    assert {(n, c) for n, c, *_ in speed} == {(4096, False), (4096, True), (16384, False), (16384, True)}
    for n, causal, f16, f8, ratio in speed:
        assert ratio == pytest.approx(f8 / f16)
    acc = hr.fp8_accuracy(data)
    assert acc["fp16"] < acc["fp8_rotated"] < acc["fp8"]


def test_resources_parse_the_compiler_report(data):
    rows = hr.resources(data, head_dim=128, num_warps=8)
    kinds = {(r["kernel"], r["block_m"], r["block_n"]) for r in rows}
    assert ("pointer", 128, 128) in kinds and ("tma", 128, 128) in kinds
    for r in rows:
        assert 0 < r["n_regs"][0] <= r["n_regs"][1] <= 255


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.json"):
        hr.load(tmp_path / "nothing.json")


def test_recorded_decoding_bench_table():
    data = decoding_results.load_recorded_bench()
    text = decoding_results.format_recorded_bench(data)
    assert "H100" in text and "copy ceiling" in text
    assert len(text.splitlines()) == 3 + len(data["results"])
    long = [r for r in data["results"] if r["seq_len"] >= 65536]
    assert long and all(r["triton"]["fraction_of_copy_ceiling"] > 0 for r in long)


# ---------------------------------------------------------------- the Gluon forward (section 7)

@pytest.fixture(scope="module")
def gluon():
    return hr.load_gluon()


def test_gluon_file_has_every_impl_on_every_cell_and_passed_its_checks(gluon):
    assert "H100" in hr.provenance(gluon) and "driver" not in hr.provenance(gluon)
    rows = hr.gluon_rows(gluon)
    assert len(rows) == 12  # fp16/bf16 x N 1k/4k/16k x causal, d=128
    for row in rows:
        assert all(row[impl] > 0 for _, impl in hr.GLUON_COLUMNS), row
    assert gluon["errors"] and all(e["ok"] for e in gluon["errors"])
    assert set(gluon["compile"]) == {"tma", "overlap", "ws", "pingpong"}


def test_gluon_table_holds_the_recorded_numbers_and_their_ratios(gluon):
    text = hr.gluon_table(gluon)
    lines = text.splitlines()
    assert lines[0] == hr.provenance(gluon)
    body = [line for line in lines if line.startswith(("float16", "bfloat16"))]
    assert len(body) == len(hr.gluon_rows(gluon))
    for row, line in zip(hr.gluon_rows(gluon), body):
        for _, impl in hr.GLUON_COLUMNS:
            assert f"{row[impl]:.1f}" in line, (impl, line)
        pp = hr.gluon_tflops(gluon, "gluon_pingpong", row["dtype"], row["N"], row["causal"])
        tma = hr.gluon_tflops(gluon, "tma", row["dtype"], row["N"], row["causal"])
        cudnn = hr.gluon_tflops(gluon, "sdpa_cudnn", row["dtype"], row["N"], row["causal"])
        assert row["vs_tma"] == pytest.approx(pp / tma) and row["vs_cudnn"] == pytest.approx(pp / cudnn)
        assert line.split()[-2:] == [f"{pp / tma:.2f}", f"{pp / cudnn:.2f}"]


def test_gluon_missing_cell_and_missing_file(gluon, tmp_path):
    assert hr.gluon_tflops(gluon, "gluon_pingpong", "float16", 999, False) is None
    partial = {"meta": gluon["meta"], "speed": [r for r in gluon["speed"] if r["impl"] != "sdpa_cudnn"]}
    rows = hr.gluon_rows(partial)
    assert all(r["sdpa_cudnn"] is None and r["vs_cudnn"] is None and r["vs_tma"] for r in rows)
    assert hr.gluon_table(partial).splitlines()[-1].endswith("-")
    assert hr.load_gluon(tmp_path / "nothing.json") is None


def test_gluon_plot_has_a_bar_per_impl_and_cell(gluon):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = hr.gluon_plot(gluon)
    try:
        bars = fig.axes[0].patches
        assert len(bars) == len(hr.GLUON_COLUMNS) * len(hr.gluon_rows(gluon))
        assert max(b.get_height() for b in bars) == max(r["tflops"] for r in gluon["speed"])
    finally:
        plt.close(fig)


def test_source_excerpt_reads_the_marked_lines_from_the_file():
    import inspect

    text = hr.source_excerpt(hr.gluon_table, "lines = [", "return")
    lines, first = inspect.getsourcelines(hr.gluon_table)
    body = text.splitlines()
    assert body[0].startswith("hopper_results.py:") and "lines = [" in body[0] and "return" in body[-1]
    number = int(body[0].split(":")[1].split()[0])
    assert lines[number - first].rstrip().endswith(body[0].split(maxsplit=1)[1].strip())
    assert len(hr.source_excerpt(hr.gluon_table, "lines = [").splitlines()) == len(lines) - (number - first)
    with pytest.raises(ValueError, match="start 'no such line'"):
        hr.source_excerpt(hr.gluon_table, "no such line")
    with pytest.raises(ValueError, match="end 'no such line'"):
        hr.source_excerpt(hr.gluon_table, "lines = [", "no such line")


def test_gluon_kernel_facts_compiles_in_a_child_process():
    from course_lib.kernels import gluon_hopper as gh

    if not gh.available():  # pragma: no cover - depends on the installed Triton
        pytest.skip(f"gluon not importable: {gh.GLUON_IMPORT_ERROR}")
    facts = hr.gluon_kernel_facts(("ws",), head_dim=64, causal=False)
    assert set(facts) == {"ws"}
    assert facts["ws"]["wait_group_1"] >= 1 and "dec 24" in facts["ws"]["setmaxnreg"], facts


# ---------------------------------------------------------------- the Gluon backward (section 7)

def test_gluon_backward_table_holds_the_recorded_numbers():
    data = hr.load_gluon_backward()
    rows = hr.gluon_backward_rows(data)
    assert len(rows) == 12  # fp16/bf16 x N 1k/4k/16k x causal, d=128
    lines = hr.gluon_backward_table(data).splitlines()
    assert lines[0] == hr.provenance(data)
    body = [line for line in lines if line.startswith(("float16", "bfloat16"))]
    assert len(body) == len(rows)
    for row, line in zip(rows, body):
        bwd, both = row["bwd"], row["fwd+bwd"]
        for _, impl in hr.GLUON_BACKWARD_COLUMNS:
            assert bwd[impl] > 0 and str(bwd[impl]) in line, (impl, line)
        ratios = line.split("|")[-2].split() + line.split("|")[-1].split()
        assert ratios == [f"{bwd['course_gluon_bwd'] / bwd['course_triton_bwd']:.2f}",
                          f"{bwd['course_gluon_bwd'] / bwd['sdpa_cudnn']:.2f}",
                          f"{both['course_gluon_bwd'] / both['sdpa_cudnn']:.2f}"]


def test_gluon_backward_missing_impl_and_file(tmp_path):
    data = hr.load_gluon_backward()
    partial = {"meta": data["meta"], "speed": [r for r in data["speed"] if r["impl"] != "sdpa_cudnn"]}
    assert all(line.rstrip().endswith("-") for line in hr.gluon_backward_table(partial).splitlines()[4:])
    assert hr.load_gluon_backward(tmp_path / "none.json") is None


# ---------------------------------------------------------------- FlashAttention-4's two tricks (section 8)

@pytest.fixture(scope="module")
def fa4():
    return hr.load_fa4()


@pytest.fixture(scope="module")
def ablation_tool():
    """tools/gluon_ablation.py's names (its --record runs on any machine, without a GPU)."""
    import runpy
    import types
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "gluon_ablation.py"
    return types.SimpleNamespace(**runpy.run_path(str(path)))


FA4_RECORD_MAX_BYTES = 30_000  # the record stays small: the per-case errors stay in the full run


def test_fa4_record_is_small_complete_and_names_where_and_how(fa4):
    assert hr.FA4_FILE.stat().st_size <= FA4_RECORD_MAX_BYTES
    line = hr.provenance(fa4)
    assert "H100" in line and "driver 580" in line and "triton 3.6.0" in line and "2026-11-27" in line
    assert bench.TIMER_NOTES["cudagraph"] in line
    cells = fa4["speed"]["cells"]
    assert len(cells) == 12  # fp16/bf16 x N 1k/4k/16k x causal
    assert all(t > 0 for values in fa4["speed"]["tflops"].values() for t in values)
    assert not fa4["skipped"] and not fa4["failed"] and not fa4["excluded"]
    for name, facts in fa4["compile"].items():
        assert {"ex2", "poly_fma", "registers", "spill_bytes"} <= set(facts), name


def test_fa4_speed_summary_is_what_the_cells_give(fa4):
    rows = hr.fa4_rows(fa4)
    assert len(rows) == sum(len(v) for v in fa4["speed"]["tflops"].values())
    assert hr.fa4_speed_summary(rows) == fa4["summary"]["speed"]
    base = hr.fa4_ratios(rows, "pingpong/128/baseline", "sdpa_cudnn/128")
    assert fa4["summary"]["speed"]["pingpong/128/baseline"]["min_x_cudnn"] == pytest.approx(min(base), abs=5e-4)


def test_fa4_summary_table_shows_the_recorded_numbers(fa4):
    lines = hr.fa4_summary_table(fa4).splitlines()
    assert lines[0] == hr.provenance(fa4) and "16k tokens" in lines[1]
    for name, s in fa4["summary"]["speed"].items():
        if name.count("/") != 2:
            continue
        variant, d, config = name.split("/")
        label = hr.fa4_label(fa4, config)
        [line] = [x for x in lines if x.split("|")[0].split() == [variant, d, *label.split()]]
        facts = fa4["compile"][name]
        assert line.split("|")[1].split() == [str(facts[k]) for k in ("ex2", "poly_fma", "registers", "spill_bytes")]
        assert line.split("|")[2].split() == [f"{s['median_x_cudnn']:.3f}", f"{s['min_x_cudnn']:.3f}"]
        assert line.split("|")[3].strip() == f"{s['median_x_baseline']:.3f}"
    library = fa4["summary"]["speed"]["course/64"]
    assert any(x.startswith("Triton forward") and f"{library['median_x_cudnn']:.3f}" in x for x in lines)


def test_fa4_cell_table_divides_each_config_by_the_baseline_in_its_cell(fa4):
    cells = hr.fa4_cells(hr.fa4_rows(fa4))
    for variant, d in fa4["meta"]["groups"]:
        lines = hr.fa4_cell_table(fa4, variant, d).splitlines()
        assert lines[0] == hr.provenance(fa4)
        assert ("library" in lines[2]) == (d == 64)  # the library's forward was timed at d = 64 only
        body = [x for x in lines if x.startswith(("float16", "bfloat16"))]
        assert len(body) == len(fa4["speed"]["cells"])
        timed = [c for c in fa4["meta"]["configs"]
                 if c != "baseline" and f"{variant}/{d}/{c}" in fa4["speed"]["tflops"]]
        for (dtype, n, causal), line in zip(fa4["speed"]["cells"], body):
            base = cells[(f"{variant}/{d}/baseline", dtype, n, causal)]
            cudnn = cells[(f"sdpa_cudnn/{d}", dtype, n, causal)]
            assert line.split("|")[1].split() == [str(base), f"{base / cudnn:.3f}"]
            assert line.split("|")[2].split() == [f"{cells[(f'{variant}/{d}/{c}', dtype, n, causal)] / base:.3f}"
                                                  for c in timed]
            assert line.split("|")[3].split()[-1] == str(cudnn)
    with pytest.raises(ValueError, match="variant, d"):
        hr.fa4_cell_table(fa4, "tma", 128)


def test_fa4_accuracy_table_counts_each_kind_of_input(fa4):
    lines = hr.fa4_accuracy_table(fa4).splitlines()
    assert lines[0] == hr.provenance(fa4) and "±500" in lines[1] and "2.0 x SDPA" in lines[1]
    body = lines[4:]
    assert len(body) == len(fa4["summary"]["accuracy"])
    for (name, a), line in zip(fa4["summary"]["accuracy"].items(), body):
        kinds = a["by_inputs"]
        assert sum(k["passed"] for k in kinds.values()) == a["passed"]
        assert sum(k["cases"] for k in kinds.values()) == a["cases"]
        assert line.split("|")[1].split() == [f"{kinds[k]['passed']}/{kinds[k]['cases']}" for k in ("ordinary", "fuzz")]
        assert line.split("|")[2].split() == [f"{a['worst_o_x_sdpa']:.2f}", f"{a['worst_lse_x_sdpa']:.2f}"]
        skipped = a.get("rescale_skipped")
        assert (line.split("|")[3].split() == ["-", "-"]) == (skipped is None), line
    # what chapter 09 says about them: the cubic fails lse on ordinary inputs, the quintic and the baseline pass
    acc = fa4["summary"]["accuracy"]
    for d in (64, 128):
        assert acc[f"pingpong/{d}/baseline"]["passed"] == acc[f"pingpong/{d}/baseline"]["cases"]
        assert acc[f"pingpong/{d}/exp2_emu_2of4_deg5"]["passed"] == acc[f"pingpong/{d}/exp2_emu_2of4_deg5"]["cases"]
        assert acc[f"pingpong/{d}/exp2_emu_1of4"]["by_inputs"]["ordinary"]["passed"] == 0


def test_fa4_labels_come_from_the_switches(fa4):
    assert [hr.fa4_label(fa4, c) for c in fa4["meta"]["configs"]] == [
        "baseline", "τ=8", "exp2 1/4", "exp2 2/4", "τ=8 + exp2 1/4", "τ=8 + exp2 2/4", "exp2 2/4 deg 5"]


def test_fa4_missing_file(tmp_path):
    assert hr.load_fa4(tmp_path / "nothing.json") is None


def _full_run(tool) -> dict:
    """A small full run in tools/gluon_ablation.py's --out format: one group, two configs, two cells."""
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.0", "torch": "2.11.0", "triton": "3.6.0",
            "date": "2026-11-27", "timer": "cudagraph", "seq_lens": [1024], "configs": tool.CONFIGS,
            "groups": [["pingpong", 64]], "fuzz_logit": 500.0, "rule": "ok iff ..."}
    speed = [{"impl": impl, "d": 64, "dtype": "float16", "N": 1024, "causal": causal, "tflops": t}
             for impl, ts in (("sdpa_cudnn/64", (400.0, 300.0)), ("pingpong/64/baseline", (360.0, 240.0)),
                              ("pingpong/64/rescale_tau8", (342.0, 240.0)))
             for causal, t in zip((False, True), ts)]
    errors = [{"variant": "pingpong", "d": 64, "config": config, "inputs": kind, "o_err": o, "lse_err": 1e-6,
               "sdpa_o_err": 1e-3, "sdpa_lse_err": 1e-6, "ok": o <= 2e-3,
               **({"rescale_skipped": skip} if config == "rescale_tau8" else {})}
              for config, kind, o, skip in (("baseline", "ordinary", 1e-3, None), ("baseline", "fuzz", 1e-3, None),
                                            ("rescale_tau8", "ordinary", 1e-3, 1.0),
                                            ("rescale_tau8", "fuzz", 3e-3, 0.01))]
    facts = {"registers": 168, "spill_bytes": 0, "shared_bytes": 115024, "ex2": 260, "poly_fma": 0,
             "guarded_mul_f32": 0, "setmaxnreg": ["inc 240"], "wgmma": 48, "triton": "3.6.0"}
    failed = {"error": "CompilationError: ..."}  # a config whose check child could not compile it
    return {"meta": meta, "compile": {"pingpong/64/baseline": facts, "pingpong/64/exp2_emu_1of4": failed},
            "errors": errors, "speed": speed,
            "skipped": [], "failed": [], "excluded": []}


def test_record_trims_a_full_run_and_the_reader_reads_it_back(ablation_tool, tmp_path):
    import json

    full = _full_run(ablation_tool)
    path = tmp_path / "full.json"
    path.write_text(json.dumps(full))
    data = ablation_tool.write_record(path, tmp_path / "record.json")
    assert hr.load_fa4(tmp_path / "record.json") == data
    assert data["speed"]["cells"] == [["float16", 1024, False], ["float16", 1024, True]]
    assert sorted(map(str, hr.fa4_rows(data))) == sorted(map(str, full["speed"]))  # the cells survive the round trip
    assert set(data["compile"]["pingpong/64/baseline"]) == set(ablation_tool.RECORD_COMPILE_KEYS) - {"error"}
    assert data["compile"]["pingpong/64/exp2_emu_1of4"] == full["compile"]["pingpong/64/exp2_emu_1of4"]
    assert data["meta"]["tokens"] == bench.TOKENS and data["meta"]["exp2_pack"] >= 1
    speed = data["summary"]["speed"]["pingpong/64/rescale_tau8"]
    assert speed == {"cells": 2, "median_x_cudnn": round((342 / 400 + 240 / 300) / 2, 3),
                     "min_x_cudnn": 0.8, "median_x_baseline": round((342 / 360 + 1.0) / 2, 3)}
    acc = data["summary"]["accuracy"]["pingpong/64/rescale_tau8"]
    assert acc["passed"] == 1 and acc["by_inputs"]["fuzz"] == {"passed": 0, "cases": 1, "worst_o_x_sdpa": 3.0,
                                                               "worst_lse_x_sdpa": 1.0}
    assert acc["rescale_skipped"]["fuzz"] == {"min": 0.01, "median": 0.01, "max": 0.01}
    assert "rescale_skipped" not in data["summary"]["accuracy"]["pingpong/64/baseline"]
    assert "τ=8" in ablation_tool.report(data)


def test_record_refuses_a_file_that_is_not_a_full_run(ablation_tool, tmp_path):
    path = tmp_path / "record_not_run.json"
    path.write_text('{"meta": {}, "speed": []}')
    with pytest.raises(ValueError, match=r"full_path .*record_not_run.json lacks \['compile', 'errors'\]"):
        ablation_tool.write_record(path, tmp_path / "out.json")


def test_cudnn_standing_reads_the_recorded_grids_and_the_targets():
    rows = hr.cudnn_standing()
    assert {(r["timer"], r["pass"]) for r in rows} == {(t, p) for t in hr.CUDNN_TARGETS for p in bench.PASSES}
    for r in rows:
        ratios = bench.ratios(bench.load_recorded("h100", r["timer"]), r["pass"], baseline="sdpa_cudnn")
        assert r["cells"] == len(ratios) == 24 and r["min"] == min(ratios)
        assert r["target_min"] == hr.CUDNN_TARGETS[r["timer"]]["min"]
    text = hr.cudnn_standing_table()
    assert bench.TIMER_NOTES["cudagraph"] in text and bench.TIMER_NOTES["eager"] in text
    assert "(≥ 1.00)" in text and "(≥ 0.85)" in text and "(no target)" in text


# ---------------------------------------------------------------- the backward's overlap and persistent grid

@pytest.fixture(scope="module")
def bwd_ab():
    return hr.load_bwd_overlap()


def _bwd_line(table: str, *first_words: str) -> str:
    """The one line of ``table`` that starts with ``first_words`` (split on whitespace)."""
    found = [x for x in table.splitlines() if x.split()[:len(first_words)] == list(first_words)]
    assert len(found) == 1, (first_words, found)
    return found[0]


def test_bwd_overlap_record_names_where_and_how_and_every_config_passed(bwd_ab):
    line = hr.provenance(bwd_ab)
    assert "H100" in line and "driver 580" in line and "triton 3.6.0" in line and "2026-11-27" in line
    assert bench.TIMER_NOTES["cudagraph"] in line
    assert hr.BWD_OVERLAP_FILE.stat().st_size <= FA4_RECORD_MAX_BYTES
    assert len(bwd_ab["speed"]["cells"]) == 12  # bf16 x d 64/128 x N 1k/4k/16k x causal
    assert not bwd_ab["skipped"] and not bwd_ab["failed"] and not bwd_ab["excluded"]
    accuracy = bwd_ab["summary"]["accuracy"]
    assert len(accuracy) == 10 and all(a["passed"] == a["cases"] for a in accuracy.values())
    assert sum(a["cases"] for a in accuracy.values()) == 240


def test_bwd_overlap_rows_give_the_recorded_summary(bwd_ab):
    for pass_ in hr.BWD_PASSES:
        rows = hr.bwd_overlap_rows(bwd_ab, pass_)
        assert len(rows) == sum(t is not None for v in bwd_ab["speed"]["tflops"][pass_].values() for t in v)
        assert hr.fa4_speed_summary(rows) == bwd_ab["summary"]["speed"][pass_]
    with pytest.raises(ValueError, match="pass_ must be one of .*got 'fwd'"):
        hr.bwd_overlap_rows(bwd_ab, "fwd")


def test_bwd_overlap_summary_table_shows_the_recorded_numbers(bwd_ab):
    text = hr.bwd_overlap_summary_table(bwd_ab)
    assert text.splitlines()[0] == hr.provenance(bwd_ab)
    assert "persistent, persistent_overlap timed at N = 1024 only" in text
    speed = bwd_ab["summary"]["speed"]
    for name in speed["bwd"]:
        if name.startswith(hr.FA4_CUDNN):
            continue
        _, d, config = name.split("/")
        parts = _bwd_line(text, d, config).split("|")
        assert parts[0].split()[-1] == str(speed["bwd"][name]["cells"])
        for part, pass_ in zip(parts[1:], hr.BWD_PASSES):
            s = speed[pass_][name]
            assert part.split() == [f"{s[k]:.3f}" for k in ("median_x_cudnn", "min_x_cudnn", "median_x_baseline")]
    assert _bwd_line(text, "128", "persistent_overlap").split("|")[0].split()[2:5] == ["PERSISTENT", "+", "PIPELINE=1"]


def test_bwd_overlap_cell_table_divides_each_config_by_the_baseline_in_its_cell(bwd_ab):
    for pass_ in hr.BWD_PASSES:
        cells = hr.fa4_cells(hr.bwd_overlap_rows(bwd_ab, pass_))
        body = hr.bwd_overlap_cell_table(bwd_ab, pass_).splitlines()[4:]
        assert len(body) == len(bwd_ab["speed"]["cells"])
        others = [c for c in bwd_ab["meta"]["configs"] if c != "baseline"]
        for (dtype, d, n, causal), line in zip(bwd_ab["speed"]["cells"], body):
            base = cells[(f"bwd/{d}/baseline", dtype, n, causal)]
            cudnn = cells[(f"sdpa_cudnn/{d}", dtype, n, causal)]
            assert line.split("|")[1].split() == [str(base), f"{base / cudnn:.3f}"]
            expected = [f"{cells[key] / base:.3f}" if (key := (f"bwd/{d}/{c}", dtype, n, causal)) in cells else "-"
                        for c in others]
            assert line.split("|")[2].split() == expected


def test_bwd_overlap_facts_table_holds_the_compiled_facts_and_the_checks(bwd_ab):
    import runpy
    from pathlib import Path

    text = hr.bwd_overlap_facts_table(bwd_ab)
    for name, facts in bwd_ab["compile"].items():
        _, d, config = name.split("/")
        parts = _bwd_line(text, d, config).split("|")
        assert parts[1].split()[:2] == [str(facts["spill_bytes"]), f"{facts['shared_bytes'] / 1024:.1f}"]
        assert "".join(parts[1].split()[2:]) == str(facts["dq_overlap"]).replace(" ", "")
        a = bwd_ab["summary"]["accuracy"][name]
        assert parts[2].split() == [f"{a['by_inputs'][k]['passed']}/{a['by_inputs'][k]['cases']}" for k in ("ordinary", "fuzz")]
        assert parts[3].split() == [f"{a[f'worst_{g}_x_sdpa']:.2f}" for g in hr.BWD_GRADS]
    # the table names the compiled kernel the tool keeps the facts of
    tool = runpy.run_path(str(Path(__file__).resolve().parents[1] / "tools" / "gluon_bwd_ablation.py"))
    dtype, causal, n = tool["FACTS_CASE"]
    assert (dtype, causal) == ("float16", True) and f"fp16 causal N = {n} one" in text


def test_bwd_overlap_tables_show_a_dash_where_nothing_was_measured(bwd_ab):
    import copy

    data = copy.deepcopy(bwd_ab)
    del data["summary"]["speed"]["fwd+bwd"]["bwd/64/overlap"]  # timed in one pass only
    del data["summary"]["accuracy"]["bwd/64/overlap"]  # its checks did not run
    data["compile"]["bwd/64/overlap"] = {"error": "CompilationError: out of resources"}
    summary = _bwd_line(hr.bwd_overlap_summary_table(data), "64", "overlap").split("|")
    assert summary[2].split() == ["-", "-", "-"] and summary[1].split() == ["0.832", "0.760", "0.974"]
    facts = _bwd_line(hr.bwd_overlap_facts_table(data), "64", "overlap").split("|")
    assert "CompilationError" in facts[1] and facts[2].split() == ["-", "-"] and facts[3].split() == ["-"] * 3


def test_bwd_overlap_missing_file_warns_and_gives_none(tmp_path):
    with pytest.warns(UserWarning, match=r"no recorded backward ablation at .*nothing.json: run tools/gluon_bwd_ablation.py"):
        assert hr.load_bwd_overlap(tmp_path / "nothing.json") is None


H100_REGISTERS_PER_SM = 65_536  # 32-bit registers, a 256 KB register file per SM (NVIDIA H100 whitepaper, 2022)


def _ch09_prose(cell_id: str) -> str:
    """A markdown cell of chapter 09 (solutions/), its whitespace collapsed to single spaces."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[1] / "solutions" / "09_flashattention3_hopper.ipynb")
                    .read_text(encoding="utf-8"))
    [cell] = [c for c in nb["cells"] if c.get("id") == cell_id]
    source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
    return " ".join(source.split())


def _pct_loss(ratio: float) -> str:
    """``1 - ratio`` as the prose writes a loss: one decimal, or none from 10% up."""
    loss = 100 * (1 - ratio)
    return f"{loss:.1f}" if loss < 10 else f"{loss:.0f}"


def test_chapter_09_quotes_the_backward_ablation_as_recorded(bwd_ab):
    """Every number section 8's backward prose quotes, recomputed from the record (and the H100's figures)."""
    import math
    import re
    import statistics

    from course_lib.platform import hardware

    h100 = hardware.get_gpu("H100 SXM")
    speed, compiled = bwd_ab["summary"]["speed"], bwd_ab["compile"]
    base = lambda d, p="bwd": speed[p][f"bwd/{d}/baseline"]  # noqa: E731
    ratio = lambda d, c, p="bwd": speed[p][f"bwd/{d}/{c}"]["median_x_baseline"]  # noqa: E731

    # the prediction: 0.3-0.6 µs of a step at today's median speed (d = 128, 5 products of 64 x 128 x d)
    prediction = _ch09_prose("c09-bo03")
    step_flop = 5 * 2 * 64 * 128 * 128
    today = statistics.median(r["tflops"] for r in hr.bwd_overlap_rows(bwd_ab, "bwd") if r["impl"] == "bwd/128/baseline")
    step_us = step_flop / (today / h100.sm_count * 1e12) * 1e6
    assert f"0.3–0.6 µs a step, {100 * 0.3 / step_us:.0f}–{100 * 0.6 / step_us:.0f}% of it" in prediction
    # one program per SM either way: two consumer warpgroups (128 threads each) at the registers setmaxnreg gives them
    for d in (128, 64):
        consumer_regs = max(int(x.split()[1]) for x in compiled[f"bwd/{d}/baseline"]["setmaxnreg"] if x.startswith("inc"))
        held = 2 * 128 * consumer_regs
        assert f"2 × 128 × {consumer_regs} = {held:,} of an SM's {H100_REGISTERS_PER_SM:,} registers" in prediction
        assert H100_REGISTERS_PER_SM / 2 < held <= H100_REGISTERS_PER_SM

    findings = _ch09_prose("c09-bo09")
    cases = sum(a["cases"] for a in bwd_ab["summary"]["accuracy"].values())
    assert f"{cases} of {cases} cases" in findings
    assert (f"loses {_pct_loss(ratio(128, 'overlap'))}% (d = 128) and {_pct_loss(ratio(64, 'overlap'))}% (d = 64) at the "
            f"median with both products") in findings
    assert f"{_pct_loss(ratio(128, 'overlap_st'))}% and {_pct_loss(ratio(64, 'overlap_st'))}% with `Sᵀ` alone" in findings
    # cell by cell: slower in all but one cell
    cells = hr.fa4_cells(hr.bwd_overlap_rows(bwd_ab, "bwd"))
    per_cell = {(c, dtype, d, n, causal): cells[(f"bwd/{d}/{c}", dtype, n, causal)] / cells[(f"bwd/{d}/baseline", dtype, n, causal)]
                for dtype, d, n, causal in bwd_ab["speed"]["cells"] for c in ("overlap", "overlap_st")}
    faster = {k: r for k, r in per_cell.items() if r >= 1}
    assert f"slower in {len(per_cell) - len(faster)} of the {len(per_cell)} cells" in findings
    [((_, _, d, n, causal), r)] = faster.items()
    assert f"the exception +{100 * (r - 1):.1f}% (d = {d}, N = {n // 1024}k, {'causal' if causal else 'not causal'})" in findings
    assert (f"from {base(128, 'fwd+bwd')['median_x_cudnn']:.3f}× cuDNN at the median to "
            f"{speed['fwd+bwd']['bwd/128/overlap']['median_x_cudnn']:.3f}×") in findings
    in_flight = {d: sorted({n for c in ("overlap", "overlap_st") for n in compiled[f"bwd/{d}/{c}"]["dq_overlap"] if n})
                 for d in (128, 64)}
    assert in_flight == {d: [d // 16, 2 * d // 16] for d in (128, 64)}  # Sᵀ's instructions, or Sᵀ's and dPᵀ's
    assert f"{in_flight[128][0]} or {in_flight[128][1]} `wgmma` instructions" in findings
    assert f"{in_flight[64][0]} or {in_flight[64][1]} at d = 64" in findings
    assert all(compiled[f"bwd/{d}/baseline"]["dq_overlap"] == [0, 0] for d in (128, 64))
    spills = {c: compiled[f"bwd/128/{c}"]["spill_bytes"] for c in ("overlap", "overlap_st", "baseline")}
    assert f"({spills['overlap']} and {spills['overlap_st']} bytes against {spills['baseline']})" in findings
    assert all(compiled[f"bwd/64/{c}"]["spill_bytes"] == 0 for c in bwd_ab["meta"]["configs"])
    gap = max(abs(ratio(d, "overlap") - ratio(d, "overlap_st")) for d in (128, 64))
    assert f"within {100 * gap:.1f}% of `Sᵀ` alone" in findings
    assert f"`dQ_i` ({64 * 128 * 4 // 1024} KiB a step at d = 128)" in findings
    assert (f"loses {_pct_loss(ratio(128, 'persistent'))}% (d = 128) and {_pct_loss(ratio(64, 'persistent'))}% (d = 64) "
            "at the median of its two cells") in findings
    persistent_128 = [cells[("bwd/128/persistent", "bfloat16", 1024, causal)]
                      / cells[("bwd/128/baseline", "bfloat16", 1024, causal)] for causal in (False, True)]
    assert f"{persistent_128[0]:.3f} of the baseline without the mask, {persistent_128[1]:.3f} with it" in findings
    batch, heads = bench.problem_shape(1024, 128)
    items = batch * heads * 1024 // 128  # (128-key tile, batch·head) items at N = 1k
    per_program = items / h100.sm_count
    assert (f"{items:,} items over {h100.sm_count} programs is {math.floor(per_program)} or {math.ceil(per_program)} each: "
            f"the fixed share costs at most {math.ceil(per_program) / per_program - 1:.0%} there, not "
            f"{_pct_loss(persistent_128[0])}%") in findings

    persistent = sorted(round(100 * (1 - ratio(d, "persistent"))) for d in (128, 64))
    assert f"lost {persistent[0]}–{persistent[1]}% there" in _ch09_prose("c09-fa19")
    overlap = sorted(100 * (1 - ratio(d, c)) for d in (128, 64) for c in ("overlap", "overlap_st"))
    summary = re.search(r"\(−([\d.]+)% to −([\d.]+)% and −(\d+)% to −(\d+)% at the median\)", _ch09_prose("c09-052"))
    assert summary, "the summary no longer quotes the backward's two switches"
    assert summary.groups() == (f"{overlap[0]:.1f}", f"{overlap[-1]:.1f}", *map(str, persistent))
