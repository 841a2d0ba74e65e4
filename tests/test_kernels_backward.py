"""The Triton backward kernels and the autograd Function against float64 autograd (chapter 07)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from course_lib.attention.reference import naive_attention_torch

pytestmark = [pytest.mark.ch07]

# ‖grad − ref‖ / ‖ref‖ budgets (measured ~3e-7 fp32, ~5e-4 fp16, ~3e-3 bf16; ~5-10x headroom).
GRAD_REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖, read as an absolute error when ‖ref‖ < 1 (dQ is exactly 0 when a
    row sees one key, for instance)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1.0)).item()


def _leaves(shapes, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def reference_grads(q, k, v, do, causal, scale=None):
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o, _ = naive_attention_torch(q64, k64, v64, causal=causal, scale=scale)
    o.backward(do.double())
    return q64.grad, k64.grad, v64.grad


def check_grads(q, k, v, causal, scale=None, seed=0):
    from course_lib import flash_attention

    o = flash_attention(q, k, v, causal=causal, scale=scale)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=gen).to(device=o.device, dtype=o.dtype)
    grads = torch.autograd.grad(o, (q, k, v), do)  # works for views (non-leaves) too
    refs = reference_grads(q, k, v, do, causal, scale)
    for name, x, g, ref in zip("qkv", (q, k, v), grads, refs):
        assert g.shape == x.shape and g.dtype == x.dtype
        err = rel_err(g, ref)
        assert err < GRAD_REL_TOL[x.dtype], (
            f"d{name}: relative error {err:.2e} for q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"{q.dtype}, causal={causal}")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("lead, n_q, n_k, d, causal", [
    ((2, 2), 37, 53, 16, False),
    ((2,), 53, 37, 32, True),
    ((), 100, 100, 64, True),
    ((1, 2), 70, 45, 24, False),
])
def test_grads_match_reference(lead, n_q, n_k, d, causal, dtype, device):
    q, k, v = _leaves([(*lead, n_q, d), (*lead, n_k, d), (*lead, n_k, d)], dtype, device)
    check_grads(q, k, v, causal)


@pytest.mark.parametrize("dkdv_blocks, dq_blocks", [((16, 32), (32, 16)), ((32, 16), (16, 16))])
def test_backward_many_tiles(dkdv_blocks, dq_blocks, device):
    """Small tiles in both backward kernels: diagonal band at the start of the dK/dV loop,
    unmasked middle, ragged tail; N_q > N_k and N_q < N_k."""
    from course_lib.kernels.backward import attention_backward
    from course_lib.kernels.forward import attention_forward
    from course_lib.kernels.tuning import Blocks

    for n_q, n_k in ((75, 50), (50, 75)):
        q, k, v = _leaves([(1, 2, n_q, 32), (1, 2, n_k, 32), (1, 2, n_k, 32)], torch.float32, device, n_q)
        do = torch.randn(1, 2, n_q, 32).to(device)
        for causal in (False, True):
            o, lse = attention_forward(q.detach(), k.detach(), v.detach(), causal, 0.2)
            grads = attention_backward(do, q.detach(), k.detach(), v.detach(), o, lse, causal, 0.2,
                                       Blocks(*dkdv_blocks), Blocks(*dq_blocks))
            for g, ref in zip(grads, reference_grads(q, k, v, do, causal, 0.2)):
                assert rel_err(g, ref) < GRAD_REL_TOL[torch.float32]


@settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.generate])  # no shrinking: too slow here
@given(lead=st.sampled_from([(), (2,)]), n_q=st.integers(1, 70), n_k=st.integers(1, 70),
       d=st.sampled_from([16, 24, 32]), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_grads_random_shapes(lead, n_q, n_k, d, causal, seed):
    from course_lib.platform import runtime

    q, k, v = _leaves([(*lead, n_q, d), (*lead, n_k, d), (*lead, n_k, d)], torch.float32,
                      runtime.current().device, seed)
    check_grads(q, k, v, causal, seed=seed)


def test_grads_non_contiguous_and_leading_dims(device):
    gen = torch.Generator().manual_seed(3)
    base_q = torch.randn(2, 33, 3, 32, generator=gen).to(device).requires_grad_()
    base_k = torch.randn(2, 3, 32, 47, generator=gen).to(device).requires_grad_()
    v = torch.randn(2, 3, 47, 32, generator=gen).to(device).requires_grad_()
    q = base_q.transpose(1, 2)  # (2, 3, 33, 32), non-contiguous
    k = base_k.transpose(-1, -2)  # (2, 3, 47, 32), stride_d = 47
    check_grads(q, k, v, causal=True)
    # (N, d) inputs
    q2, k2, v2 = _leaves([(29, 16), (31, 16), (31, 16)], torch.float32, device, 5)
    check_grads(q2, k2, v2, causal=True)


def test_sum_backward_just_works(device):
    from course_lib import flash_attention

    q, k, v = _leaves([(2, 19, 16)] * 3, torch.float32, device)
    flash_attention(q, k, v, causal=True).sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_gradcheck_float64():
    """torch.autograd.gradcheck in float64 (interpreter only: float64 is not a GPU kernel dtype).
    fast_mode checks random projections of the Jacobian: a few dozen kernel calls, not thousands."""
    from course_lib import flash_attention
    from course_lib.platform import runtime

    if not runtime.current().interpreted:
        pytest.skip("float64 runs only in the interpreter")
    q, k, v = _leaves([(1, 2, 7, 16), (1, 2, 11, 16), (1, 2, 11, 16)], torch.float64, "cpu")
    for causal in (False, True):
        assert torch.autograd.gradcheck(lambda a, b, c: flash_attention(a, b, c, causal=causal),
                                        (q, k, v), fast_mode=True)


def test_causal_keys_no_query_sees_get_zero_grad(device):
    """With N_q < N_k and causal, keys j >= N_q are never attended: dK, dV there are exactly 0."""
    q, k, v = _leaves([(1, 10, 16), (1, 40, 16), (1, 40, 16)], torch.float32, device)
    from course_lib import flash_attention

    flash_attention(q, k, v, causal=True).sum().backward()
    assert (k.grad[:, 10:] == 0).all() and (v.grad[:, 10:] == 0).all()


# ------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, n", [(dt, n) for dt in (torch.float16, torch.bfloat16) for n in (1000, 4096, 16384)]
                         + [(torch.float32, 1000), (torch.float32, 4096)],  # IEEE fp32 dots are slow
                         ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_grads_gpu_large(dtype, d, n, causal):
    heads = 2 if n <= 4096 else 1
    q, k, v = _leaves([(1, heads, n, d)] * 3, dtype, "cuda", seed=n + d)
    check_grads(q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_grads_gpu_ragged_and_odd_head_dims(dtype):
    for lead, n_q, n_k, d, causal in [((2, 3), 1000, 777, 80, True), ((3,), 333, 2049, 96, True),
                                      ((2, 2), 129, 129, 256, False), ((1, 4), 517, 517, 16, True)]:
        q, k, v = _leaves([(*lead, n_q, d), (*lead, n_k, d), (*lead, n_k, d)], dtype, "cuda")
        check_grads(q, k, v, causal)


def _spy_backwards(monkeypatch) -> list:
    """Record which backward kernel each call runs, as the dispatch took it: "gluon one-pass"
    (kernels/gluon_backward.py), "triton one-pass" (chapter 07's dK/dV kernel adding dQ with
    atomics) or "triton two-kernel" (dK/dV, then dQ: the deterministic one), read from the
    launcher the dispatch made (``BackwardLaunch.one_pass``)."""
    from course_lib.kernels import backward, gluon_backward

    ran = []
    gluon, triton_call = gluon_backward.attention_backward_gluon, backward.BackwardLaunch.__call__

    def spy_gluon(*args, **kwargs):
        ran.append("gluon one-pass")
        return gluon(*args, **kwargs)

    def spy_triton(self, *args, **kwargs):
        ran.append("triton one-pass" if self.one_pass else "triton two-kernel")
        return triton_call(self, *args, **kwargs)

    monkeypatch.setattr(gluon_backward, "attention_backward_gluon", spy_gluon)
    monkeypatch.setattr(backward.BackwardLaunch, "__call__", spy_triton)
    return ran


def _keeps_its_promise(kernel: str, got, deterministic) -> None:
    """What a backward promises against the deterministic one's gradients ``(dq, dk, dv)``."""
    if kernel == "triton two-kernel":  # it is the deterministic backward
        assert all(torch.equal(a, b) for a, b in zip(got, deterministic))
    elif kernel == "triton one-pass":  # dK, dV from the same code; dQ summed by fp32 atomics
        assert torch.equal(got[1], deterministic[1]) and torch.equal(got[2], deterministic[2])
        assert rel_err(got[0], deterministic[0]) < GRAD_REL_TOL[torch.bfloat16] / 10
    else:  # the Gluon kernel: its own tiles and order of accumulation, the documented tolerance
        for name, a, b in zip(("dq", "dk", "dv"), got, deterministic):
            assert rel_err(a, b) < GRAD_REL_TOL[torch.bfloat16], (kernel, name)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_backward_is_bitwise_reproducible_gpu(d, monkeypatch):
    """What each backward the library can take at (2, 5, 2048, d), bf16, causal (160 query tiles, more than an
    H100's SMs: not a small problem, tuning.small_problem), promises, with
    the kernel that ran named (``_spy_backwards``):

    - ``deterministic=True`` (chapter 07's two kernels, no atomics): the same bits every run;
    - the default: the Gluon one-pass backward on Hopper at d = 64 and 128 (the dispatch's own
      test, ``library_uses_gluon_backward``, says so), whose tiles and order of accumulation are
      its own: within the documented bf16 tolerance (``GRAD_REL_TOL``) of the deterministic one,
      not bitwise; elsewhere one of chapter 07's;
    - the Triton one-pass backward (taken on purpose: Gluon off, one-pass at every shape): dK, dV
      bit-identical to the deterministic one (the same code), dQ within fp32 rounding of its
      atomic sums (a tenth of the bf16 tolerance).
    """
    from course_lib import flash_attention
    from course_lib.kernels import gluon_backward, tuning

    ran = _spy_backwards(monkeypatch)
    q, k, v = _leaves([(2, 5, 2048, d)] * 3, torch.bfloat16, "cuda")
    do = torch.randn(2, 5, 2048, d, device="cuda", dtype=torch.bfloat16)

    def grads(deterministic):
        for x in (q, k, v):
            x.grad = None
        flash_attention(q, k, v, causal=True, deterministic=deterministic).backward(do)
        return [x.grad.clone() for x in (q, k, v)]

    first, second = grads(True), grads(True)
    assert ran == ["triton two-kernel"] * 2
    assert all(torch.equal(a, b) for a, b in zip(first, second))

    o = flash_attention(q, k, v, causal=True).detach()
    gluon = gluon_backward.library_uses_gluon_backward(q, k, v, o, do)
    if torch.cuda.get_device_capability()[0] == 9 and d in tuning.GLUON_BACKWARD_HEAD_DIMS:
        assert gluon, "on Hopper the default backward at this head dim is the Gluon kernel"
    ran.clear()
    default = grads(False)
    assert ran == ["gluon one-pass"] if gluon else ran in (["triton one-pass"], ["triton two-kernel"])
    _keeps_its_promise(ran[0], default, first)

    monkeypatch.setenv(tuning.GLUON_BACKWARD_ENV, "0")
    monkeypatch.setattr(tuning, "one_pass_pays", lambda *shape: True)
    ran.clear()
    one_pass = grads(False)
    assert ran == ["triton one-pass"]
    _keeps_its_promise("triton one-pass", one_pass, first)


