"""Checks for chapter 01 (naive attention).

* Exercise 1.1 — ``attention_numpy(q, k, v)``: ``softmax(q kᵀ / √d) v`` with NumPy.
* Exercise 1.2 — ``attention_torch(q, k, v)``: the same with PyTorch tensors.
* Exercise 1.3 — ``standard_attention(q, k, v, causal=False, scale=None) -> (o, lse)``: the whole
  of the library's oracle :func:`course_lib.attention.reference.naive_attention_numpy` (causal mask, scale,
  safe softmax, log-sum-exp), with a hint ladder: ``STANDARD_HINTS``, ``STANDARD_SKELETON``.

Exercises 1.1 and 1.2 are checked against PyTorch's ``scaled_dot_product_attention`` computed in
float64, on shapes that are deliberately not square or round (``N_q ≠ N_k``, ``d_v ≠ d``, batched,
and one case with logits in the thousands, where an ``exp`` without the max subtracted
overflows).
Exercise 1.3 is checked against the oracle itself, on cases that tell the causal alignments apart
(``N_q ≠ N_k``), pass an explicit ``scale``, and mix float32 and float64.
"""

from __future__ import annotations

import math

import numpy as np

from course_lib.teaching.checks import learner_check
from course_lib.teaching.checks import Case, check_function
from course_lib.constants import LOG2_E
from course_lib.attention.reference import default_scale, naive_attention_numpy, naive_attention_torch

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

# Each model is the mistaken code itself, computed in the inputs' dtype as a learner's NumPy or
# torch code does (float32 inputs stay float32), so that it reproduces that answer on every case,
# including the overflow of exp in float32 and the NaN rows of an unsafe softmax.
_SCALES = {  # name: the factor the scores are multiplied by, from d, N_q, N_k
    "sqrt": lambda d, n_q, n_k: default_scale(d),
    "none": lambda d, n_q, n_k: 1.0,
    "d": lambda d, n_q, n_k: 1.0 / d,
    "times_sqrt": lambda d, n_q, n_k: math.sqrt(d),
    "n_q": lambda d, n_q, n_k: default_scale(n_q),
    "half_d": lambda d, n_q, n_k: 2.0 / d,  # s / (d ** 1/2) = s / (d / 2)
    "two_d": lambda d, n_q, n_k: 0.5 / d,  # s / d ** 1/2 = (s / d) / 2
}


