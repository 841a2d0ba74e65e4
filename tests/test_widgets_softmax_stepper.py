"""The online-softmax stepper widget, driven without a browser (chapter 03)."""

from __future__ import annotations

import numpy as np
import pytest

from course_lib.attention.softmax import safe_softmax
from course_lib.teaching.widgets import softmax_stepper as ws
from course_lib.teaching.widgets._display import FIGSIZE

pytestmark = pytest.mark.ch03


@pytest.fixture
def stepper():
    return ws.SoftmaxStepper(preset=ws.READING_ROW, block_size=2)


def bar_heights(ax):
    return np.array([p.get_height() for p in ax.patches])


def plotted_lines(ax):
    return {line.get_label(): np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()}


def test_starts_empty_with_labelled_controls(stepper):
    assert stepper.tiles_done == 0 and stepper.n_tiles == 2
    assert stepper.m == -np.inf and stepper.l == 0.0
    assert np.all(bar_heights(stepper.ax_weights) == 0)
    assert "empty state" in stepper.status.value
    for control in (stepper.preset, stepper.block_slider, stepper.next_button,
                    stepper.reset_button, stepper.new_row_button):
        assert control.description
    assert tuple(stepper.fig.get_size_inches()) == FIGSIZE
    assert stepper.image.value[:4] == b"\x89PNG"


def test_next_tile_updates_state_and_plots(stepper):
    png_before = stepper.image.value
    stepper.next_button.click()
    assert stepper.tiles_done == 1
    assert stepper.m == 2.0
    assert stepper.l == pytest.approx(np.exp(-1.0) + 1.0)
    heights = bar_heights(stepper.ax_weights)
    np.testing.assert_allclose(heights[:2], [np.exp(-1.0) / stepper.l, 1.0 / stepper.l])
    assert np.all(heights[2:] == 0)
    assert stepper.image.value != png_before
    assert "Tile 1 of 2" in stepper.status.value

    stepper.next_button.click()
    assert stepper.done and stepper.next_button.disabled
    assert round(stepper.l, 3) == 1.741
    np.testing.assert_allclose(bar_heights(stepper.ax_weights), safe_softmax(stepper.row))
    lines = plotted_lines(stepper.ax_state)
    np.testing.assert_allclose(lines["running sum l"], [s.l_new for s in stepper.steps])
    assert lines["correction exp(m_old − m_new)"][1] == 1.0  # the max did not change
    assert "All tiles in" in stepper.status.value

    stepper.next_button.click()  # past the end: nothing happens
    assert stepper.tiles_done == 2


def test_reset_returns_to_empty_state(stepper):
    stepper.step()
    stepper.reset_button.click()
    assert stepper.tiles_done == 0 and stepper.l == 0.0
    assert not stepper.next_button.disabled
    assert np.all(bar_heights(stepper.ax_weights) == 0)


def test_block_size_slider_changes_tiling_and_resets(stepper):
    stepper.step()
    stepper.block_slider.value = 3
    assert stepper.tiles_done == 0
    assert stepper.n_tiles == 2  # tiles of 3 and 1
    assert [(s.start, s.stop) for s in stepper.steps] == [(0, 3), (3, 4)]
    stepper.block_slider.value = 1
    assert stepper.n_tiles == 4


def test_correction_shown_when_max_grows():
    stepper = ws.SoftmaxStepper(preset=ws.RISING, block_size=3)
    stepper.step()
    stepper.step()
    s = stepper.steps[1]
    assert s.m_new > s.m_old
    correction = plotted_lines(stepper.ax_state)["correction exp(m_old − m_new)"]
    assert correction[1] == pytest.approx(np.exp(s.m_old - s.m_new))
    assert correction[1] < 1
    assert f"{s.correction:.4f}" in stepper.status.value


def test_weights_match_softmax_after_last_tile_for_every_preset_and_block_size():
    stepper = ws.SoftmaxStepper()
    for preset in ws.PRESETS:
        stepper.preset.value = preset
        for block_size in (1, 5):  # one score at a time; a ragged tiling (5 divides no row)
            stepper.block_slider.value = min(block_size, stepper.block_slider.max)
            stepper.run_to_end()
            w = stepper.current_weights()
            assert np.isfinite(w).all(), preset
            np.testing.assert_allclose(w, safe_softmax(stepper.row), rtol=1e-12, atol=1e-15)


def test_row_choice_and_new_random_row():
    stepper = ws.SoftmaxStepper(preset=ws.READING_ROW, block_size=4)
    stepper.preset.value = ws.READING_SCORES
    np.testing.assert_array_equal(stepper.row, [2.0, 5.0, 3.0])
    assert stepper.block_slider.max == 3 and stepper.block_slider.value == 3  # clamped
    stepper.new_row_button.click()
    assert stepper.preset.value == ws.RANDOM
    first = stepper.row.copy()
    assert len(first) == ws.RANDOM_LENGTH
    stepper.step()
    stepper.new_row_button.click()
    assert not np.array_equal(first, stepper.row)
    assert stepper.tiles_done == 0


def test_large_logits_row_stays_finite():
    stepper = ws.SoftmaxStepper(preset=ws.LARGE, block_size=5)
    stepper.run_to_end()
    assert stepper.m > ws.LARGE_LOGIT - 10
    assert np.isfinite(stepper.l)
    low, high = stepper.ax_scores.get_ylim()
    assert low > 0  # bars start near the scores, not at 0
    assert high > stepper.row.max()


def test_custom_row_and_bad_arguments():
    stepper = ws.SoftmaxStepper(row=[0.0, 1.0, -np.inf, 2.0], block_size=2)
    stepper.run_to_end()
    assert stepper.current_weights()[2] == 0.0
    with pytest.raises(ValueError, match="row must be a non-empty 1-D"):
        stepper.set_row([[1.0, 2.0]])
    with pytest.raises(ValueError, match="preset must be one of"):
        ws.SoftmaxStepper(preset="nope")


def test_block_size_reaches_n_on_every_row():
    """From the first row (4 scores) to every other: the slider on the page spans 1..N, and
    block size N reads the whole row as one tile."""
    stepper = ws.SoftmaxStepper()  # starts on the reading's 4-score row
    for preset in (*ws.PRESETS, ws.READING_ROW):
        stepper.preset.value = preset
        n = len(stepper.row)
        slider = stepper.block_slider
        assert stepper._slider_box.children[0] is slider, "the slider shown is not the one in use"
        assert (slider.min, slider.max) == (1, n), preset
        slider.value = n
        assert stepper.block_size == n and stepper.n_tiles == 1
        stepper.step()
        np.testing.assert_allclose(stepper.current_weights(), safe_softmax(stepper.row), rtol=1e-12)
    assert any(len(ws.preset_row(p)) == ws.RANDOM_LENGTH == 12 for p in ws.PRESETS)


def test_a_new_row_length_gets_a_fresh_slider_and_keeps_working():
    """JupyterLab's slider keeps the range it was first drawn with for its End key and drags, so a
    row of another length gets a new slider; the old one is closed and no longer drives the widget."""
    stepper = ws.SoftmaxStepper(preset=ws.READING_ROW, block_size=2)
    old = stepper.block_slider
    stepper.preset.value = ws.RANDOM
    assert stepper.block_slider is not old and old.comm is None  # closed
    assert stepper.block_slider.value == 2  # the block size carried over
    same = stepper.block_slider
    stepper.new_row_button.click()  # same length: the same slider
    assert stepper.block_slider is same
    stepper.block_slider.value = 5
    assert stepper.n_tiles == 3 and stepper.tiles_done == 0
