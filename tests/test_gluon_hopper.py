"""The Gluon forward for Hopper (course_lib/kernels/gluon_hopper.py), checked without a GPU.

Each variant is cross-compiled for sm_90 with the installed Triton (course_lib.measure.reach's stand-in
driver: compile and "load", never launch), and the tests read what the design claims from the
compiled kernel: it fits (no spills, shared memory within an H100 block's 227 KiB) and its PTX holds
the instructions the design is about. Whether it computes the right numbers needs a Hopper GPU:
``tools/gluon_forward.py`` checks that against a float64 reference.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from course_lib.attention import fp_emulation
from course_lib.measure import hopper_results
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

    from course_lib.measure.reach import StandInDriver

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


# ----------------------------------------------------------------------------------------------
# Issue 35: FlashAttention-4's conditional rescaling and software exp2 as switches of the forward,
# and head dim 64. Compiled once per module in a fresh process: every variant at d = 64, and the
# library's variant with the switches at d = 64 and 128 (the d = 128 baseline is ``facts``').

SWITCHED = {  # name -> switches; each combines what one compile can show
    "rescale_emu1": {"rescale_tau": gh.MAX_RESCALE_TAU, "exp2_emulated": 1},  # tau = 8, 1 of 4 exps emulated
    "emu2_deg5": {"exp2_emulated": 2, "exp2_degree": 5},  # no rescaling switch: its control; 2 of 4, degree 5
}
LIBRARY_VARIANT = "pingpong"  # course_lib.kernels.tuning.GLUON_VARIANT
THREADS_PER_WARP = 32
O_TOL_BF16, LSE_TOL = 3e-2, 1e-3  # max |o - o_ref| in bf16 and |lse - lse_ref|: tools/gluon_forward.py's


@pytest.fixture(scope="module")
def switch_facts():
    """``{"variant/d/name": kernel_facts}``: every variant's baseline at d = 64 and the library's
    variant with each of :data:`SWITCHED` at d = 64 and 128 (fp16, causal, N = 1000)."""
    cases = [[v, 64, "baseline", {}] for v in gh.VARIANTS]
    cases += [[LIBRARY_VARIANT, d, name, sw] for d in gh.HEAD_DIMS for name, sw in SWITCHED.items()]
    code = ("from course_lib.kernels import gluon_hopper as gh\n"
            "result = {f'{v}/{d}/{name}': gh.cross_compile(v, head_dim=d, dtype=torch.float16, causal=True, n=1000,"
            " **sw) for v, d, name, sw in args}\n")
    return hopper_results.in_fresh_process(code, cases)


def _baseline(facts, switch_facts, d: int) -> dict:
    return facts[LIBRARY_VARIANT] if d == 128 else switch_facts[f"{LIBRARY_VARIANT}/64/baseline"]


@pytest.mark.parametrize("variant", gh.VARIANTS)
def test_every_variant_compiles_and_fits_at_head_dim_64(switch_facts, variant):
    f = switch_facts[f"{variant}/64/baseline"]
    assert f["spill_bytes"] == 0, f
    assert 0 < f["shared_bytes"] <= H100_BLOCK_SHARED_BYTES, f
    assert f["registers"] <= 255 and f["wgmma"] > 0, f


@pytest.mark.parametrize("d", gh.HEAD_DIMS)
def test_conditional_rescaling_branches_around_the_rescale(facts, switch_facts, d):
    """With rescale_tau > 0 the multiplies of acc (and l) by alpha sit in an if-then block of the
    PTX (a predicated branch jumps over them when no row of the partition moved): at least one
    mul.f32 for each accumulator element a thread holds. Without the switch no such block exists."""
    cfg = gh.config(LIBRARY_VARIANT, d)
    acc_per_thread = cfg["Q_ROWS"] * d // (cfg["num_warps"] * THREADS_PER_WARP)  # one partition's rows × d
    assert _baseline(facts, switch_facts, d)["guarded_mul_f32"] == 0
    assert switch_facts[f"{LIBRARY_VARIANT}/{d}/emu2_deg5"]["guarded_mul_f32"] == 0
    assert switch_facts[f"{LIBRARY_VARIANT}/{d}/rescale_emu1"]["guarded_mul_f32"] >= acc_per_thread


@pytest.mark.parametrize("d", gh.HEAD_DIMS)
def test_software_exp2_moves_exponentials_to_the_fma_units(facts, switch_facts, d):
    """Each emulated exponential is one ex2.approx fewer and ``degree`` Horner FMAs more; 2 of 4
    emulated moves twice as many as 1 of 4."""
    base = _baseline(facts, switch_facts, d)
    one, two = (switch_facts[f"{LIBRARY_VARIANT}/{d}/{name}"] for name in SWITCHED)
    assert base["poly_fma"] == 0
    moved_one, moved_two = base["ex2"] - one["ex2"], base["ex2"] - two["ex2"]
    assert moved_one > 0 and moved_two == 2 * moved_one, (base["ex2"], one["ex2"], two["ex2"])
    assert one["poly_fma"] == 3 * moved_one and two["poly_fma"] == 5 * moved_two, (one, two)


@pytest.mark.parametrize("d", gh.HEAD_DIMS)
def test_switches_add_no_spills(facts, switch_facts, d):
    assert _baseline(facts, switch_facts, d)["spill_bytes"] == 0
    for name in SWITCHED:
        f = switch_facts[f"{LIBRARY_VARIANT}/{d}/{name}"]
        assert f["spill_bytes"] == 0 and f["registers"] <= 255, (name, f)
        assert f["shared_bytes"] <= H100_BLOCK_SHARED_BYTES, (name, f)


@pytest.mark.parametrize("emulated", range(gh.EXP2_PACK + 1))
def test_exp2_asm_uses_fp_emulations_constants(emulated):
    """The kernel's inline asm: ``emulated`` of every EXP2_PACK elements by the polynomial, whose
    PTX immediates are course_lib.attention.fp_emulation's coefficients (the ones its tests check), the rest
    on the special-function unit."""
    asm = gh._exp2_asm(emulated, gh.EXP2_PACK, fp_emulation.EXP2_POLY_DEGREE)
    assert asm.count("ex2.approx.ftz.f32") == gh.EXP2_PACK - emulated
    assert asm.count(gh.PTX_POLY_FMA) == fp_emulation.EXP2_POLY_DEGREE * emulated
    if emulated:
        for c in fp_emulation.EXP2_POLY[1:]:  # c0 = 1 enters as the last FMA's addend
            assert gh._ptx_f32(c) in asm
        assert gh._ptx_f32(fp_emulation.EXP2_CLAMP) in asm and gh._ptx_f32(fp_emulation.EXP2_FLOOR_MAGIC) in asm


@pytest.mark.parametrize("switch,value,error,match", [
    ("rescale_tau", gh.MAX_RESCALE_TAU + 1, ValueError, "rescale_tau must be in"),
    ("rescale_tau", -1.0, ValueError, "rescale_tau must be in"),
    ("rescale_tau", "8", TypeError, "rescale_tau must be a number"),
    ("exp2_emulated", gh.EXP2_PACK + 1, ValueError, "exp2_emulated must be from 0 to"),
    ("exp2_emulated", 0.5, TypeError, "exp2_emulated must be an int"),
    ("exp2_degree", 4, ValueError, "exp2_degree must be one of"),
])
def test_bad_switches_raise(switch, value, error, match):
    q = _cpu()
    with gh.stand_in_sm90(), pytest.raises(error, match=match):  # past the "needs a GPU" check
        gh.ForwardLaunch(q, q, q, False, LIBRARY_VARIANT, **{switch: value})


def test_switches_default_off():
    """Until the H100 measures them the kernel is the one it was: always rescale, every exp2 on
    the special-function unit."""
    for variant in gh.VARIANTS:
        cfg = gh.config(variant, 64)
        assert cfg["RESCALE_TAU"] == 0 and cfg["EXP2_EMULATED"] == 0, cfg


# The ablation tool's host-side logic (tools/gluon_ablation.py runs on the GPU machine).


@pytest.fixture(scope="module")
def ablation():
    path = Path(__file__).resolve().parent.parent / "tools" / "gluon_ablation.py"
    spec = importlib.util.spec_from_file_location("gluon_ablation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ablation_configs_are_valid_switches(ablation):
    for name, switches in ablation.CONFIGS.items():
        assert gh.switch_constexprs(**switches), name
    assert ablation.GROUPS[0] == (LIBRARY_VARIANT, 128)


def test_rescale_skip_replay_follows_the_kernels_rule(ablation):
    """Scores built so that tile 1 raises one row's max by 16 (log2 units) and tile 2 by 4: with
    tau = 8 the partition holding that row rescales on tile 1 only; a tau of 2 rescales on both."""
    n, d, rows, tile = 256, 16, 64, 64  # 4 tiles of 64 keys, 4 partitions of 64 rows, one program of 128
    q = torch.zeros(1, 1, n, d)
    k = torch.zeros(1, 1, n, d)
    q[0, 0, 5, 0] = 1.0  # row 5 (partition 0) scores key j as k[j, 0] · scale · log2 e
    unit = 1.0 / (d**-0.5 * ablation.constants.LOG2_E)
    k[0, 0, tile:2 * tile, 0] = 16 * unit  # tile 1: +16
    k[0, 0, 2 * tile:, 0] = 20 * unit  # tile 2 (and 3): +4 on top
    steps = 3 * n // rows  # tiles 1-3 × 4 partitions (non-causal: every program visits every tile)
    assert ablation.rescale_skip_fraction(q, k, False, 8.0, rows, 2 * rows, tile) == pytest.approx(1 - 1 / steps)
    assert ablation.rescale_skip_fraction(q, k, False, 2.0, rows, 2 * rows, tile) == pytest.approx(1 - 2 / steps)
    assert ablation.rescale_skip_fraction(q, k, False, 1e9, rows, 2 * rows, tile) == 1.0


def test_ablation_times_both_with_the_faster_fraction(ablation):
    rows = [{"impl": f"pingpong/{d}/{c}", "dtype": "float16", "N": 1024, "causal": False, "tflops": t}
            for d in (64, 128) for c, t in (("baseline", 400.0), ("exp2_emu_1of4", 380.0), ("exp2_emu_2of4", 420.0))]
    plan = ablation.speed_plan(rows, excluded={"ws/64/baseline"})
    timed = [item for items in plan for item in items]
    assert [item for item in timed if "both" in item] == ["pingpong/64/both_2of4", "ws/64/both_2of4",
                                                          "pingpong/128/both_2of4"]
    assert "ws/64/baseline" not in timed and timed[:3] == ["sdpa_cudnn/64", "sdpa_cudnn/128", "course/64"]
    rows = [dict(r, tflops=500.0) if r["impl"].endswith("1of4") else r for r in rows]  # now 1 of 4 is faster
    assert "pingpong/64/both_1of4" in ablation.speed_plan(rows, excluded=set())[2]


@pytest.mark.gpu
@pytest.mark.parametrize("d", gh.HEAD_DIMS)
@pytest.mark.parametrize("name", list(SWITCHED))
def test_switches_match_reference_on_hopper(d, name):
    """On an H100 the switched kernel's o and lse match a float64 reference (ragged N, bf16, causal
    and not), as closely as tools/gluon_forward.py asks of the kernel without them."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward is Hopper-only (compute capability 9.x); this GPU is not")
    from course_lib.kernels import compat
    from course_lib.attention.reference import naive_attention_torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    for causal in (False, True):
        q, k, v = (torch.randn(2, 3, 1000, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        o, lse = gh.attention_forward_gluon(q, k, v, causal, variant=LIBRARY_VARIANT, **SWITCHED[name])
        assert compat.gluon_failure() is None  # else the launcher ran the Triton forward in its place
        o_ref, lse_ref = naive_attention_torch(q.double(), k.double(), v.double(), causal=causal)
        assert (o.double() - o_ref).abs().max().item() < O_TOL_BF16
        assert (lse.double() - lse_ref).abs().max().item() < LSE_TOL
