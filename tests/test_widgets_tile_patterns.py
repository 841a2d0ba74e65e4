"""The tile-pattern picker and the recorded mask results, driven without a browser; the recorded
file absent (today) and present (a fixture in tmp)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from course_lib import mask_results, masks
from course_lib.widgets.tile_patterns import PATTERNS, TilePatterns, pattern_classes

pytestmark = pytest.mark.ch10

META = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "triton": "3.6.0",
        "date": "2026-11-24"}


def _row(impl, pattern, density, n, ms, pass_="fwd"):
    return {"impl": impl, "pattern": pattern, "density": density, "N": n, "pass": pass_, "ms": ms}


@pytest.fixture
def recorded_file(tmp_path):
    rows = [_row("ours", "full", 1.0, 4096, 2.0), _row("flex", "full", 1.0, 4096, 2.4),
            _row("ours", "causal", 0.504, 4096, 1.1), _row("flex", "causal", 0.504, 4096, 1.2),
            _row("ours", "random_block", 0.25, 4096, 0.55),
            _row("flex", "random_block", 0.25, 4096, 0.5),
            _row("ours", "causal", 0.504, 4096, 4.0, "fwd_bwd")]
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
    assert w.recorded["ms"] == 1.1
    assert "ours 1.1 ms, FlexAttention 1.2 ms" in w.summary.value
    w.seq_len.value = 8192
    assert w.recorded is None and "no H100 result recorded for this pattern" in w.summary.value


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
    assert mask_results.series(data, "ours", 4096) == [(0.25, 0.55), (0.504, 1.1), (1.0, 2.0)]
    ratios = sorted(mask_results.speedups(data))
    assert ratios == pytest.approx(sorted([2.4 / 2.0, 1.2 / 1.1, 0.5 / 0.55]))
    assert mask_results.speedup_summary(data)["median"] == pytest.approx(1.2 / 1.1)
    assert mask_results.speedup_summary(data, "fwd_bwd") is None
    assert mask_results.time_for(data, "random_block", 4096, density=0.3)["ms"] == 0.55
    fig = mask_results.plot_density(data)
    ax = fig.axes[0]
    assert len(ax.lines) == 3  # ours, FlexAttention, the proportional line
    assert list(ax.lines[2].get_ydata()) == [0, 2.0]


@pytest.mark.parametrize("change, match", [
    (lambda d: d["meta"].pop("triton"), "lacks triton"),
    (lambda d: d["rows"][0].pop("ms"), r"rows'\]\[0\] lacks ms"),
    (lambda d: d["rows"][0].update(impl="fa3"), "impl'] must be one of"),
    (lambda d: d["rows"][0].update(pattern="diagonal"), "pattern'] must be one of"),
    (lambda d: d["rows"][0].update({"pass": "bwd"}), "pass'] must be"),
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
