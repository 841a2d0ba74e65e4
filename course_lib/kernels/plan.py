"""Launch plans: what a dense ``flash_attention`` call works out once per call signature (issue 33).

Measured on an H100 (FACTS.md, 2026-11-26) at a small shape (B=1, H=4, N=128, d=64, bf16, causal),
a call of :func:`course_lib.flash_attention` cost 201 µs forward and 841 µs forward+backward, most
of it on the host, where SDPA's FlashAttention-2 backend costs 35 / 187 µs. Every call checked its
inputs, chose a kernel, fitted its launch config to the GPU, made tensor descriptors and their
shared-memory layouts, and went through Triton's argument binding, although none of that changes
while the call's *signature* stays the same.

The signature (:func:`signature`) is everything any of that reads: the shapes, strides, dtypes,
devices and 16-byte alignment of q, k and v, ``causal``, the runtime mode, the CUDA device, and
the environment switches that pick kernels (``COURSE_LIB_TMA``, ``COURSE_LIB_GLUON``, ...). A
:class:`Plan` is made once per signature and keeps:

- that :func:`course_lib.kernels.api.validate_inputs` passed (its checks read nothing else);
- the forward: which kernel (the Gluon forward, the TMA descriptor forward or chapter 06's), its
  config fitted to the GPU (:func:`course_lib.kernels.fit.choose`), grid, constexprs and dtypes;
- per layout of the upstream gradient (and ``deterministic``), the same for the backward (the
  Gluon one-pass kernel or chapter 07's) and its Δ pre-pass;
- in each launch, the compiled kernel, launched by its handle after the first call
  (:class:`~course_lib.kernels.launch.CachedLaunch`), and the first call's checked descriptors.

What a call still does: compute its signature and look it up, check ``scale``, allocate the
outputs, put the tensors' addresses into copies of the descriptors, launch. Nothing reads a GPU
tensor's values, so nothing waits for the GPU. A plan never serves another signature; keys hold no
tensors; the :data:`PLAN_CACHE_SIZE` most recently made signatures are kept.
"""

from __future__ import annotations

import os
import weakref

import torch

from course_lib.platform import runtime
from course_lib.kernels import backward, forward, hopper, tuning
from course_lib.kernels.launch import CachedLaunch
from course_lib.kernels.inputs import as_4d  # noqa: F401 (plan.as_4d: its old home)

# Triton specializes a pointer argument on whether it is a multiple of 16 bytes, and TMA
# descriptors need it: a compiled kernel is only right for the alignment it was compiled for.
ALIGN_BYTES = 16
# The environment switches that pick kernels or their constexprs. Read once per call, in the
# signature: tools and tests flip them within one process, and nothing cheaper tells that one
# changed (os.environ keeps no version counter; a cached copy would serve a stale plan after
# monkeypatch.setenv). The read costs 0.3 µs of the signature's 1.8 µs (our CPU, torch 2.13,
# 2026-11-27, timeit); what did cost was reading them 2-3 times per call, now once.
SWITCHES = (tuning.TMA_ENV, tuning.GLUON_ENV, tuning.GLUON_BACKWARD_ENV, tuning.AUTOTUNE_ENV,
            forward.FP32_DOTS_ENV)
# Signatures kept (oldest made first out): a model calls a handful; a sweep over many lengths
# makes one plan per length and should not grow without bound.
PLAN_CACHE_SIZE = 256

# os.environ.get costs ~2 µs for a missing name (it raises and catches KeyError inside); the
# environment's own dict (os._Environ._data, keyed by encoded names) answers in ~0.1 µs.
_ENV_DATA = getattr(os.environ, "_data", None)
_SWITCH_KEYS = tuple(os.environ.encodekey(name) for name in SWITCHES) if _ENV_DATA is not None else SWITCHES


def _switches() -> tuple:
    """The values of :data:`SWITCHES` now (None where unset; encoded as the environment stores them)."""
    if _ENV_DATA is not None:
        return tuple(map(_ENV_DATA.get, _SWITCH_KEYS))
    return tuple(map(os.environ.get, SWITCHES))


