"""``flash_attention``: the public, autograd-aware entry point to the Triton kernels.

Semantics are those of ``torch.nn.functional.scaled_dot_product_attention(q, k, v,
is_causal=causal, scale=scale)`` without dropout or an explicit mask:

- inputs ``(..., N, d)``: ``(N, d)``, ``(B, N, d)``, ``(B, H, N, d)`` or more leading dims (the
  same leading dims for q, k and v; no broadcasting);
- ``N_q`` may differ from ``N_k``;
- ``causal=True`` keeps key ``j`` for query ``i`` when ``j <= i`` (aligned to the top-left corner,
  as SDPA's ``is_causal`` does). Every query row sees at least key 0, so every ``(N_q, N_k)``
  pair is served; rows ``i >= N_k`` simply see all keys;
- any strides (non-contiguous views are read in place, nothing is copied);
- dtypes float16, bfloat16, float32 (fp32 keeps fp32 accuracy: three tf32 products per dot, not one), and float64 in the
  interpreter only (for ``torch.autograd.gradcheck``);
- head dims 16 to 256, any integer in between (non-powers of two are padded inside the kernel);
- CUDA tensors on a GPU, CPU tensors through Triton's interpreter (whichever
  :func:`course_lib.platform.runtime.setup` chose).

Anything else is refused with a ``TypeError`` or ``ValueError`` that names the argument.

Chapter 10 adds keyword-only arguments (each composable with ``causal``), served by the masked
kernels of :mod:`course_lib.kernels.masked` ("visited tiles only"); without them the dense and
causal kernels above run exactly as before:

- ``window=(left, right)``: FlashAttention-2's sliding window, query ``i`` sees keys
  ``i + N_k - N_q - left <= j <= i + N_k - N_q + right`` (-1: unbounded on that side; aligned to
  the bottom-right corner as FlashAttention-2 aligns it, the same as top-left when N_q = N_k);
- ``seq_lens``: a padded batch, ``(B,)`` ints (the same for queries and keys) or a pair
  ``(seq_lens_q, seq_lens_k)``, for ``(B, H, N, d)`` inputs: sample ``b`` has that many real
  queries/keys; padding rows get ``o = 0``; the window is aligned per sample;
- ``block_mask``: a :class:`course_lib.attention.blockmask.BlockMask` (block-sparse, documents, any
  ``mask_mod``); the kernels run with its tile sizes;
- GQA/MQA by shape, for ``(B, H, N, d)`` inputs (4 or more dims): ``k``, ``v``
  ``(B, H_kv, N_k, d)`` with ``H_kv`` dividing q's ``H``
  (SDPA's ``enable_gqa``): query head ``h`` reads K/V head ``h // (H // H_kv)``.

:func:`flash_attention_varlen` takes FlashAttention-2's packed layout. A query row that sees no
key gets ``o = 0`` and ``lse = -inf``, and zero gradients.

Every public function here works inside ``torch.compile(fullgraph=True)`` (chapter 12): its checks
read shapes, dtypes and Python arguments only, so Dynamo traces them, and its kernels run as one
``torch.library`` op, ``torch.ops.course.*`` (:mod:`course_lib.kernels.ops`: a fake implementation
for the compiler, an autograd formula that calls the backward op); the checks that read tensor
values (``seq_lens``, ``cu_seqlens``) run inside the op. Eager calls reach the same implementation
functions through the autograd Functions below, without the op dispatch.
"""

from __future__ import annotations

import numbers

import torch

from course_lib.attention import blockmask as bm
from course_lib.platform import runtime
from course_lib.constants import MAX_HEAD_DIM, MIN_HEAD_DIM
from course_lib.kernels import hopper, ops  # noqa: F401 (hopper: tools/sweep_forward.py reads api.hopper)
from course_lib.kernels import plan as plans
from course_lib.kernels.forward import attention_forward  # noqa: F401 (tools/sweep_forward.py reads it here)
from course_lib.kernels.inputs import (INTERPRETER_ONLY_DTYPES, KERNEL_DTYPES, MAX_ELEMENT_OFFSET,  # noqa: F401
                                       _check_lengths, _dtype_names, _named_lengths, _validate_lengths, as_4d,
                                       validate_offsets, validate_scale)
from course_lib.attention.reference import default_scale


