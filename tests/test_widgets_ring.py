"""The ring stepper widget, driven without a browser (chapter 11)."""

from __future__ import annotations

import numpy as np
import pytest
from numpy import logaddexp

from course_lib.widgets import ring as wr
from course_lib.widgets._display import FIGSIZE

pytestmark = pytest.mark.ch11


def test_starts_empty_and_steps_to_the_causal_mask():
    w = wr.RingStepper(world=3, layout="contiguous", causal=True)
    assert w.steps_done == 0 and not w.computed().any() and w.in_flight() == []
    assert w.running_state() == [(-np.inf, 0.0)] * 3
    assert tuple(w.fig.get_size_inches()) == FIGSIZE and w.image.value[:4] == b"\x89PNG"
    png = w.image.value
    w.next_button.click()
    assert w.steps_done == 1 and w.held() == [0, 1, 2]  # step 0: every rank its own shard
    assert w.in_flight() == [(0, 1, 0), (1, 2, 1), (2, 0, 2)]
    assert w.image.value != png and "Step 1 of 3" in w.status.value
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