def signature(q, k, v, causal: bool) -> tuple:
    """The key of the plan for these inputs: every property of the call a plan depends on.

    Raises:
        RuntimeError / AttributeError from tensors without strides or storage (sparse, nested):
        the caller checks those inputs the slow way.
    """
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device,
            (q.data_ptr() % ALIGN_BYTES == 0, k.data_ptr() % ALIGN_BYTES == 0, v.data_ptr() % ALIGN_BYTES == 0),
            causal, runtime.current().mode, _current_cuda_device() if q.is_cuda else None, _switches())


# The current CUDA device's index, as torch.cuda.current_device() returns it but without its
# _lazy_init() (asked only with a CUDA tensor in hand, so CUDA is initialized): current_device cost
# ~3 µs a call in the H100 profile (FACTS.md, 2026-11-27). Read on every call, not cached:
# torch.cuda.set_device may change it, and a launch by handle runs on the current device.
_current_cuda_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device  # CPU builds lack it


_PLANS: dict[tuple, Plan] = {}


def cached_by_key(key: tuple):
    """The plan of the signature ``key`` (:func:`signature`) if one was made, else None (makes nothing)."""
    return _PLANS.get(key)


def plan_for(q, k, v, causal: bool, key: tuple | None = None) -> Plan:
    """The plan of this call's signature (``key``: :func:`signature`, when the caller has it),
    made now if there is none."""
    key = signature(q, k, v, causal) if key is None else key
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= PLAN_CACHE_SIZE:
            _PLANS.pop(next(iter(_PLANS)))  # the oldest
        plan = _PLANS[key] = Plan(key)
    return plan


def clear() -> None:
    """Forget every plan (the next call of each signature makes its plan again)."""
    _PLANS.clear()


def _gluon_forward_module():
    """:mod:`course_lib.kernels.gluon_hopper`, imported on first use on a GPU (Gluon is experimental)."""
    from course_lib.kernels import gluon_hopper

    return gluon_hopper


def _gluon_backward_module():
    """:mod:`course_lib.kernels.gluon_backward`, imported on first use on a GPU."""
    from course_lib.kernels import gluon_backward

    return gluon_backward


class Plan:
    """What one call signature needs, made at its first call (see the module docstring).

    Attributes:
        key: the signature. validated: :func:`~course_lib.kernels.api.validate_inputs` passed for it.
        forward_launch: the forward's runner ``(q4, k4, v4, scale) -> (o4, lse)``, once made.
        backward_launches: per upstream-gradient layout and ``deterministic``, the backward's runner
            ``(do4, q4, k4, v4, o4, lse4, scale) -> (dq, dk, dv)``.
    """

    __slots__ = ("key", "validated", "four_d", "forward_launch", "backward_launches", "__weakref__")

    def __init__(self, key: tuple):
        self.key, self.validated = key, False
        self.four_d = len(key[0]) == 4  # q (B, H, N, d): no views to make, nothing to reshape
        self.forward_launch = None
        self.backward_launches: dict = {}

    def forward(self, q, k, v, causal: bool, scale: float):
        """``(o, lse)`` shaped like the inputs: ``o`` ``(..., N_q, d)``, ``lse`` ``(..., N_q)``."""
        run = self.forward_launch or self._make_forward(q, k, v, causal)
        if self.four_d:
            return run(q, k, v, scale)
        o4, lse = run(as_4d(q), as_4d(k), as_4d(v), scale)
        return o4.reshape(q.shape), lse.reshape(q.shape[:-1])

    def backward(self, do, q, k, v, o, lse, causal: bool, scale: float, deterministic: bool):
        """``(dq, dk, dv)`` shaped like q, k, v, from the forward's saved ``o`` and ``lse``."""
        key = (do.shape, do.stride(), do.dtype, do.data_ptr() % ALIGN_BYTES == 0, o.stride(),
               o.data_ptr() % ALIGN_BYTES == 0, lse.stride(), lse.data_ptr() % ALIGN_BYTES == 0, deterministic)
        run = self.backward_launches.get(key) or self._make_backward(key, do, q, k, v, o, lse, causal, deterministic)
        if self.four_d:
            return run(do, q, k, v, o, lse, scale)
        o4 = as_4d(o)
        dq, dk, dv = run(as_4d(do), as_4d(q), as_4d(k), as_4d(v), o4, lse.reshape(o4.shape[:-1]), scale)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)

    def launches(self) -> list:
        """Every :class:`~course_lib.kernels.launch.CachedLaunch` this plan made so far (tools, tests)."""
        found = []
        for run in (self.forward_launch, *self.backward_launches.values()):
            found += [x for x in vars(run).values() if isinstance(x, CachedLaunch)] if run is not None else []
            inner = getattr(run, "kernel", None) or getattr(run, "gluon_launch", None)  # TMA, Gluon runners
            found += [x for x in vars(inner).values() if isinstance(x, CachedLaunch)] if inner is not None else []
        return found

    def _make_forward(self, q, k, v, causal: bool):
        q4, k4, v4 = as_4d(q), as_4d(k), as_4d(v)
        small = tuning.small_problem_on_gpu(q4)  # chapter 06's kernel: no descriptors to pack (tuning.py)
        if not small and q4.is_cuda and _gluon_forward_module().library_uses_gluon(q4, k4, v4):  # chapter 09: Gluon
            run = _GluonForward(self, q4, k4, v4, causal)
        elif not small and hopper.library_uses_tma(q4, k4, v4):  # chapter 09: descriptor loads where they pay
            run = hopper.TmaForwardLaunch(q4, k4, v4, causal, cache=True)
        else:
            run = forward.ForwardLaunch(q4, k4, v4, causal, cache=True)
        self.forward_launch = run
        return run

    def _make_backward(self, key, do, q, k, v, o, lse, causal: bool, deterministic: bool):
        q4, k4, v4, o4, do4 = as_4d(q), as_4d(k), as_4d(v), as_4d(o), as_4d(do)
        lse4 = lse.reshape(o4.shape[:-1])
        # chapter 09: the Gluon one-pass backward on Hopper (never for deterministic=True, nor for a
        # small problem: chapter 07's two kernels, the fewest launches, tuning.small_problem)
        if (not deterministic and do.is_cuda and not tuning.small_problem_on_gpu(q4)
                and _gluon_backward_module().library_uses_gluon_backward(q4, k4, v4, o4, do4)):
            run = _GluonBackward(self, key, q4, k4, v4, o4, do4, lse4, causal)
        else:
            run = backward.BackwardLaunch(q4, k4, v4, causal, deterministic=deterministic, cache=True)
        self.backward_launches[key] = run
        return run