def _variant(q, k, v, *, scale="sqrt", axis=-1, subtract_max="row", normalise="row",
             keys="transpose", return_p=False, promote=False):
    """Attention (in the inputs' dtype) with one knob turned the wrong way; returns ``q``'s
    dtype unless ``promote`` (a float64 NumPy scalar in the scale promotes float32)."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    d, n_q, n_k = q.shape[-1], q.shape[-2], k.shape[-2]
    if keys == "transpose":
        k_t = np.swapaxes(k, -1, -2)  # (..., d, N_k)
    else:  # reshaped, not transposed: the same numbers in the wrong places
        k_t = k.reshape(*k.shape[:-2], d, n_k)
    factor = _SCALES[scale](d, n_q, n_k)
    s = q @ k_t  # (..., N_q, N_k)
    s = s / np.float64(1.0 / factor) if promote else s * factor
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        if subtract_max == "row":
            s = s - s.max(axis=axis, keepdims=True)
        elif subtract_max == "global":
            s = s - s.max()
        elif subtract_max == "no keepdims":  # s.max(-1) broadcasts along the keys
            s = s - s.max(axis=axis)[..., None, :]
        p = np.exp(s)
        if normalise == "row":
            p = p / p.sum(axis=axis, keepdims=True)
        elif normalise == "no keepdims":
            p = p / p.sum(axis=axis)[..., None, :]
        elif normalise == "global":
            p = p / p.sum()
        out = p if return_p else p @ v
    return out if promote else out.astype(q.dtype)


def _torch_version(numpy_fn):
    def wrong(q, k, v):
        import torch

        out = numpy_fn(*(x.detach().cpu().numpy() for x in (q, k, v)))
        return torch.from_numpy(out).to(q.device)
    return wrong


def _m(**knobs):
    return lambda q, k, v: _variant(q, k, v, **knobs)


WRONG_AXIS = "softmax over the wrong axis: each query's row (the last axis, over keys) must sum to 1"
NO_MAX = ("no max subtraction: exp of scores in the thousands overflows to inf (and of large "
          "negative ones underflows to 0), and inf/inf or 0/0 is NaN — subtract each row's max "
          "before exp")
GLOBAL_MAX = ("the max subtracted is the whole array's (s.max() without axis): a row far below it "
              "underflows to 0/0 = NaN; subtract each row's own max, s.max(axis=-1, keepdims=True)")

MISTAKES_NUMPY = {
    "the scores are not scaled: multiply q kᵀ by 1/√d": _m(scale="none"),
    "the scores are scaled by 1/d; the scale is 1/√d": _m(scale="d"),
    "the scores are multiplied by √d; the scale is 1/√d": _m(scale="times_sqrt"),
    "the scale used N (q.shape[-2], the number of queries); d is q.shape[-1]": _m(scale="n_q"),
    "`s / (d ** 1/2)` divides by d/2 (a power binds tighter than /): write d ** 0.5":
        _m(scale="half_d"),
    "`s / d ** 1/2` is (s / d) / 2 (a power binds tighter than /): write s / d ** 0.5":
        _m(scale="two_d"),
    WRONG_AXIS: _m(axis=-2),
    "softmax over axis 1: for batched inputs axis 1 is not the keys' axis; use axis=-1":
        _m(axis=1),
    NO_MAX: _m(subtract_max="none"),
    GLOBAL_MAX:
        _m(subtract_max="global"),
    "the row max lost its axis (s.max(axis=-1) without keepdims=True), so it is subtracted "
    "along the keys, one column at a time: keep keepdims=True": _m(subtract_max="no keepdims"),
    "the weights are not normalised: divide exp(s) by its row sum": _m(normalise="none"),
    "the row sum lost its axis (p.sum(axis=-1) without keepdims=True), so column j is divided by "
    "row j's sum: keep keepdims=True": _m(normalise="no keepdims"),
    "the weights are divided by the sum of the whole matrix (p.sum() without axis): each row is "
    "divided by its own sum": _m(normalise="global"),
    "k was reshaped to (d, N_k) instead of transposed: reshape keeps the numbers in memory "
    "order; use np.swapaxes(k, -1, -2) (k.transpose(-2, -1) in torch)": _m(keys="reshape"),
    "returned the attention weights P; the output is P @ v": _m(return_p=True),
    "the result is float64 for float32 inputs: a NumPy float64 scalar such as np.sqrt(d) promotes "
    "float32 arrays (NumPy 2 rules); divide by math.sqrt(d) or return .astype(q.dtype)":
        _m(promote=True),
}
MISTAKES_TORCH = {cause: _torch_version(fn) for cause, fn in MISTAKES_NUMPY.items()
                  if "NumPy float64 scalar" not in cause}


# ------------------------------------------------------------------------------ the cases

def _shapes():
    """(label, q shape, k shape, v shape, dtype, logits, layout).

    ``logits``: None (standard normal entries), a number L (unit-norm rows scaled so that the
    scores reach about ±L) or ``("rows", L, gap)`` (each query row's scores near +L or -L by
    turns, its keys about ``gap`` apart: rows far from each other and from 0, and in float32 each
    row dominated by one key, so that a correct float32 answer stays within tolerance).
    ``layout``: "plain" or "views" (q a (B, N, H, d) array permuted to (B, H, N, d), k a
    (..., d, N_k) array transposed, v every other column of a wider array)."""
    return [
        ("N=37, d=12", (37, 12), (37, 12), (37, 12), np.float64, None, "plain"),
        ("5 queries, 7 keys, d=8, d_v=12", (5, 8), (7, 8), (7, 12), np.float64, None, "plain"),
        ("batched (2, 3, 13, 20), d_v=7, float32, strided views", (2, 3, 13, 20),
         (2, 3, 13, 20), (2, 3, 13, 7), np.float32, None, "views"),
        (f"logits near ±{LARGE_LOGIT:g}", (19, 8), (19, 8), (19, 8), np.float64, LARGE_LOGIT,
         "plain"),
        ("(2, 2, 9, 10), 11 keys, rows of scores near +1000 and -1000", (2, 2, 9, 10),
         (2, 2, 11, 10), (2, 2, 11, 6), np.float64, ("rows", 1000.0, 30.0), "views"),
        ("(3, 6, 7), 8 keys, float32, rows of scores near +300 and -300", (3, 6, 7), (3, 8, 7),
         (3, 8, 5), np.float32, ("rows", 300.0, 12.0), "plain"),
    ]


def _layout(x, kind, rng):
    """``x`` (..., N, w) as a strided view with the same values: ``kind`` "q" (heads interleaved),
    "k" (column stride ≠ 1) or "v" (every other column of a wider array)."""
    if kind == "q" and x.ndim == 4:
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if kind == "k":
        return np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2)
    wide = rng.standard_normal((*x.shape[:-1], 2 * x.shape[-1])).astype(x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def _arrays(seed=_SEED):
    rng = np.random.default_rng(seed)
    out = []
    for label, qs, ks, vs, dtype, logit, layout in _shapes():
        q, k, v = (rng.standard_normal(s) for s in (qs, ks, vs))
        d = qs[-1]
        if isinstance(logit, tuple):  # coordinate 0 carries ±L, coordinate 1 the gaps
            _, size, gap = logit
            scale, n_k = default_scale(d), ks[-2]
            sign = np.where(np.arange(qs[-2]) % 2 == 0, 1.0, -1.0)[:, None]  # (N_q, 1)
            q, k = 0.05 * q, 0.05 * k  # small non-integer noise in the other coordinates
            q[..., :1] = sign * size / scale
            k[..., :1] = 1.0
            # key j adds ±gap·j/2 + gap·j/2: each row's scores are gap apart, in a row's own order
            q[..., 1:2] = np.where(rng.random((*qs[:-1], 1)) < 0.5, -1.0, 1.0) * gap / scale
            k[..., 1:2] = (np.arange(n_k)[:, None] + 0.5 * (rng.random((*ks[:-1], 1)) - 0.5))
        elif logit is not None:
            # unit-norm rows times √(logit·√d) each, so scaled scores reach about ±logit
            q = q / np.linalg.norm(q, axis=-1, keepdims=True)
            k = k / np.linalg.norm(k, axis=-1, keepdims=True)
            size = np.sqrt(logit / default_scale(d))
            q, k = q * size, k * size
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        if layout == "views":
            q, k, v = (_layout(x, kind, rng) for x, kind in ((q, "q"), (k, "k"), (v, "v")))
        out.append((label, q, k, v))
    return out


def numpy_cases() -> list[Case]:
    """The cases Exercise 1.1 is checked on (NumPy arrays)."""
    return [Case((q, k, v), label=label) for label, q, k, v in _arrays()]


def torch_cases(device=None) -> list[Case]:
    """The same cases as torch tensors on ``device`` (default: the runtime's device); the views
    keep their strides (``torch.from_numpy`` shares them)."""
    import torch

    if device is None:
        from course_lib.platform import runtime

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
                      axis=-1, subtract_max="row", lse_max=True, lse_log2=False,
                      lse_unshifted=False, normalise=True, mask_after_softmax=False,
                      lse_dtype=np.float64, o_dtype=None):
    """The oracle's computation (float64) with one knob turned the wrong way; ``lse_dtype="q"``
    returns lse in q's dtype."""
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    d, n_q, n_k = q64.shape[-1], q64.shape[-2], k64.shape[-2]
    given = default_scale(d) if scale is None else scale
    s = {"given": given, "sqrt": default_scale(d), "d": 1.0 / d if scale is None else scale,
         "divided": given if scale is None else 1.0 / scale,  # s / scale with scale given
         "both": given * default_scale(d) if scale is not None else given,
         }[factor] * (q64 @ np.swapaxes(k64, -1, -2))  # (..., N_q, N_k)
    rows, cols = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    visible = {"top-left": cols <= rows, "transposed": cols >= rows, "strict": cols < rows,
               "bottom-right": cols <= rows + (n_k - n_q), "zero": cols <= rows}[mask]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        if causal and not mask_after_softmax:
            s = np.where(visible, s, 0.0 if mask == "zero" else -np.inf)
        if subtract_max == "row":
            m = s.max(axis=axis, keepdims=True)
        elif subtract_max == "global":
            m = np.broadcast_to(s.max(), s[..., :1].shape) if axis == -1 else None
        else:
            m = np.zeros_like(s[..., :1])
        p = np.exp(s - m)
        l = p.sum(axis=axis, keepdims=True)
        if normalise:
            p = p / l
        if causal and mask_after_softmax:
            p = np.where(visible, p, 0.0)
        o = p @ v64
        if lse_unshifted:
            lse = np.log(np.exp(s).sum(axis=-1))
        else:
            lse = np.log(l).squeeze(axis) + (m.squeeze(axis) if lse_max else 0.0)  # (..., N_q)
    if lse_log2:
        lse = lse * LOG2_E
    return o.astype(o_dtype or q.dtype), lse.astype(q.dtype if lse_dtype == "q" else lse_dtype)


def _mistake(**knobs):
    return lambda q, k, v, causal=False, scale=None: _standard_variant(
        q, k, v, causal, scale, **knobs)


MISTAKES_STANDARD = {
    f"no max subtraction: exp of scores in the thousands overflows to inf (and of large negative "
    f"ones underflows to 0), and inf/inf or 0/0 is NaN — subtract each row's max before exp":
        _mistake(subtract_max="none"),
    GLOBAL_MAX:
        _mistake(subtract_max="global"),
    "the causal mask is transposed: key j is visible to query i when j <= i (np.tril's shape, "
    "ones on and below the diagonal)": _mistake(mask="transposed"),
    "the causal mask is off by one (j < i): a query also sees its own key (j <= i); with j < i "
    "query 0 sees no key at all (a NaN row)": _mistake(mask="strict"),
    "the causal mask is aligned to the bottom-right corner (j <= i + N_k - N_q); SDPA's is_causal "
    "and the oracle align it top-left: j <= i": _mistake(mask="bottom-right"),
    "the masked scores were set to 0 (s * mask) instead of -inf: a score of 0 still gets the "
    "weight exp(0 - m); put -inf where a key is hidden": _mistake(mask="zero"),
    "the causal mask was applied to the weights after the softmax: mask the scores (-inf) before "
    "it, so that each row's visible weights still sum to 1": _mistake(mask_after_softmax=True),
    "the `scale` argument is ignored: use it when given, 1/√d only when it is None":
        _mistake(factor="sqrt"),
    "the given `scale` divides the scores: it multiplies them (s = scale · q kᵀ)":
        _mistake(factor="divided"),
    "both the given `scale` and 1/√d were applied: 1/√d is only the default, for scale=None":
        _mistake(factor="both"),
    "the scores are scaled by 1/d; the default scale is 1/√d": _mistake(factor="d"),
    "softmax over the wrong axis: each query's row (the last axis, over keys) must sum to 1":
        _mistake(axis=-2),
    "the weights are not normalised: divide by the row sum l (o = p @ v / l)":
        _mistake(normalise=False),
    "lse without the max: log Σ exp(s - m) is lse - m; add m back": _mistake(lse_max=False),
    "lse computed as log(Σ exp(s)) without the max: exp overflows to inf (or underflows to 0) for "
    "scores in the thousands; use lse = m + log(l)": _mistake(lse_unshifted=True),
    "lse in log2 units (log2 Σ exp): the oracle's lse is the natural log (np.log); the base-2 "
    "version is chapter 06's kernel trick": _mistake(lse_log2=True),
    "lse is in q's dtype: the oracle returns lse in float64 whatever the input (compute in "
    "float64, cast only o back to q's dtype)": _mistake(lse_dtype="q"),
    "o is float64 for float32 inputs: return o.astype(q.dtype)": _mistake(o_dtype=np.float64),
}


def standard_cases(seed=_SEED + 3) -> list[Case]:
    """The cases Exercise 1.3 is checked on: N_q ≠ N_k both ways, leading dims, causal and not,
    explicit scales (with and without causal), float32 and float64, head dims that are not
    perfect squares, strided views, and scores in the thousands of both signs.

    (A fully masked row cannot occur: with the top-left causal mask query i always sees key 0.)
    """
    rng = np.random.default_rng(seed)

    def qkv(lead, n_q, n_k, d, d_v, dtype=np.float64):
        return tuple(rng.standard_normal((*lead, n, w)).astype(dtype)
                     for n, w in ((n_q, d), (n_k, d), (n_k, d_v)))

    arrays = _arrays(seed)
    _, q_big, k_big, v_big = arrays[3]  # scores near ±LARGE_LOGIT, (19, 8) each
    _, q_rows, k_rows, v_rows = arrays[4]  # rows near +1000 / -1000, (2, 2, 9|11, 10|6), views
    q_f32, k_f32, v_f32 = (_layout(x, kind, rng) for x, kind in
                           zip(qkv((2, 3), 13, 13, 20, 20, np.float32), "qkv"))
    return [
        Case(qkv((), 5, 7, 8, 12), label="5 queries, 7 keys, d=8, d_v=12"),
        Case((q_f32, k_f32, v_f32), {"causal": True},
             label="causal, batched (2, 3, 13, 20), float32, strided views"),
        Case(qkv((), 6, 9, 8, 8), {"causal": True}, label="causal, 6 queries, 9 keys"),
        Case(qkv((2,), 9, 5, 8, 4), {"causal": True}, label="causal, 9 queries, 5 keys, (2, ...)"),
        Case(qkv((3,), 10, 11, 6, 6), {"scale": EXPLICIT_SCALE},
             label=f"scale={EXPLICIT_SCALE}, (3, 10, 6)"),
        Case(qkv((2, 2), 7, 4, 12, 5), {"causal": True, "scale": 1.7},
             label="causal, scale=1.7, 7 queries, 4 keys, (2, 2, ...)"),
        Case((q_big, k_big, v_big), {"causal": True},
             label=f"causal, scores near ±{LARGE_LOGIT:g}"),
        Case((q_rows[..., :5, :], k_rows, v_rows), {"causal": False},
             label="rows of scores near +1000 and -1000, 5 queries, 11 keys, (2, 2, ...)"),
        Case((q_rows, k_rows[..., :6, :], v_rows[..., :6, :]), {"causal": True},
             label="causal, rows of scores near +1000 and -1000, 9 queries, 6 keys, (2, 2, ...)"),
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
    """Check Exercise 1.3 against :func:`course_lib.attention.reference.naive_attention_numpy`; return
    ``fn`` (pass) or the oracle (not done yet)."""
    return check_function("Exercise 1.3", fn, naive_attention_numpy, standard_cases(),
                          mistakes=MISTAKES_STANDARD, **kwargs)
