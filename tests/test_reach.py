"""Launch configs fitted to GPUs we do not have, proven by cross-compiling (course_lib.measure.reach).

The full survey (every target, dtype and head dim) takes minutes: `python -m course_lib.measure.reach`;
its last result is summarised in course_lib/data/benchmarks/NOTES.md. Here: the head dim and
targets the issue measured (d=128 fp16 on sm_86, whose 99 KiB the H100's backward tiles overflow,
and sm_90 itself), and Blackwell's sm_120 (RTX 50xx, RTX PRO 6000 = Colab's G4: 99 KiB, TMA but
no wgmma), compiled by the Blackwell ptxas Triton bundles.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import astuple

import pytest
import torch

from course_lib.measure import reach
from course_lib.platform.hardware import COMPUTE_TARGETS
from course_lib.kernels import tuning
from course_lib.measure.reach import problems


def _reach(folder, *args) -> tuple[list[dict], str]:
    """The rows and the printed table of ``python -m course_lib.measure.reach --check`` over ``args``, in a
    child process (a cross-compile needs a process of its own); fails with its output when the
    check fails. The rows go through ``folder``."""
    out = folder / "rows.json"
    done = subprocess.run([sys.executable, "-m", "course_lib.measure.reach", *args, "--check", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    return _reach(tmp_path_factory.mktemp("reach"), "--targets", "86,90,120", "--dtypes", "float16",
                  "--head-dims", "128")


def test_every_launch_fits_its_target_without_new_spills(survey):
    rows, table = survey
    assert {r["target"] for r in rows} == {86, 90, 120}
    for target in (86, 90, 120):
        assert {r["kernel"] for r in rows if r["target"] == target} >= {
            "attention_forward_kernel", "dkdv_kernel", "dq_kernel", "masked_forward_kernel", "masked_dkdv_kernel",
            "masked_dq_kernel", "split_kv_kernel", "combine_kernel"}
    assert problems(rows) == []
    for r in rows:
        assert r["shared"] <= COMPUTE_TARGETS[r["target"]].max_shared_bytes_per_block
    assert "0 problems" in table


def test_the_hopper_only_path_is_launched_on_hopper_only(survey):
    """The descriptor (TMA) forward is the library's on 9.x only (hopper.library_uses_tma): sm_120
    has TMA but no wgmma, and keeps chapter 06's kernel."""
    rows, _ = survey
    tma_targets = {r["target"] for r in rows if r["kernel"] == "attention_forward_tma_kernel"}
    assert tma_targets == {t for t in (86, 90, 120) if COMPUTE_TARGETS[t].wgmma} == {90}


def test_sm120_fits_99_kib_without_spills(survey):
    """On an RTX 50xx / RTX PRO 6000 every launch fits 99 KiB; the H100's d=128 backward tiles
    are refitted, as on an RTX 3090, and nothing spills."""
    rows, _ = survey
    on_120 = [r for r in rows if r["target"] == 120]
    limit = COMPUTE_TARGETS[120].max_shared_bytes_per_block
    assert on_120 and all(r["limit"] == limit == 99 * 1024 and r["shared"] <= limit for r in on_120)
    assert all(r["spill_bytes"] == 0 for r in on_120)
    refitted = {r["kernel"] for r in on_120 if r["table"] is not None and r["config"] != r["table"]}
    assert {"dkdv_kernel", "dq_kernel"} <= refitted


@pytest.mark.parametrize("arch", sorted(COMPUTE_TARGETS))
def test_the_gluon_kernels_need_a_hopper_gpu(arch, monkeypatch):
    """On every target but 9.x (Blackwell's 10.0 and 12.0 included) the library's Gluon kernels say
    no before looking at anything else, and the one-pass backward adds dQ by atomics, not by TMA."""
    from course_lib.kernels import backward, gluon_hopper

    target = COMPUTE_TARGETS[arch]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: target.capability)
    q = _OnCuda(torch.zeros(1, 1, 128, 128, dtype=torch.float16))
    why = gluon_hopper.gluon_unsupported_reason(q, q, q)
    if not gluon_hopper.available():  # pragma: no cover - depends on the installed Triton
        assert why == gluon_hopper.GLUON_IMPORT_ERROR
    elif target.wgmma:
        assert why is None
    else:
        assert why == "the kernel uses Hopper's wgmma and TMA: it needs a GPU of compute capability 9.x"
    assert (backward.dq_mode(q, 128, interpreted=False) == backward.DQ_TMA.value) == target.wgmma