def test_one_pass_and_two_kernel_backward_agree(device):
    """The default one-pass backward (dQ by atomic adds from the dK/dV kernel) and the two-kernel
    backward (deterministic=True) give the same gradients, on ragged, causal, N_q != N_k shapes
    and several tile shapes; dK and dV come from the same code in both."""
    from course_lib.kernels import tuning
    from course_lib.kernels.backward import attention_backward
    from course_lib.kernels.forward import attention_forward

    gen = torch.Generator().manual_seed(11)
    for n_q, n_k, d, causal in [(45, 70, 24, False), (70, 45, 16, True), (33, 33, 32, True)]:
        q, do = (torch.randn(2, 2, n_q, d, generator=gen).to(device) for _ in range(2))
        k, v = (torch.randn(2, 2, n_k, d, generator=gen).to(device) for _ in range(2))
        o, lse = attention_forward(q, k, v, causal, 0.25)
        refs = reference_grads(q, k, v, do, causal, 0.25)
        for blocks in (tuning.Blocks(16, 32), tuning.Blocks(32, 16)):
            one = attention_backward(do, q, k, v, o, lse, causal, 0.25, blocks, blocks)
            two = attention_backward(do, q, k, v, o, lse, causal, 0.25, blocks, blocks, deterministic=True)
            for a, b, ref in zip(one, two, refs):
                assert rel_err(a, ref) < GRAD_REL_TOL[torch.float32]
                assert rel_err(a, b) < GRAD_REL_TOL[torch.float32]
            assert torch.equal(one[1], two[1]) and torch.equal(one[2], two[2])


