"""Reference ("naive") attention: the oracles every faster version is checked against.

Standard attention materialises the full score matrix ``S = scale · q kᵀ`` of shape
``(..., N_q, N_k)``, applies the mask, takes a row softmax ``P`` and returns ``o = P v``. We also
return the natural-log log-sum-exp of each score row, ``lse = log Σ_j exp(S_ij)``, which is what
the FlashAttention forward saves for its backward.

Semantics follow ``torch.nn.functional.scaled_dot_product_attention``: inputs ``(..., N, d)``,
``scale`` defaults to ``1/sqrt(d)``, and ``causal=True`` keeps key ``j`` for query ``i`` when
``j <= i`` (the mask is aligned to the top-left corner, as SDPA's ``is_causal`` does).
"""

from __future__ import annotations

import math

import numpy as np

# Float dtypes the NumPy implementations accept (half precision is a GPU story, chapter 06).
NUMPY_FLOAT_DTYPES = (np.float32, np.float64)


def default_scale(head_dim: int) -> float:
    """The softmax scale 1/sqrt(d) from "Attention Is All You Need"."""
    return 1.0 / math.sqrt(head_dim)


def validate_qkv_numpy(q, k, v, scale=None):
    """Check NumPy attention inputs; raise TypeError/ValueError naming the bad argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape (..., N, d) with at least 2 dims, "
                             f"got shape {x.shape}")
        if x.dtype.type not in NUMPY_FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32 or float64, got dtype {x.dtype}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim d, got q {q.shape} and k {k.shape}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same (..., N_k) dims, got k {k.shape} and v {v.shape}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q and k must have the same leading dims, got q {q.shape} and k {k.shape}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def causal_mask(n_q: int, n_k: int) -> np.ndarray:
    """Boolean ``(n_q, n_k)`` array, True where key ``j`` is visible to query ``i`` (``j <= i``)."""
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None]


def naive_attention_numpy(q, k, v, causal: bool = False, scale: float | None = None):
    """Standard attention in NumPy, computed in float64.

    Args:
        q: ``(..., N_q, d)``; k: ``(..., N_k, d)``; v: ``(..., N_k, d_v)``.
        causal: mask key ``j > i`` (top-left aligned).
        scale: score scale, default ``1/sqrt(d)``.

    Returns:
        ``(o, lse)``: ``o`` ``(..., N_q, d_v)`` in the input dtype; ``lse`` ``(..., N_q)`` float64.
        A query row with no visible key (only possible when ``causal`` and ``N_q > N_k`` never
        happens with top-left alignment) would get ``o = 0`` and ``lse = -inf``.
    """
    validate_qkv_numpy(q, k, v, scale)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = scale * (q64 @ np.swapaxes(k64, -1, -2))  # (..., N_q, N_k)
    if causal:
        s = np.where(causal_mask(q.shape[-2], k.shape[-2]), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)  # (..., N_q, 1)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)  # (..., N_q, N_k), unnormalised
    l = p.sum(axis=-1, keepdims=True)  # (..., N_q, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(l > 0, (p @ v64) / np.where(l > 0, l, 1.0), 0.0)
        lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(l[..., 0]), -np.inf)
    return o.astype(q.dtype), lse


def naive_attention_torch(q, k, v, causal: bool = False, scale: float | None = None):
    """Standard attention in PyTorch, materialising the N×N matrix (softmax in float32 or better).

    Args/shape conventions as :func:`naive_attention_numpy`; works on any device.

    Returns:
        ``(o, lse)``: ``o`` in the input dtype, ``lse`` in float32 (float64 for float64 input).
    """
    import torch

    scale = default_scale(q.shape[-1]) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = scale * (q.to(acc) @ k.to(acc).transpose(-1, -2))  # (..., N_q, N_k)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (..., N_q)
    p = torch.exp(s - lse[..., None])
    o = p @ v.to(acc)
    return o.to(q.dtype), lse