class _GluonForward:
    """The Gluon forward's launcher with the plan's launch. If the kernel did not compile (the
    launcher then ran a Triton kernel and turned Gluon off, :class:`course_lib.kernels.compat.FallBack`),
    the plan forgets this runner and the next call plans again, with the Triton kernels."""

    def __init__(self, plan: Plan, q4, k4, v4, causal: bool):
        self.gluon, self.plan, self.causal = _gluon_forward_module(), weakref.ref(plan), causal
        self.gluon_launch = self.gluon.ForwardLaunch(q4, k4, v4, causal, tuning.GLUON_VARIANT, cache=True)

    def __call__(self, q, k, v, scale: float):
        out = self.gluon.attention_forward_gluon(q, k, v, self.causal, scale, tuning.GLUON_VARIANT, self.gluon_launch)
        if self.gluon_launch.launch.compiled is None and self.plan() is not None:  # did not compile
            self.plan().forward_launch = None
        return out


class _GluonBackward:
    """The Gluon backward's launcher with the plan's launch (a kernel that did not compile: as
    :class:`_GluonForward`)."""

    def __init__(self, plan: Plan, key: tuple, q4, k4, v4, o4, do4, lse4, causal: bool):
        self.gluon, self.plan, self.key, self.causal = _gluon_backward_module(), weakref.ref(plan), key, causal
        self.gluon_launch = self.gluon.BackwardLaunch(q4, k4, v4, o4, do4, lse4, causal, cache=True)

    def __call__(self, do, q, k, v, o, lse, scale: float):
        grads = self.gluon.attention_backward_gluon(do, q, k, v, o, lse, self.causal, scale, launch=self.gluon_launch)
        if self.gluon_launch.launch.compiled is None and self.plan() is not None:  # did not compile
            self.plan().backward_launches.pop(self.key, None)
        return grads


__all__ = ["ALIGN_BYTES", "SWITCHES", "PLAN_CACHE_SIZE", "Plan", "signature", "cached_by_key", "plan_for", "clear",
           "as_4d"]
