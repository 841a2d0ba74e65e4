"""Launch plans (course_lib/kernels/plan.py, course_lib/kernels/launch.py): one plan per call
signature, made once, reused for that signature only, and the same results as without it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from course_lib import flash_attention
from course_lib.platform import runtime
from course_lib.kernels import forward, plan as plans
from course_lib.attention.reference import naive_attention_torch

pytestmark = [pytest.mark.ch06, pytest.mark.ch07]

# Gradient and output error allowed against the float64 reference: fp32 on CPU (the interpreter's
# dots are exact, so ~1e-6), fp16 on a GPU (fp32 would compile for a minute per kernel there).
ATOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 2e-2}


@pytest.fixture(autouse=True)
def _no_plans():
    """Each test starts from no plans (a plan from another test would hide the one made here)."""
    plans.clear()
    yield
    plans.clear()


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.float16


def _qkv(shape, device, dtype=None, n_k=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or _dtype(device)
    kv_shape = shape[:-2] + (n_k or shape[-2], shape[-1])
    return tuple(torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in (shape, kv_shape, kv_shape))


def _plan_of(q, k, v, causal):
    return plans.cached_by_key(plans.signature(q, k, v, causal))


def _runs(q, k, v, do, causal: bool, times: int) -> list[tuple]:
    """``times`` calls of forward+backward on copies of q, k, v: ``(o, dq, dk, dv)`` of each."""
    runs = []
    for _ in range(times):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = flash_attention(*leaves, causal=causal)
        o.backward(do)
        runs.append((o.detach(), *(x.grad for x in leaves)))
    return runs


def _reference(q, k, v, do, causal: bool) -> tuple:
    """``(o, dq, dk, dv)`` of the float64 reference."""
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    o = naive_attention_torch(*ref, causal=causal)[0]
    o.backward(do.double())
    return (o.detach(), *(x.grad for x in ref))


def _close_to_reference(o, q, k, v, causal):
    ref, _ = naive_attention_torch(q.double(), k.double(), v.double(), causal=causal)
    assert o.shape == q.shape
    assert torch.allclose(o.double(), ref, atol=ATOL[o.dtype], rtol=0), (o.double() - ref).abs().max().item()


def test_same_signature_reuses_the_plan(device):
    """A second call of the same signature (fresh tensors, same layout) finds the first call's
    plan and its forward launch; nothing new is made."""
    q, k, v = _qkv((1, 2, 40, 32), device)
    with torch.no_grad():
        flash_attention(q, k, v, causal=True)
        first = _plan_of(q, k, v, True)
        assert first is not None and first.validated and first.forward_launch is not None
        made = first.forward_launch
        q2, k2, v2 = _qkv((1, 2, 40, 32), device, seed=1)
        o2 = flash_attention(q2, k2, v2, causal=True)
    assert _plan_of(q2, k2, v2, True) is first and first.forward_launch is made
    assert len(plans._PLANS) == 1
    _close_to_reference(o2, q2, k2, v2, True)


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a tensor whose data starts one element past a 16-byte boundary."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:]
    return flat.view(x.shape).copy_(x)


def test_each_signature_gets_its_own_plan(device):
    """Another stride (a transposed view), dtype, shape, mask or 16-byte alignment is another
    signature: a new plan each, and each call's answer is right."""
    q, k, v = _qkv((1, 2, 40, 32), device)
    other_dtype = torch.float64 if runtime.current().interpreted else torch.bfloat16
    variants = {
        "base": (q, k, v, True),
        "strides": tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)) + (True,),
        "dtype": tuple(x.to(other_dtype) for x in (q, k, v)) + (True,),
        "shape": _qkv((1, 2, 41, 32), device) + (True,),
        "causal": (q, k, v, False),
        "alignment": (_misaligned(q), k, v, True),
    }
    assert variants["alignment"][0].data_ptr() % plans.ALIGN_BYTES != 0
    seen = []
    with torch.no_grad():
        for name, (qx, kx, vx, causal) in variants.items():
            o = flash_attention(qx, kx, vx, causal=causal)
            plan = _plan_of(qx, kx, vx, causal)
            assert plan is not None and all(plan is not p for p in seen), name
            seen.append(plan)
            if qx.dtype != torch.bfloat16:  # bf16's rounding needs a looser bound than this test's
                _close_to_reference(o, qx, kx, vx, causal)
    assert len(plans._PLANS) == len(variants)