def validate_inputs(q, k, v, causal, scale):
    """Raise TypeError/ValueError naming the bad argument; return the call's launch plan when the
    call is valid.

    The checks read only the call's signature (shapes, strides, dtypes, devices, ``causal``; see
    :func:`course_lib.kernels.plan.signature`), so a signature that passed once is only looked up
    again, and only ``scale`` is checked (not under torch.compile, which traces the checks).

    Returns:
        The :class:`~course_lib.kernels.plan.Plan` of the call's signature, for the caller to run
        the call with (:func:`_forward`: one signature and one lookup per call); None under
        torch.compile or for tensors without strides.
    """
    key = None
    if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and isinstance(causal, bool) and not torch.compiler.is_compiling()):
        try:
            key = plans.signature(q, k, v, causal)
        except (RuntimeError, AttributeError):  # no strides or storage (sparse, nested): checked below
            key = None
        plan = plans.cached_by_key(key) if key is not None else None
        if plan is not None and plan.validated:
            validate_scale(scale)
            return plan
    _validate_inputs(q, k, v, causal, scale)
    if key is None:
        return None
    plan = plans.plan_for(q, k, v, causal, key)
    plan.validated = True
    return plan


def _validate_inputs(q, k, v, causal, scale) -> None:
    """Every check of :func:`validate_inputs`, on every call."""
    rt = runtime.current()
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{name} must have shape (..., N, d) with at least 2 dims, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor ({_dtype_names(KERNEL_DTYPES)}), "
                            f"got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    allowed = KERNEL_DTYPES + (INTERPRETER_ONLY_DTYPES if rt.interpreted else ())
    if q.dtype not in allowed:
        extra = (" (float64 only runs in the interpreter, for gradcheck)"
                 if q.dtype in INTERPRETER_ONLY_DTYPES else "")
        raise TypeError(f"q, k and v have dtype {q.dtype}; supported: {_dtype_names(allowed)}{extra}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}")
    if q.device.type != rt.device:
        where = ("this session runs kernels natively on the GPU: move the tensors to 'cuda'" if rt.on_gpu
                 else "this session has no GPU and runs Triton's interpreter: use CPU tensors")
        raise ValueError(f"q, k and v are on {q.device}, but {where}")
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"q, k and v must have the same leading dims (...), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of keys N_k, got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"q, k and v must have the same head dim d, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim d = {d} is not supported: the kernels take "
                         f"{MIN_HEAD_DIM} <= d <= {MAX_HEAD_DIM} (q has shape {tuple(q.shape)})")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"empty sequence: N_q = {q.shape[-2]}, N_k = {k.shape[-2]}; both must be >= 1")
    if any(s == 0 for s in q.shape[:-2]):
        raise ValueError(f"q has an empty leading dim, shape {tuple(q.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    validate_scale(scale)
    validate_offsets(q=q, k=k, v=v)


def _forward(q, k, v, causal: bool, scale: float, plan=None):
    """``(o, lse)`` shaped like the inputs: ``o`` ``(..., N_q, d)``, ``lse`` ``(..., N_q)``.

    The kernel (chapter 09's Gluon or TMA forward on Hopper, chapter 06's elsewhere) and its launch
    are chosen once per call signature (:mod:`course_lib.kernels.plan`); ``plan``: the one
    :func:`validate_inputs` returned for these inputs (None: looked up here).
    """
    return (plan or plans.plan_for(q, k, v, causal)).forward(q, k, v, causal, scale)


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: the forward saves ``q, k, v, o, lse``; the backward kernels use them.

    What is saved has the inputs' leading shape, as other FlashAttention autograd functions save
    it: ``o`` ``(..., N_q, d)`` and the natural-log ``lse`` ``(..., N_q)`` (``(B, N_q)`` for
    ``(B, N, d)`` inputs), so harnesses that look for the log-sum-exp among
    ``ctx.saved_tensors`` find it.

    ``plan`` (optional): the launch plan :func:`validate_inputs` returned for these inputs; it is
    kept on ``ctx``, so the backward looks nothing up (it runs under the kernel switches its forward
    saw).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, deterministic: bool = False, plan=None):
        plan = plan or plans.plan_for(q, k, v, causal)
        o, lse = plan.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.deterministic, ctx.plan = causal, scale, deterministic, plan
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        grads = _backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.deterministic, getattr(ctx, "plan", None))
        return (*grads, None, None, None, None)


