"""The checks and views the kernels' entry points share: dtypes, ``scale``, 32-bit offsets,
per-sample lengths, and ``(..., N, d)`` seen as ``(B, H, N, d)``.

They sit below the public API (:mod:`course_lib.kernels.api`) so that the kernels' own launchers
(flash-decoding, the teaching kernel, the masked plans) use them without importing the API; the API
re-exports each name it had (``api.validate_scale``, ``api.as_4d``, ...).
"""

from __future__ import annotations

import math
import numbers

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRETER_ONLY_DTYPES = (torch.float64,)
# Offsets inside the kernels are 32-bit integers: refuse tensors that span more elements.
MAX_ELEMENT_OFFSET = 2**31 - 1


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


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


def _named_lengths(seq_lens) -> list:
    """``[(name, lengths)]`` of ``seq_lens``: one tensor for queries and keys, or a pair."""
    if isinstance(seq_lens, (tuple, list)):
        lens_q, lens_k = seq_lens
        return [("seq_lens_q", lens_q), ("seq_lens_k", lens_k)]
    return [("seq_lens", seq_lens)]


def _check_lengths(name: str, lens, batch: int) -> None:
    """Type and shape of per-sample lengths (no values read: torch.compile traces this)."""
    if not isinstance(lens, torch.Tensor) or lens.is_floating_point() or lens.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of shape (B,), got {type(lens).__name__} "
                        f"{getattr(lens, 'dtype', '')}")
    if lens.shape != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},), got {tuple(lens.shape)}")


def _validate_lengths(name: str, lens, batch: int, n: int, device) -> torch.Tensor:
    _check_lengths(name, lens, batch)
    values = lens.tolist()  # checked on the host; lengths on the CPU are copied to q's device
    if any(x < 0 or x > n for x in values):
        raise ValueError(f"{name} must lie in [0, {n}] (the padded length), got {values}")
    return lens.to(device=device, dtype=torch.int32).contiguous()


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
