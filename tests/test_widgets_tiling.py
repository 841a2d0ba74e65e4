"""The tiling simulator, driven without a browser."""

from __future__ import annotations

import time

import numpy as np
import pytest

from course_lib.attention import iomodel
from course_lib.teaching.widgets._display import LABEL_WIDTH
from course_lib.teaching.widgets.tiling import (CURRENT, DEFAULT_PLAY_SPEED, DONE, IO_HEADROOM, ORDERS,
                                      PLAY_SPEEDS, RESIDENT, SKIPPED, TODO, TilingSimulator)

pytestmark = pytest.mark.ch04

STEP_TIME_LIMIT_S = 3.0  # generous: a step at 64 × 64 tiles takes ~0.1-0.3 s on a laptop CPU


@pytest.fixture
def sim():
    return TilingSimulator(seq_len=200, block_m=48, block_n=32, head_dim=64, order="fa2",
                           causal=False)


def test_initial_state(sim):
    assert sim.shape == (5, 7)
    assert sim.position == 0 and sim.counts() == (0, 0, 0)
    assert (sim.grid_image.get_array() == TODO).all()
    assert sim.image.value[:4] == b"\x89PNG"


def test_step_marks_current_then_done(sim):
    sim.step()
    grid = np.asarray(sim.grid_image.get_array())
    assert grid[0, 0] == CURRENT and (grid.ravel()[1:] == TODO).all()
    assert sim.resident_blocks() == (0, 0)
    q_strip, kv_strip = sim.strip_states()
    assert q_strip[0] == RESIDENT and kv_strip[0] == RESIDENT
    sim.step()
    grid = np.asarray(sim.grid_image.get_array())
    assert grid[0, 0] == DONE and grid[0, 1] == CURRENT
    reads, writes, flops = sim.counts()
    assert reads == 48 * 64 + 2 * 32 * 2 * 64 and writes == 0 and flops > 0
    assert sim.io_bars[0].get_width() == reads
    assert "Step 2" in sim.status.value


def test_step_button_play_and_reset(sim):
    sim.step_button.click()
    assert sim.position == 1
    sim.play.value = 10
    assert sim.position == 10
    sim.reset_button.click()
    assert sim.position == 0 and sim.play.value == 0


def test_run_to_end_matches_the_formula(sim):
    sim.play.value = sim.play.max
    assert sim.done and sim.step_button.disabled
    total = iomodel.fa2_io(200, 200, 64, 48, 32)
    assert sim.counts() == (total.reads, total.writes, total.flops)
    assert (sim.grid_state() == DONE).all()
    sim.step()  # a step past the end does nothing
    assert sim.done


def test_every_control_changes_the_state(sim):
    sim.seq_len.value = 264
    assert sim.shape == (6, 9) and sim.position == 0
    sim.block_m.value = 64
    assert sim.shape == (5, 9)
    sim.block_n.value = 64
    assert sim.shape == (5, 5)
    before = sim.total
    sim.head_dim.value = 128
    assert sim.total.reads > before.reads
    sim.order.value = "fa1"
    sim.step()
    assert sim.resident_blocks() == (0, 0) and sim.counts()[1] > 0  # FA1 initialised o, l, m
    assert sim.total == iomodel.fa1_io(264, 264, 128, 64, 64)
    sim.causal.value = True
    sim.play.value = sim.play.max
    grid = sim.grid_state()
    assert (grid == SKIPPED).sum() == iomodel.causal_skip_grid(264, 264, 64, 64).sum() > 0
    assert sim.standard == iomodel.standard_io(264, 264, 128)


def test_standard_attention_reference_marks(sim):
    segments = sim.standard_marks.get_segments()  # one vertical tick per row
    assert [seg[0, 0] for seg in segments] == [sim.standard.reads, sim.standard.writes]
    assert all(seg[0, 0] == seg[1, 0] for seg in segments)
    # the legend shows a small tick for it, not the plotted artist (which drew a giant marker)
    assert "standard attention total" in [t.get_text() for t in sim.ax_io.get_legend().get_texts()]


def test_traffic_bars_are_linear_so_progress_reads_honestly(sim):
    assert sim.ax_io.get_xscale() == "linear"
    assert sim.ax_io.get_xlim()[0] == 0
    assert sim.io_bars[0].get_width() == 0  # nothing read yet: an empty bar, not a stand-in 1
    sim.play.value = 10
    reads = sim.counts()[0]
    share = sim.io_bars[0].get_width() / sim.ax_io.get_xlim()[1]
    assert share == pytest.approx(reads / (IO_HEADROOM * max(sim.standard.reads, sim.total.reads)))
    assert sim.io_texts[0].get_text().startswith(f"{reads / 1e3:.3g} k of ")


