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
- dtypes float16, bfloat16, float32 (fp32 uses IEEE fp32 dots, not tf32), and float64 in the
  interpreter only (for ``torch.autograd.gradcheck``);
- head dims 16 to 256, any integer in between (non-powers of two are padded inside the kernel);
- CUDA tensors on a GPU, CPU tensors through Triton's interpreter (whichever
  :func:`course_lib.runtime.setup` chose).

Anything else is refused with a ``TypeError`` or ``ValueError`` that names the argument.
"""

from __future__ import annotations

import math
import numbers

import torch

from course_lib import runtime
from course_lib.constants import MAX_HEAD_DIM, MIN_HEAD_DIM
from course_lib.kernels.backward import attention_backward
from course_lib.kernels import hopper
from course_lib.kernels.forward import attention_forward
from course_lib.reference import default_scale

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRETER_ONLY_DTYPES = (torch.float64,)
# Offsets inside the kernels are 32-bit integers: refuse tensors that span more elements.
MAX_ELEMENT_OFFSET = 2**31 - 1


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def validate_inputs(q, k, v, causal, scale) -> None:
    """Raise TypeError/ValueError naming the bad argument; return None when the call is valid."""
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


def validate_scale(scale) -> None:
    """``scale`` is None or a finite real number (not a bool); else TypeError/ValueError."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")


def validate_offsets(**tensors) -> None:
    """Every element of each tensor is reachable with a 32-bit offset (the kernels' index type)."""
    for name, x in tensors.items():
        span = sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride()))
        if span > MAX_ELEMENT_OFFSET:
            raise ValueError(f"{name} spans {span + 1} elements; the kernels use 32-bit offsets "
                             f"(at most {MAX_ELEMENT_OFFSET + 1})")


def as_4d(x: torch.Tensor) -> torch.Tensor:
    """View ``(..., N, d)`` as ``(B, H, N, d)``: add unit dims, or merge extra leading dims.

    Adding dims never copies; merging more than two leading dims copies only when their strides
    cannot be merged (``reshape``'s rule).
    """
    if x.dim() == 2:
        return x[None, None]
    if x.dim() == 3:
        return x[None]
    if x.dim() == 4:
        return x
    return x.reshape(-1, *x.shape[-3:])


def _forward(q, k, v, causal: bool, scale: float):
    """``(o, lse)`` shaped like the inputs: ``o`` ``(..., N_q, d)``, ``lse`` ``(..., N_q)``."""
    q4, k4, v4 = as_4d(q), as_4d(k), as_4d(v)
    if hopper.library_uses_tma(q4, k4, v4):  # chapter 09: descriptor loads where they pay
        o4, lse = hopper.attention_forward_tma(q4, k4, v4, causal, scale)
    else:
        o4, lse = attention_forward(q4, k4, v4, causal, scale)
    return o4.reshape(q.shape), lse.reshape(q.shape[:-1])


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: the forward saves ``q, k, v, o, lse``; the backward kernels use them.

    What is saved has the inputs' leading shape, as other FlashAttention autograd functions save
    it: ``o`` ``(..., N_q, d)`` and the natural-log ``lse`` ``(..., N_q)`` (``(B, N_q)`` for
    ``(B, N, d)`` inputs), so harnesses that look for the log-sum-exp among
    ``ctx.saved_tensors`` find it.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        o4 = as_4d(o)
        dq, dk, dv = attention_backward(as_4d(do), as_4d(q), as_4d(k), as_4d(v), o4,
                                        lse.reshape(o4.shape[:-1]), ctx.causal, ctx.scale)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None, None


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """FlashAttention (Triton), forward and backward: ``softmax(scale · q kᵀ [+ causal mask]) v``.

    Args:
        q: ``(..., N_q, d)``; k, v: ``(..., N_k, d)``; same leading dims, dtype and device.
        causal: top-left aligned causal mask, as SDPA's ``is_causal``.
        scale: score scale; default ``1/sqrt(d)``.

    Returns:
        ``o``: ``(..., N_q, d)`` in q's dtype. Differentiable w.r.t. q, k and v.
    """
    validate_inputs(q, k, v, causal, scale)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    return FlashAttentionFunction.apply(q, k, v, causal, scale)


def flash_attention_with_lse(q, k, v, causal: bool = False, scale: float | None = None):
    """Forward only, also returning the natural-log log-sum-exp per query row.

    Returns:
        ``(o, lse)``: ``o`` ``(..., N_q, d)``; ``lse`` ``(..., N_q)`` float32 (float64 for float64).
    """
    validate_inputs(q, k, v, causal, scale)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    return _forward(q, k, v, causal, scale)
