"""The widgets under the oldest ipywidgets the course supports (7.7.1: Google Colab's widget
frontend runs ipywidgets 7) as well as under the pinned 8.1.9. ``make test-oldest`` runs this file
with ipywidgets 7.7.1; ``make test`` with 8.1.9."""

from __future__ import annotations

import ipywidgets
import pytest

from course_lib.platform import versions
from course_lib.teaching.widgets.tiling import PLAY_SPEEDS, TilingSimulator, playing_trait

pytestmark = pytest.mark.ch04


def test_play_trait_is_the_one_this_ipywidgets_syncs():
    play = ipywidgets.Play()
    name = playing_trait(play)
    assert play.has_trait(name) and play.trait_metadata(name, "sync")
    assert name == ("playing" if int(ipywidgets.__version__.split(".")[0]) >= 8 else "_playing")


def test_play_finishes_the_last_partial_frame_on_this_ipywidgets(monkeypatch):
    """What the browser's Play does, through the trait this ipywidgets version has: add ``step``
    while the value stays within max, stop playing; the steps left over are run when it stops."""
    sim = TilingSimulator(seq_len=256, block_m=16, block_n=16, causal=True)
    monkeypatch.setattr(sim, "_render", lambda: None)  # frames' data only, no PNGs
    label, (interval, step) = PLAY_SPEEDS[-1]
    sim.speed.value = (interval, step)
    trait = playing_trait(sim.play)
    setattr(sim.play, trait, True)
    while sim.play.value + sim.play.step <= sim.play.max:
        sim.play.value += sim.play.step
    assert 0 < sim.play.max - sim.play.value < step and not sim.done  # a partial frame is left
    setattr(sim.play, trait, False)
    assert sim.done and sim.play.value == sim.play.max


def test_installed_ipywidgets_is_within_the_supported_range():
    installed = tuple(int(p) for p in ipywidgets.__version__.split(".")[:3])
    oldest = tuple(int(p) for p in versions.MINIMUM["ipywidgets"].split("."))
    assert installed >= oldest, f"ipywidgets {ipywidgets.__version__} is older than {oldest}"