# One implementation, two ways in. Eager calls go through the autograd Functions of this module,
# which call the functions below directly; under torch.compile the public functions call the
# torch.library ops of course_lib.kernels.ops, whose implementations are these same functions
# (registered with @ops.implementation). The eager path skips the custom-op dispatch because it
# costs host time on every call. Measured on the CPU machine (torch 2.13.0+cpu, 2 cores shared with
# other jobs, 2026-11-26; a "kernel" that only allocates o and lse at (1, 4, 128, 64); best of 5 x
# 3000 calls): called directly 6 us, as an op 13 us; with grad, autograd.Function.apply 20 us vs the
# op with register_autograd 46 us; forward+backward 106 vs 145 us. Against SDPA's 35 / 187 us per
# call on the H100 (issue 33), 7-40 us more per call is not negligible.


@ops.implementation("attention_forward")
def _forward_op(q, k, v, causal: bool, scale: float, deterministic: bool):
    """``course::attention_forward``: :func:`_forward` (``deterministic`` is for the backward op)."""
    return _forward(q, k, v, causal, scale)


@ops.implementation("attention_backward")
def _backward(do, q, k, v, o, lse, causal: bool, scale: float, deterministic: bool, plan=None):
    """``(dq, dk, dv)`` shaped like q, k, v: the dense backward kernels (chapter 09's Gluon one-pass
    backward on Hopper unless ``deterministic``, chapter 07's elsewhere), chosen once per call
    signature and upstream-gradient layout (:mod:`course_lib.kernels.plan`); ``plan``: the forward's
    (None: looked up here)."""
    return (plan or plans.plan_for(q, k, v, causal)).backward(do, q, k, v, o, lse, causal, scale, deterministic)


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None, *, window=None,
                    seq_lens=None, block_mask=None, deterministic: bool = False) -> torch.Tensor:
    """FlashAttention (Triton), forward and backward: ``softmax(scale · q kᵀ [+ mask]) v``.

    Args:
        q: ``(..., N_q, d)``; k, v: ``(..., N_k, d)``; same leading dims, dtype and device (for
            ``(B, H, N, d)`` inputs, k and v may have fewer heads, ``H_kv`` dividing ``H``: GQA/MQA).
        causal: top-left aligned causal mask, as SDPA's ``is_causal``.
        scale: score scale; default ``1/sqrt(d)``.
        window, seq_lens, block_mask: keyword-only masks (see the module docstring), served by
            the masked kernels; rows that see no key get ``o = 0``.
        deterministic: the backward. False (default): the one-pass backward (one kernel for dK,
            dV and dQ, dQ summed with fp32 atomic adds; on a GPU the order of the adds, and so the
            last bits of dQ, can differ between runs). True: the two-kernel backward (dK/dV, then
            dQ, no atomics): bit-for-bit reproducible, and slower (it recomputes the score tiles).
            With masks the same holds on Hopper (the Gluon one-pass masked backward, or the two
            Triton kernels); elsewhere, and for ``seq_lens``, the masked backward is always the
            deterministic one.

    Returns:
        ``o``: ``(..., N_q, d)`` in q's dtype. Differentiable w.r.t. q, k and v.
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    if _uses_masks(q, k, window, seq_lens, block_mask):
        if torch.compiler.is_compiling():
            return ops.masked_attention_forward(*_masked_op_args(q, k, v, causal, scale, window, seq_lens,
                                                                 block_mask), deterministic)[0]
        q4, k4, v4, scale, plan = _masked_call(q, k, v, causal, scale, window, seq_lens, block_mask)
        if not _differentiated(q, k, v):
            return _masked_kernels_forward(q4, k4, v4, scale, plan)[0].reshape(q.shape)
        return MaskedAttentionFunction.apply(q4, k4, v4, scale, plan, deterministic).reshape(q.shape)
    plan = validate_inputs(q, k, v, causal, scale)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if plan is None and torch.compiler.is_compiling():
        return ops.attention_forward(q, k, v, causal, scale, deterministic)[0]
    if not _differentiated(q, k, v):
        return _forward(q, k, v, causal, scale, plan)[0]
    return FlashAttentionFunction.apply(q, k, v, causal, scale, deterministic, plan)


def _differentiated(q, k, v) -> bool:
    """Whether autograd records this call: grad mode on and an input that requires grad. When not
    (inference, generation, ``torch.no_grad``), the call skips its autograd Function: on an H100
    ``Function.apply`` cost a third of a tiny forward's host time (tools/profile_overhead.py)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def flash_attention_with_lse(q, k, v, causal: bool = False, scale: float | None = None, *, window=None,
                             seq_lens=None, block_mask=None):
    """Forward only, also returning the natural-log log-sum-exp per query row.

    Returns:
        ``(o, lse)``: ``o`` ``(..., N_q, d)``; ``lse`` ``(..., N_q)`` float32 (float64 for float64),
        ``-inf`` for a row that sees no key.
    """
    if _uses_masks(q, k, window, seq_lens, block_mask):
        if torch.compiler.is_compiling():
            with torch.no_grad():  # forward only, as in eager: the outputs have no autograd history
                return ops.masked_attention_forward(*_masked_op_args(q, k, v, causal, scale, window, seq_lens,
                                                                     block_mask), False)
        return _masked_forward(q, k, v, causal, scale, window, seq_lens, block_mask)
    plan = validate_inputs(q, k, v, causal, scale)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if plan is None and torch.compiler.is_compiling():
        with torch.no_grad():
            return ops.attention_forward(q, k, v, causal, scale, False)
    return _forward(q, k, v, causal, scale, plan)


