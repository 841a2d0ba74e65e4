"""The memory-vs-N widget, driven without a browser: set controls, read the plotted data."""

import numpy as np
import pytest

from course_lib.attention import costmodel
from course_lib.platform.hardware import GPUS
from course_lib.teaching.widgets._display import FIGSIZE, LABEL_WIDTH
from course_lib.teaching.widgets.memory import MemoryWidget, format_tick

pytestmark = pytest.mark.ch01


@pytest.fixture
def w():
    return MemoryWidget(seq_len=4096, head_dim=64, heads=16, batch=1, dtype="float16",
                        gpu="A100 80GB")


def test_plotted_terms_match_the_cost_model(w):
    n, quadratic = w.lines["quadratic"].get_data()
    _, linear = w.lines["linear"].get_data()
    i = len(n) // 2
    m = costmodel.attention_memory(int(n[i]), 64, "float16", heads=16)
    assert quadratic[i] == m.score_bytes and linear[i] == m.linear_bytes
    # log-log slopes: 2 for the N×N term, 1 for Q, K, V, O
    slope = lambda y: np.polyfit(np.log(n), np.log(y), 1)[0]
    assert slope(quadratic) == pytest.approx(2, abs=0.02)
    assert slope(linear) == pytest.approx(1, abs=0.02)
    assert w.ax.get_xscale() == "log" and w.ax.get_yscale() == "log"
    assert tuple(w.fig.get_size_inches()) == FIGSIZE
    assert w.image.value[:4] == b"\x89PNG"


def test_gpu_line_and_limit_follow_the_gpu(w):
    assert w.lines["gpu"].get_ydata()[0] == GPUS["A100 80GB"].memory_bytes
    n80 = w.max_n
    assert w.lines["limit"].get_xdata()[0] == n80
    w.gpu.value = "RTX 4090"
    assert w.lines["gpu"].get_ydata()[0] == GPUS["RTX 4090"].memory_bytes
    assert w.max_n < n80
    assert "RTX 4090" in w.ax.get_title()


def test_more_heads_run_out_sooner_and_the_summary_says_so(w):
    before = w.max_n
    w.heads.value = 64
    assert w.max_n < before
    assert w.max_n == costmodel.max_seq_len(GPUS["A100 80GB"].memory_bytes, 64, "float16", heads=64)
    w.seq_len.value = 2**18
    assert "does not fit" in w.summary.value
    w.seq_len.value = 1024
    assert "fits in" in w.summary.value and "does not" not in w.summary.value


def test_current_point_and_dtype(w):
    w.seq_len.value = 8192
    x, y = w.lines["current"].get_data()
    assert x[0] == 8192 and y[0] == w.memory.total_bytes
    fp16 = w.memory.total_bytes
    w.dtype.value = "float32"
    assert w.memory.total_bytes == 2 * fp16
    w.batch.value = 3
    assert w.memory.total_bytes == 6 * fp16


def test_controls_are_labelled(w):
    for control in w.controls:
        assert control.description
    assert w.widget() is not None


def test_sliders_share_one_label_width_and_read_out_like_the_summary(w):
    sliders = w.controls[:4]
    assert {c.style.description_width for c in sliders} == {LABEL_WIDTH}
    w.seq_len.value = 8192
    assert w.seq_len.label == "8,192" and w.seq_len.value == 8192  # read-out as in the summary
    assert "N = 8,192" in w.summary.value
    assert w.heads.readout_format == w.batch.readout_format == ",d"


@pytest.mark.parametrize("heads, gpu", [(16, "A100 80GB"), (19, "A100 80GB"), (86, "H100 SXM"),
                                        (1, "RTX 4090"), (128, "H200")])
def test_y_axis_ends_on_ticks_so_the_lowest_label_stays(w, heads, gpu):
    w.heads.value = heads
    w.gpu.value = gpu
    low, high = w.ax.get_ylim()
    ticks = [t for t in w.ax.get_yticks() if low <= t <= high]
    assert ticks[0] == low and ticks[-1] == high  # both ends carry a labelled tick
    assert len(ticks) >= 3
    _, linear = w.lines["linear"].get_data()
    assert low <= linear.min()  # and the curves stay inside
    assert format_tick(2.0**30) == "1 GiB"


def test_title_reads_naturally(w):
    w.heads.value = 19
    assert w.ax.get_title().startswith("batch 1 × 19 heads, d = 64, float16")
    w.heads.value = 1
    assert w.ax.get_title().startswith("batch 1 × 1 head, ")


def test_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        MemoryWidget(seq_len=1000)
    with pytest.raises(ValueError, match="gpu"):
        MemoryWidget(gpu="TPU")
