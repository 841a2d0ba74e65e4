"""The tile-pattern picker and the recorded mask results, driven without a browser; the recorded
file absent (a path in tmp), present (a fixture in tmp, in tools/bench_masks.py's format) and the
committed H100 file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from course_lib.measure import mask_results
from course_lib.attention import masks
from course_lib.teaching.widgets.tile_patterns import (BENCH_PATTERNS, PATTERNS, TilePatterns,
                                                       pattern_classes)

pytestmark = pytest.mark.ch10

META = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "triton": "3.6.0",
        "date": "2026-11-24"}


def _row(impl, pattern, label, density, n, ms, pass_="fwd", dtype="float16"):
    return {"impl": impl, "dtype": dtype, "d": 128, "N": n, "pattern": pattern, "label": label,
            "param": None, "density": density, "tile_density": density, "pass": pass_, "ms": ms}


@pytest.fixture
def recorded_file(tmp_path):
    rows = [_row("course", "full", "full", 1.0, 4096, 2.0),
            _row("course_dense", "full", "full", 1.0, 4096, 1.6),
            _row("flex", "full", "full", 1.0, 4096, 2.4),
            _row("course", "causal", "causal", 0.5, 4096, 1.1),
            _row("flex", "causal", "causal", 0.5, 4096, 1.2),
            _row("fa2_varlen", "causal", "causal", 0.5, 4096, 1.5),
            _row("course", "random", "random 25% blocks", 0.25, 4096, 0.55),
            _row("flex", "random", "random 25% blocks", 0.25, 4096, 0.5),
            _row("course", "documents", "4 documents", 0.3, 4096, 0.9),
            _row("course_varlen", "documents", "4 documents", 0.3, 4096, 0.6),
            _row("fa2_varlen", "documents", "4 documents", 0.3, 4096, 0.9),
            _row("course", "causal", "causal", 0.5, 4096, 4.0, "fwd+bwd"),
            _row("flex", "causal", "causal", 0.5, 4096, 3.0, "fwd+bwd"),
            _row("course", "causal", "causal", 0.5, 4096, 9.0, dtype="bfloat16"),
            _row("flex", "causal", "causal", 0.5, 4096, 1.8, dtype="bfloat16")]
    path = tmp_path / "h100_masks.json"
    path.write_text(json.dumps({"meta": META, "rows": rows}))
    return path


@pytest.mark.parametrize("value", [v for _, v in PATTERNS])
def test_index_classes_match_the_brute_force_classes(value):
    """Small sizes: the classes from indices equal masks.classify_tiles of the element mask."""
    n, block = 200, 16
    classes = pattern_classes(value, n, block, window=40, documents=3, density=0.3)
    t = -(-n // block)
    if value == "full":
        mask = np.ones((n, n), dtype=bool)
    elif value == "causal":
        mask = np.tril(np.ones((n, n), dtype=bool))
    elif value == "sliding_window":
        mask = masks.sliding_window_mask(n, n, 40)
    elif value == "document":
        doc = np.minimum(np.arange(n) * 3 // n, 2)
        mask = (doc[:, None] == doc[None, :]) & np.tril(np.ones((n, n), dtype=bool))
    else:
        mask = masks.block_sparse_mask(classes == masks.FULL, n, n, block, block)
    assert classes.shape == (t, t)
    np.testing.assert_array_equal(classes, masks.classify_tiles(mask, block, block))


def test_unknown_pattern_and_bad_density_are_named():
    with pytest.raises(ValueError, match="pattern must be one of"):
        pattern_classes("diagonal", 128, 32)
    with pytest.raises(ValueError, match="density must be in"):
        pattern_classes("random_block", 128, 32, density=0.0)


def test_widget_counts_and_flops_follow_the_controls(tmp_path):
    w = TilePatterns(pattern="full", seq_len=4096, block=128, head_dim=64,
                     results_path=tmp_path / "absent.json")
    assert w.counts == {"skipped": 0, "partial": 0, "full": 1024, "total": 1024}
    assert w.flops["visited"] == w.flops["dense"] == 4 * 4096 * 4096 * 64
    w.pattern.value = "causal"
    assert w.counts["partial"] == 32 and w.density_visited == pytest.approx(528 / 1024)
    assert w.flops["visited"] == 528 * 4 * 128 * 128 * 64
    w.pattern.value = "sliding_window"
    assert w.window.layout.display == "" and w.documents.layout.display == "none"
    before = w.counts["skipped"]
    w.window.value = 256
    assert w.counts["skipped"] > before
    assert w.image.value[:4] == b"\x89PNG"
    assert "no H100 results are recorded yet" in w.summary.value


def test_widget_shows_the_recorded_time(recorded_file):
    w = TilePatterns(pattern="causal", seq_len=4096, results_path=recorded_file)
    assert w.recorded["ms"] == 1.1 and w.recorded["dtype"] == "float16"
    assert ("forward: ours 1.1 ms, FlexAttention 1.2 ms; forward + backward: ours 4 ms, "
            "FlexAttention 3 ms") in w.summary.value
    w.pattern.value = "random_block"  # the nearest recorded density is the only random cell
    assert w.recorded["label"] == "random 25% blocks" and "ours 0.55 ms" in w.summary.value
    w.pattern.value = "block_sparse"  # not in the benchmark
    assert w.recorded is None and "no H100 result recorded for this pattern" in w.summary.value
    w.pattern.value = "causal"
    w.seq_len.value = 8192
    assert w.recorded is None and "no H100 result recorded for this pattern" in w.summary.value


def test_committed_results_validate_and_cover_the_widget():
    """The committed H100 file (tools/bench_masks.py's output) validates, and every picker
    pattern that the benchmark measures finds recorded rows at each recorded length."""
    data = mask_results.load()
    assert "H100" in data["meta"]["gpu"]
    recorded_kinds = {row["pattern"] for row in data["rows"]}
    for _, value in PATTERNS:
        kind = BENCH_PATTERNS[value]
        if kind is None:
            assert value == "block_sparse"  # the one picker pattern the benchmark lacks
            continue
        assert kind in recorded_kinds
        for n in mask_results.lengths(data):
            w_rows = mask_results.rows_of(data, "course", "fwd", n=n, pattern=kind)
            assert w_rows, (value, n)
    w = TilePatterns(pattern="sliding_window", seq_len=mask_results.lengths(data)[0])
    assert w.recorded is not None and w.recorded["pattern"] == "window"
    assert "FlexAttention" in w.summary.value
    for pass_ in mask_results.PASSES:
        for baseline in mask_results.BASELINES:
            assert mask_results.speedup_summary(data, pass_, baseline)["n"] > 0


def test_results_absent_say_so(tmp_path):
    path = tmp_path / "h100_masks.json"
    assert mask_results.recorded(path) is None
    assert mask_results.status(path) == mask_results.NOT_RECORDED
    assert "No H100 results are recorded yet" in mask_results.NOT_RECORDED
    with pytest.raises(FileNotFoundError, match="h100_masks.json"):
        mask_results.load(path)


def test_results_present_are_read(recorded_file):
    data = mask_results.load(recorded_file)
    assert "H100" in mask_results.status(recorded_file) and "triton 3.6.0" in mask_results.status(
        recorded_file)
    assert mask_results.lengths(data) == [4096]
    assert mask_results.series(data, "course", 4096) == [(0.25, 0.55), (0.3, 0.9), (0.5, 1.1),
                                                         (1.0, 2.0)]
    assert mask_results.series(data, "course", 4096, dtype="bfloat16") == [(0.5, 9.0)]
    fwd16 = [2.4 / 2.0, 1.2 / 1.1, 0.5 / 0.55]
    assert sorted(mask_results.speedups(data, dtype="float16")) == pytest.approx(sorted(fwd16))
    assert sorted(mask_results.speedups(data)) == pytest.approx(sorted(fwd16 + [1.8 / 9.0]))
    summary = mask_results.speedup_summary(data)
    assert summary["n"] == 4 and summary["min"] == pytest.approx(0.2)
    assert summary["max"] == pytest.approx(1.2)
    assert mask_results.speedup_summary(data, "fwd+bwd")["median"] == pytest.approx(0.75)
    # against FA2 varlen, ours is the faster of the masked and the varlen kernel on each cell
    assert sorted(mask_results.speedups(data, baseline="fa2_varlen")) == pytest.approx(
        [1.5 / 1.1, 0.9 / 0.6])
    assert mask_results.speedup_summary(data, "fwd+bwd", "fa2_varlen") is None
    assert mask_results.time_for(data, "random", 4096, tile_density=0.3)["ms"] == 0.55
    assert mask_results.time_for(data, "window", 4096) is None
    props = {p["label"]: p for p in mask_results.proportionality(data)}
    assert props["causal"]["predicted_ms"] == pytest.approx(1.6 * 0.5)
    assert props["causal"]["ratio"] == pytest.approx(1.1 / 0.8)
    assert props["causal"]["ratio_own"] == pytest.approx(1.1 / 1.0)
    assert props["causal"]["ratio_tiles"] == pytest.approx(1.1 / (1.6 * props["causal"]["tile_density"]))
    assert "random 25% blocks" in mask_results.format_proportionality(data)
    assert mask_results.proportionality(data, "fwd+bwd") == []  # no full-mask row to scale
    fig = mask_results.plot_density(data)
    fwd, fwd_bwd = fig.axes
    assert len(fwd.lines) == 3  # ours, FlexAttention, the proportional line
    assert list(fwd.lines[2].get_ydata()) == [0, 1.6]
    assert len(fwd_bwd.lines) == 2 and "float16" in fwd.get_title()
    assert "torch 2.11.0+cu130" in fig.get_suptitle()


def test_bad_choices_are_named(recorded_file):
    data = mask_results.load(recorded_file)
    with pytest.raises(ValueError, match="baseline must be one of"):
        mask_results.speedups(data, baseline="sdpa")
    with pytest.raises(ValueError, match="pass_ must be one of"):
        mask_results.series(data, "course", 4096, "fwd_bwd")
    with pytest.raises(ValueError, match="impl must be one of"):
        mask_results.rows_of(data, "ours")
    with pytest.raises(ValueError, match="pattern must be one of"):
        mask_results.time_for(data, "sliding_window", 4096)
    with pytest.raises(ValueError, match="dtype must be one of"):
        mask_results.plot_density(data, dtype="float32")


@pytest.mark.parametrize("change, match", [
    (lambda d: d["meta"].pop("triton"), "lacks triton"),
    (lambda d: d["rows"][0].pop("ms"), r"rows'\]\[0\] lacks ms"),
    (lambda d: d["rows"][0].update(impl="ours"), "impl'] must be one of"),
    (lambda d: d["rows"][0].update(pattern="sliding_window"), "pattern'] must be one of"),
    (lambda d: d["rows"][0].update(dtype="float32"), "dtype'] must be one of"),
    (lambda d: d["rows"][0].update({"pass": "fwd_bwd"}), "pass'] must be one of"),
    (lambda d: d["rows"][0].update(tile_density=0), r"tile_density'\] must be in"),
    (lambda d: d["rows"][0].update(density=1.5), r"density'\] must be in"),
    (lambda d: d["rows"][0].update(ms=0), r"ms'\] must be a positive"),
    (lambda d: d.update(rows=[]), "non-empty list"),
])
def test_malformed_results_are_named(recorded_file, change, match):
    data = json.loads(recorded_file.read_text())
    change(data)
    with pytest.raises(ValueError, match=match):
        mask_results.validate(data)
    with pytest.raises(ValueError, match="'meta' dict"):
        mask_results.validate([])
