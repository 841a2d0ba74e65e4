"""Launch configs: the autotuner is only offered configs that neither spill nor overflow."""

from __future__ import annotations

import pytest

from course_lib.kernels import tuning

pytestmark = [pytest.mark.ch06]


class _FakeTensor:
    """Stands in for the Q argument: the pruner only asks for its element size."""

    def __init__(self, element_size: int):
        self._element_size = element_size

    def element_size(self) -> int:
        return self._element_size


PRUNERS = {"forward": (tuning.forward_configs, tuning.prune_forward, "BLOCK_M"),
           "dkdv": (tuning.dkdv_configs, tuning.prune_dkdv, "BLOCK_N"),
           "dq": (tuning.dq_configs, tuning.prune_dq, "BLOCK_M")}


def _kept(kernel, head_dim, element_size):
    configs, prune, _ = PRUNERS[kernel]
    return prune(configs(), {"Q": _FakeTensor(element_size)}, HEAD_DIM=head_dim)


def _shape(c):
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)


def test_spilling_forward_config_is_pruned_at_d128():
    # (128, 64) on 4 warps ran at 201 TFLOP/s against 466 on 8 warps at d=128 (NOTES.md sweep)
    assert (128, 64, 4, 3) in [_shape(c) for c in tuning.forward_configs()]
    kept = [_shape(c) for c in _kept("forward", 128, 2)]
    assert (128, 64, 4, 3) not in kept and (128, 64, 8, 3) in kept
    # ... and kept at d=64, where it does not spill and is among the fastest
    assert (128, 64, 4, 3) in [_shape(c) for c in _kept("forward", 64, 2)]


def test_spilling_dkdv_config_is_pruned_at_d128():
    # (32, 128) on 4 warps: 159 TFLOP/s against 352 for (64, 128) on 8 warps at d=128
    kept = [_shape(c) for c in _kept("dkdv", 128, 2)]
    assert (32, 128, 4, 3) not in kept and (64, 128, 8, 3) in kept


@pytest.mark.parametrize("kernel", list(PRUNERS))
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("element_size", [2, 4])
def test_every_kept_config_fits(kernel, head_dim, element_size):
    owned = PRUNERS[kernel][2]
    kept = _kept(kernel, head_dim, element_size)
    assert kept, "the pruner must leave at least one config"
    for c in kept:
        assert tuning.acc_values_per_thread(c.kwargs[owned], head_dim, c.num_warps) \
            <= tuning.MAX_ACC_VALUES_PER_THREAD, _shape(c)
        if element_size >= 4 or head_dim > 128:
            assert c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_N"] <= 64, _shape(c)


def test_gpu_defaults_obey_the_register_rule():
    for kernel, owned in (("forward", "block_m"), ("dkdv", "block_n"), ("dq", "block_m")):
        for head_dim in (64, 128):
            b = tuning.gpu_default(kernel, head_dim, 2)
            assert tuning.acc_values_per_thread(getattr(b, owned), head_dim, b.num_warps) \
                <= tuning.MAX_ACC_VALUES_PER_THREAD, (kernel, head_dim, b)


def test_gpu_table_picks_by_length_and_mask():
    long_fwd = tuning.gpu_default("forward", 128, 2, seq_len=16384, causal=True)
    short_fwd = tuning.gpu_default("forward", 128, 2, seq_len=1024, causal=True)
    assert (long_fwd.block_m, long_fwd.num_warps) == (128, 8)
    assert (short_fwd.block_m, short_fwd.block_n) == (64, 64)
    assert tuning.gpu_default("forward", 128, 2, seq_len=1024, causal=False) == long_fwd  # not causal
    assert tuning.gpu_default("dkdv", 64, 2, seq_len=1000, causal=True).block_n == 64
    assert tuning.gpu_default("dkdv", 64, 2, seq_len=4096, causal=True).block_n == 128
    assert tuning.gpu_default("forward", 256, 2).block_m <= 64  # shared memory at d=256
    with pytest.raises(ValueError, match="kernel must be"):
        tuning.gpu_default("sideways", 64, 2)


def test_autotune_is_opt_in(monkeypatch):
    monkeypatch.delenv(tuning.AUTOTUNE_ENV, raising=False)
    assert not tuning.autotune_enabled()
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    assert tuning.autotune_enabled()
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    assert not tuning.autotune_enabled()


def test_one_pass_backward_is_the_default_only_where_it_paid():
    """The measured rule: one-pass at d <= 64 except short causal sequences; two kernels at d=128."""
    from course_lib.kernels import tuning

    assert tuning.one_pass_pays(4096, 64, causal=True) and tuning.one_pass_pays(1024, 64, causal=False)
    assert not tuning.one_pass_pays(1024, 64, causal=True)
    assert not tuning.one_pass_pays(16384, 128, causal=False)
    assert tuning.gpu_default("fused", 64, 2) == tuning.Blocks(64, 64, 4, 3)
    assert tuning.gpu_candidates("fused", 128, 2)[0] == tuning.Blocks(64, 128, 8, 3)


def test_small_problems_take_the_triton_kernels_and_every_grid_cell_keeps_gluon():
    """Fewer query tiles than SMs is small (the Triton kernels, the two-kernel backward); every cell
    of the recorded H100 grid (bench.problem_shape over N = 1k-16k, d = 64 and 128) is not."""
    from course_lib.measure import bench
    from course_lib.kernels import tuning

    h100_sms = 132
    assert tuning.small_problem(4, 128, h100_sms)  # the overhead bench's B=1, H=4, N=128: 4 tiles
    assert tuning.small_problem(4, 512, h100_sms)  # 16 tiles
    assert tuning.small_problem(131, 128, h100_sms) and not tuning.small_problem(132, 128, h100_sms)
    assert tuning.small_problem(1, 129, 3) and not tuning.small_problem(1, 257, 3)  # tiles round up
    for n in (1024, 4096, 16384):
        for d in (64, 128):
            batch, heads = bench.problem_shape(n, d)
            assert not tuning.small_problem(batch * heads, n, h100_sms), (n, d)
    assert tuning.one_pass_pays(4096, 64, False) and not tuning.one_pass_pays(4096, 64, False, True)


def test_small_problem_rule_is_off_the_gpu():
    """CPU tensors (the interpreter, the sm_90 stand-in) are never a small GPU problem."""
    import torch

    from course_lib.kernels import tuning

    assert not tuning.small_problem_on_gpu(torch.zeros(1, 1, 16, 16))


def test_parse_blocks_reads_the_tools_config_form():
    from course_lib.kernels import tuning

    assert tuning.parse_blocks("64/128/8/3") == tuning.Blocks(64, 128, 8, 3)
    for bad in ("64/128/8", "64x128/8/3/1", "a/b/c/d"):
        with pytest.raises(ValueError, match="a config must read BLOCK_M/BLOCK_N/warps/stages"):
            tuning.parse_blocks(bad)
