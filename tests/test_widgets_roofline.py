"""The arithmetic-intensity calculator and roofline, driven without a browser."""

import numpy as np
import pytest

from course_lib.attention import costmodel
from course_lib.platform.hardware import GPUS, TERA, balance_point
from course_lib.teaching.widgets._display import FIGSIZE
from course_lib.teaching.widgets.roofline import RooflineWidget, label_collides

pytestmark = pytest.mark.ch02


@pytest.fixture
def w():
    return RooflineWidget(seq_len=1024, head_dim=64, dtype="float16", gpu="A100 80GB")


def test_points_are_the_cost_model_on_the_roof(w):
    costs = costmodel.step_costs(1024, 64, "float16")
    for name in costmodel.STEPS:
        x, y = w.markers[name].get_data()
        assert x[0] == pytest.approx(costs[name].intensity)
        assert y[0] * TERA == pytest.approx(costmodel.attainable_flops(costs[name].intensity,
                                                                       "A100 80GB"))
    assert w.labels["softmax"].get_text() == "softmax: 1.25"
    assert w.labels["qk"].get_text() == "QKᵀ and PV: 56.9"  # one label for the shared point
    assert not w.labels["pv"].get_visible()
    assert tuple(w.fig.get_size_inches()) == FIGSIZE
    assert w.image.value[:4] == b"\x89PNG"


def test_memory_bound_steps_are_red_and_the_big_matmul_is_green(w):
    assert all(w.memory_bound[name] for name in costmodel.STEPS)
    assert not w.memory_bound["matmul"]
    assert w.markers["softmax"].get_color() == "tab:red"
    assert w.markers["matmul"].get_color() == "tab:green"
    assert w.balance == pytest.approx(balance_point("A100 80GB", "float16"))
    assert w.balance_line.get_xdata()[0] == pytest.approx(w.balance)


def test_roof_is_flat_at_peak(w):
    x, y = w.roof.get_data()
    assert max(y) == pytest.approx(GPUS["A100 80GB"].fp16_tflops)
    w.gpu.value = "H100 SXM"
    _, y = w.roof.get_data()
    assert max(y) == pytest.approx(GPUS["H100 SXM"].fp16_tflops)
    assert "H100 SXM" in w.ax.get_title()


def test_fp32_lowers_the_balance_point_so_qk_becomes_compute_bound():
    w = RooflineWidget(seq_len=4096, head_dim=128, dtype="float16", gpu="A100 80GB")
    assert w.memory_bound["qk"]
    w.dtype.value = "float32"  # A100 FP32: 19.5 TFLOP/s ÷ 2,039 GB/s ≈ 9.6 FLOP/byte
    assert not w.memory_bound["qk"]
    assert w.memory_bound["softmax"]
    assert w.markers["qk"].get_color() == "tab:green"


def test_sliders_change_points_and_times(w):
    before = w.points["qk"][0]
    w.head_dim.value = 128
    assert w.points["qk"][0] > before
    softmax = w.points["softmax"][0]
    w.seq_len.value = 16384
    assert w.points["softmax"][0] == softmax  # softmax's intensity depends on neither N nor d
    memory_s, compute_s = w.times["softmax"]
    assert memory_s > 100 * compute_s
    assert "<table" in w.table.value and "memory" in w.table.value


def test_table_has_units_separators_and_right_aligned_numbers():
    w = RooflineWidget(seq_len=131072, head_dim=80, dtype="float16", gpu="H100 SXM")
    html = w.table.value
    assert "FLOPs (GFLOP)" in html and "HBM traffic (GB)" in html
    assert "intensity (FLOP/byte)" in html
    qk = costmodel.step_costs(131072, 80, "float16")["qk"]
    assert f">{qk.flops / 1e9:,.0f}</td>" in html and "," in f"{qk.flops / 1e9:,.0f}"
    assert "e+" not in html  # no 1.34e+08
    assert "text-align: right" in html and "padding" in html
    assert "N = 131,072" in html
    w.seq_len.value = 128  # small sizes switch to smaller units
    assert "FLOPs (MFLOP)" in w.table.value and "HBM traffic (MB)" in w.table.value


@pytest.mark.parametrize("gpu, dtype", [*((gpu, "float16") for gpu in sorted(GPUS)),
                                        ("A100 80GB", "float32"), ("RTX 4090", "float32")])
def test_point_labels_touch_no_line_axis_or_other_label(gpu, dtype):
    """The "mask: 0.25" label once sat on the 10⁰ tick, and the matmul label on the roof."""
    w = RooflineWidget(seq_len=1024, head_dim=64, dtype=dtype, gpu=gpu)
    for seq_len, head_dim in ((1024, 64), (131072, 80), (128, 256), (16384, 128)):
        w.seq_len.value, w.head_dim.value = seq_len, head_dim  # each redraws: the PNG's positions
        renderer = w.fig.canvas.get_renderer()
        to_px = w.ax.transData.transform
        roof = to_px(np.column_stack(w.roof.get_data()))
        markers = to_px(np.array([[m.get_xdata()[0], m.get_ydata()[0]]
                                  for m in w.markers.values()]))
        balance_x = to_px([[w.balance, 1.0]])[0, 0]
        shown = [label for label in w.labels.values() if label.get_visible()]
        boxes = [label.get_window_extent(renderer) for label in shown]
        texts = [label.get_text() for label in shown]
        for i, box in enumerate(boxes):
            others = boxes[:i] + boxes[i + 1:]
            assert not label_collides(box, w.ax.bbox, balance_x, roof, markers, others), \
                (gpu, dtype, seq_len, head_dim, texts[i])
        assert box.x0 >= w.ax.bbox.x0  # inside the axes: clear of the tick labels


def test_controls_are_labelled_and_bad_arguments_rejected(w):
    assert all(c.description for c in w.controls)
    with pytest.raises(ValueError, match="seq_len"):
        RooflineWidget(seq_len=1000)
    with pytest.raises(ValueError, match="gpu"):
        RooflineWidget(gpu="TPU v5")