# ----------------------------------------------------------------------------------------------
# Chapter 10: masks, variable lengths, GQA (the masked kernels)


def _masked_module():
    from course_lib.kernels import masked  # decorates the masked kernels on first use only

    return masked


class _LazyMasked:
    def __getattr__(self, name):
        return getattr(_masked_module(), name)


masked = _LazyMasked()


def _uses_masks(q, k, window, seq_lens, block_mask) -> bool:
    """True when a chapter 10 argument is used (a mask, lengths, or fewer K/V heads than Q heads)."""
    if window is not None or seq_lens is not None or block_mask is not None:
        return True
    return (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 4
            and k.dim() == q.dim() and k.shape[-3] != q.shape[-3] and k.shape[:-3] == q.shape[:-3])


def validate_gqa(q, k, v) -> None:
    """q ``(B, H, N_q, d)`` (or more leading dims), k and v ``(B, H_kv, N_k, d)`` with ``H_kv`` dividing
    ``H``; returns q's first ``H_kv`` heads, for :func:`validate_inputs` to check the rest. (A 3-D
    input is ``(B, N, d)``: its first dim is the batch, never heads.)"""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"k and v must have the same leading dims (..., H_kv), got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.dim() >= 4 and k.dim() == q.dim() and k.shape[-3] != q.shape[-3]:
        heads, kv_heads = q.shape[-3], k.shape[-3]
        if k.shape[:-3] != q.shape[:-3]:
            raise ValueError(f"q, k and v must have the same leading dims before the heads, got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}")
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"GQA: the query heads H = {heads} must be a multiple of the key/value heads "
                             f"H_kv = {kv_heads} (q {tuple(q.shape)}, k {tuple(k.shape)})")
        validate_offsets(q=q)
        q = q.narrow(-3, 0, kv_heads)
    return q


