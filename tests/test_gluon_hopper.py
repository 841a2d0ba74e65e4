"""The Gluon forward for Hopper (course_lib/kernels/gluon_hopper.py), checked without a GPU.

Each variant is cross-compiled for sm_90 with the installed Triton (course_lib.reach's stand-in
driver: compile and "load", never launch), and the tests read what the design claims from the
compiled kernel: it fits (no spills, shared memory within an H100 block's 227 KiB) and its PTX holds
the instructions the design is about. Whether it computes the right numbers needs a Hopper GPU:
``tools/gluon_forward.py`` checks that against a float64 reference.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from course_lib import hopper_results
from course_lib.kernels import gluon_hopper as gh

if not gh.available():  # pragma: no cover - depends on the installed Triton
    pytest.skip(f"gluon not importable: {gh.GLUON_IMPORT_ERROR}", allow_module_level=True)

H100_BLOCK_SHARED_BYTES = 227 * 1024  # the most shared memory one block may use on sm_90


@pytest.fixture(scope="module")
def facts():
    """kernel_facts of each variant at fp16, d=128, causal, ragged N (compiled once per module, in
    a child process: Gluon cannot compile where Triton's interpreter has already run a kernel, as
    other tests in the same worker do)."""
    return hopper_results.gluon_kernel_facts(gh.VARIANTS, head_dim=128, causal=True)


@pytest.mark.parametrize("variant", gh.VARIANTS)
def test_variant_compiles_and_fits(facts, variant):
    f = facts[variant]
    assert f["spill_bytes"] == 0, f
    assert 0 < f["shared_bytes"] <= H100_BLOCK_SHARED_BYTES, f
    assert f["registers"] <= 255, f  # the most one thread can have
    assert f["wgmma"] > 0, f  # the products run on Hopper's warpgroup tensor-core instruction


def test_overlap_leaves_one_product_running(facts):
    """Design b: S_{j+1} is waited for with one product (O += P V) still pending; design a waits
    for every product at once."""
    assert facts["tma"]["wait_group_1"] == 0, facts["tma"]
    assert facts["overlap"]["wait_group_1"] >= 1, facts["overlap"]
    assert facts["ws"]["wait_group_1"] >= 1, facts["ws"]
    # design d: each of the two consumer partitions has its own loop, each with its own wait
    assert facts["pingpong"]["wait_group_1"] == 2 * facts["ws"]["wait_group_1"], facts["pingpong"]


def test_warp_specialization_sets_register_budgets(facts):
    """Design c: the producer gives registers back (setmaxnreg.dec to its budget) and the
    consumers take more (setmaxnreg.inc); the single-partition variants have no budgets."""
    for variant in ("ws", "pingpong"):
        cfg = gh.config(variant, 128)
        budgets = facts[variant]["setmaxnreg"]
        assert f"dec {cfg['LOADER_REGS']}" in budgets, budgets
        assert f"inc {cfg['CONSUMER_REGS']}" in budgets, budgets
    assert facts["tma"]["setmaxnreg"] == [] and facts["overlap"]["setmaxnreg"] == []


def test_pingpong_needs_no_more_shared_memory(facts):
    """Design d splits Q into two 64-row blocks, one per consumer, and each writes its half of O
    through its own block: the same buffers as design c (a few barriers more)."""
    q_kv_bytes = (128 + 2 * 2 * 128) * 128 * 2  # Q tile + 2 slots of K and V tiles, fp16, d=128
    for variant in ("ws", "pingpong"):
        assert q_kv_bytes <= facts[variant]["shared_bytes"] < q_kv_bytes + 1024, facts[variant]


def test_head_dim_64_bf16_compiles_and_the_driver_comes_back():
    code = ("from triton.runtime import driver\n"
            "from course_lib.kernels import gluon_hopper as gh\n"
            "before = driver._active\n"
            "result = gh.cross_compile('ws', head_dim=64, dtype=torch.bfloat16, causal=False, n=200)\n"
            "result['driver_put_back'] = driver._active is before\n")
    f = hopper_results.in_fresh_process(code)
    assert f["spill_bytes"] == 0 and f["shared_bytes"] <= H100_BLOCK_SHARED_BYTES, f
    assert f["driver_put_back"], f


def _cpu(shape=(1, 2, 64, 128), dtype=torch.float16):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("make,match", [
    (lambda: (_cpu(dtype=torch.float32),) * 3, "float16 or bfloat16"),
    (lambda: (_cpu((1, 2, 64, 96)),) * 3, "head dim must be one of"),
    (lambda: (_cpu(), _cpu((1, 2, 32, 128)), _cpu((1, 2, 32, 128))), "N_q = N_k"),
    (lambda: (_cpu().transpose(2, 3),) * 3, "last stride 1|one shape"),
    (lambda: (_cpu((1, 2, 64, 132))[..., :128],) * 3, "multiples of 16 bytes"),
])
def test_unsupported_inputs_raise(make, match):
    q, k, v = make()
    from triton.runtime import driver

    from course_lib.reach import StandInDriver

    before = driver._active
    driver.set_active(StandInDriver(90))  # past the "needs a GPU" check, to the input checks
    try:
        with pytest.raises(ValueError, match=match):
            gh.attention_forward_gluon(q, k, v, causal=False)
    finally:
        driver._active = before


def test_cpu_tensors_without_the_stand_in_raise():
    q = _cpu()
    with pytest.raises(ValueError, match="CPU tensors are only accepted while compiling"):
        gh.attention_forward_gluon(q, q, q, causal=False)


def test_unknown_variant_raises():
    with pytest.raises(ValueError, match="variant must be one of"):
        gh.config("cooperative", 128)


def test_the_library_keeps_the_triton_kernels_off_hopper():
    """On the CPU (interpreter) the library never takes the Gluon kernel."""
    q = torch.zeros(1, 1, 64, 128, dtype=torch.float16)
    assert not gh.library_uses_gluon(q, q, q)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_library_forward_takes_gluon_on_hopper(causal, monkeypatch):
    """On an H100, flash_attention at d=128 runs the ping-pong Gluon forward, and its output, lse
    and the gradients (the backward kernels read the Gluon forward's o and lse) match a float64
    reference; COURSE_LIB_GLUON=0 puts the TMA forward back."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward is Hopper-only (compute capability 9.x); this GPU is not")
    from course_lib import flash_attention

    calls = []
    real = gh.attention_forward_gluon
    signature = inspect.signature(real)  # the plan passes the variant by position

    def spy(*a, **kw):
        calls.append(signature.bind(*a, **kw).arguments)
        return real(*a, **kw)
    monkeypatch.setattr(gh, "attention_forward_gluon", spy)
    gen = torch.Generator(device="cuda").manual_seed(0)
    # 4·8 heads of 9 query tiles: more tiles than an H100 has SMs (a smaller problem takes chapter
    # 06's kernel on purpose, tuning.small_problem)
    q, k, v = (torch.randn(4, 8, 1111, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    o = flash_attention(q, k, v, causal=causal)
    assert calls and calls[0]["variant"] == "pingpong"
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    assert (o.double() - ref).abs().max().item() < 3e-2
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    for g, r in zip(grads, ref_grads):
        assert ((g.double() - r).norm() / r.norm()).item() < 2e-2
    monkeypatch.setenv("COURSE_LIB_GLUON", "0")
    calls.clear()
    flash_attention(q, k, v, causal=causal)
    assert not calls
