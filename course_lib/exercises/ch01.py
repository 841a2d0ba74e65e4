"""Checks for chapter 01 (naive attention).

* Exercise 1.1 — ``attention_numpy(q, k, v)``: ``softmax(q kᵀ / √d) v`` with NumPy.
* Exercise 1.2 — ``attention_torch(q, k, v)``: the same with PyTorch tensors.
* Exercise 1.3 — ``standard_attention(q, k, v, causal=False, scale=None) -> (o, lse)``: the whole
  of the library's oracle :func:`course_lib.reference.naive_attention_numpy` (causal mask, scale,
  safe softmax, log-sum-exp), with a hint ladder: ``STANDARD_HINTS``, ``STANDARD_SKELETON``.

Exercises 1.1 and 1.2 are checked against PyTorch's ``scaled_dot_product_attention`` computed in
float64, on shapes that are deliberately not square or round (``N_q ≠ N_k``, ``d_v ≠ d``, batched,
and one case with logits in the thousands, where an ``exp`` without the max subtracted
overflows).
Exercise 1.3 is checked against the oracle itself, on cases that tell the causal alignments apart
(``N_q ≠ N_k``), pass an explicit ``scale``, and mix float32 and float64.
"""

from __future__ import annotations

import numpy as np

from course_lib.checks import learner_check
from course_lib.checks import Case, check_function
from course_lib.constants import LOG2_E
from course_lib.reference import default_scale, naive_attention_numpy, naive_attention_torch

__all__ = ["reference_attention_numpy", "reference_attention_torch", "numpy_cases", "torch_cases",
           "check_attention_numpy", "check_attention_torch", "MISTAKES_NUMPY", "MISTAKES_TORCH",
           "standard_cases", "check_standard_attention", "MISTAKES_STANDARD", "STANDARD_HINTS",
           "STANDARD_SKELETON"]

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

@learner_check
def check_attention_numpy(fn, **kwargs):
    """Check Exercise 1.1; return ``fn`` (pass) or the library's version (not done yet)."""
    return check_function("Exercise 1.1", fn, reference_attention_numpy, numpy_cases(),
                          fallback=library_attention_numpy, mistakes=MISTAKES_NUMPY, **kwargs)


@learner_check
def check_attention_torch(fn, device=None, **kwargs):
    """Check Exercise 1.2; return ``fn`` (pass) or the library's version (not done yet)."""
    return check_function("Exercise 1.2", fn, reference_attention_torch, torch_cases(device),
                          fallback=library_attention_torch, mistakes=MISTAKES_TORCH, **kwargs)


# ---------------------------------------------------------------------------------------------
# Exercise 1.3: standard_attention(q, k, v, causal=False, scale=None) -> (o, lse)
# ---------------------------------------------------------------------------------------------

# An explicit scale that is not 1/√d of any case's head dim, so an ignored `scale` shows.
EXPLICIT_SCALE = 0.3


def _standard_variant(q, k, v, causal=False, scale=None, *, factor="given", mask="top-left",
                      axis=-1, subtract_max=True, lse_max=True, lse_log2=False,
                      mask_after_softmax=False, lse_dtype=np.float64, o_dtype=None):
    """The oracle's computation (float64) with one knob turned the wrong way; ``lse_dtype="q"``
    returns lse in q's dtype."""
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    d, n_q, n_k = q64.shape[-1], q64.shape[-2], k64.shape[-2]
    given = default_scale(d) if scale is None else scale
    s = {"given": given, "sqrt": default_scale(d), "d": 1.0 / d}[factor] * (
        q64 @ np.swapaxes(k64, -1, -2))  # (..., N_q, N_k)
    rows, cols = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    visible = {"top-left": cols <= rows, "transposed": cols >= rows, "strict": cols < rows,
               "bottom-right": cols <= rows + (n_k - n_q)}[mask]  # (N_q, N_k)
    if causal and not mask_after_softmax:
        s = np.where(visible, s, -np.inf)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        m = s.max(axis=axis, keepdims=True) if subtract_max else np.zeros_like(s[..., :1])
        p = np.exp(s - m)
        l = p.sum(axis=axis, keepdims=True)
        p = p / l
        if causal and mask_after_softmax:
            p = np.where(visible, p, 0.0)
        o = p @ v64
        lse = np.log(l).squeeze(axis) + (m.squeeze(axis) if lse_max else 0.0)  # (..., N_q)
    if lse_log2:
        lse = lse * LOG2_E
    return o.astype(o_dtype or q.dtype), lse.astype(q.dtype if lse_dtype == "q" else lse_dtype)


def _mistake(**knobs):
    return lambda q, k, v, causal=False, scale=None: _standard_variant(
        q, k, v, causal, scale, **knobs)


