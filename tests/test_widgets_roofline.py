"""The arithmetic-intensity calculator and roofline, driven without a browser."""

import pytest

from course_lib import costmodel
from course_lib.hardware import GPUS, TERA, balance_point
from course_lib.widgets.roofline import FIGSIZE, RooflineWidget

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
    assert "<table>" in w.table.value and "memory" in w.table.value


def test_controls_are_labelled_and_bad_arguments_rejected(w):
    assert all(c.description for c in w.controls)
    with pytest.raises(ValueError, match="seq_len"):
        RooflineWidget(seq_len=1000)
    with pytest.raises(ValueError, match="gpu"):
        RooflineWidget(gpu="TPU v5")
