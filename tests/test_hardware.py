"""Tests for course_lib.platform.hardware: the GPU table, lookup and balance points."""

import math

import pytest

from course_lib.platform import hardware
from course_lib.platform.hardware import GPUS, balance_point, get_gpu

pytestmark = pytest.mark.ch02

REQUIRED = ["A100 40GB", "A100 80GB", "H100 SXM", "H200", "RTX 4090"]


def test_table_has_the_promised_gpus():
    for name in REQUIRED:
        assert name in GPUS


@pytest.mark.parametrize("name", list(GPUS))
def test_every_figure_is_positive_and_sourced(name):
    gpu = GPUS[name]
    for field in ("memory_gb", "bandwidth_gb_s", "fp16_tflops", "bf16_tflops", "fp32_tflops",
                  "sram_kib_per_sm", "max_shared_kib_per_sm", "sm_count"):
        assert getattr(gpu, field) > 0, field
    assert gpu.max_shared_kib_per_sm <= gpu.sram_kib_per_sm
    assert "datasheet" in gpu.source or "whitepaper" in gpu.source
    # tensor-core half precision is always faster than plain FP32
    assert gpu.fp16_tflops > gpu.fp32_tflops


def test_units():
    a100 = get_gpu("A100 40GB")
    assert a100.memory_bytes == 40e9
    assert a100.bandwidth_bytes_per_s == 1555e9
    assert a100.peak_flops("fp16") == 312e12
    assert a100.peak_flops(dtype="float32") == 19.5e12
    # the reading's "about 20 MB of SRAM": 108 SMs × 192 KiB
    assert a100.total_sram_bytes == 108 * 192 * 1024
    assert 20e6 < a100.total_sram_bytes < 22e6


def test_lookup_ignores_case_and_spaces_and_passes_gpus_through():
    assert get_gpu("h100sxm") is GPUS["H100 SXM"]
    assert get_gpu(GPUS["H200"]) is GPUS["H200"]


def test_unknown_gpu_names_the_argument():
    with pytest.raises(ValueError, match=r"gpu must be one of .*H100 SXM.*'B200'"):
        get_gpu("B200")
    with pytest.raises(TypeError, match="gpu must be"):
        get_gpu(100)


def test_unknown_dtype_names_the_argument():
    with pytest.raises(ValueError, match="dtype must be one of"):
        GPUS["H100 SXM"].peak_flops("int8")


def test_reading_balance_points():
    # 312 TFLOP/s ÷ 1,935 GB/s (A100 80GB PCIe) = 161; ÷ 2.0 TB/s (rounded) = 156
    assert balance_point("A100 80GB PCIe") == pytest.approx(161.2, abs=0.1)
    assert 312 / 2.0 == 156
    # H100 SXM: 989 ÷ 3.35 ≈ 295
    assert balance_point("H100 SXM", "bf16") == pytest.approx(295, abs=1)


@pytest.mark.parametrize("name", list(GPUS))
def test_balance_point_is_peak_over_bandwidth(name):
    gpu = GPUS[name]
    for dtype in ("float16", "bfloat16", "float32"):
        assert math.isclose(balance_point(name, dtype),
                            gpu.peak_flops(dtype) / gpu.bandwidth_bytes_per_s)
    assert balance_point(name, "fp32") < balance_point(name, "fp16")


def test_h200_is_an_h100_with_more_faster_memory():
    h100, h200 = GPUS["H100 SXM"], GPUS["H200"]
    assert h200.fp16_tflops == h100.fp16_tflops and h200.sm_count == h100.sm_count
    assert h200.memory_gb > h100.memory_gb and h200.bandwidth_gb_s > h100.bandwidth_gb_s
    assert hardware.gpu_names()[0] == "A100 40GB"