@pytest.mark.parametrize("order", ["fa2", "fa1"])
@pytest.mark.parametrize("n, block_m, block_n", [(200, 48, 32), (1000, 64, 48), (256, 64, 64)])
def test_tiles_are_drawn_with_their_real_size(order, n, block_m, block_n):
    """A ragged last tile is drawn as wide (tall) as the rows it really holds, read from the mesh."""
    sim = TilingSimulator(seq_len=n, block_m=block_m, block_n=block_n, order=order, causal=True)
    heights, widths = sim.tile_rectangles()
    t_r, t_c = sim.shape
    assert list(heights) == [iomodel.block_rows(i, n, block_m) for i in range(t_r)]
    assert list(widths) == [iomodel.block_rows(j, n, block_n) for j in range(t_c)]
    assert heights.sum() == widths.sum() == n  # the tiles cover the N × N matrix exactly
    assert sim.ax_grid.get_xlim() == (0, n) and sim.ax_grid.get_ylim() == (n, 0)
    if n % block_n:
        assert widths[-1] < block_n
    # the strips beside the grid line up with its tiles
    assert np.array_equal(sim.q_image.get_coordinates()[:, 0, 1], sim.grid_image.get_coordinates()[:, 0, 1])
    assert np.array_equal(sim.kv_image.get_coordinates()[0, :, 0], sim.grid_image.get_coordinates()[0, :, 0])


def _suggested_experiment(order="fa2"):
    """Section 9's suggestion: large N with small tiles (64 × 64 tiles), causal, and Play."""
    return TilingSimulator(seq_len=1024, block_m=16, block_n=16, order=order, causal=True)


@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_skipped_tiles_cost_no_step(order, monkeypatch):
    sim = _suggested_experiment(order)
    monkeypatch.setattr(sim, "_render", lambda: None)  # 2k steps: skip the PNGs, keep the data
    kinds = [e.kind for e in iomodel.tile_events(1024, 1024, 64, 16, 16, True, order)]
    skips = kinds.count("skip")
    assert skips == iomodel.causal_skip_grid(1024, 1024, 16, 16).sum() > 0
    assert sim.n_events == len(kinds) and sim.n_steps == len(kinds) - skips
    assert sim.play.max == sim.n_steps
    steps = 0
    while not sim.done:  # Step from start to end: every press shows a tile computed or an output stored
        sim.step()
        steps += 1
        assert sim.current_event().kind != "skip"
    assert steps == sim.n_steps
    assert (sim.grid_state() == SKIPPED).sum() == skips and (sim.grid_state() == TODO).sum() == 0
    assert "Step %d / %d" % (steps, steps) in sim.status.value


def test_a_step_says_which_hidden_tiles_it_passed(sim):
    sim.causal.value = True  # 200 × 200, tiles 48 × 32: Q block 0 sees K/V blocks 0 and 1 only
    sim.step(), sim.step()
    assert sim.grid_state()[0, 2:].tolist() == [TODO] * 5
    sim.step()  # passes K/V blocks 2..6 of Q block 0, then stores its output
    assert sim.current_event().kind == "store"
    assert sim.grid_state()[0, 2:].tolist() == [SKIPPED] * 5
    assert "5 tiles skipped" in sim.status.value and "no step spent" in sim.status.value


def test_play_speed_control(monkeypatch):
    sim = _suggested_experiment()
    monkeypatch.setattr(sim, "_render", lambda: None)  # frames' data only, no PNGs
    assert sim.speed.value == DEFAULT_PLAY_SPEED == (sim.play.interval, sim.play.step)
    seconds = {label: sim.n_steps / step * interval / 1000 for label, (interval, step) in PLAY_SPEEDS}
    print({label: f"{t:.0f} s" for label, t in seconds.items()})
    # before: one Play frame of 0.25 s per event, skipped tiles included
    assert sim.n_events * 0.25 > 1000 and seconds[PLAY_SPEEDS[1][0]] < 0.55 * sim.n_events * 0.25
    assert min(seconds.values()) < 15  # the fastest setting plays 64 × 64 causal tiles in seconds
    label, (interval, step) = PLAY_SPEEDS[-1]
    sim.speed.value = (interval, step)
    assert (sim.play.interval, sim.play.step) == (interval, step)
    # what the browser's Play does: add `step` while the result stays ≤ max, then stop playing
    sim.play.playing = True
    while sim.play.value + sim.play.step <= sim.play.max:
        sim.play.value += sim.play.step
    assert sim.play.max - sim.play.value < step
    sim.play.playing = False
    assert sim.done and sim.play.value == sim.play.max  # the last partial frame is not lost


def test_pausing_play_keeps_the_position(sim):
    sim.play.playing = True
    sim.play.value = 5
    sim.play.playing = False
    assert sim.position == 5 and not sim.done


def test_labelled_controls_share_one_label_width_and_fit(sim):
    labelled = [sim.seq_len, sim.block_m, sim.block_n, sim.head_dim, sim.order, sim.speed]
    assert {c.style.description_width for c in labelled} == {LABEL_WIDTH}
    # the longest description at ~7.5 px a character (13 px sans-serif) fits its label
    longest = max(len(c.description) for c in labelled)
    assert longest * 7.5 < int(LABEL_WIDTH.removesuffix("px"))
    assert all(len(label) <= 16 for label, _ in ORDERS)  # loop-order buttons: no ellipsis


def test_step_is_fast_at_64_by_64_tiles():
    sim = TilingSimulator(seq_len=1024, block_m=16, block_n=16)
    assert sim.shape == (64, 64)
    start = time.perf_counter()
    steps = 5
    for _ in range(steps):
        sim.step()
    per_step = (time.perf_counter() - start) / steps
    print(f"one step at 64 x 64 tiles: {per_step * 1e3:.0f} ms")
    assert per_step < STEP_TIME_LIMIT_S
    start = time.perf_counter()
    sim.play.value = 3000  # a jump replays 3000 events at once
    print(f"jump to event 3000: {(time.perf_counter() - start) * 1e3:.0f} ms")
    assert sim.position == 3000