def test_a_plan_never_serves_a_different_shape(device):
    """The same tensor object changed in place (``unsqueeze_``) is another signature; and a plan's
    launch keeps the shape it was made for."""
    q, k, v = _qkv((24, 16), device)
    with torch.no_grad():
        flash_attention(q, k, v)
        before = _plan_of(q, k, v, False)
        for x in (q, k, v):
            x.unsqueeze_(0)  # (1, 24, 16): same data, another shape
        o = flash_attention(q, k, v)
    after = _plan_of(q, k, v, False)
    assert after is not before and o.shape == (1, 24, 16)
    _close_to_reference(o, q, k, v, False)
    assert before.forward_launch.o_shape == (1, 1, 24, 16) == after.forward_launch.o_shape  # both as (B, H, N, d)
    assert before.key[0] == (24, 16) and after.key[0] == (1, 24, 16)


def test_checks_still_run_on_a_known_signature(device):
    """A signature that passed is not checked again, but ``scale`` and ``causal`` are checked on
    every call, and a signature that failed fails every time."""
    q, k, v = _qkv((2, 17, 16), device)
    flash_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="scale must be finite"):
        flash_attention(q, k, v, causal=True, scale=math.nan)
    with pytest.raises(TypeError, match="scale must be a real number"):
        flash_attention(q, k, v, causal=True, scale="0.1")
    with pytest.raises(TypeError, match="causal must be True or False, got 1"):
        flash_attention(q, k, v, causal=1)
    other = k.to(torch.float32 if k.dtype != torch.float32 else torch.float16)  # GPU inputs are fp16 already
    for _ in range(2):
        with pytest.raises(TypeError, match="same dtype"):
            flash_attention(q, other, v)
    assert not _plan_of(q, other, v, False)


def test_switches_are_part_of_the_signature(device, monkeypatch):
    """Flipping an environment switch that picks kernels or constexprs (here fp32's dot precision)
    gives another plan; putting it back finds the old one."""
    q, k, v = _qkv((1, 1, 20, 16), device, dtype=torch.float32)
    monkeypatch.delenv(forward.FP32_DOTS_ENV, raising=False)
    with torch.no_grad():
        flash_attention(q, k, v)
        unset, switches = _plan_of(q, k, v, False), plans._switches()
        monkeypatch.setenv(forward.FP32_DOTS_ENV, "ieee")
        assert plans._switches() != switches
        flash_attention(q, k, v)
        ieee = _plan_of(q, k, v, False)
        assert ieee is not unset and ieee.forward_launch.meta["DOT_PRECISION"] == "ieee"
        monkeypatch.delenv(forward.FP32_DOTS_ENV)
        assert _plan_of(q, k, v, False) is unset


def test_the_cache_keeps_the_newest_plans(device, monkeypatch):
    monkeypatch.setattr(plans, "PLAN_CACHE_SIZE", 2)
    shapes = [(1, 1, n, 16) for n in (9, 10, 11)]
    with torch.no_grad():
        for shape in shapes:
            flash_attention(*_qkv(shape, device))
    assert len(plans._PLANS) == 2
    assert [key[0] for key in plans._PLANS] == [torch.Size(s) for s in shapes[1:]]  # the oldest went first


