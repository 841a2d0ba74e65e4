"""fp32 launches above head dim 128: small ieee tiles in the backward, tf32x3 in the forward.

The choice was made by cross-compiling for sm_90 (NOTES.md, "fp32 dots"); tests/test_reach.py
compiles it. Here: the table hands it out only to fp32 above 128 and leaves everything else as it
was, and tools/fp32_dots.py can still put the old choice back for its before/after comparison.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from course_lib.kernels import forward, tuning

pytestmark = [pytest.mark.ch06]

KERNELS = ("forward", "dkdv", "dq")


def _fp32_dots_tool():
    path = Path(__file__).resolve().parents[1] / "tools" / "fp32_dots.py"
    spec = importlib.util.spec_from_file_location("fp32_dots_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp32_above_128_gets_the_wide_table(kernel):
    for causal, seq_len in ((False, 16384), (True, 1024)):
        got = tuning.gpu_default(kernel, 256, 4, seq_len, causal)
        assert got == tuning.FP32_WIDE[kernel]
        assert tuning.gpu_candidates(kernel, 256, 4, seq_len, causal)[0] == got
    # ... and nothing else does: fp16/bf16 at 256 and fp32 at 128 keep the small-tiles branch
    assert tuning.gpu_default(kernel, 256, 2) != tuning.FP32_WIDE[kernel]
    assert tuning.gpu_default(kernel, 256, 2) == tuning.gpu_default(kernel, 128, 4)


def test_forward_uses_tf32x3_at_every_head_dim_and_backward_only_up_to_128(monkeypatch):
    monkeypatch.delenv(forward.FP32_DOTS_ENV, raising=False)
    assert forward.fp32_dot_precision(256, forward_pass=True) == "tf32x3"
    assert forward.fp32_dot_precision(256) == "ieee"
    assert forward.fp32_dot_precision(128) == forward.fp32_dot_precision(128, forward_pass=True) == "tf32x3"
    monkeypatch.setenv(forward.FP32_DOTS_ENV, "ieee")  # forcing one still forces it everywhere
    assert forward.fp32_dot_precision(64, forward_pass=True) == "ieee"
    monkeypatch.setenv(forward.FP32_DOTS_ENV, "fast")
    with pytest.raises(ValueError, match="COURSE_LIB_FP32_DOTS must be one of"):
        forward.fp32_dot_precision(64)


def test_fp32_dots_tool_restores_the_old_choice(monkeypatch):
    monkeypatch.delenv(forward.FP32_DOTS_ENV, raising=False)
    # undone after the test: the tool changes these two globals in its own process
    monkeypatch.setattr(tuning, "FP32_WIDE", tuning.FP32_WIDE)
    monkeypatch.setattr(forward, "FORWARD_TF32X3_MAX_HEAD_DIM", forward.FORWARD_TF32X3_MAX_HEAD_DIM)
    _fp32_dots_tool().use_choice_before_fp32_wide()
    assert forward.fp32_dot_precision(256, forward_pass=True) == "ieee"
    assert tuning.gpu_default("dkdv", 256, 4) == tuning.Blocks(32, 64, 4, 2)
    assert tuning.gpu_default("dq", 256, 4) == tuning.gpu_default("forward", 256, 4) == tuning.Blocks(64, 32, 4, 2)


def test_fp32_dots_tool_refuses_unknown_precisions():
    with pytest.raises(SystemExit):
        _fp32_dots_tool().main(["--precisions", "fast"])
