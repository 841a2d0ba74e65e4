"""The Gluon one-pass backward for Hopper (course_lib/kernels/gluon_backward.py).

Without a GPU the kernel is cross-compiled for sm_90 (course_lib.measure.reach's stand-in driver) and the
tests read what the design claims from the compiled kernel: the consumers get 240 registers a
thread and the producer 24 (``setmaxnreg``), the five products per tile pair are wgmma, dQ is
added with 16-byte or 8-byte fp32 atomics, and it fits in an H100 block's shared memory. Whether
it computes the right gradients needs a Hopper GPU: the GPU tests below, and
``tools/gluon_backward.py``. Issue 35's two switches (the dQ atomics under the next step's first
products, the persistent grid) are cross-compiled here and checked and timed on the GPU by
``tools/gluon_bwd_ablation.py``, whose host-side record and tables are tested at the end.
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
from triton.runtime import driver
from course_lib.kernels import gluon_backward as gb
result = {}
for causal in (False, True):
    before = driver._active
    facts = gb.cross_compile(causal=causal, n=1000)
    ptx = gb.attention_backward_gluon.last_kernel.asm["ptx"]
    facts["commit_groups"] = ptx.count("wgmma.commit_group")
    facts["vector_atomics"] = len(gb.PTX_DQ_ADD.findall(ptx))  # 16- or 8-byte fp32 adds
    facts["driver_put_back"] = driver._active is before
    result[str(causal)] = facts
# the masked backward on a mask with both kinds of rule (documents, and a causal band), GQA group 2
facts = gb.cross_compile_masked(q_shape=(1, 4, 1000, 128), kv_heads=2, documents=3, causal=True)
ptx = gb.masked_backward_gluon.last_kernel.asm["ptx"]
facts["commit_groups"] = ptx.count("wgmma.commit_group")
facts["vector_atomics"] = len(gb.PTX_DQ_ADD.findall(ptx))  # 16- or 8-byte fp32 adds
result["masked"] = facts
# issue 35's switches (causal kernels hold both loops, masked and not)
for d, causal, pipeline, persistent in SWITCHED:
    facts = gb.cross_compile(causal=causal, n=1000, head_dim=d, config={"PIPELINE": pipeline, "PERSISTENT": persistent})
    ptx = gb.attention_backward_gluon.last_kernel.asm["ptx"]
    facts["commit_groups"] = ptx.count("wgmma.commit_group")
    facts["barriers"] = ptx.count("mbarrier.init")
    facts["reads_grid_size"] = "%nctaid.x" in ptx  # gl.num_programs(0): the persistent programs' stride
    result["/".join(map(str, (d, causal, pipeline, persistent)))] = facts
"""
# (head dim, causal, PIPELINE, PERSISTENT) of the switches' compiles: both overlaps at d = 128 (causal;
# and non-causal, whose unmasked loop is what long sequences run), the wider one at d = 64, the
# persistent grid at d = 128
SWITCHED = [(64, True, gb.PIPELINE_ST_DPT, False), (128, True, gb.PIPELINE_ST_DPT, False),
            (128, False, gb.PIPELINE_ST_DPT, False), (128, True, gb.PIPELINE_ST, False),
            (128, True, gb.NO_PIPELINE, True)]
PIPELINED = [case for case in SWITCHED if case[2] != gb.NO_PIPELINE]
COMPILE = f"SWITCHED = {SWITCHED!r}\n" + COMPILE
WGMMA_K = 16  # a wgmma's reduction depth at 16-bit inputs: Sᵀ = K Q_iᵀ over d takes d / 16 instructions


@pytest.fixture(scope="module")
def compiled():
    """kernel_facts (and a few PTX counts) of the library's config, causal and not."""
    from course_lib.measure import hopper_results

    out = hopper_results.in_fresh_process(COMPILE)
    return {**{causal: out[str(causal)] for causal in (False, True)}, "masked": out["masked"],
            **{case: out["/".join(map(str, case))] for case in SWITCHED}}


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