def _check_masked(q, k, v, causal, scale, window, seq_lens, block_mask):
    """The checks of a masked call that read no tensor values (torch.compile traces them; the
    lengths' values are checked where the plan is built), with the element rules a builder
    stored in ``block_mask`` merged into the arguments, as if passed here.

    Returns ``(causal, window, seq_lens)``.
    """
    validate_inputs(validate_gqa(q, k, v), k, v, causal, scale)
    if window is not None:
        window = bm.validate_window(window)
    q4, k4 = as_4d(q), as_4d(k)
    batch, heads, n_q, n_k = q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2]
    if block_mask is not None and not isinstance(block_mask, bm.BlockMask):
        raise TypeError(f"block_mask must be a course_lib.attention.blockmask.BlockMask, "
                        f"got {type(block_mask).__name__}")
    if block_mask is not None:
        if (block_mask.n_q, block_mask.n_k) != (n_q, n_k):
            raise ValueError(f"block_mask was built for n_q={block_mask.n_q}, n_k={block_mask.n_k}; the inputs "
                             f"have N_q={n_q}, N_k={n_k} (tile counts {block_mask.shape[-2:]} do not match)")
        b_m, h_m = block_mask.shape[:2]
        if b_m not in (1, batch) or h_m not in (1, heads):
            raise ValueError(f"block_mask has leading dims ({b_m}, {h_m}); expected (1 or B={batch}, "
                             f"1 or H={heads})")
        causal = causal or block_mask.causal
        for name, mine, theirs in (("window", window, block_mask.window), ("seq_lens", seq_lens, block_mask.seq_lens)):
            if mine is not None and theirs is not None:
                raise ValueError(f"{name} is given twice: as an argument and inside block_mask; give it once")
        window = window if window is not None else block_mask.window
        seq_lens = seq_lens if seq_lens is not None else block_mask.seq_lens
    if seq_lens is not None:
        if q.dim() != 4:
            raise ValueError(f"seq_lens needs q, k, v of shape (B, H, N, d), got q {tuple(q.shape)}")
        for name, lens in _named_lengths(seq_lens):
            _check_lengths(name, lens, batch)
    return causal, window, seq_lens


def _masked_op_args(q, k, v, causal, scale, window, seq_lens, block_mask) -> tuple:
    """A checked masked call as the arguments of ``course::masked_attention_forward`` before
    ``deterministic`` (torch.compile traces this)."""
    causal, window, seq_lens = _check_masked(q, k, v, causal, scale, window, seq_lens, block_mask)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    return (q, k, v, causal, scale, *ops.mask_args(window, seq_lens, block_mask))


def _masked_call(q, k, v, causal, scale, window, seq_lens, block_mask):
    """Check a masked call and build its :class:`~course_lib.kernels.masked.MaskPlan`.

    Returns ``(q4, k4, v4, scale, plan)`` with ``(B, H, N, d)`` views.
    """
    causal, window, seq_lens = _check_masked(q, k, v, causal, scale, window, seq_lens, block_mask)
    q4, k4, v4 = as_4d(q), as_4d(k), as_4d(v)
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    if block_mask is not None:
        if block_mask.device != q.device:  # built on the CPU (the builders' default): copied once
            copies = block_mask.__dict__.setdefault("_copies", {})
            if str(q.device) not in copies:
                copies[str(q.device)] = block_mask.to(q.device)
            block_mask = copies[str(q.device)]
        block_m, block_n = block_mask.block_size
    else:
        block_m, block_n = masked.tile_sizes(d, q.dtype)
    scale = default_scale(d) if scale is None else float(scale)
    if seq_lens is not None:  # lengths are data: checked and planned on every call
        return q4, k4, v4, scale, masked.mask_plan(q, batch, heads, n_q, n_k, block_m, block_n, causal, window,
                                                   seq_lens, block_mask)
    # Without lengths the plan depends on shapes and arguments only: keep it (in the block mask,
    # whose tensors are read-only by contract, or in a small module cache), so that repeated calls
    # build no tile lists and make no host-device copies.
    key = (batch, heads, n_q, n_k, block_m, block_n, causal, window, str(q.device))
    cache = _PLAN_CACHE if block_mask is None else block_mask.__dict__.setdefault("_plans", {})
    plan = cache.get(key)
    if plan is None:
        if len(cache) >= _PLAN_CACHE_SIZE:
            cache.pop(next(iter(cache)))
        plan = cache[key] = masked.mask_plan(q, batch, heads, n_q, n_k, block_m, block_n, causal, window, None,
                                             block_mask)
    return q4, k4, v4, scale, plan


_PLAN_CACHE: dict = {}
_PLAN_CACHE_SIZE = 64


def _masked_kernels_forward(q4, k4, v4, scale: float, plan):
    """``(o, lse)`` of the masked forward on ``(B, H, N, d)`` views: on Hopper the Gluon kernel of
    :mod:`course_lib.kernels.gluon_masked` where it covers the inputs, else the Triton kernels
    (:func:`course_lib.kernels.masked.masked_forward`)."""
    if q4.is_cuda:
        from course_lib.kernels import gluon_masked  # Gluon is experimental: imported on a GPU only

        if gluon_masked.library_uses_gluon_masked(q4, k4, v4, plan):
            return gluon_masked.masked_forward_gluon(q4, k4, v4, scale, plan)
    return masked.masked_forward(q4, k4, v4, scale, plan)


