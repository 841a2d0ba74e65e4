"""The Gluon one-pass backward for Hopper (course_lib/kernels/gluon_backward.py).

Without a GPU the kernel is cross-compiled for sm_90 (course_lib.measure.reach's stand-in driver) and the
tests read what the design claims from the compiled kernel: the consumers get 240 registers a
thread and the producer 24 (``setmaxnreg``), the five products per tile pair are wgmma, dQ is
added with 16-byte or 8-byte fp32 atomics, and it fits in an H100 block's shared memory. Whether
it computes the right gradients needs a Hopper GPU: the GPU test below, and
``tools/gluon_backward.py``.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.kernels import gluon_backward as gb
from course_lib.kernels import gluon_hopper as gh

if not gh.available():  # pragma: no cover - depends on the installed Triton
    pytest.skip(f"gluon not importable: {gh.GLUON_IMPORT_ERROR}", allow_module_level=True)

H100_BLOCK_SHARED_BYTES = 227 * 1024
WGMMA_PER_TILE_PAIR = 5  # S^T, dP^T, dV, dK, dQ: the one-pass backward's products
GRAD_ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # on top of twice the Triton backward's error


# Compiled in a child process (hopper_results.in_fresh_process): Gluon cannot compile in a process
# where Triton's interpreter has already run a kernel, as other tests in the same worker do.
COMPILE = """
import re
from triton.runtime import driver
from course_lib.kernels import gluon_backward as gb
# 16- or 8-byte fp32 adds: atom (Triton 3.6-3.8) or red (3.9 on: the same add, its old value unused)
VECTOR_ADD = r"(?:atom|red)\\.global\\.gpu\\.relaxed\\.add\\.v[24]\\.f32"
result = {}
for causal in (False, True):
    before = driver._active
    facts = gb.cross_compile(causal=causal, n=1000)
    ptx = gb.attention_backward_gluon.last_kernel.asm["ptx"]
    facts["commit_groups"] = ptx.count("wgmma.commit_group")
    facts["vector_atomics"] = len(re.findall(VECTOR_ADD, ptx))
    facts["driver_put_back"] = driver._active is before
    result[str(causal)] = facts
# the masked backward on a mask with both kinds of rule (documents, and a causal band), GQA group 2
facts = gb.cross_compile_masked(q_shape=(1, 4, 1000, 128), kv_heads=2, documents=3, causal=True)
ptx = gb.masked_backward_gluon.last_kernel.asm["ptx"]
facts["commit_groups"] = ptx.count("wgmma.commit_group")
facts["vector_atomics"] = len(re.findall(VECTOR_ADD, ptx))
result["masked"] = facts
"""


@pytest.fixture(scope="module")
def compiled():
    """kernel_facts (and a few PTX counts) of the library's config, causal and not."""
    from course_lib.measure import hopper_results

    out = hopper_results.in_fresh_process(COMPILE)
    return {**{causal: out[str(causal)] for causal in (False, True)}, "masked": out["masked"]}


@pytest.mark.parametrize("causal", [False, True])
def test_compiles_within_an_h100_block(compiled, causal):
    facts = compiled[causal]
    assert 0 < facts["shared_bytes"] <= H100_BLOCK_SHARED_BYTES, facts
    assert facts["registers"] <= 255, facts
    # A few words of spilled scalars are tolerated (read back from L1); the tiles must stay in registers.
    assert facts["spill_bytes"] <= gb.SPILL_BYTES_ALLOWED, facts


@pytest.mark.parametrize("causal", [False, True])
def test_partitions_get_their_register_budgets(compiled, causal):
    facts = compiled[causal]
    assert f"dec {gb.CONFIG['LOADER_REGS']}" in facts["setmaxnreg"], facts
    assert "inc 240" in facts["setmaxnreg"], facts  # the consumers: the dK and dV tiles alone take 128


def test_five_products_per_tile_pair(compiled):
    """Both loops (masked and not) issue S^T, dP^T, dV, dK and dQ as wgmma: one wgmma group each,
    so 2 x 5 "commit_group"s in the PTX, and the dQ product reads dS^T transposed from shared memory."""
    facts = compiled[True]
    assert facts["commit_groups"] == 2 * WGMMA_PER_TILE_PAIR, facts
    assert facts["vector_atomics"] > 0, facts  # dQ: vector atomics