def test_overlap_issues_the_next_products_before_the_atomics(compiled):
    """PIPELINE on: in each loop, the previous step's dQ atomics come after this step's Sᵀ (and, in
    the unmasked loop with PIPELINE_ST_DPT, dPᵀ) are issued and before any is waited for; the last
    step's after the loops, with nothing in flight. Off (the library's): never under a product."""
    for d, causal, pipeline, persistent in PIPELINED:
        st = d // WGMMA_K  # Sᵀ's wgmma instructions (dPᵀ's: as many)
        unmasked = 2 * st if pipeline == gb.PIPELINE_ST_DPT else st
        facts = compiled[d, causal, pipeline, persistent]
        assert facts["dq_overlap"] == [st, unmasked, 0], (d, causal, pipeline, facts)
        assert facts["commit_groups"] == 2 * WGMMA_PER_TILE_PAIR, facts  # still 5 products a step, each loop
    assert compiled[True]["dq_overlap"] == [0, 0] and compiled[False]["dq_overlap"] == [0, 0]


def test_overlap_keeps_the_register_and_shared_memory_budgets(compiled):
    """No new spills where today's kernel has none (d = 64) or in the non-causal kernel at d = 128;
    the causal one's masked loop may hold a few more scalars, never a tile. dQ's staging buffer still
    fits an H100 block, and the partitions keep their register budgets."""
    for (d, causal, pipeline, _), facts in ((case, compiled[case]) for case in PIPELINED):
        assert 0 < facts["shared_bytes"] <= H100_BLOCK_SHARED_BYTES, facts
        assert f"dec {gb.CONFIG['LOADER_REGS']}" in facts["setmaxnreg"] and "inc 240" in facts["setmaxnreg"], facts
        today = compiled[causal]["spill_bytes"]  # the library's kernel at d = 128, this Triton
        if d == 64:  # 0 with every Triton version today (the module's SPILL_BYTES_ALLOWED note)
            assert facts["spill_bytes"] == 0, facts
        elif causal:
            assert facts["spill_bytes"] <= today + gb.SWITCH_EXTRA_SPILL_BYTES, (pipeline, facts, today)
        else:
            assert facts["spill_bytes"] <= today, (pipeline, facts, today)


def test_persistent_grid_walks_items_with_its_own_barrier(compiled):
    """PERSISTENT: the programs stride over the items by the grid's size, one more mbarrier (the K and
    V buffers free again), the products and budgets of the one-item kernel, a few scalars more spilled
    at most."""
    facts, today = compiled[128, True, gb.NO_PIPELINE, True], compiled[True]
    assert facts["reads_grid_size"], facts
    assert facts["barriers"] == compiled[128, True, gb.PIPELINE_ST, False]["barriers"] + 1, facts
    assert facts["commit_groups"] == 2 * WGMMA_PER_TILE_PAIR and facts["dq_overlap"] == [0, 0], facts
    assert f"dec {gb.CONFIG['LOADER_REGS']}" in facts["setmaxnreg"] and "inc 240" in facts["setmaxnreg"], facts
    assert 0 < facts["shared_bytes"] <= H100_BLOCK_SHARED_BYTES, facts
    assert facts["spill_bytes"] <= today["spill_bytes"] + gb.SWITCH_EXTRA_SPILL_BYTES, (facts, today)


@pytest.mark.parametrize("config,error,match", [
    ({"PIPELINE": -1}, ValueError, r"config\['PIPELINE'\] must be one of \(0, 1, 2\), got -1"),
    ({"PIPELINE": "1"}, ValueError, r"config\['PIPELINE'\] must be one of"),
    ({"PERSISTENT": 1}, TypeError, r"config\['PERSISTENT'\] must be a bool, got 1"),
])
def test_unknown_switch_values_raise(config, error, match):
    from triton.runtime import driver

    from course_lib.measure.reach import StandInDriver

    before = driver._active
    driver.set_active(StandInDriver(90))
    try:
        x = _cpu()
        with pytest.raises(error, match=match):
            gb.attention_backward_gluon(x, x, x, x, x, torch.zeros(x.shape[:-1]), False, 0.1, config=config)
    finally:
        driver._active = before


def test_dq_overlap_reads_the_ptx():
    """dq_overlap on hand-written PTX: products issued and not waited for before a run of atomics
    count; a wait, a ring-slot wait or a label in between resets the count."""
    add = "atom.global.gpu.relaxed.add.v4.f32 %f1, [%rd1], {%f2, %f3, %f4, %f5};"
    mma = "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {...};"
    ptx = "\n".join(["mbarrier.try_wait.parity.shared::cta.b64 complete, [%r1], %r2;", mma, mma,
                     "wgmma.commit_group.sync.aligned;", add, add,  # 2 in flight
                     "wgmma.wait_group.sync.aligned 0;", add,  # none
                     mma, "$L__BB0_3:", add,  # a label: another block, read as none
                     mma, "red.global.gpu.relaxed.add.v2.f32 [%rd2], {%f6, %f7};"])  # Triton 3.9's 8-byte add
    assert gb.dq_overlap(ptx) == [2, 0, 0, 1]


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