def _masked_kernels_backward(do, q4, k4, v4, o4, lse, scale: float, plan, deterministic: bool):
    """``(dq, dk, dv)`` of the masked backward: unless ``deterministic``, on Hopper the Gluon one-pass
    backward (:func:`course_lib.kernels.gluon_backward.masked_backward_gluon`, dQ by atomic adds) where
    it covers the mask; else the two Triton kernels of :mod:`course_lib.kernels.masked`, bit-for-bit
    reproducible."""
    if not deterministic and q4.is_cuda:
        from course_lib.kernels import gluon_backward  # Gluon is experimental: imported on a GPU only

        if gluon_backward.library_uses_gluon_masked_backward(q4, k4, v4, o4, do, plan):
            return gluon_backward.masked_backward_gluon(do, q4, k4, v4, o4, lse, scale, plan)
    return masked.masked_backward(do, q4, k4, v4, o4, lse, scale, plan)


class MaskedAttentionFunction(torch.autograd.Function):
    """Autograd glue of the masked kernels, on ``(B, H, N, d)`` views and a ``MaskPlan``."""

    @staticmethod
    def forward(ctx, q4, k4, v4, scale: float, plan, deterministic: bool = True):
        o4, lse = _masked_kernels_forward(q4, k4, v4, scale, plan)
        ctx.save_for_backward(q4, k4, v4, o4, lse)
        ctx.scale, ctx.plan, ctx.deterministic = scale, plan, deterministic
        return o4

    @staticmethod
    def backward(ctx, do):
        q4, k4, v4, o4, lse = ctx.saved_tensors
        dq, dk, dv = _masked_kernels_backward(do, q4, k4, v4, o4, lse, ctx.scale, ctx.plan,
                                              deterministic=ctx.deterministic)
        return dq, dk, dv, None, None, None


def _masked_forward(q, k, v, causal, scale, window, seq_lens, block_mask):
    """``(o, lse)`` of a masked call, shaped like the inputs: ``o`` ``(..., N_q, d)``, ``lse`` ``(..., N_q)``."""
    q4, k4, v4, scale, plan = _masked_call(q, k, v, causal, scale, window, seq_lens, block_mask)
    o4, lse = _masked_kernels_forward(q4, k4, v4, scale, plan)
    return o4.reshape(q.shape), lse.reshape(q.shape[:-1])


@ops.implementation("masked_attention_forward")
def _masked_forward_op(q, k, v, causal, scale, *rest):
    """``course::masked_attention_forward``: ``rest`` is :func:`course_lib.kernels.ops.mask_args`'s
    tuple, then ``deterministic`` (for the backward op)."""
    return _masked_forward(q, k, v, causal, scale, *ops.mask_from_args(*rest[:-1]))


@ops.implementation("masked_attention_backward")
def _masked_backward_op(do, q, k, v, o, lse, causal, scale, *rest):
    """``course::masked_attention_backward``: the plan of the forward's arguments, rebuilt (from the
    API's caches, or from the lengths' values), then the masked backward kernels."""
    q4, k4, v4, scale, plan = _masked_call(q, k, v, causal, scale, *ops.mask_from_args(*rest[:-1]))
    dq, dk, dv = _masked_kernels_backward(as_4d(do), q4, k4, v4, as_4d(o), lse.reshape(q4.shape[:-1]), scale,
                                          plan, deterministic=rest[-1])
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


def _check_cu_seqlens(name: str, cu, max_name: str, max_seqlen) -> None:
    """Type and shape of the offsets and their ``max_seqlen`` (no values read: torch.compile traces this)."""
    if not isinstance(cu, torch.Tensor) or cu.is_floating_point() or cu.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (B + 1,), got {type(cu).__name__} "
                        f"{getattr(cu, 'dtype', '')}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must have shape (B + 1,) with B >= 1, got {tuple(cu.shape)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < 1:
        raise ValueError(f"{max_name} must be a positive int, got {max_seqlen!r}")


