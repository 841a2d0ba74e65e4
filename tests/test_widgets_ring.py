"""The ring stepper widget, driven without a browser (chapter 11)."""

from __future__ import annotations

import numpy as np
import pytest
from numpy import logaddexp

from course_lib.teaching.widgets import ring as wr
from course_lib.teaching.widgets._display import FIGSIZE

pytestmark = pytest.mark.ch11


def test_starts_empty_and_steps_to_the_causal_mask():
    w = wr.RingStepper(world=3, layout="contiguous", causal=True)
    assert w.steps_done == 0 and not w.computed().any() and w.in_flight() == []
    assert "Before step 0 (steps 0 to 2)" in w.status.value
    assert w.running_state() == [(-np.inf, 0.0)] * 3
    assert tuple(w.fig.get_size_inches()) == FIGSIZE and w.image.value[:4] == b"\x89PNG"
    png = w.image.value
    w.next_button.click()
    assert w.steps_done == 1 and w.held() == [0, 1, 2]  # step 0: every rank its own shard
    assert w.in_flight() == [(0, 1, 0), (1, 2, 1), (2, 0, 2)]
    assert w.image.value != png and "Step 0 done (steps 0 to 2)" in w.status.value
    w.next_button.click()
    assert w.held() == [2, 0, 1]
    w.next_button.click()
    assert w.done and w.next_button.disabled and w.in_flight() == []
    np.testing.assert_array_equal(w.computed(), np.tril(np.ones((w.n, w.n), dtype=bool)))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
def test_final_state_is_the_rows_log_sum_exp(layout, causal):
    w = wr.RingStepper(world=4, layout=layout, causal=causal, seed=3)
    w.run_to_end()
    for r, (m, l) in enumerate(w.running_state()):
        row = w.positions(r)[-1]
        visible = w.scores[row, : row + 1] if causal else w.scores[row]
        assert m + np.log(l) == pytest.approx(logaddexp.reduce(visible), rel=1e-12)


def test_zigzag_shards_and_controls_reset():
    w = wr.RingStepper(world=2, layout="zigzag")
    np.testing.assert_array_equal(w.positions(0), [0, 1, 6, 7])
    w.step()
    w.world_slider.value = 4
    assert w.steps_done == 0 and w.n == 16
    w.layout_buttons.value = "contiguous"
    np.testing.assert_array_equal(w.positions(1), [4, 5, 6, 7])
    w.step()
    w.reset_button.click()
    assert w.steps_done == 0
    w.causal_box.value = False
    w.run_to_end()
    assert w.computed().all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="layout must be one of"):
        wr.RingStepper(layout="striped")
    with pytest.raises(ValueError, match="world must be an int from 2 to 8"):
        wr.RingStepper(world=1)


def test_every_rank_has_its_own_colour_and_none_is_the_not_yet_grey():
    """Rank 7 was drawn in tab10's grey, the colour of "later steps"."""
    from matplotlib.colors import to_rgba

    w = wr.RingStepper(world=wr.MAX_WORLD, layout="contiguous", causal=False)
    w.run_to_end()
    image = w.ax_grid.images[0].get_array()  # (N, N, 4)
    colours = [tuple(image[w.positions(r)[0], 0]) for r in range(w.world)]
    assert len(set(colours)) == w.world
    assert all(c[0] != c[1] or c[1] != c[2] for c in colours)  # no grey
    assert to_rgba(wr.NOT_YET_GREY) not in colours


def test_idle_ranks_say_so():
    """Contiguous and causal, rank 0 sees nothing of the shards that reach it after step 0."""
    w = wr.RingStepper(world=3, layout="contiguous", causal=True)
    w.step()
    w.step()
    assert w.idle() == [True, False, False]
    labels = {t.get_gid(): t.get_text() for t in w.ax_ring.texts if t.get_gid()}
    assert labels["label 0"] == "chunks 0\nholds K/V 2, idle (masked)"
    assert labels["label 1"] == "chunks 1\nused K/V 0"


@pytest.mark.parametrize("world", range(2, wr.MAX_WORLD + 1))
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_labels_stay_in_the_figure_and_off_the_ranks(world, layout):
    """No text is clipped by the figure's edge and no label covers a rank's circle."""
    import numpy as np

    w = wr.RingStepper(world=world, layout=layout, causal=True)
    w.step()
    renderer = w.fig.canvas.get_renderer()
    w.fig.canvas.draw()
    figure = w.fig.bbox
    texts = [t for ax in (w.ax_grid, w.ax_ring) for t in
             (*ax.texts, ax.xaxis.label, ax.yaxis.label, ax.title)]
    for text in texts:
        box = text.get_window_extent(renderer)
        assert figure.x0 <= box.x0 and box.x1 <= figure.x1 and figure.y0 <= box.y0 \
            and box.y1 <= figure.y1, (text.get_text(), box, figure)
    radius = np.sqrt(wr.RANK_MARKER_SIZE) / 2 * w.fig.dpi / 72  # pixels
    centres = [w.ax_ring.transData.transform(c.get_offsets()[0]) for c in w.ax_ring.collections]
    assert len(centres) == world
    for text in (t for t in w.ax_ring.texts if t.get_gid()):  # labels and K/V in flight
        box = text.get_window_extent(renderer)
        for x, y in centres:
            nearest = np.clip(x, box.x0, box.x1), np.clip(y, box.y0, box.y1)
            assert np.hypot(x - nearest[0], y - nearest[1]) > radius, (text.get_text(), world)