def test_masked_backward_compiles_with_the_same_design(compiled):
    """The masked kernel (tile lists, documents and a band, GQA) keeps the dense one's budgets, its
    shared memory and its 5 products per step in each of its two loops (FULL steps, PARTIAL ones)."""
    facts = compiled["masked"]
    assert 0 < facts["shared_bytes"] <= H100_BLOCK_SHARED_BYTES, facts
    assert facts["spill_bytes"] <= gb.MASKED_SPILL_BYTES_ALLOWED, facts
    assert f"dec {gb.CONFIG['LOADER_REGS']}" in facts["setmaxnreg"] and "inc 240" in facts["setmaxnreg"], facts
    assert facts["commit_groups"] == 2 * WGMMA_PER_TILE_PAIR and facts["vector_atomics"] > 0, facts


def test_cross_compile_puts_the_driver_back(compiled):
    assert compiled[False]["driver_put_back"] and compiled[True]["driver_put_back"]


def _cpu(shape=(1, 2, 64, 128), dtype=torch.float16):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("make,match", [
    (lambda: (_cpu(dtype=torch.float32),) * 5, "float16 or bfloat16"),
    (lambda: (_cpu((1, 2, 64, 96)),) * 5, "head dim must be one of"),
    (lambda: (_cpu(), _cpu((1, 2, 32, 128)), _cpu((1, 2, 32, 128)), _cpu(), _cpu()), "N_q = N_k"),
    (lambda: (_cpu(),) * 4 + (_cpu((1, 2, 64, 132))[..., :128],), "multiples of 16 bytes"),
])
def test_unsupported_inputs_raise(make, match):
    do, q, k, v, o = make()
    from triton.runtime import driver

    from course_lib.measure.reach import StandInDriver

    before = driver._active
    driver.set_active(StandInDriver(90))  # past the "needs a GPU" check, to the input checks
    try:
        with pytest.raises(ValueError, match=match):
            gb.attention_backward_gluon(do, q, k, v, o, torch.zeros(q.shape[:-1]), False, 0.1)
    finally:
        driver._active = before


def test_lse_must_match():
    from triton.runtime import driver

    from course_lib.measure.reach import StandInDriver

    before = driver._active
    driver.set_active(StandInDriver(90))
    try:
        x = _cpu()
        with pytest.raises(ValueError, match="lse must be float32 contiguous"):
            gb.attention_backward_gluon(x, x, x, x, x, torch.zeros(1, 2, 64, dtype=torch.float16), False, 0.1)
    finally:
        driver._active = before


def _masked_inputs(seq_lens=None):
    """CPU q, k (GQA: 2 K/V heads for 4 query heads) and the library's plan for a causal window
    of 128x128 tiles (the kernel's; the interpreter's own would be 64x64), or for ``seq_lens``."""
    from course_lib.attention import blockmask as bm
    from course_lib.platform import runtime
    from course_lib.kernels import api

    if runtime.current().on_gpu:
        pytest.skip("builds plans from CPU tensors through the API, which a GPU session refuses (CI runs it); "
                    "the GPU tests below cover this machine")
    q, k = _cpu((2, 4, 256, 128)), _cpu((2, 2, 256, 128))
    if seq_lens is not None:
        *_, plan = api._masked_call(q, k, k, True, None, None, seq_lens, None)
    else:
        window = bm.sliding_window_block_mask(256, 256, (100, 0), 128, 128, causal=True)
        *_, plan = api._masked_call(q, k, k, False, None, None, None, window)
    return q, k, plan


@pytest.mark.parametrize("change,match", [
    (dict(seq_lens=torch.tensor([256, 100])), "per-sample lengths"),
    (dict(o=_cpu((2, 4, 255, 128))), "o must be shaped like q"),
    (dict(lse=torch.zeros(2, 4, 256, dtype=torch.float16)), "lse must be float32"),
])
def test_masked_backward_names_what_it_does_not_cover(change, match):
    from triton.runtime import driver

    from course_lib.measure.reach import StandInDriver

    q, k, plan = _masked_inputs(change.get("seq_lens"))
    o = change.get("o", q)
    lse = change.get("lse", torch.zeros(q.shape[:-1]))
    before = driver._active
    driver.set_active(StandInDriver(90))
    try:
        with pytest.raises(ValueError, match=match):
            gb.masked_backward_gluon(q, q, k, k, o, lse, 0.1, plan)
    finally:
        driver._active = before


