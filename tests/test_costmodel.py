"""Tests for course_lib.attention.costmodel: memory, per-step FLOPs and bytes, intensity, roofline."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.attention import costmodel as cm
from course_lib.platform.hardware import GPUS, balance_point

pytestmark = pytest.mark.ch02

sizes = st.integers(min_value=1, max_value=1 << 17)
dims = st.integers(min_value=1, max_value=512)
elem = st.sampled_from([1, 2, 4, 8])


def test_bytes_per_element():
    assert cm.bytes_per_element("fp16") == 2
    assert cm.bytes_per_element("bfloat16") == 2
    assert cm.bytes_per_element(np.float32) == 4
    assert cm.bytes_per_element(np.dtype("float64")) == 8
    import torch
    assert cm.bytes_per_element(torch.bfloat16) == 2
    assert cm.bytes_per_element(torch.float32) == 4
    with pytest.raises(ValueError, match="dtype must be one of"):
        cm.bytes_per_element("int8")


def test_reading_entry_counts():
    assert cm.score_matrix_entries(1024) == 1_048_576  # "about 1 million"
    assert round(cm.score_matrix_entries(16384) / 1e6) == 268  # "268 million"
    assert round(cm.score_matrix_entries(131072) / 1e9) == 17  # "17 billion"


def test_memory_breakdown_by_hand():
    m = cm.attention_memory(1024, 64, "fp16", batch=2, heads=3, layers=4)
    copies = 2 * 3 * 4
    assert m.qkv_bytes == 3 * copies * 1024 * 64 * 2
    assert m.output_bytes == copies * 1024 * 64 * 2
    assert m.score_bytes == copies * 1024 * 1024 * 2
    assert m.total_bytes == m.linear_bytes + m.score_bytes
    assert cm.attention_memory(1024, 64, "fp16", score_matrices=2).score_bytes == 2 * 1024**2 * 2


@pytest.mark.parametrize("name,value", [("seq_len", 0), ("head_dim", -3), ("batch", 0)])
def test_memory_bad_sizes_name_the_argument(name, value):
    kwargs = {"seq_len": 8, "head_dim": 8, "batch": 1}
    kwargs[name] = value
    with pytest.raises(ValueError, match=name):
        cm.attention_memory(kwargs["seq_len"], kwargs["head_dim"], batch=kwargs["batch"])


def test_non_integer_sizes_are_type_errors():
    with pytest.raises(TypeError, match="seq_len"):
        cm.step_costs(10.5, 64)
    with pytest.raises(TypeError, match="heads"):
        cm.attention_memory(10, 64, heads=True)


@given(sizes, dims, elem, st.integers(1, 8), st.integers(1, 32))
def test_quadratic_vs_linear(n, d, b, batch, heads):
    m = cm.attention_memory(n, d, b, batch=batch, heads=heads)
    # the N×N term overtakes Q, K, V, O exactly when N > 4d
    assert (m.score_bytes > m.linear_bytes) == (n > 4 * d)


@settings(max_examples=50)
@given(st.floats(min_value=1e6, max_value=1e12), st.sampled_from([32, 64, 80, 128]),
       st.integers(1, 4), st.integers(1, 32), st.integers(1, 3))
def test_max_seq_len_is_the_boundary(memory, d, batch, heads, mats):
    kwargs = dict(batch=batch, heads=heads, score_matrices=mats)
    n = cm.max_seq_len(memory, d, "fp16", **kwargs)
    assert cm.attention_memory(n, d, "fp16", **kwargs).total_bytes <= memory
    assert cm.attention_memory(n + 1, d, "fp16", **kwargs).total_bytes > memory


def test_max_seq_len_rejects_bad_memory():
    with pytest.raises(ValueError, match="memory_bytes"):
        cm.max_seq_len(0, 64)


def test_step_costs_by_hand():
    n, d, b = 1000, 80, 2
    c = cm.step_costs(n, d, "bf16")
    assert list(c) == list(cm.STEPS)
    assert c["qk"].flops == 2 * n * n * d
    assert c["qk"].bytes_read == 2 * n * d * b and c["qk"].bytes_written == n * n * b
    assert c["mask"].flops == n * n and c["mask"].bytes == 2 * n * n * b
    assert c["softmax"].flops == 5 * n * n and c["softmax"].bytes == 2 * n * n * b
    assert c["dropout"].flops == 2 * n * n and c["dropout"].bytes == 2 * n * n * b
    assert c["pv"].flops == 2 * n * n * d
    assert c["pv"].bytes_read == (n * n + n * d) * b and c["pv"].bytes_written == n * d * b
    total = cm.total_cost(n, d, "bf16")
    assert total.flops == sum(s.flops for s in c.values())
    assert total.bytes == sum(s.bytes for s in c.values())


def test_reading_softmax_intensity():
    # 5 FLOPs per element over 2·2 bytes per element (fp16): 1.25; the 4-FLOP count gives 1.0
    assert cm.softmax_intensity(1024, 64, 2) == 1.25
    assert 4 / (2 * 2) == 1.0
    assert cm.softmax_intensity(1024, 64, 4) == 0.625


def test_qk_intensity_value():
    n, d = 1024, 64
    assert cm.qk_intensity(n, d, 2) == pytest.approx(2 * n * n * d / ((2 * n * d + n * n) * 2))
    assert cm.qk_intensity(n, d, 2) == pytest.approx(56.89, abs=0.01)


def test_reading_large_matmul():
    assert cm.matmul_cost(8192, 8192, 8192, "fp16").intensity == pytest.approx(2730.67, abs=0.01)


@given(sizes, dims, elem, st.integers(1, 8), st.integers(1, 16))
def test_intensity_does_not_depend_on_batch_or_heads(n, d, b, batch, heads):
    one = cm.step_costs(n, d, b)
    many = cm.step_costs(n, d, b, batch=batch, heads=heads)
    for name in cm.STEPS:
        assert many[name].flops == batch * heads * one[name].flops
        assert many[name].intensity == pytest.approx(one[name].intensity)


@given(sizes, dims)
def test_every_step_of_standard_attention_is_memory_bound_on_an_a100_at_d_le_128(n, d):
    # QKᵀ's intensity 2N²d/((2Nd+N²)·2) < d ≤ 128 < 153: nothing reaches the A100's balance point
    if d > 128:
        return
    bp = balance_point("A100 80GB", "fp16")
    assert all(s.intensity < bp for s in cm.step_costs(n, d, "fp16").values())


@given(sizes, dims, elem)
def test_matmul_steps_approach_d_over_bytes(n, d, b):
    # as N grows the S write dominates and QKᵀ tends to 2d/b FLOP per byte from below
    assert cm.qk_intensity(n, d, b) < 2 * d / b


def test_roofline():
    gpu = GPUS["A100 80GB PCIe"]
    assert cm.attainable_flops(1.25, gpu) == pytest.approx(1.25 * 1935e9)
    assert cm.attainable_flops(1e5, gpu) == 312e12
    x = np.array([0.5, balance_point(gpu), 1e4])
    y = cm.attainable_flops(x, "A100 80GB PCIe")
    assert y.shape == (3,)
    assert y[1] == pytest.approx(312e12)
    with pytest.raises(ValueError, match="intensity"):
        cm.attainable_flops(-1, gpu)


def test_attention_flops_convention():
    f = cm.attention_flops(2, 16, 1024, 64)
    assert f == 4 * 2 * 16 * 1024**2 * 64
    assert cm.attention_flops(2, 16, 1024, 64, causal=True) == f / 2
    assert cm.attention_flops(2, 16, 1024, 64, pass_="bwd") == 2.5 * f
    assert cm.attention_flops(2, 16, 1024, 64, pass_="fwd_bwd") == 3.5 * f
    assert cm.attention_flops(2, 16, 1024, 64, True, "fwd_bwd") == 3.5 * f / 2
    with pytest.raises(ValueError, match="pass_"):
        cm.attention_flops(1, 1, 8, 8, pass_="forward")
    with pytest.raises(ValueError, match="head_dim"):
        cm.attention_flops(1, 1, 8, 0)


def test_attention_flops_match_the_two_matmuls_of_the_step_model():
    c = cm.step_costs(777, 96, "fp16", batch=3, heads=5)
    assert cm.attention_flops(3, 5, 777, 96) == c["qk"].flops + c["pv"].flops


def test_format_bytes():
    assert cm.format_bytes(512) == "512 B"
    assert cm.format_bytes(2**31) == "2.00 GiB"
    assert cm.format_bytes(3 * 2**20) == "3.00 MiB"