def _validate_cu_seqlens(name: str, cu, total: int, max_name: str, max_seqlen) -> list[int]:
    """The offsets' values, checked on the host (one device-to-host copy when they live on a GPU)."""
    _check_cu_seqlens(name, cu, max_name, max_seqlen)
    values = cu.tolist()  # checked on the host; _varlen_plan makes the device copies, once per packing
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(x < 0 for x in lengths):
        raise ValueError(f"{name} must be non-decreasing (cumulative sequence lengths), got {values}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total} (the sequence lengths must sum to "
                         f"it), got {values[-1]}")
    if max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence ({max(lengths)})")
    return values


def _varlen_plan(q4, k4, values_q, values_k, max_seqlen_q, max_seqlen_k, causal, window):
    """The :class:`~course_lib.kernels.masked.MaskPlan` of a checked ``flash_attention_varlen``
    call, kept per packing (the offsets' values, checked on the host), so that a repeated call
    builds no tile lists and copies nothing to the device (and, with offsets on the CPU, can be
    captured in a CUDA graph).

    Where queries and keys share the offsets and the masked Gluon kernels cover the call (a Hopper
    GPU), the packed batch is a *document mask* over the ``total`` packed tokens: token ``t`` of
    sequence ``b`` has document id ``b``; with equal lengths FlashAttention-2's bottom-right
    causal and window bands are the top-left ones of each sequence, and a band on global indices
    is the same band on each sequence's own. The Gluon kernels take that plan (no per-sample
    lengths); elsewhere the plan is the ragged one of the Triton kernels (a program per sequence
    and tile, each reading its sequence's start and length).
    """
    d = q4.shape[-1]
    block_m, block_n = masked.tile_sizes(d, q4.dtype)
    key = (tuple(values_q), tuple(values_k), max_seqlen_q, max_seqlen_k, q4.shape[1], k4.shape[1], d, q4.dtype,
           causal, window, block_m, block_n, str(q4.device))
    plan = _VARLEN_CACHE.get(key)
    if plan is not None:
        return plan
    if len(_VARLEN_CACHE) >= _PLAN_CACHE_SIZE:
        _VARLEN_CACHE.pop(next(iter(_VARLEN_CACHE)))
    lengths_q = [b - a for a, b in zip(values_q, values_q[1:])]
    if values_q == values_k and q4.is_cuda:
        from course_lib.kernels import gluon_masked  # Gluon is experimental: imported on a GPU only

        total = values_q[-1]
        ids = torch.repeat_interleave(torch.arange(len(lengths_q)), torch.tensor(lengths_q)).to(q4.device)
        documents = bm.document_block_mask(ids, block_m, block_n)
        plan = masked.mask_plan(q4, 1, q4.shape[1], total, total, block_m, block_n, causal, window, None, documents)
        if gluon_masked.library_uses_gluon_masked(q4, k4, k4, plan):
            _VARLEN_CACHE[key] = plan
            return plan
    lengths_k = [b - a for a, b in zip(values_k, values_k[1:])]
    device = q4.device
    start_q, len_q, start_k, len_k = (torch.tensor(x, dtype=torch.int32, device=device)
                                      for x in (values_q[:-1], lengths_q, values_k[:-1], lengths_k))
    lo, hi = bm.window_band(window, len_q.long(), len_k.long(), causal, bottom_right_causal=True)
    classes = bm.band_tile_classes(max_seqlen_q, max_seqlen_k, block_m, block_n, lo=lo, hi=hi, len_q=len_q,
                                   len_k=len_k, device=device)
    plan = _VARLEN_CACHE[key] = masked.MaskPlan(
        block_mask=bm.BlockMask(classes, max_seqlen_q, max_seqlen_k, block_m, block_n), causal=causal,
        causal_bottom_right=True, window=window, len_q=len_q, len_k=len_k, start_q=start_q, start_k=start_k,
        varlen=True, num_samples=len_q.numel())
    return plan


_VARLEN_CACHE: dict = {}


def _check_sequence_counts(cu_seqlens_q, cu_seqlens_k) -> None:
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")


def _varlen_call(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window):
    """The offsets' values checked on the host, then the plan of :func:`_varlen_plan` (kept per packing)."""
    values_q = _validate_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q4.shape[2], "max_seqlen_q", max_seqlen_q)
    values_k = _validate_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k4.shape[2], "max_seqlen_k", max_seqlen_k)
    _check_sequence_counts(cu_seqlens_q, cu_seqlens_k)
    return _varlen_plan(q4, k4, values_q, values_k, max_seqlen_q, max_seqlen_k, causal, window)