def test_the_library_keeps_the_triton_backward_off_hopper():
    x = _cpu()
    assert not gb.library_uses_gluon_backward(x, x, x, x, x)
    q, k, plan = _masked_inputs()
    assert not gb.library_uses_gluon_masked_backward(q, k, k, q, q, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,n,d", [(False, 1111, 128), (True, 1111, 128), (True, 200, 128), (False, 1000, 64)])
def test_library_backward_takes_gluon_on_hopper(causal, n, d, monkeypatch):
    """On an H100, flash_attention's backward at d=64 and d=128 runs the Gluon kernel and its gradients
    match float64; deterministic=True and COURSE_LIB_GLUON_BACKWARD=0 keep chapter 07's kernels."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward is Hopper-only (compute capability 9.x); this GPU is not")
    from course_lib import flash_attention

    calls = []
    real = gb.attention_backward_gluon
    monkeypatch.setattr(gb, "attention_backward_gluon", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    from course_lib.kernels import tuning

    # Enough heads for a full GPU: a small problem (fewer query tiles than SMs) takes chapter 07's
    # two kernels on purpose (tuning.small_problem).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads = -(-sms // (2 * -(-n // tuning.SMALL_PROBLEM_TILE_ROWS)))
    assert not tuning.small_problem(2 * heads, n, sms)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, heads, n, d, device="cuda", dtype=torch.float16, generator=gen).requires_grad_()
               for _ in range(3))
    do = torch.randn(2, heads, n, d, device="cuda", dtype=torch.float16, generator=gen)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    grads = torch.autograd.grad(flash_attention(q, k, v, causal=causal), (q, k, v), do)
    assert calls == [1]
    for g, r in zip(grads, ref_grads):
        assert ((g.double() - r).abs().max() / r.abs().max()).item() < 1e-2
    calls.clear()
    torch.autograd.grad(flash_attention(q, k, v, causal=causal, deterministic=True), (q, k, v), do)
    monkeypatch.setenv("COURSE_LIB_GLUON_BACKWARD", "0")
    torch.autograd.grad(flash_attention(q, k, v, causal=causal), (q, k, v), do)
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_masked_backward_takes_gluon_on_hopper(d, dtype, monkeypatch):
    """On an H100, masked calls (ragged N, GQA group 2, each mask kind of test_gluon_masked) take the
    Gluon one-pass backward unless deterministic=True; its gradients are as close to float64 as the
    two Triton kernels', and rows that see no key get zero gradients."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward is Hopper-only (compute capability 9.x); this GPU is not")
    from test_gluon_masked import _gpu_cases
    from test_kernels_masked import reference

    from course_lib import flash_attention

    calls = []
    real = gb.masked_backward_gluon
    monkeypatch.setattr(gb, "masked_backward_gluon", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for n in (1000, 1008):  # 1008: the dense mask's rows are 16-byte aligned (1000: Triton's)
        gen = torch.Generator(device="cuda").manual_seed(d + n)
        q = torch.randn(2, 4, n, d, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(2, 2, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        do = torch.randn(q.shape, device="cuda", dtype=dtype, generator=gen)
        for name, kwargs, mask in _gpu_cases(n, 2):
            exact = [x.double().requires_grad_() for x in (q, k, v)]
            o_ref, lse_ref = reference(*exact, mask.cuda())
            ref = torch.autograd.grad(o_ref, exact, do.double())
            grads = {}
            for deterministic in (False, True):
                calls.clear()
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                o = flash_attention(*leaves, deterministic=deterministic, **kwargs)
                grads[deterministic] = torch.autograd.grad(o, leaves, do)
                gluon = not deterministic and not (name == "dense mask" and n == 1000)
                assert calls == ([1] if gluon else []), (name, n, deterministic)
            empty = torch.isinf(lse_ref)  # (B, H, N): rows that see no key
            assert (grads[False][0][empty] == 0).all(), name
            for i, which in enumerate(("dq", "dk", "dv")):
                err = (grads[False][i].double() - ref[i]).abs().max().item()
                err_t = (grads[True][i].double() - ref[i]).abs().max().item()
                print(f"{dtype} d={d} n={n} {name:14s} {which}: gluon {err:.2e} triton {err_t:.2e}")
                assert err <= 2 * err_t + GRAD_ATOL[dtype], (name, n, which, err, err_t)