def test_backward_plan_per_gradient_layout(device):
    """An expanded upstream gradient (``o.sum().backward()``: stride 0) and a dense one, and the
    deterministic backward, are separate backward launches of one plan; all three are right."""
    q, k, v = (x.requires_grad_() for x in _qkv((1, 2, 33, 16), device, n_k=45))
    o = flash_attention(q, k, v, causal=True)
    o.sum().backward()
    grads_sum = [x.grad.clone() for x in (q, k, v)]
    do = torch.ones_like(o)
    for deterministic in (False, True):
        for x in (q, k, v):
            x.grad = None
        flash_attention(q, k, v, causal=True, deterministic=deterministic).backward(do)
        for got, want in zip((q.grad, k.grad, v.grad), grads_sum):
            assert torch.allclose(got.double(), want.double(), atol=ATOL[got.dtype])
    plan = _plan_of(q, k, v, True)
    assert len(plan.backward_launches) == 3
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    naive_attention_torch(*ref, causal=True)[0].sum().backward()
    for got, want in zip(grads_sum, ref):
        assert torch.allclose(got.double(), want.grad, atol=ATOL[got.dtype])


def test_one_signature_per_call(device, monkeypatch):
    """A call of a known signature works out its signature once: the forward runs the plan its
    validation found, and the backward the plan its forward kept on the autograd context."""
    q, k, v = (x.requires_grad_() for x in _qkv((1, 2, 24, 16), device))
    flash_attention(q, k, v, causal=True).sum().backward()  # makes the plan and its launches
    counted = []
    real = plans.signature
    monkeypatch.setattr(plans, "signature", lambda *a: counted.append(1) or real(*a))
    with torch.no_grad():
        flash_attention(q, k, v, causal=True)
    assert len(counted) == 1
    counted.clear()
    o = flash_attention(q, k, v, causal=True)
    o.sum().backward()
    assert len(counted) == 1
    assert o.grad_fn.plan is _plan_of(q, k, v, True)  # the autograd context keeps the forward's plan


def test_backward_buffers_share_the_scratch_never_the_gradients():
    """On a GPU (and here when asked): dQ's accumulator and Δ share one zeroed buffer (Δ 512-byte
    aligned); dq, dk, dv, the call's outputs, never share storage (a custom op's outputs must not
    alias: opcheck's test_schema). CPU tensors keep separate allocations by default."""
    from course_lib.kernels.backward import Buffers

    assert not Buffers((1, 2, 40, 32), (1, 2, 40, 32), torch.float16, torch.float32, "cpu", True).combine
    buffers = Buffers((1, 2, 40, 32), (1, 2, 40, 32), torch.float16, torch.float32, "cpu", one_pass=True,
                      combine=True)  # as on a GPU
    dq_acc, delta = buffers.scratch()
    assert dq_acc.shape == (1, 2, 40, 32) and delta.shape == (1, 2, 40) and delta.is_contiguous()
    assert dq_acc.untyped_storage().data_ptr() == delta.untyped_storage().data_ptr()
    assert (delta.data_ptr() - dq_acc.data_ptr()) % 512 == 0 and delta.data_ptr() >= dq_acc[-1, -1, -1, -1].data_ptr()
    assert torch.count_nonzero(dq_acc) == 0
    dq, dk, dv = buffers.grads()
    assert dq is None  # one-pass: made from the accumulator
    dq_acc.fill_(1.0 / 3)
    dq = buffers.dq_from(dq, dq_acc)
    assert torch.equal(dq, dq_acc.to(torch.float16))
    assert len({x.untyped_storage().data_ptr() for x in (dq, dk, dv, dq_acc)}) == 4
    two = Buffers((1, 1, 3, 17), (1, 1, 5, 17), torch.float16, torch.float32, "cpu", one_pass=False, combine=True)
    assert two.scratch()[0] is None
    dq, dk, dv = two.grads()
    assert len({x.untyped_storage().data_ptr() for x in (dq, dk, dv)}) == 3
    assert dq.shape == (1, 1, 3, 17) and dk.shape == dv.shape == (1, 1, 5, 17)
    fp32 = Buffers((1, 1, 8, 16), (1, 1, 8, 16), torch.float32, torch.float32, "cpu", one_pass=True, combine=True)
    dq_acc, _ = fp32.scratch()
    dq, dk, dv = fp32.grads()
    assert dq is None and fp32.dq_from(dq, dq_acc) is dq_acc  # fp32 work: dQ's sums are dq


