"""Checks for chapter 01 (naive attention).

* Exercise 1.1 — ``attention_numpy(q, k, v)``: ``softmax(q kᵀ / √d) v`` with NumPy.
* Exercise 1.2 — ``attention_torch(q, k, v)``: the same with PyTorch tensors.

Both are checked against PyTorch's ``scaled_dot_product_attention`` computed in float64, on
shapes that are deliberately not square or round (``N_q ≠ N_k``, ``d_v ≠ d``, batched, and one
case with logits in the thousands, where an ``exp`` without the max subtracted overflows).
"""

from __future__ import annotations

import numpy as np

from course_lib.checks import Case, check_function
from course_lib.reference import default_scale, naive_attention_numpy, naive_attention_torch

__all__ = ["reference_attention_numpy", "reference_attention_torch", "numpy_cases", "torch_cases",
           "check_attention_numpy", "check_attention_torch", "MISTAKES_NUMPY", "MISTAKES_TORCH"]

# Logit size of the overflow case: exp(x) overflows float64 above ~709.78 (and float32 above ~88.7),
# so logits around two thousand make an unsafe softmax return inf/NaN.
LARGE_LOGIT = 2000.0
_SEED = 1234


def _sdpa64(q, k, v):
    """SDPA in float64 on torch tensors (any device); returns float64."""
    import torch
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q.double(), k.double(), v.double())


def reference_attention_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """PyTorch's SDPA (float64) on NumPy inputs: ``(..., N_q, d)``, ``(..., N_k, d)``,
    ``(..., N_k, d_v)`` → ``(..., N_q, d_v)`` in ``q``'s dtype."""
    import torch

    o = _sdpa64(*(torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v)))
    return o.numpy().astype(q.dtype)


def reference_attention_torch(q, k, v):
    """PyTorch's SDPA computed in float64, returned in ``q``'s dtype on ``q``'s device."""
    return _sdpa64(q, k, v).to(q.dtype)


def library_attention_numpy(q, k, v):
    """What the notebook continues with when Exercise 1.1 is not done: the library's oracle."""
    return naive_attention_numpy(q, k, v)[0]


def library_attention_torch(q, k, v):
    """What the notebook continues with when Exercise 1.2 is not done."""
    return naive_attention_torch(q, k, v)[0]


# ------------------------------------------------------------- the mistakes a check recognises

def _variant(q, k, v, *, scale="sqrt", axis=-1, subtract_max=True, normalise=True,
             return_p=False):
    """Attention in float64 with one knob turned the wrong way; returns ``q``'s dtype."""
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    d = q64.shape[-1]
    factor = {"sqrt": default_scale(d), "none": 1.0, "d": 1.0 / d}[scale]
    s = factor * (q64 @ np.swapaxes(k64, -1, -2))  # (..., N_q, N_k)
    with np.errstate(over="ignore", invalid="ignore"):
        if subtract_max:
            s = s - s.max(axis=axis, keepdims=True)
        p = np.exp(s)
        if normalise:
            p = p / p.sum(axis=axis, keepdims=True)
    out = p if return_p else p @ v64
    return out.astype(q.dtype)


def _torch_version(numpy_fn):
    def wrong(q, k, v):
        import torch

        out = numpy_fn(*(x.detach().cpu().numpy() for x in (q, k, v)))
        return torch.from_numpy(out).to(q.device)
    return wrong


MISTAKES_NUMPY = {
    "the scores are not scaled: multiply q kᵀ by 1/√d": lambda q, k, v: _variant(q, k, v, scale="none"),
    "the scores are scaled by 1/d; the scale is 1/√d": lambda q, k, v: _variant(q, k, v, scale="d"),
    "softmax over the wrong axis: each query's row (the last axis, over keys) must sum to 1":
        lambda q, k, v: _variant(q, k, v, axis=-2),
    "the weights are not normalised: divide exp(s) by its row sum":
        lambda q, k, v: _variant(q, k, v, normalise=False),
    "returned the attention weights P; the output is P @ v":
        lambda q, k, v: _variant(q, k, v, return_p=True),
    "the result is float64 for float32 inputs: a NumPy float64 scalar such as np.sqrt(d) promotes "
    "float32 arrays (NumPy 2 rules); divide by math.sqrt(d) or return .astype(q.dtype)":
        lambda q, k, v: _variant(q, k, v).astype(np.float64),
}
MISTAKES_TORCH = {cause: _torch_version(fn) for cause, fn in MISTAKES_NUMPY.items()
                  if "NumPy float64 scalar" not in cause}


# ------------------------------------------------------------------------------ the cases

def _shapes():
    """(label, q shape, k shape, v shape, dtype, logit size or None)."""
    return [
        ("N=37, d=16", (37, 16), (37, 16), (37, 16), np.float64, None),
        ("5 queries, 7 keys, d=8, d_v=12", (5, 8), (7, 8), (7, 12), np.float64, None),
        ("batched (2, 3, 33, 24), float32", (2, 3, 33, 24), (2, 3, 33, 24), (2, 3, 33, 24),
         np.float32, None),
        (f"logits near {LARGE_LOGIT:g}", (19, 8), (19, 8), (19, 8), np.float64, LARGE_LOGIT),
    ]


def _arrays(seed=_SEED):
    rng = np.random.default_rng(seed)
    out = []
    for label, qs, ks, vs, dtype, logit in _shapes():
        q, k, v = (rng.standard_normal(s) for s in (qs, ks, vs))
        if logit is not None:
            # unit-norm rows times √(logit·√d) each, so scaled scores reach about ±logit
            q = q / np.linalg.norm(q, axis=-1, keepdims=True)
            k = k / np.linalg.norm(k, axis=-1, keepdims=True)
            size = np.sqrt(logit / default_scale(qs[-1]))
            q, k = q * size, k * size
        out.append((label, q.astype(dtype), k.astype(dtype), v.astype(dtype)))
    return out


def numpy_cases() -> list[Case]:
    """The cases Exercise 1.1 is checked on (NumPy arrays)."""
    return [Case((q, k, v), label=label) for label, q, k, v in _arrays()]


def torch_cases(device=None) -> list[Case]:
    """The same cases as torch tensors on ``device`` (default: the runtime's device)."""
    import torch

    if device is None:
        from course_lib import runtime

        device = runtime.current().device
    return [Case(tuple(torch.from_numpy(x).to(device) for x in (q, k, v)), label=label)
            for label, q, k, v in _arrays()]


# ------------------------------------------------------------------------------ the checks

def check_attention_numpy(fn, **kwargs):
    """Check Exercise 1.1; return ``fn`` (pass) or the library's version (not done yet)."""
    return check_function("Exercise 1.1", fn, reference_attention_numpy, numpy_cases(),
                          fallback=library_attention_numpy, mistakes=MISTAKES_NUMPY, **kwargs)


def check_attention_torch(fn, device=None, **kwargs):
    """Check Exercise 1.2; return ``fn`` (pass) or the library's version (not done yet)."""
    return check_function("Exercise 1.2", fn, reference_attention_torch, torch_cases(device),
                          fallback=library_attention_torch, mistakes=MISTAKES_TORCH, **kwargs)