# issue 35's switches as tools/gluon_bwd_ablation.py names them (the tool times them; this checks them)
SWITCH_CASES = [(config, d, True) for config in ("overlap", "overlap_st", "persistent", "persistent_overlap")
                for d in (64, 128)] + [("persistent_overlap", 128, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("config,d,causal", SWITCH_CASES)
def test_switches_keep_the_gradients_on_hopper(config, d, causal):
    """On an H100, each switch's gradients (ragged N, several programs per SM for the persistent
    grid) are as close to float64 as the library's config's, on the same inputs."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward is Hopper-only (compute capability 9.x); this GPU is not")
    from course_lib.kernels import compat
    from course_lib.kernels.api import _forward

    switches = {"overlap": {"PIPELINE": gb.PIPELINE_ST_DPT}, "overlap_st": {"PIPELINE": gb.PIPELINE_ST},
                "persistent": {"PERSISTENT": True},
                "persistent_overlap": {"PERSISTENT": True, "PIPELINE": gb.PIPELINE_ST_DPT}}[config]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, dtype = 1000, torch.float16
    heads = 2 * sms // -(-n // gb.CONFIG["BLOCK_N"])  # about 2 items per program of the persistent grid
    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v, do = (torch.randn(1, heads, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*exact, is_causal=causal), exact,
                              do.double())
    o, lse = _forward(q, k, v, causal, d ** -0.5)
    base = gb.attention_backward_gluon(do, q, k, v, o, lse, causal, d ** -0.5)
    grads = gb.attention_backward_gluon(do, q, k, v, o, lse, causal, d ** -0.5, config=switches)
    assert compat.gluon_failure() is None, compat.gluon_failure()
    for which, g, g0, r in zip(("dq", "dk", "dv"), grads, base, ref):
        err, err0 = ((x.double() - r).abs().max().item() for x in (g, g0))
        assert err <= 2 * err0 + GRAD_ATOL[dtype], (config, which, err, err0)


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


# The backward ablation's host-side logic (tools/gluon_bwd_ablation.py runs on the GPU machine; its
# --record and tables run anywhere).


@pytest.fixture(scope="module")
def bwd_tool():
    """tools/gluon_bwd_ablation.py, imported as its own children import it (tools/ on the path)."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    return importlib.import_module("gluon_bwd_ablation")


def _bwd_full_run(tool) -> dict:
    """A small full run in the tool's --out format: d = 128, cuDNN and two configs, two cells, both
    passes; one config's checks with a case over the rule and one that could not be judged."""
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.0", "torch": "2.11.0", "triton": "3.6.0",
            "date": "2026-11-27", "timer": "cudagraph", "configs": tool.CONFIGS}
    tflops = {"sdpa_cudnn/128": ((400.0, 420.0), (300.0, 320.0)), "bwd/128/baseline": ((320.0, 360.0), (240.0, 270.0)),
              "bwd/128/overlap": ((360.0, 378.0), (240.0, 280.0))}  # impl -> per cell (bwd, fwd+bwd)
    speed = [{"impl": impl, "d": 128, "dtype": "bfloat16", "N": 4096, "causal": causal, "pass": p, "tflops": t}
             for impl, cells in tflops.items() for causal, per_pass in zip((False, True), cells)
             for p, t in zip(tool.PASSES, per_pass)]
    speed.append({"impl": "bwd/128/overlap_st", "d": 128, "dtype": "bfloat16", "N": 4096, "causal": False,
                  "pass": "bwd", "skipped": "out of time"})
    errors = [{"config": config, "d": 128, "inputs": kind, "ok": ok, "dq_err": dq, "dk_err": 1e-3, "dv_err": 1e-3,
               "sdpa_dq_err": 1e-3, "sdpa_dk_err": 1e-3, "sdpa_dv_err": 2e-3}
              for config, kind, dq, ok in (("baseline", "ordinary", 1e-3, True), ("overlap", "ordinary", 1e-3, True),
                                           ("overlap", "fuzz", 3e-3, False))]
    errors.append({"config": "overlap", "d": 128, "inputs": "fuzz", "ok": None, "sdpa_error": "RuntimeError: ..."})
    facts = {"registers": 168, "spill_bytes": 8, "shared_bytes": 197932, "dq_overlap": [8, 16, 0], "wgmma": 64,
             "setmaxnreg": ["dec 24", "inc 240"], "ex2": 12, "triton": "3.6.0"}
    return {"meta": meta, "compile": {"bwd/128/overlap": facts, "bwd/128/overlap_st": {"error": "silent: killed"}},
            "errors": errors, "speed": speed, "skipped": ["bwd/128/overlap_st"], "failed": [],
            "excluded": ["bwd/128/overlap_st"]}


def test_bwd_ablation_record_and_tables(bwd_tool, tmp_path):
    import json

    full = _bwd_full_run(bwd_tool)
    path = tmp_path / "full.json"
    path.write_text(json.dumps(full))
    data = bwd_tool.write_record(path, tmp_path / "record.json")
    assert json.loads((tmp_path / "record.json").read_text()) == data
    assert data["speed"]["cells"] == [["bfloat16", 128, 4096, False], ["bfloat16", 128, 4096, True]]
    assert data["speed"]["tflops"]["bwd"]["bwd/128/overlap"] == [360.0, 240.0]
    assert data["speed"]["tflops"]["fwd+bwd"]["sdpa_cudnn/128"] == [420.0, 320.0]
    assert data["speed"]["tflops"]["bwd"]["bwd/128/overlap_st"] == [None, None]  # skipped: not timed
    # ex2 and wgmma dropped; the error key is only a failed config's
    assert set(data["compile"]["bwd/128/overlap"]) == set(bwd_tool.RECORD_COMPILE_KEYS) - {"error"}
    assert data["compile"]["bwd/128/overlap_st"] == {"error": "silent: killed"}
    bwd = data["summary"]["speed"]["bwd"]["bwd/128/overlap"]
    assert bwd == {"cells": 2, "median_x_cudnn": round((360 / 400 + 240 / 300) / 2, 3), "min_x_cudnn": 0.8,
                   "median_x_baseline": round((360 / 320 + 1.0) / 2, 3)}
    assert "sdpa_cudnn/128" not in data["summary"]["speed"]["fwd+bwd"]
    acc = data["summary"]["accuracy"]["bwd/128/overlap"]
    assert (acc["passed"], acc["cases"], acc["worst_dq_x_sdpa"], acc["worst_dv_x_sdpa"]) == (1, 3, 3.0, 0.5)
    assert acc["by_inputs"]["fuzz"]["passed"] == 0 and acc["by_inputs"]["fuzz"]["cases"] == 2
    assert data["excluded"] == ["bwd/128/overlap_st"]
    text = bwd_tool.report(data)
    assert "NVIDIA H100 80GB HBM3" in text and "bwd TFLOP/s, d = 128;" in text
    rows = [line.split() for line in text.splitlines()]
    # the first table (bwd, d = 128): cuDNN, baseline, overlap, overlap_st (not timed), then each config ÷ cuDNN
    assert ["bfloat16", "4096", "False", "|", "400.0", "320.0", "360.0", "-", "|", "0.800", "0.900", "-"] in rows
    assert "bwd/128/overlap      1/3 passed;" in text


def test_bwd_ablation_record_refuses_a_file_that_is_not_a_full_run(bwd_tool, tmp_path):
    path = tmp_path / "not_a_run.json"
    path.write_text('{"meta": {}, "speed": []}')
    with pytest.raises(ValueError, match=r"full_path .*not_a_run.json lacks \['compile', 'errors'\]"):
        bwd_tool.write_record(path, tmp_path / "out.json")


def test_bwd_ablation_configs_are_the_kernels_switches(bwd_tool):
    """Each config sets entries of the kernel's CONFIG only; together they try every PIPELINE and the
    persistent grid; the baseline is the library's backward."""
    for name, switches in bwd_tool.CONFIGS.items():
        assert set(switches) <= set(gb.CONFIG), name
    assert {c.get("PIPELINE", gb.NO_PIPELINE) for c in bwd_tool.CONFIGS.values()} == set(gb.PIPELINES)
    assert any(c.get("PERSISTENT") for c in bwd_tool.CONFIGS.values())
    assert {**gb.CONFIG, **bwd_tool.CONFIGS[bwd_tool.BASELINE]} == gb.CONFIG