@pytest.mark.parametrize("seed", range(4))
def test_results_unchanged_with_plans(device, seed):
    """Fresh random irregular shapes (ragged N_q != N_k, head dims that are not powers of two,
    2- to 5-dim inputs): the first call (makes the plan) and the second (uses it) give the same o
    and gradients, equal to the float64 reference within the dtype's error, and the forward equals
    the launcher called without a plan."""
    rng = np.random.default_rng(seed)
    lead = tuple(int(x) for x in rng.integers(1, 3, size=int(rng.integers(0, 4))))
    n_q, n_k, d = (int(x) for x in (rng.integers(1, 90), rng.integers(1, 90), rng.integers(16, 72)))
    causal = bool(rng.integers(0, 2))
    q, k, v = _qkv(lead + (n_q, d), device, n_k=n_k, seed=seed)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q)
    runs = _runs(q, k, v, do, causal, times=2)
    assert _plan_of(q, k, v, causal).forward_launch is not None
    if device == "cpu":  # the interpreter runs the programs in order: bit for bit the same
        assert all(torch.equal(a, b) for a, b in zip(*runs))
    for got, want in zip(runs[1], _reference(q, k, v, do, causal)):
        assert torch.allclose(got.double(), want, atol=ATOL[got.dtype], rtol=1e-3), (got.double() - want).abs().max()
    q4, k4, v4 = (plans.as_4d(x) for x in (q, k, v))
    o_direct, _ = forward.attention_forward(q4, k4, v4, causal, d ** -0.5)
    if device == "cpu":
        assert torch.equal(o_direct.reshape(q.shape), runs[1][0])


@pytest.mark.gpu
def test_gpu_plans_launch_by_handle_and_match_the_first_call():
    """On the GPU: after a call, every launch of a plan (forward, Δ, backward) goes by handle; the
    forward by handle gives the first call's o bit for bit, the backward the first call's gradients
    (up to the order of dQ's atomic adds), and both match the float64 reference (fp16 and bf16,
    d = 64 and 128, causal or not, a small problem (fewer query tiles than SMs: the Triton kernels,
    tuning.small_problem) and a larger one (the Gluon kernels on Hopper): the paths the H100 takes)."""
    from course_lib.kernels import backward, tuning

    small, large = (2, 3, 300), (4, 16, 300)  # 18 and 192 query tiles of 128 rows
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert tuning.small_problem(6, 300, sms) and not tuning.small_problem(64, 300, sms), sms
    for dtype in (torch.float16, torch.bfloat16):
        for d, shape in ((d, s) for d in (64, 128) for s in (small, large)):
            for causal in (False, True):
                q, k, v = _qkv(shape + (d,), "cuda", dtype=dtype)
                do = torch.randn_like(q)
                runs = _runs(q, k, v, do, causal, times=3)
                plan = _plan_of(q, k, v, causal)
                if shape == small:  # chapter 06's forward, chapter 07's two-kernel backward
                    assert type(plan.forward_launch) is forward.ForwardLaunch
                    assert [type(x) for x in plan.backward_launches.values()] == [backward.BackwardLaunch]
                    assert not next(iter(plan.backward_launches.values())).one_pass
                made = plan.launches()
                assert len(made) >= 3 and all(x.by_handle for x in made), (dtype, d, causal)
                assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][0], runs[2][0])
                tol = 2e-2 if dtype == torch.float16 else 6e-2
                for got, want in zip(runs[2], _reference(q, k, v, do, causal)):
                    bound = tol * max(1.0, want.abs().max().item())
                    assert (got.double() - want).abs().max() <= bound, (dtype, d, causal)
