"""Launch configs fitted to GPUs we do not have, proven by cross-compiling (course_lib.reach).

The full survey (every target, dtype and head dim) takes minutes: `python -m course_lib.reach`;
its last result is summarised in course_lib/data/benchmarks/NOTES.md. Here: the head dim and
targets the issue measured (d=128 fp16 on sm_86, whose 99 KiB the H100's backward tiles overflow,
and sm_90 itself).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import astuple

import pytest

from course_lib.hardware import COMPUTE_TARGETS
from course_lib.kernels import tuning
from course_lib.reach import problems


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    out = tmp_path_factory.mktemp("reach") / "rows.json"
    done = subprocess.run([sys.executable, "-m", "course_lib.reach", "--targets", "86,90", "--dtypes", "float16",
                           "--head-dims", "128", "--check", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_every_launch_fits_its_target_without_new_spills(survey):
    rows, table = survey
    assert {r["target"] for r in rows} == {86, 90}
    assert {r["kernel"] for r in rows} >= {"attention_forward_kernel", "dkdv_kernel", "dq_kernel",
                                            "attention_forward_tma_kernel", "split_kv_kernel", "combine_kernel"}
    assert problems(rows) == []
    for r in rows:
        assert r["shared"] <= COMPUTE_TARGETS[r["target"]].max_shared_bytes_per_block
    assert "0 problems" in table


def test_the_h100_keeps_its_table(survey):
    rows, _ = survey
    fitted = [r for r in rows if r["target"] == 90 and r["table"] is not None]
    assert fitted and all(r["config"] == r["table"] for r in fitted)


def test_the_d128_backward_is_refitted_for_99_kib(survey):
    """The issue's example: the H100's d=128 backward tiles need ~129 KiB; an RTX 3090 has 99."""
    rows, _ = survey
    for kernel in ("dkdv_kernel", "dq_kernel"):
        on_86 = [r for r in rows if r["target"] == 86 and r["kernel"] == kernel]
        assert on_86
        for r in on_86:
            assert r["config"] != r["table"]
            too_big = [shared for config, shared, _ in r["tried"] if config == r["table"]]
            assert too_big and too_big[0] > r["limit"]  # the table's choice was tried and did not fit
            assert r["spill_bytes"] == 0


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("element_size", [2, 4])
def test_candidates_start_with_the_table_and_only_shrink(kernel, head_dim, element_size):
    for causal, seq_len in ((False, 16384), (True, 1024)):
        first, *rest = tuning.gpu_candidates(kernel, head_dim, element_size, seq_len, causal)
        assert first == tuning.gpu_default(kernel, head_dim, element_size, seq_len, causal)
        assert len(set(rest)) == len(rest) and first not in rest
        for b in rest:
            assert b.block_m <= first.block_m and b.block_n <= first.block_n
            owned = b.block_n if kernel == "dkdv" else b.block_m
            assert tuning.acc_values_per_thread(owned, head_dim, b.num_warps) <= tuning.MAX_ACC_VALUES_PER_THREAD


def test_decode_candidates_lower_stages_then_tiles():
    got = tuning.decode_candidates(16, 64, shrink_block_n=True)
    assert got[:3] == [tuning.Blocks(16, 64, 4, s) for s in (3, 2, 1)]
    assert [b.block_n for b in got] == [64] * 3 + [32] * 3 + [16] * 3
    assert [b.block_n for b in tuning.decode_candidates(16, 128, shrink_block_n=False)] == [128] * 3


def test_fp32_above_128_compiles_without_spills_for_every_gpu(tmp_path):
    """fp32 at d=256 (tuning.FP32_WIDE): the backward's ieee tiles spill nothing on the H100, and
    every kernel fits the smallest shared memory of the targets, so no GPU has to refit them."""
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "course_lib.reach", "--targets", "90", "--dtypes", "float32",
                           "--head-dims", "256", "--families", "attention", "--causal", "0", "--check",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text()) if r["table"] is not None}
    smallest = min(t.max_shared_bytes_per_block for t in COMPUTE_TARGETS.values())
    for kernel, name in (("forward", "attention_forward_kernel"), ("dkdv", "dkdv_kernel"), ("dq", "dq_kernel")):
        r = rows[name]
        assert tuple(r["config"]) == tuple(r["table"]) == astuple(tuning.FP32_WIDE[kernel])
        assert r["shared"] <= smallest, (name, r["shared"])
    assert rows["dkdv_kernel"]["spill_bytes"] == rows["dq_kernel"]["spill_bytes"] == 0


def test_reach_refuses_unknown_families():
    done = subprocess.run([sys.executable, "-m", "course_lib.reach", "--families", "prefill"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "families must be among ('attention', 'decode', 'masked')" in done.stderr


def test_reach_refuses_unknown_targets():
    done = subprocess.run([sys.executable, "-m", "course_lib.reach", "--targets", "75"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "targets must be among [80, 86, 89, 90]" in done.stderr