@ops.implementation("varlen_attention_forward")
def _varlen_forward(q4, k4, v4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
                    deterministic=False):
    """``(o, lse)`` of a packed batch on ``(1, H, total, d)`` views: ``o`` ``(1, H, total_q, d)``,
    ``lse`` ``(1, H, total_q)`` (``deterministic`` is for the backward op)."""
    window = None if window is None else tuple(window)  # the op passes a list; the plan cache wants a key
    plan = _varlen_call(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window)
    return _masked_kernels_forward(q4, k4, v4, scale, plan)


@ops.implementation("varlen_attention_backward")
def _varlen_backward_op(do, q4, k4, v4, o4, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        scale, window, deterministic):
    """``course::varlen_attention_backward``: the plan from the packing's cache, then the masked backward."""
    window = None if window is None else tuple(window)
    plan = _varlen_call(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window)
    return _masked_kernels_backward(do, q4, k4, v4, o4, lse, scale, plan, deterministic=deterministic)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                           causal: bool = False, scale: float | None = None, window=None,
                           return_lse: bool = False, deterministic: bool = False):
    """Attention over a packed batch of variable-length sequences, as FlashAttention-2's
    ``flash_attn_varlen_func``; forward and backward.

    Args:
        q: ``(total_q, H, d)``: the sequences' queries one after another; k, v:
            ``(total_k, H_kv, d)`` (``H_kv`` dividing ``H``: GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: ``(B + 1,)`` int tensors, ``0 = c_0 <= c_1 <= ... = total``:
            sequence ``b`` is rows ``c_b .. c_{b+1} - 1``.
        max_seqlen_q, max_seqlen_k: at least the longest sequence (sets the grid).
        causal: FlashAttention-2's convention, bottom-right aligned per sequence: query ``i`` of a
            sequence of ``n_q`` queries and ``n_k`` keys sees keys ``j <= i + n_k - n_q``.
        scale: default ``1/sqrt(d)``.
        window: ``(left, right)``, FlashAttention-2's sliding window, per sequence (see
            :func:`flash_attention`).
        return_lse: also return the log-sum-exp ``(H, total_q)`` float32 (forward only then).
        deterministic: as :func:`flash_attention`'s (FlashAttention-2's varlen function has it too).
            On Hopper, when queries and keys share the offsets, the call runs the masked Gluon
            kernels on a document mask over the packed tokens (see :func:`_varlen_plan`), whose
            default backward adds dQ with atomics; ``True`` keeps the Triton backward.

    Returns:
        ``o`` ``(total_q, H, d)`` in q's dtype (a view of a ``(H, total_q, d)`` buffer), or
        ``(o, lse)``. Tokens attend only within their own sequence; a query that sees no key gets
        ``o = 0`` (``lse = -inf``).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must be packed as (total, heads, d), got shape {tuple(x.shape)}")
    q4, k4, v4 = (x.permute(1, 0, 2)[None] for x in (q, k, v))  # (1, H, total, d) views
    validate_inputs(validate_gqa(q4, k4, v4), k4, v4, causal, scale)
    if window is not None:
        window = bm.validate_window(window)
    # the offsets' values are checked where the plan is built (_varlen_call): in the op under torch.compile
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if torch.compiler.is_compiling():
        _check_sequence_counts(cu_seqlens_q, cu_seqlens_k)
        args = (q4, k4, v4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                None if window is None else list(window), deterministic)
        if return_lse:
            with torch.no_grad():  # forward only, as in eager
                o4, lse = ops.varlen_attention_forward(*args)
            return o4[0].permute(1, 0, 2), lse[0]
        return ops.varlen_attention_forward(*args)[0][0].permute(1, 0, 2)
    if return_lse:
        o4, lse = _varlen_forward(q4, k4, v4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                  window)
        return o4[0].permute(1, 0, 2), lse[0]
    plan = _varlen_call(q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window)
    return MaskedAttentionFunction.apply(q4, k4, v4, scale, plan, deterministic)[0].permute(1, 0, 2)
