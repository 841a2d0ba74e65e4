"""Chapter 09's recorded H100 results: the file is there, complete, and read the way the notebook
says (ablation steps, two-stage gain, FP8 speed and accuracy, compiler resources)."""

from __future__ import annotations

import pytest

from course_lib import decoding, hopper_results as hr

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
    data = decoding.load_recorded_bench()
    text = decoding.format_recorded_bench(data)
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