def test_deterministic_must_be_a_bool():
    from course_lib import flash_attention

    q = torch.randn(1, 8, 16)
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        flash_attention(q, q, q, deterministic="yes")


def test_mistake_hooks_are_off_by_default_and_each_changes_the_gradients(device):
    """Chapter 07's mistake models are the library's kernels with ``mistake=`` set: without it the
    kernels are exact (out= writes the same values), and every hook changes what it claims to."""
    from course_lib.kernels import tuning
    from course_lib.kernels.backward import MISTAKES, attention_backward
    from course_lib.kernels.forward import attention_forward

    gen = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(1, 2, n, 16, generator=gen).to(device) for n in (40, 40, 40, 40))
    causal, scale, blocks = True, 0.3, tuning.Blocks(32, 16)
    o, lse = attention_forward(q, k, v, causal, scale)
    right = attention_backward(do, q, k, v, o, lse, causal, scale, blocks, blocks)
    for got, want in zip(right, reference_grads(q, k, v, do, causal, scale)):
        assert rel_err(got, want) < GRAD_REL_TOL[torch.float32]
    out = tuple(torch.empty_like(x) for x in (q, k, v))
    assert attention_backward(do, q, k, v, o, lse, causal, scale, blocks, blocks, out=out) is out
    assert all(torch.equal(a, b) for a, b in zip(out, right))
    square = tuning.Blocks(16, 16)  # P-for-Pᵀ mistakes only have a shape on square tiles
    for name in MISTAKES:
        tile = square if name in ("dk_ds_not_dst", "dv_p_not_pt") else blocks
        wrong = attention_backward(do, q, k, v, o, lse, causal, scale, tile, tile, mistake=name)
        changed = [not torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in zip(wrong, right)]
        assert any(changed), name
        if name in ("dk_no_scale", "dk_ds_not_dst", "dv_p_not_pt"):  # one gradient only
            assert sum(changed) == 1, (name, changed)