MISTAKES_STANDARD = {
    f"no max subtraction: exp of scores near {LARGE_LOGIT:g} overflows to inf, and inf/inf is NaN "
    "— subtract each row's max before exp": _mistake(subtract_max=False),
    "the causal mask is transposed: key j is visible to query i when j <= i (np.tril's shape, "
    "ones on and below the diagonal)": _mistake(mask="transposed"),
    "the causal mask is off by one (j < i): a query also sees its own key (j <= i); with j < i "
    "query 0 sees no key at all (a NaN row)": _mistake(mask="strict"),
    "the causal mask is aligned to the bottom-right corner (j <= i + N_k - N_q); SDPA's is_causal "
    "and the oracle align it top-left: j <= i": _mistake(mask="bottom-right"),
    "the causal mask was applied to the weights after the softmax: mask the scores (-inf) before "
    "it, so that each row's visible weights still sum to 1": _mistake(mask_after_softmax=True),
    "the `scale` argument is ignored: use it when given, 1/√d only when it is None":
        _mistake(factor="sqrt"),
    "the scores are scaled by 1/d; the default scale is 1/√d": _mistake(factor="d"),
    "softmax over the wrong axis: each query's row (the last axis, over keys) must sum to 1":
        _mistake(axis=-2),
    "lse without the max: log Σ exp(s - m) is lse - m; add m back": _mistake(lse_max=False),
    "lse in log2 units (log2 Σ exp): the oracle's lse is the natural log (np.log); the base-2 "
    "version is chapter 06's kernel trick": _mistake(lse_log2=True),
    "lse is in q's dtype: the oracle returns lse in float64 whatever the input (compute in "
    "float64, cast only o back to q's dtype)": _mistake(lse_dtype="q"),
    "o is float64 for float32 inputs: return o.astype(q.dtype)": _mistake(o_dtype=np.float64),
}


def standard_cases(seed=_SEED + 3) -> list[Case]:
    """The cases Exercise 1.3 is checked on: N_q ≠ N_k both ways, leading dims, causal and not,
    an explicit scale, float32 and float64, and scores near LARGE_LOGIT."""
    rng = np.random.default_rng(seed)

    def qkv(lead, n_q, n_k, d, d_v, dtype=np.float64):
        return tuple(rng.standard_normal((*lead, n, w)).astype(dtype)
                     for n, w in ((n_q, d), (n_k, d), (n_k, d_v)))

    _, q_big, k_big, v_big = _arrays(seed)[-1]  # scores near LARGE_LOGIT, (19, 8) each
    return [
        Case(qkv((), 5, 7, 8, 12), label="5 queries, 7 keys, d=8, d_v=12"),
        Case(qkv((2, 3), 13, 13, 16, 16, np.float32), {"causal": True},
             label="causal, batched (2, 3, 13, 16), float32"),
        Case(qkv((), 6, 9, 8, 8), {"causal": True}, label="causal, 6 queries, 9 keys"),
        Case(qkv((2,), 9, 5, 8, 4), {"causal": True}, label="causal, 9 queries, 5 keys, (2, ...)"),
        Case(qkv((3,), 10, 11, 6, 6), {"scale": EXPLICIT_SCALE},
             label=f"scale={EXPLICIT_SCALE}, (3, 10, 6)"),
        Case((q_big, k_big, v_big), {"causal": True},
             label=f"causal, scores near {LARGE_LOGIT:g}"),
    ]


STANDARD_HINTS = [
    "Work in float64 as the oracle does: <code>q64 = q.astype(np.float64)</code> (same for k, v). "
    "At the end cast <code>o</code> back to <code>q.dtype</code>; <code>lse</code> stays float64.",
    "The scale: <code>1 / math.sqrt(d)</code> when <code>scale is None</code>, else "
    "<code>scale</code>. Scores <code>s = scale · q64 @ swapaxes(k64, -1, -2)</code>: "
    "<code>(..., N_q, N_k)</code>.",
    "Causal: a boolean <code>(N_q, N_k)</code> array, True where <code>j &lt;= i</code> "
    "(<code>np.arange(N_k)[None, :] &lt;= np.arange(N_q)[:, None]</code>); put "
    "<code>-inf</code> where it is False with <code>np.where</code>. It broadcasts over the "
    "leading dims.",
    "Safe softmax over the last axis: <code>m = s.max(-1, keepdims=True)</code>, "
    "<code>p = exp(s - m)</code> (masked scores give 0), "
    "<code>l = p.sum(-1, keepdims=True)</code>, "
    "<code>o = (p @ v64) / l</code>.",
    "The log-sum-exp: <code>log Σ exp(s) = m + log Σ exp(s - m)</code>, so "
    "<code>lse = m[..., 0] + np.log(l[..., 0])</code>, shape <code>(..., N_q)</code>.",
]

STANDARD_SKELETON = '''\
scale = ...                                   # 1/√d unless given
q64, k64, v64 = ...                           # float64 copies
s = ...                                       # (..., N_q, N_k) scaled scores
if causal:
    visible = ...                             # (N_q, N_k) True where j <= i
    s = ...                                   # -inf where not visible
m = ...                                       # (..., N_q, 1) row max
p = ...                                       # (..., N_q, N_k) exp(s - m)
l = ...                                       # (..., N_q, 1) row sum
o = ...                                       # (..., N_q, d_v) p @ v64 / l
lse = ...                                     # (..., N_q) m + log l
return ...                                    # o in q's dtype, lse float64'''


@learner_check
def check_standard_attention(fn, **kwargs):
    """Check Exercise 1.3 against :func:`course_lib.reference.naive_attention_numpy`; return
    ``fn`` (pass) or the oracle (not done yet)."""
    return check_function("Exercise 1.3", fn, naive_attention_numpy, standard_cases(),
                          mistakes=MISTAKES_STANDARD, **kwargs)
