"""Every implementation of the algorithm, one oracle, the same ragged shapes (minitorch style).

Each forward the course builds (NumPy FA2 and FA1 loop orders, NumPy with a mask rule, the
chapter 06 teaching kernel, the library Triton kernel) and each backward (NumPy tiled, Triton
through autograd) runs on shapes drawn by Hypothesis: N_q and N_k unrelated and rarely a multiple of
a tile, small tiles so that every case spans several, causal or not, one or two leading dims. All
are compared with ``course_lib.attention.reference`` (float64). A new implementation joins by adding one
entry to ``FORWARDS`` or ``BACKWARDS``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from course_lib import flash_attention
from course_lib.platform import runtime
from course_lib.attention import tiled, tiled_backward
from course_lib.kernels import teaching
from course_lib.attention.reference import naive_attention_numpy, naive_attention_torch

pytestmark = [pytest.mark.ch04, pytest.mark.ch06, pytest.mark.ch07]

TRITON_BLOCK = 16  # the smallest tile tl.dot takes: short sequences still span several tiles
NUMPY_BLOCKS = dict(block_m=8, block_n=5)  # unequal, so a BLOCK_M / BLOCK_N mix-up shows


def _device() -> str:
    return runtime.current().device


def _torch(x, dtype):
    return torch.from_numpy(np.ascontiguousarray(x)).to(device=_device(), dtype=dtype)


def _triton_dtype():
    # float64 runs only in the interpreter; on a GPU the kernels' exact dtype is fp32 (IEEE dots)
    return torch.float64 if runtime.current().interpreted else torch.float32


def _numpy_fa2(q, k, v, causal):
    return tiled.flash_attention_numpy(q, k, v, causal=causal, **NUMPY_BLOCKS)


def _numpy_fa1(q, k, v, causal):
    return tiled.flash_attention_numpy_fa1(q, k, v, causal=causal, **NUMPY_BLOCKS)


def _teaching(q, k, v, causal):
    # the teaching kernel takes float32 (it is the chapter 06 exercise kernel)
    o, lse = teaching.forward(_torch(q, torch.float32), _torch(k, torch.float32), _torch(v, torch.float32),
                              causal, blocks=(TRITON_BLOCK, TRITON_BLOCK))
    return o.double().cpu().numpy(), lse.double().cpu().numpy()


def _library(q, k, v, causal):
    from course_lib import flash_attention_with_lse

    dt = _triton_dtype()
    o, lse = flash_attention_with_lse(_torch(q, dt), _torch(k, dt), _torch(v, dt), causal)
    return o.double().cpu().numpy(), lse.double().cpu().numpy()


# name -> (function (q, k, v, causal) -> (o, lse), atol)
FORWARDS = {
    "numpy FA2": (_numpy_fa2, 1e-10),
    "numpy FA1": (_numpy_fa1, 1e-10),
    "teaching Triton": (_teaching, 2e-5 if runtime.current().interpreted else 5e-3),  # fp32 (tf32 on a GPU)
    "library Triton": (_library, 1e-10 if runtime.current().interpreted else 2e-5),
}


@st.composite
def problems(draw, max_n=48, head_dims=(16, 32)):
    """q, k, v (float64) with ragged lengths, and a causal flag."""
    lead = tuple(draw(st.lists(st.integers(1, 2), min_size=1, max_size=2)))
    n_q, n_k = draw(st.integers(1, max_n)), draw(st.integers(1, max_n))
    d = draw(st.sampled_from(head_dims))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(lead + (n_q, d))
    k = rng.standard_normal(lead + (n_k, d))
    v = rng.standard_normal(lead + (n_k, d))
    return q, k, v, draw(st.booleans())


_SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", list(FORWARDS))
@_SETTINGS
@given(problem=problems())
def test_every_forward_matches_the_reference(name, problem):
    q, k, v, causal = problem
    fn, atol = FORWARDS[name]
    o, lse = fn(q, k, v, causal)
    o_ref, lse_ref = naive_attention_numpy(q, k, v, causal)
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape, (name, o.shape, lse.shape)
    np.testing.assert_allclose(o, o_ref, atol=atol, rtol=0, err_msg=f"{name}: o, shape {q.shape} / {k.shape}, causal={causal}")
    np.testing.assert_allclose(lse, lse_ref, atol=atol, rtol=0, err_msg=f"{name}: lse, causal={causal}")


def _reference_grads(q, k, v, do, causal):
    qt, kt, vt = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    o, _ = naive_attention_torch(qt, kt, vt, causal=causal)
    o.backward(torch.from_numpy(do))
    return qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy()


def _numpy_backward(q, k, v, do, causal):
    o, lse = naive_attention_numpy(q, k, v, causal)
    return tiled_backward.flash_attention_numpy_backward(q, k, v, o, lse, do, causal=causal, **NUMPY_BLOCKS)


def _triton_backward(q, k, v, do, causal):
    dt = _triton_dtype()
    qt, kt, vt = (_torch(x, dt).requires_grad_() for x in (q, k, v))
    flash_attention(qt, kt, vt, causal=causal).backward(_torch(do, dt))
    return tuple(x.grad.double().cpu().numpy() for x in (qt, kt, vt))


BACKWARDS = {
    "numpy tiled": (_numpy_backward, 1e-9),
    "library Triton (autograd)": (_triton_backward, 1e-9 if runtime.current().interpreted else 1e-4),
}


@pytest.mark.parametrize("name", list(BACKWARDS))
@_SETTINGS
@given(problem=problems(max_n=40))
def test_every_backward_matches_the_reference(name, problem):
    q, k, v, causal = problem
    do = np.random.default_rng(q.size).standard_normal(q.shape[:-1] + (v.shape[-1],))
    fn, atol = BACKWARDS[name]
    grads = fn(q, k, v, do, causal)
    for label, g, ref in zip(("dq", "dk", "dv"), grads, _reference_grads(q, k, v, do, causal)):
        assert g.shape == ref.shape, (name, label, g.shape, ref.shape)
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(g, ref, atol=atol * scale, rtol=0,
                                   err_msg=f"{name}: {label}, shapes {q.shape} / {k.shape}, causal={causal}")


@_SETTINGS
@given(problem=problems(max_n=60), window=st.integers(1, 20))
def test_the_masked_forward_matches_the_masked_reference(problem, window):
    """The same loop with a sliding-window rule: tiles outside the band skipped, others masked."""
    from course_lib.attention import masks

    q, k, v, _ = problem
    o, lse = masks.sliding_window_attention_numpy(q, k, v, window, **NUMPY_BLOCKS)
    i, j = np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]
    mask = (j <= i) & (j > i - window)  # written out here, not taken from the rule under test
    o_ref, lse_ref = masks.masked_attention_numpy(q, k, v, mask)
    np.testing.assert_allclose(o, o_ref, atol=1e-10, rtol=0)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))  # rows that see no key
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[finite], lse_ref[finite], atol=1e-10, rtol=0)