class _OnCuda:
    """A CPU tensor that says it is on a CUDA device (only ``.device`` differs), to ask the
    dispatch rules what they would do on a GPU this machine does not have."""

    def __init__(self, x: torch.Tensor):
        self._x = x

    device = torch.device("cuda", 0)

    def __getattr__(self, name):
        return getattr(self._x, name)


def test_colab_and_blackwell_gpus_are_named_in_the_mode_line(monkeypatch):
    """runtime.setup()'s line on Colab's G4 (an RTX PRO 6000, 12.0) names the runtime and says
    the Hopper-only kernels stay off; a B200 (10.0) says so too; an H100 line has no such note."""
    import types

    from course_lib.platform import runtime

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    versions = {"python": "3.13", "torch": "2.11.0+cu128", "triton": "3.6.0", "numpy": "2.1.3"}

    def line(name, capability):
        return runtime.Runtime(mode=runtime.GPU, device="cuda", gpu_name=name, versions=versions,
                               capability=capability).describe()

    g4 = line("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0))
    assert g4.startswith("GPU mode: Triton kernels run natively on NVIDIA RTX PRO 6000 Blackwell Server Edition "
                         "(Colab's G4 runtime; compute capability 12.0, 99 KiB of shared memory per block: "
                         "the Hopper-only kernels (wgmma, Gluon) stay off)")
    assert "compute capability 10.0, 227 KiB" in line("NVIDIA B200", (10, 0))
    assert line("NVIDIA H100 80GB HBM3", (9, 0)).startswith("GPU mode: Triton kernels run natively on "
                                                             "NVIDIA H100 80GB HBM3 (Colab's H100 runtime) · ")


def test_blackwell_targets_compile_and_fit(tmp_path):
    """B200 (sm_100, 227 KiB) and RTX 50xx / RTX PRO 6000 (sm_120, 99 KiB), causal fp16 at d=64
    (``make test-newest`` runs it with the newest Triton): every launch compiles for Blackwell and
    fits, the fitted configs spill nothing, and none is the Hopper-only descriptor forward."""
    rows, _ = _reach(tmp_path, "--targets", "100,120", "--dtypes", "float16", "--head-dims", "64",
                     "--families", "attention,decode", "--causal", "1")
    assert {r["target"] for r in rows} == {100, 120} and problems(rows) == []
    for target in (100, 120):
        kernels = {r["kernel"] for r in rows if r["target"] == target}
        assert kernels >= {"attention_forward_kernel", "dkdv_kernel", "split_kv_kernel"}, kernels
        assert "attention_forward_tma_kernel" not in kernels
    assert all(r["shared"] <= r["limit"] == COMPUTE_TARGETS[r["target"]].max_shared_bytes_per_block for r in rows)
    # the configs fit.choose picks spill nothing, the backward's preprocess included (Triton 3.9
    # spills 8 B of its 4-warp kernel here on sm_100: it is refitted to 8 warps)
    assert all(r["spill_bytes"] == 0 for r in rows if r["table"] is not None)


def test_ptx_facts_show_each_generations_tensor_core_instruction():
    """Chapter 09, section 8: the same Triton forwards become wgmma on sm_90, tcgen05.mma with
    tensor memory on sm_100, and Ampere's mma.sync on sm_120; the descriptor kernel's loads are
    TMA copies on all three."""
    rows = {(r["target"], r["kernel"]): r for r in reach.ptx_facts((90, 100, 120))}
    assert set(rows) == {(t, k) for t in (90, 100, 120) for k in reach.PTX_FACT_KERNELS}
    for kernel in reach.PTX_FACT_KERNELS:
        h100, b200, rtx50 = rows[90, kernel], rows[100, kernel], rows[120, kernel]
        assert h100["wgmma"] > 0 and h100["tcgen05.mma"] == h100["mma.sync"] == 0, h100
        assert b200["tcgen05.mma"] > 0 and b200["tensor memory"] > 0 and b200["wgmma"] == 0, b200
        assert rtx50["mma.sync"] > 0 and rtx50["wgmma"] == rtx50["tcgen05.mma"] == rtx50["tensor memory"] == 0, rtx50
    for target in (90, 100, 120):
        assert rows[target, "attention_forward_tma_kernel"]["TMA copy"] > 0
        assert rows[target, "attention_forward_kernel"]["TMA copy"] == 0
    table = reach.format_ptx_facts(list(rows.values()))
    assert table.splitlines()[0].split()[:3] == ["target", "kernel", "wgmma"] and "sm_120" in table


def test_ptx_facts_refuse_unknown_targets():
    with pytest.raises(ValueError, match=r"targets must be among \[80, 86, 89, 90, 100, 120\], got \[75\]"):
        reach.ptx_facts((75,))


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
    found, _ = _reach(tmp_path, "--targets", "90", "--dtypes", "float32", "--head-dims", "256",
                      "--families", "attention", "--causal", "0")
    rows = {r["kernel"]: r for r in found if r["table"] is not None}
    smallest = min(t.max_shared_bytes_per_block for t in COMPUTE_TARGETS.values())
    for kernel, name in (("forward", "attention_forward_kernel"), ("dkdv", "dkdv_kernel"), ("dq", "dq_kernel")):
        r = rows[name]
        assert tuple(r["config"]) == tuple(r["table"]) == astuple(tuning.FP32_WIDE[kernel])
        assert r["shared"] <= smallest, (name, r["shared"])
    assert rows["dkdv_kernel"]["spill_bytes"] == rows["dq_kernel"]["spill_bytes"] == 0


def test_reach_refuses_unknown_families():
    done = subprocess.run([sys.executable, "-m", "course_lib.measure.reach", "--families", "prefill"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "families must be among ('attention', 'decode', 'masked')" in done.stderr


def test_reach_refuses_unknown_targets():
    done = subprocess.run([sys.executable, "-m", "course_lib.measure.reach", "--targets", "75"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "targets must be among [80, 86, 89, 90, 100, 120]" in done.stderr


@pytest.mark.slow  # ~110 s with an empty Triton cache on the 2-core machine: fp32 d = 256 compiles
def test_the_a100_fits_the_fp32_d256_masked_dkdv_without_spills(tmp_path):
    """sm_80's ptxas (12.8, bundled with the pinned triton 3.7.1; 3.9.0's does not spill here) holds
    the table's 2-stage masked dK/dV kernel (fp32, d = 256) to 128 registers and spills 16 B, where
    the H100 spills none; every smaller fallback spills too. The same tiles with one stage more get
    176 registers and no spill, and fit on the A100 (163 KiB). The H100 keeps the table's config."""
    # sm_80 alone (the H100's rows are compiled, and kept, by the tests around this one)
    rows, _ = _reach(tmp_path, "--targets", "80", "--dtypes", "float32", "--head-dims", "256",
                     "--families", "masked", "--causal", "0")
    dkdv = {r["target"]: r for r in rows if r["kernel"] == "masked_dkdv_kernel"}
    table = [16, 32, 8, 2]  # tuning.FP32_WIDE["dkdv"], the configuration the H100 ran
    a100 = dkdv[80]
    assert a100["table"] == table and a100["config"] == [16, 32, 8, 3], a100
    assert a100["spill_bytes"] == 0
    assert a100["shared"] <= a100["limit"] == COMPUTE_TARGETS[80].max_shared_bytes_per_block
    tried = {tuple(config): spills for config, _, spills in a100["tried"]}
    assert tried[tuple(table)] > 0  # the table's config was tried first and spilled
    assert all(spills != 0 for config, spills in tried.items() if config != (16, 32, 8, 3))


def test_the_b200_fits_the_preprocess_kernel_without_spills(tmp_path):
    """Blackwell's ptxas spills a few bytes of the backward's 4-warp preprocess kernel (Δ = rowsum(dO ∘
    O)) for sm_100, the same bytes on every compile: at fp16 d = 128 with triton 3.7.1, d = 64 with
    3.9.0. There it is refitted to 8 warps, which spill nothing; elsewhere it keeps 4. The H100 keeps
    Triton's default launch options (4 warps, 3 stages) that it was measured with."""
    from triton.backends.nvidia.compiler import CUDAOptions

    rows, _ = _reach(tmp_path, "--targets", "90,100", "--dtypes", "float16", "--head-dims", "64,128",
                     "--families", "attention", "--causal", "0")
    assert all(r["config"] == r["table"] for r in rows if r["target"] == 90 and r["table"] is not None)
    pre = [r for r in rows if r["kernel"] == "preprocess_kernel"]
    assert {(r["target"], r["d"]) for r in pre} == {(t, d) for t in (90, 100) for d in (64, 128)}
    refitted = 0
    for r in pre:
        default, wider = (list(astuple(b)) for b in tuning.preprocess_candidates(64, r["d"]))
        assert default == [64, r["d"], CUDAOptions.num_warps, CUDAOptions.num_stages] == [64, r["d"], 4, 3]
        assert r["table"] == default and r["spill_bytes"] == 0, r
        if r["config"] == default:
            assert [config for config, _, _ in r["tried"]] == [default], r  # no spill: nothing else compiled
        else:
            assert r["target"] == 100 and r["config"] == wider, r
            assert [[config, spills > 0] for config, _, spills in r["tried"]] == [[default, True], [wider, False]], r
            refitted += 1
    assert refitted > 0  # the spill the survey found: 8 B on sm_100 (triton 3.7.1 and 3.9.0)


def _row(target, spill_bytes, d=128):
    return {"target": target, "kernel": "preprocess_kernel", "dtype": "float16", "d": d, "causal": False,
            "n": 1024, "shared": 256, "limit": COMPUTE_TARGETS[target].max_shared_bytes_per_block,
            "spill_bytes": spill_bytes}


def test_spills_without_an_h100_row_are_listed_not_hidden():
    """A spill is a problem only against the sm_90 row of the same launch; a survey without sm_90
    (how the sm_100 preprocess spill went unreported in the Blackwell-only survey) lists the spill
    as unchecked instead of passing it silently."""
    blackwell_only = [_row(100, 8), _row(120, 0)]
    assert problems(blackwell_only) == [] and reach.unchecked_spills(blackwell_only) == [blackwell_only[0]]
    with_h100 = blackwell_only + [_row(90, 0)]
    assert reach.unchecked_spills(with_h100) == []
    assert problems(with_h100) == ["sm_100 preprocess_kernel float16 d=128 causal=False N=1024: spills 8 B where "
                                   "the H100 choice does not"]
    assert problems(blackwell_only + [_row(90, 16)]) == []  # the H100's own choice spills too


@pytest.mark.gpu
def test_the_h100_launches_the_preprocess_kernel_as_measured():
    """On the GPU: fitting the backward's Δ kernel keeps Triton's default launch options (4 warps,
    3 stages) on the GPU the tables were measured on, so the recorded H100 numbers still describe it."""
    from course_lib import flash_attention
    from course_lib.kernels import backward, fit

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tables were measured on compute capability 9.0; this GPU refits freely")
    for d in (64, 128):
        q = torch.randn(1, 2, 256, d, device="cuda", dtype=torch.float16, requires_grad=True)
        flash_attention(q, q, q, causal=True).sum().backward()
    chosen = [c.chosen.blocks for c in fit.CHOICES.values() if c.kernel == "preprocess_kernel"]
    assert chosen and all((b.num_warps, b.num_stages) == (4, 3) for b in chosen), chosen
    compiled = [c for cache in backward.preprocess_kernel.device_caches.values() for c in cache[0].values()]
    assert compiled and all((c.metadata.num_warps, c.metadata.num_stages) == (4, 3) for c in compiled)
