"""Differential diagnosis: what the evidence of every case says about a wrong answer.

:func:`course_lib.teaching.checks.check_function` runs a learner's answer on every case of an exercise and
keeps, per case, the answer's output, the right output and the case's *features* (what the case
varies: an explicit scale, a ragged last tile, N_q ≠ N_k, causal, a non-contiguous input, GQA,
scores beyond ±80, …). This module reads that evidence, once for every check, and says what
singles out the failures — never a guess:

* **contrast** — the features every failing case has and no right case has ("fails exactly on
  the cases with a scale other than 1/√d");
* **parts** — which outputs of a multi-output answer are right ("`o` right on every case; `lse`
  wrong on cases 2 and 4");
* **where** — which rows (and which Q tile), or which side of the diagonal, are wrong;
* **transforms** — the answer is the right one times a known constant (log2 e, ln 2, 1/√d, √d,
  2, ½, −1, the case's scale), transposed, permuted along one axis (heads, batch elements), or
  shifted by one tile of rows;
* **invariants** — a property the right output has on every case and the answer breaks: rows
  of probabilities (≥ 0, summing to 1), rows that sum to 0 (as Σ_j dS_ij does), an output inside
  the range of the rows it averages (o of v's rows), lse at least the row's largest visible score
  and at most that plus ln(#visible keys).

An invariant is used only where the right output itself satisfies it on every case, so it never
states a rule the exercise does not have. A contrast is used only where it cannot be chance: an
experiment (the first failing case rerun with the feature switched off, :func:`toggle`) showed
that the feature matters, or at least two cases fail and two pass; absences ("fails on the cases
*without* X") are never used. A line names no cause: it says what the evidence shows, plainly
enough that the learner reads the slip from it.

The module depends on NumPy (torch only through tensors it is handed), so the check layer
(:mod:`course_lib.teaching.checks`) can import it.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from course_lib.constants import LN_2, LOG2_E

RIGHT, WRONG, CRASHED = "right", "wrong", "crashed"

# Scores (or log-sum-exps) beyond this size overflow exp() in float32 (exp(89) > 3.4e38): a
# softmax or merge that skips the max-subtraction fails exactly there.
LARGE_VALUE = 80.0
# At most this many evidence lines per diagnosis: the message stays a few lines long.
MAX_LINES = 4
# At most this many features listed when several set the failing cases apart, and parts of an
# output named one by one in "which parts are right".
MAX_FEATURES_LISTED = 4
MAX_PARTS_LISTED = 3
# Two estimates of a factor agree within this relative difference when a known constant is named.
CONSTANT_RTOL = 2e-3
# A row scaled by less than this is a row that is missing (all but zero), not one resized.
MIN_ROW_FACTOR = 0.01
# Axes longer than this are not searched for a permutation (heads and batch elements are few).
MAX_PERMUTED_AXIS = 64
# Score matrices larger than this are not built for features or invariants (cost).
MAX_SCORE_ELEMENTS = 4_000_000


# ----------------------------------------------------------------------------------------------
# Arrays, whatever the learner returned


def is_tensor(x: Any) -> bool:
    """True for a torch.Tensor (without importing torch: no tensor exists unless it was)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def to_numpy64(x: Any) -> np.ndarray:
    """Any array-like (tensor on any device, ndarray, number) as a float64 ndarray."""
    if is_tensor(x):
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_tensor(x)


def _as64(x: Any) -> np.ndarray | None:
    """``x`` as float64, or None when it is no array or number (a string, a dict, None)."""
    if isinstance(x, (bool, np.bool_)) or x is None or isinstance(x, (str, bytes, dict)):
        return None
    try:
        out = to_numpy64(x)
    except (TypeError, ValueError, RuntimeError):
        return None
    return out if out.dtype == np.float64 else None


def part_label(path: str, index: int, names: Sequence[str] | None = None) -> str:
    """The name of element ``index`` of the output at ``path`` ("" is the whole output): a
    name from ``names`` at the top level (`` `lse` ``), else ``output [i]``; nested parts add
    ``[i]`` (``output [0][1]``, `` `o_shards`[1]``)."""
    if not path:
        if names is not None and index < len(names):
            name = names[index]
            return f"`{name}`" if name.isidentifier() else name  # a code name, or words
        return f"output [{index}]"
    return f"{path}[{index}]"


def parts(value: Any, names: Sequence[str] | None = None, path: str = "") -> list[tuple[str, Any]]:
    """``(label, leaf)`` for every array or number in ``value``, through tuples and lists (the
    labels of :func:`part_label`; a single array is the part "the output")."""
    if isinstance(value, (tuple, list)):
        found = []
        for i, item in enumerate(value):
            found += parts(item, names if not path else None, part_label(path, i, names))
        return found
    return [(path or "the output", value)]


# ----------------------------------------------------------------------------------------------
# Features of a case, from its inputs


def _contiguous(x: Any) -> bool:
    if is_tensor(x):
        return bool(x.is_contiguous())
    return bool(x.flags.c_contiguous)


def _dtype_of(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def _floating(x: Any) -> bool:
    return (x.is_floating_point() if is_tensor(x) else np.asarray(x).dtype.kind == "f")


def _int(x: Any) -> int | None:
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (int, np.integer)):
        return int(x)
    return None


def attention_shapes(inputs: dict) -> dict | None:
    """The attention notation of a case, when its inputs follow it: ``q (..., N_q, d)``,
    ``k (..., N_k, d)`` (and ``v (..., N_k, d_v)``), not packed (no ``cu_seqlens``). Returns
    ``{"n_q", "n_k", "d", "q", "k"}`` or None."""
    q, k = inputs.get("q"), inputs.get("k")
    if not (_is_array(q) and _is_array(k)) or "cu_seqlens" in inputs:
        return None
    if q.ndim < 2 or k.ndim < 2 or q.shape[-1] != k.shape[-1]:
        return None
    v = inputs.get("v")
    if _is_array(v) and (v.ndim != k.ndim or v.shape[-2] != k.shape[-2]):
        return None
    return {"n_q": q.shape[-2], "n_k": k.shape[-2], "d": q.shape[-1], "q": q, "k": k}


def effective_scale(inputs: dict, d: int) -> float:
    """The score scale a case asks for: its ``scale`` when given, else 1/√d."""
    scale = inputs.get("scale")
    return 1.0 / math.sqrt(d) if scale is None or isinstance(scale, bool) else float(scale)


def _scores(inputs: dict):
    """``(s, visible)``: the case's scores ``scale · q kᵀ`` in float64 ``(..., N_q, N_k)`` and the
    boolean visibility (causal top-left, the ``mask`` input, or all), or None when the inputs do
    not follow the attention notation (or are too large to build)."""
    shapes = attention_shapes(inputs)
    if shapes is None:
        return None
    q, k = to_numpy64(shapes["q"]), to_numpy64(shapes["k"])
    if q.ndim >= 3 and k.ndim == q.ndim and q.shape[-3] != k.shape[-3]:
        if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
            return None
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)  # GQA: each K/V head serves a group
    try:
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except ValueError:
        return None
    n_q, n_k = shapes["n_q"], shapes["n_k"]
    if math.prod(lead) * n_q * n_k > MAX_SCORE_ELEMENTS:
        return None
    s = effective_scale(inputs, shapes["d"]) * (q @ np.swapaxes(k, -1, -2))
    visible = np.ones((n_q, n_k), dtype=bool)
    if inputs.get("causal") is True:
        visible = np.tri(n_q, n_k, dtype=bool)
    mask = inputs.get("mask")
    if _is_array(mask) and tuple(mask.shape) == (n_q, n_k):
        visible = to_numpy64(mask) != 0
    return s, np.broadcast_to(visible, s.shape)


_STATISTIC = re.compile(r"^(lse|m)(_\w+)?$")


# A case feature: a split of the keys (flash-decoding's ``splits``) that holds no key, so its rows
# see none there (a 0/0 or an all -inf max in that chunk is then the chunk's, not a slip's)
EMPTY_CHUNK = "an empty chunk (a split with no key)"


def derive_features(inputs: dict) -> dict:
    """What a case varies that a wrong answer may depend on, read from its inputs (argument
    name → value). Generic: dtypes, non-contiguous arrays, given options (``causal``, ``scale``,
    block sizes and other numbers); in the course's attention notation (``q``, ``k``, ``v``,
    ``block_m``, ``block_n``, ``mask``) also N_q ≠ N_k, ragged last tiles, BLOCK_M ≠ BLOCK_N,
    d ≠ d_v, leading dims, GQA, a scale other than 1/√d, scores beyond ±80, rows that see no key;
    for running statistics (``lse``, ``m``, …) values beyond ±80, far apart, or -inf."""
    feats: dict[str, Any] = {}
    arrays = {name: x for name, x in inputs.items() if _is_array(x)}
    dtypes = sorted({_dtype_of(x) for x in arrays.values() if _floating(x)})
    if dtypes:
        feats["dtype"] = "/".join(dtypes)
    for name, x in arrays.items():
        if x.ndim >= 2:
            feats[f"non-contiguous `{name}`"] = not _contiguous(x)
    for name, value in inputs.items():
        if isinstance(value, (bool, np.bool_)) and name != "causal":
            feats[f"`{name}`={bool(value)}"] = True
        elif _int(value) is not None and name not in ("block_m", "block_n"):
            feats[f"`{name}`"] = _int(value)
    if isinstance(inputs.get("causal"), (bool, np.bool_)):
        feats["a causal mask"] = bool(inputs["causal"])
    shapes = attention_shapes(inputs)
    if shapes is not None:
        n_q, n_k, d, q, k = (shapes[key] for key in ("n_q", "n_k", "d", "q", "k"))
        feats["N_q ≠ N_k"] = n_q != n_k
        v = inputs.get("v")
        if _is_array(v):
            feats["d ≠ d_v"] = v.shape[-1] != d
        feats["leading dims"] = q.ndim > 2
        if q.ndim >= 3:
            feats["several heads"] = q.shape[-3] > 1
        if q.ndim >= 4:
            feats["several batch elements"] = q.shape[-4] > 1
        if q.ndim >= 3 and k.ndim >= 3:
            feats["GQA (fewer K/V heads than query heads)"] = q.shape[-3] != k.shape[-3]
        bm, bn = _int(inputs.get("block_m")), _int(inputs.get("block_n"))
        if bm:
            feats["a ragged last Q tile"] = n_q % bm != 0
        if bn:
            feats["a ragged last K/V tile"] = n_k % bn != 0
        if bm and bn:
            feats["BLOCK_M ≠ BLOCK_N"] = bm != bn
        if "scale" in inputs:
            given = inputs.get("scale")
            feats["a scale other than 1/√d"] = (given is not None and not isinstance(given, bool)
                                               and not math.isclose(float(given), d ** -0.5))
            feats[DEFAULT_SCALE] = given is None
        scored = _scores(inputs)
        if scored is not None:
            s, visible = scored
            feats[f"scores beyond ±{LARGE_VALUE:g}"] = bool(
                np.abs(s).max(initial=0) > LARGE_VALUE)
            feats["rows that see no key"] = bool((~visible.any(axis=-1)).any())
        splits = _int(inputs.get("splits"))
        if splits and splits > 1:  # flash-decoding: the keys cut into `splits` chunks of ceil(N_k / splits)
            feats[EMPTY_CHUNK] = (splits - 1) * -(-n_k // splits) >= n_k
    elif _matmul_k(inputs) is not None:
        k, block_k = _matmul_k(inputs)
        feats["more than one step over K"] = k > block_k
        feats["a ragged last step over K (K not a multiple of BLOCK_K)"] = k % block_k != 0
        for axis, name in ((0, "block_m"), (1, "block_n")):
            block = _int(inputs.get(name))
            n = (inputs["a"].shape[0], inputs["b"].shape[1])[axis]
            if block:
                feats[f"a ragged last {'row' if axis == 0 else 'column'} tile"] = n % block != 0
    elif "cu_seqlens" in inputs and _is_array(inputs.get("q")) and _is_array(inputs.get("k")):
        q, k = inputs["q"], inputs["k"]
        if q.ndim == 3 and k.ndim == 3:
            feats["GQA (fewer K/V heads than query heads)"] = q.shape[1] != k.shape[1]
        lengths = np.diff(to_numpy64(inputs["cu_seqlens"]))
        feats["samples of unequal lengths"] = bool(lengths.size > 1 and np.ptp(lengths) > 0)
    for name, x in arrays.items():
        if not _STATISTIC.match(name) or not _floating(x):
            continue
        values = to_numpy64(x)
        finite = values[np.isfinite(values)]
        largest = np.abs(finite).max(initial=0)
        feats[f"`{name}` beyond ±{LARGE_VALUE:g}"] = bool(largest > LARGE_VALUE)
        feats[f"`{name}` values over {LARGE_VALUE:g} apart"] = bool(
            finite.size > 1 and np.ptp(finite) > LARGE_VALUE)
        feats[f"-inf in `{name}` (empty rows)"] = bool(np.isneginf(values).any())
    return feats


# ----------------------------------------------------------------------------------------------
# The evidence of one check


@dataclass
class Outcome:
    """One case as the check saw it: its number, features and status (:data:`RIGHT`,
    :data:`WRONG`, :data:`CRASHED`), what the answer returned and the right output, the
    tolerance ``(atol, rtol)`` and the inputs by argument name."""

    n: int
    features: dict
    status: str
    got: Any = None
    want: Any = None
    tolerance: tuple = (0.0, 0.0)
    inputs: dict = field(default_factory=dict)


def diagnose(outcomes: Sequence[Outcome], names: Sequence[str] | None = None,
             headline: int | None = None, experiments: dict | None = None) -> list[str]:
    """The evidence lines (each ``"  evidence: …"``) for a check whose answer failed some case.

    Args:
        outcomes: every case the answer ran on, in order.
        names: the names of a tuple output's parts (``("o", "lse")``), or None.
        headline: the number of the case the message shows first (default: the first failing).
        experiments: ``{feature: passed}``: whether the headline case passed with that feature
            switched off (:func:`toggle`). A passed experiment singles its feature out; a failed
            one (the feature alone does not explain the failure, or the switch changed more
            than it) leaves the contrast unsaid.

    Returns:
        At most :data:`MAX_LINES` lines; [] when the evidence says nothing beyond the failure.
    """
    failing = [o for o in outcomes if o.status != RIGHT]
    if not failing:
        return []
    first = next((o for o in failing if o.n == headline), failing[0])
    found = []
    experiments = experiments or {}
    for make in (_contrast, _parts_right, _transforms, _where, _invariants):
        try:
            found += (make(outcomes, first, names, experiments) if make is _contrast
                      else make(outcomes, first, names))
        except Exception:  # noqa: BLE001 - evidence is optional; a learner's odd output gives none
            continue
    return [f"  evidence: {line}" for line in found[:MAX_LINES]]


def _numbers(ns: Iterable[int]) -> str:
    ns = list(ns)
    return ns and (str(ns[0]) if len(ns) == 1 else ", ".join(map(str, ns[:-1])) + f" and {ns[-1]}")


def _phrase(feature: str, value: Any) -> str:
    """'with X', 'without X' or 'with X = v': feature names are noun phrases."""
    if value is True:
        return f"with {feature}"
    if value is False:
        return f"without {feature}"
    return f"with {feature} = {value}"


_ABSENT = object()


def separating(outcomes: Sequence[Outcome], absences: bool = False) -> list[tuple[str, Any]]:
    """``(feature, value)`` for each feature that every failing case has (with that value) and
    no right case has: present features (True) and categories (a dtype), not absences — that a
    case *lacks* something rarely makes it fail, and with a handful of cases an absence
    separates by chance. A category whose value is a number needs two failing cases.
    ``absences=True`` adds the absences an experiment can switch on (:data:`_ON`: causal off
    on every failing case and on on every right one), for :func:`toggle` to test: such an
    absence is evidence only when the experiment says it is."""
    bad = [o for o in outcomes if o.status != RIGHT]
    good = [o for o in outcomes if o.status == RIGHT]
    if not bad or not good:
        return []
    names = list(dict.fromkeys(f for o in outcomes for f in o.features))
    found = []
    for feature in names:
        values = {_key(o.features.get(feature, _ABSENT)) for o in bad}
        if len(values) != 1:
            continue
        value = bad[0].features.get(feature, _ABSENT)
        if value is _ABSENT or value is None:
            continue
        if (value is False or value is np.False_) and not (absences and feature in _ON):
            continue
        if feature in _TESTED_ONLY and not absences:
            continue
        if len(bad) == 1 and not isinstance(value, (bool, np.bool_, str)):
            continue  # one failing case has a number of its own by chance: no evidence
        if any(_key(o.features.get(feature, _ABSENT)) == _key(value) for o in good):
            continue
        found.append((feature, value))
    return found


def separating_features(outcomes: Sequence[Outcome]) -> list[str]:
    """The phrases ("with a causal mask") of :func:`separating`."""
    return [_phrase(f, v) for f, v in separating(outcomes)]


def toggle(feature: str, inputs: dict, on: bool = False) -> dict | None:
    """The inputs of a case with ``feature`` switched off, where that is a change of the inputs
    that keeps the rest of the case (an experiment: does the case pass without it?): the scale
    set to 1/√d, causal off, a non-contiguous input made contiguous, one head (or one batch
    element) kept, one step over K (BLOCK_K raised to cover K). With ``on``, switched on where
    that is an option of the case (:data:`_ON`: causal on). None for any other feature."""
    if on:
        if feature == "a causal mask" and inputs.get("causal") is False:
            return {**inputs, "causal": True}
        return None
    if feature == "more than one step over K" and _matmul_k(inputs) is not None:
        k, block_k = _matmul_k(inputs)
        return {**inputs, "block_k": max(16, 1 << (k - 1).bit_length())}
    shapes = attention_shapes(inputs)
    if feature in ("a scale other than 1/√d", DEFAULT_SCALE) and shapes is not None:
        return {**inputs, "scale": shapes["d"] ** -0.5}
    if feature in ("several heads", "several batch elements") and shapes is not None:
        q = shapes["q"]
        axis = q.ndim - (3 if feature == "several heads" else 4)  # of q, k, v, o, dO (…, N, d)
        if axis < 0:
            return None
        changed = dict(inputs)
        k, n_q = shapes["k"], shapes["n_q"]
        for name, x in inputs.items():  # the first head (or batch element) of every tensor
            if _is_array(x) and x.shape[:axis] == q.shape[:axis] and (
                    x.ndim == q.ndim or (x.ndim == q.ndim - 1 and x.shape[-1] == n_q)) \
                    and x.shape[axis] in (q.shape[axis], k.shape[axis]):
                changed[name] = (x.narrow(axis, 0, 1) if is_tensor(x)
                                 else np.take(x, [0], axis=axis))
        return changed
    if feature == "a causal mask" and inputs.get("causal") is True:
        return {**inputs, "causal": False}
    found = re.fullmatch(r"non-contiguous `(\w+)`", feature)
    if found and _is_array(inputs.get(found.group(1))):
        x = inputs[found.group(1)]
        dense = x.contiguous() if is_tensor(x) else np.ascontiguousarray(x)
        return {**inputs, found.group(1): dense}
    return None


# Absences an experiment can switch on, and how the message says the switch.
_ON = {"a causal mask": "causal=True"}
# A case that leaves the scale to its default (scale=None).
DEFAULT_SCALE = "the default scale (scale=None)"
# Features that are evidence only through an experiment: the default scale is what most cases
# of an exercise share by design, so only passing with the same scale given explicitly (the
# answer's own default is then never used) singles it out.
_TESTED_ONLY = {DEFAULT_SCALE: "the same scale, 1/√d, passed explicitly"}


def _matmul_k(inputs: dict) -> tuple[int, int] | None:
    """``(K, BLOCK_K)`` of a tiled matrix product's case (inputs ``a`` (M, K), ``b`` (K, N) and
    ``block_k``), else None."""
    a, b, block_k = inputs.get("a"), inputs.get("b"), _int(inputs.get("block_k"))
    if not (_is_array(a) and _is_array(b) and block_k) or a.ndim != 2 or b.ndim != 2 or \
            a.shape[1] != b.shape[0]:
        return None
    return int(a.shape[1]), block_k


def _key(value: Any) -> Any:
    return bool(value) if isinstance(value, (bool, np.bool_)) else value


# A feature no experiment tested is evidence only when at least this many cases fail and this
# many pass: with fewer, some feature sets them apart by chance (a dtype, a size) too often.
MIN_CASES_EACH_SIDE = 2


def _contrast(outcomes, first, names, experiments) -> list[str]:
    bad = [o.n for o in outcomes if o.status != RIGHT]
    good = [o.n for o in outcomes if o.status == RIGHT]
    verb = ("crashes" if all(o.status == CRASHED for o in outcomes if o.status != RIGHT)
            else "fails")
    if not good:
        return []
    found = separating(outcomes)
    switched_on = [f for f, v in separating(outcomes, absences=True)
                   if (v is False or f in _TESTED_ONLY) and experiments.get(f)]
    if switched_on and not any(experiments.get(f) for f, _ in found):
        feature = switched_on[0]
        value = feature in _TESTED_ONLY
        return [f"{verb} exactly on the case{'s' if len(bad) > 1 else ''} "
                f"{_phrase(feature, value)} (case{'s' if len(bad) > 1 else ''} {_numbers(bad)}); "
                f"right on every other case, and case {first.n} passes when only that is "
                f"changed ({_TESTED_ONLY[feature] if value else _ON[feature]})"]
    tested = [f for f, _ in found if experiments.get(f)]
    if not tested and any(experiments.get(f) is False for f, _ in found):
        return []  # a feature that sets them apart did not matter alone: nothing singled out
    if not tested and min(len(bad), len(good)) < MIN_CASES_EACH_SIDE:
        return []  # one failing (or one right) case differs from the rest in some way by chance
    if not found or len(found) > MAX_FEATURES_LISTED:
        return []
    cases = f"case{'s' if len(bad) > 1 else ''} {_numbers(bad)}"
    if tested:  # an experiment singled it out, whatever else the cases share
        feature = tested[0]
        how = _OFF.get(feature, "that input made contiguous")
        return [f"{verb} exactly on the case{'s' if len(bad) > 1 else ''} {_phrase(feature, True)} "
                f"({cases}); right on every other case, and case {first.n} passes when only that "
                f"is changed ({how})"]
    phrases = [_phrase(f, v) for f, v in found]
    if len(phrases) == 1:
        return [f"{verb} exactly on the case{'s' if len(bad) > 1 else ''} {phrases[0]} "
                f"({cases}); right on every other case"]
    return [f"{verb} on {cases}, right on {_numbers(good)}; what sets the failing "
            f"case{'s' if len(bad) > 1 else ''} apart: {'; '.join(phrases)} — the cases do not "
            f"tell which of these matters"]


_OFF = {"a scale other than 1/√d": "the scale set to 1/√d",
        "a causal mask": "causal=False",
        "more than one step over K": "BLOCK_K raised to cover K in one step",
        "several heads": "only its first head kept",
        "several batch elements": "only its first batch element kept"}


def _close(g: np.ndarray, w: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """Element-wise agreement within tolerance (NaN agrees with NaN only)."""
    with np.errstate(invalid="ignore", over="ignore"):
        ok = np.isclose(g, w, atol=atol, rtol=rtol, equal_nan=True)
    return ok


def _part_status(got, want, names, tolerance) -> dict[str, bool | None]:
    """label -> True (right), False (wrong), None (not comparable: missing or another shape)."""
    want_parts = parts(want, names)
    got_parts = dict(parts(got, names)) if isinstance(got, (tuple, list)) else {}
    status = {}
    for label, w in want_parts:
        g = got_parts.get(label)
        g64, w64 = _as64(g), _as64(w)
        if g64 is None or w64 is None or g64.shape != w64.shape:
            status[label] = None
            continue
        # an integer output (a count, an index) handed back as floats is not right, whatever
        # its values: the headline says so, and "right on every failing case" must not
        status[label] = (_kind(g) == _kind(w) or _kind(w) != "i") and bool(
            _close(g64, w64, *tolerance).all())
    return status


def _kind(x: Any) -> str:
    """"i" for integers (Python, NumPy or torch), "f" for floating point, "b" for booleans."""
    if isinstance(x, (bool, np.bool_)):
        return "b"
    if isinstance(x, (int, np.integer)):
        return "i"
    if is_tensor(x):
        return "b" if x.dtype == sys.modules["torch"].bool else "f" if x.is_floating_point() else "i"
    kind = np.asarray(x).dtype.kind
    return "i" if kind in "iu" else kind


def _parts_right(outcomes, first, names) -> list[str]:
    if not isinstance(first.want, (tuple, list)):
        return []
    seen: dict[str, list] = {}
    for o in outcomes:
        if o.status != WRONG:
            continue
        for label, ok in _part_status(o.got, o.want, names, o.tolerance).items():
            seen.setdefault(label, []).append((o.n, ok))
    right = [label for label, oks in seen.items() if oks and all(ok is True for _, ok in oks)]
    wrong = {label: [n for n, ok in oks if ok is False] for label, oks in seen.items()}
    wrong = {label: ns for label, ns in wrong.items() if ns}
    if not right or not wrong:
        return []
    total = len([o for o in outcomes if o.status == WRONG])
    if len(wrong) > MAX_PARTS_LISTED:
        said = f"the other {len(wrong)} parts wrong"
    else:
        said = "; ".join(f"{label} wrong on " + ("every one" if len(ns) == total else
                                                 f"case{'s' if len(ns) > 1 else ''} "
                                                 f"{_numbers(ns)}")
                         for label, ns in wrong.items())
    if len(right) > MAX_PARTS_LISTED:
        return []
    return [f"{_numbers(right)} {'is' if len(right) == 1 else 'are'} right on every failing "
            f"case; {said}"]


# ---- where: rows, tiles, the diagonal


def _row_axis(shape: tuple, inputs: dict) -> int | None:
    """The axis of ``shape`` that counts query rows, when the inputs say which (else -2, or
    None for a vector)."""
    shapes = attention_shapes(inputs)
    if shapes is not None:
        n_q = shapes["n_q"]
        if len(shape) >= 2 and shape[-2] == n_q:
            return -2
        if len(shape) >= 1 and shape[-1] == n_q:
            return -1
        return None
    if "cu_seqlens" in inputs and _is_array(inputs.get("q")) and shape and \
            shape[0] == inputs["q"].shape[0]:
        return 0
    return -2 if len(shape) >= 2 else None


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous runs ``(first, last)`` of sorted indices."""
    runs = []
    for i in indices.tolist():
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _span(first: int, last: int) -> str:
    return f"{first}" if first == last else f"{first}–{last}"


def _floating_value(x: Any) -> bool:
    """True for a floating-point array or number: the parts whose values transforms and
    invariants can speak of (not index lists, counts or flags)."""
    if is_tensor(x):
        return bool(x.is_floating_point())
    if isinstance(x, (bool, np.bool_, int, np.integer)):
        return False
    return isinstance(x, (float, np.floating)) or (isinstance(x, np.ndarray) and x.dtype.kind == "f")


def _wrong_parts(o: Outcome, names) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(label, got, want)`` float64 for each floating-point part of a wrong case that has the
    right shape and is wrong."""
    want_parts = [(label, w) for label, w in parts(o.want, names) if _floating_value(w)]
    got_map = dict(parts(o.got, names)) if isinstance(o.want, (tuple, list)) else \
        {"the output": o.got}
    found = []
    for label, w in want_parts:
        g64, w64 = _as64(got_map.get(label)), _as64(w)
        if g64 is None or w64 is None or g64.shape != w64.shape or g64.size == 0:
            continue
        if not _close(g64, w64, *o.tolerance).all():
            found.append((label, g64, w64))
    return found


def _where(outcomes, first, names) -> list[str]:
    if first.status != WRONG:
        return []
    for label, g, w in _wrong_parts(first, names)[:1]:
        bad = ~_close(g, w, *first.tolerance)
        line = _diagonal(bad, first.inputs, label, first.n)
        if line:
            return [line]
        axis = _row_axis(g.shape, first.inputs)
        if axis is None or g.ndim == 0:
            return []
        rows_bad = np.moveaxis(bad, axis, -1).reshape(-1, g.shape[axis]).any(axis=0)
        n = rows_bad.size
        by_sample = _samples_wrong(rows_bad, first.inputs, label, first.n)
        if by_sample:
            return [by_sample]
        if rows_bad.all() or n < 2:
            return _columns(bad, label, first.n) if g.ndim >= 2 and axis != -1 else []
        runs = _runs(np.flatnonzero(rows_bad))
        n_right = int(n - rows_bad.sum())
        if len(runs) > 3 or n_right < 2:
            return []
        text = ", ".join(f"row{'s' if a != b else ''} {_span(a, b)}" for a, b in runs)
        block = _int(first.inputs.get("block_m")) if axis in (-2, -1) and \
            attention_shapes(first.inputs) is not None else None
        tiles = ""
        if block:
            touched = sorted({r // block for r in np.flatnonzero(rows_bad)})
            full = all(rows_bad[t * block:min((t + 1) * block, n)].all() for t in touched)
            if full:
                last = (n - 1) // block
                names_t = ", ".join(str(t) for t in touched)
                tiles = (f" — exactly Q tile{'s' if len(touched) > 1 else ''} {names_t}"
                         + (" (the ragged last tile)" if touched == [last] and n % block else "")
                         + f" of BLOCK_M={block}")
        if not tiles and rows_bad.sum() > n // 2:
            return []  # most rows wrong, in no tile's pattern: nothing singled out
        verb = "is" if rows_bad.sum() == 1 else "are"
        return [f"in case {first.n}, only {text} of {label} {verb} wrong{tiles}; the other "
                f"{n_right} of its {n} rows are right"]
    return []


def _samples_wrong(rows_bad: np.ndarray, inputs: dict, label: str, n: int) -> str | None:
    """For packed samples (``cu_seqlens``): which samples' rows are wrong, when that is a whole
    number of samples and not all of them ("sample 0 right; samples 1 and 2 wrong")."""
    cu = inputs.get("cu_seqlens")
    if not _is_array(cu):
        return None
    bounds = [int(b) for b in to_numpy64(cu)]
    if bounds[-1] != rows_bad.size or len(bounds) < 3:
        return None
    state = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        part = rows_bad[a:b]
        if part.size and part.all():
            state.append(False)
        elif not part.any():
            state.append(True)
        else:
            return None  # part of a sample wrong: not a per-sample story
    right = [i for i, ok in enumerate(state) if ok]
    wrong = [i for i, ok in enumerate(state) if not ok]
    if not right or not wrong:
        return None
    first_rows = ", ".join(f"{bounds[i]}" for i in wrong[:3])
    return (f"in case {n}, every row of sample{'s' if len(right) > 1 else ''} {_numbers(right)} "
            f"of {label} is right and every row of sample{'s' if len(wrong) > 1 else ''} "
            f"{_numbers(wrong)} wrong (their first rows: {first_rows}): what differs between "
            f"samples is where their rows start (cu_seqlens[b])")


def _columns(bad: np.ndarray, label: str, n: int) -> list[str]:
    cols = bad.reshape(-1, bad.shape[-1]).any(axis=0)
    if cols.all() or not cols.any():
        return []
    runs = _runs(np.flatnonzero(cols))
    if len(runs) > 2:
        return []
    text = ", ".join(_span(a, b) for a, b in runs)
    return [f"in case {n}, only column{'s' if cols.sum() > 1 else ''} {text} of {label} "
            f"{'are' if cols.sum() > 1 else 'is'} wrong (of {cols.size}); every row has them"]


def _diagonal(bad: np.ndarray, inputs: dict, label: str, n: int) -> str | None:
    """A line when the wrong entries of an (…, N_q, N_k)-like part all lie on one side of the
    diagonal (or on it)."""
    if bad.ndim < 2 or min(bad.shape[-2:]) < 2 or not bad.any():
        return None
    shapes = attention_shapes(inputs)  # only a (…, N_q, N_k) part has queries and keys
    if shapes is None or bad.shape[-2:] != (shapes["n_q"], shapes["n_k"]):
        return None
    where = bad.reshape(-1, *bad.shape[-2:]).any(axis=0)
    i, j = np.nonzero(where)
    for test, text in ((j > i, "above the diagonal (key after query)"),
                       (j == i, "on the diagonal"),
                       (j < i, "below the diagonal (key before query)"),
                       (j >= i, "on or above the diagonal")):
        if test.all():
            return (f"in case {n}, every wrong entry of {label} lies {text}; the entries on the "
                    f"other side are right")
    return None


# ---- transforms


def _constants(inputs: dict) -> list[tuple[str, float]]:
    known = [("log2(e) = 1.4427", LOG2_E), ("ln 2 = 0.6931", LN_2), ("2", 2.0), ("½", 0.5),
             ("−1 (the sign is flipped)", -1.0)]
    shapes = attention_shapes(inputs)
    d = shapes["d"] if shapes else None
    if d:
        known += [(f"1/√d = {d ** -0.5:.4g}", d ** -0.5), (f"√d = {d ** 0.5:.4g}", d ** 0.5)]
    scale = inputs.get("scale")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale not in (0, 1):
        known += [(f"the case's scale {scale:g}", float(scale)),
                  (f"1 / the case's scale {scale:g}", 1.0 / float(scale))]
        if d:
            known += [(f"the case's scale ÷ (1/√d) = {scale * d ** 0.5:.4g}", scale * d ** 0.5),
                      (f"(1/√d) ÷ the case's scale = {d ** -0.5 / scale:.4g}", d ** -0.5 / scale)]
    return known


def _factor(g: np.ndarray, w: np.ndarray, atol: float, rtol: float) -> float | None:
    """c when g = c · w everywhere (within tolerance, c ≠ 1), else None."""
    finite = np.isfinite(g) & np.isfinite(w)
    if not finite.all():
        return None
    denom = float((w * w).sum())
    if denom == 0:
        return None
    c = float((g * w).sum()) / denom
    if not np.isfinite(c) or math.isclose(c, 1.0, rel_tol=CONSTANT_RTOL):
        return None
    if not np.isclose(g, c * w, atol=atol * max(1.0, abs(c)), rtol=rtol).all():
        return None
    return c


def _rounded_to(g: np.ndarray, w: np.ndarray) -> str | None:
    """The lower precision (float16, bfloat16) that ``w`` rounded to gives exactly ``g``, when
    ``g`` differs from ``w`` by that rounding only; else None."""
    torch = sys.modules.get("torch")
    finite = np.isfinite(w)
    if not finite.any() or np.array_equal(g, w):
        return None
    candidates = [("float16", lambda x: x.astype(np.float16).astype(np.float64))]
    if torch is not None:
        candidates.append(("bfloat16", lambda x: torch.from_numpy(x).to(torch.bfloat16).double().numpy()))
    for name, rounded in candidates:
        with np.errstate(over="ignore", invalid="ignore"):
            r = rounded(w)
        if np.array_equal(g[finite], r[finite]):
            return name
    return None


def _transform_of(o: Outcome, label: str, g: np.ndarray, w: np.ndarray) -> str | None:
    atol, rtol = o.tolerance
    low = _rounded_to(g, w)
    if low is not None:
        return (f"{label} is exactly the right values rounded to {low}: the answer passes "
                f"through {low} on the way (a cast, or a {low} buffer) where the output keeps "
                f"full precision")
    c = _factor(g, w, atol, rtol)
    if c is not None and abs(c) < MIN_ROW_FACTOR and np.all(np.abs(g[np.isfinite(g)]) <= atol):
        return f"{label} is all zeros"  # zeros indeed, not a small factor within a loose rtol (fp8)
    if c is not None:
        named = [name for name, value in _constants(o.inputs)
                 if math.isclose(c, value, rel_tol=CONSTANT_RTOL)]
        if len(named) == 1:
            return f"{label} is the right one times {named[0]}"
        if named:  # two known constants are equal here: name every one, choose none
            return f"{label} is the right one times {c:.4g}, which is {' and '.join(named)}"
        return f"{label} is the right one times {c:.4g} (one factor for every element)"
    axis = _row_axis(g.shape, o.inputs)
    if g.ndim >= 2 and axis == -2 and g.shape[-1] > 1 and np.isfinite(g).all():
        w_rows = w.reshape(-1, w.shape[-1])
        g_rows = g.reshape(-1, g.shape[-1])
        norms = (w_rows * w_rows).sum(axis=1)
        if (norms > 0).all():
            cs = (g_rows * w_rows).sum(axis=1) / norms
            if np.isclose(g_rows, cs[:, None] * w_rows, atol=atol, rtol=rtol).all() and \
                    np.ptp(cs) > CONSTANT_RTOL * max(1.0, float(np.abs(cs).max())) and \
                    np.abs(cs).min() > MIN_ROW_FACTOR:  # a zero row is missing, not resized
                return (f"each row of {label} is the right row times a factor of its own "
                        f"(from {cs.min():.3g} to {cs.max():.3g}): the rows point the right way "
                        f"but have the wrong size")
    if np.isfinite(g).all():
        shift = float(np.mean(g - w))
        if abs(shift) > atol and np.isclose(g, w + shift, atol=atol, rtol=rtol).all():
            return f"{label} is the right one plus {shift:.4g} on every element"
    if g.ndim >= 2 and g.shape[-1] == g.shape[-2] and g.shape[-1] > 1 and \
            np.isclose(g, np.swapaxes(w, -1, -2), atol=atol, rtol=rtol, equal_nan=True).all():
        return f"{label} is the right one transposed (its last two axes swapped)"
    swapped = _swapped_axes(g, w, atol, rtol, o.inputs)
    if swapped:
        return f"{label} holds the right values with {swapped}"
    perm = _permutation(g, w, atol, rtol, o.inputs)
    if perm:
        return f"{label} holds the right values in another order: {perm}"
    shifted = _row_shift(g, w, atol, rtol, o.inputs)
    if shifted:
        return f"{label}'s rows are the right rows {shifted}"
    return None


def _axis_names(shape: tuple, inputs: dict) -> list[str]:
    axis = _row_axis(shape, inputs)
    names = [f"axis {a}" for a in range(len(shape))]
    if axis == 0 and "cu_seqlens" in inputs and len(shape) == 3:
        return ["row", "head", "column"]
    if axis is not None and attention_shapes(inputs) is not None:
        row = axis % len(shape)
        lead = ["batch element", "head"][-row:] if row <= 2 else names[:row]
        names = ([f"axis {a}" for a in range(row - len(lead))] + lead)[:row] + ["row"] + \
            (["column"] if row == len(shape) - 2 else [])
    return names


def _permutation(g, w, atol, rtol, inputs) -> str | None:
    names = _axis_names(g.shape, inputs)
    for axis in range(g.ndim):
        n = g.shape[axis]
        if not 2 <= n <= MAX_PERMUTED_AXIS:
            continue
        mapping = []
        for i in range(n):
            gi = np.take(g, i, axis=axis)
            match = [j for j in range(n)
                     if np.isclose(gi, np.take(w, j, axis=axis), atol=atol, rtol=rtol,
                                   equal_nan=True).all()]
            if len(match) != 1:
                break
            mapping.append(match[0])
        else:
            if sorted(mapping) == list(range(n)) and mapping != list(range(n)):
                moved = [f"{i}→{j}" for i, j in enumerate(mapping) if i != j][:6]
                what = names[axis] if axis < len(names) else f"axis {axis}"
                return (f"along the {what} axis (size {n}), your index i holds the right index "
                        f"π(i): {', '.join(moved)}")
    return None


def _swapped_axes(g, w, atol, rtol, inputs) -> str | None:
    """Which two axes of equal length (other than the last two: that is a transpose) the
    answer has exchanged, when ``g`` is ``w`` with exactly those two swapped; else None."""
    names = _axis_names(g.shape, inputs)
    for a in range(g.ndim):
        for b in range(a + 1, g.ndim):
            if g.shape[a] != g.shape[b] or g.shape[a] < 2 or (a, b) == (g.ndim - 2, g.ndim - 1):
                continue
            if np.isclose(g, np.swapaxes(w, a, b), atol=atol, rtol=rtol, equal_nan=True).all():
                what_a = names[a] if a < len(names) else f"axis {a}"
                what_b = names[b] if b < len(names) else f"axis {b}"
                return (f"its {what_a} and {what_b} axes swapped (axes {a} and {b}, both of "
                        f"size {g.shape[a]}): its ({what_a} i, {what_b} j) holds the right "
                        f"({what_a} j, {what_b} i) — the two indices are computed the other "
                        f"way round")
    return None


def _row_shift(g, w, atol, rtol, inputs) -> str | None:
    axis = _row_axis(g.shape, inputs)
    if axis is None:
        return None
    n = g.shape[axis]
    candidates = {1: "one row"}
    for key, what in (("block_m", "BLOCK_M"), ("block_n", "BLOCK_N")):
        b = _int(inputs.get(key))
        if b and b < n:
            candidates.setdefault(b, f"one {what} tile")
    gm, wm = np.moveaxis(g, axis, 0), np.moveaxis(w, axis, 0)
    for size, what in candidates.items():
        for s in (size, -size):
            lo, hi = max(0, -s), min(n, n - s)
            if hi - lo < 2:
                continue
            if np.isclose(gm[lo:hi], wm[lo + s:hi + s], atol=atol, rtol=rtol, equal_nan=True).all():
                return (f"shifted by {abs(s)} ({what}): your row i holds the right row "
                        f"i {'+' if s > 0 else '−'} {abs(s)}, on every row where that exists")
    return None


def _transforms(outcomes, first, names) -> list[str]:
    if first.status != WRONG:
        return []
    lines = []
    for label, g, w in _wrong_parts(first, names):
        text = _transform_of(first, label, g, w)
        if text is None:
            continue
        others = [o for o in outcomes if o.status == WRONG and o is not first]
        same = [o.n for o in others
                if any(lbl == label and _same_transform(_transform_of(o, lbl, gg, ww), text)
                       for lbl, gg, ww in _wrong_parts(o, names))]
        where = ("on every failing case" if others and len(same) == len(others) else
                 f"on case {first.n}" + (f" (and {_numbers(same)})" if same else ""))
        lines.append(f"{where}, {text}")
    if not lines:  # another shape: what the wrong shape is made of
        for label, g, w in _shape_mismatches(first, names):
            text = _shape_story(label, g, w, first)
            if text:
                lines.append(f"on case {first.n}, {text}")
    if not lines:  # floats where integers belong: what the float values are
        lines += [f"on case {first.n}, {text}" for text in _float_for_int(first, names)]
    if not lines:  # flags negated, indices shifted by one constant
        lines += [f"on case {first.n}, {text}" for text in _discrete_transforms(first, names)]
    if not lines:  # the right values in another floating-point dtype
        lines += [f"on case {first.n}, {text}" for text in _other_float_dtype(first, names)]
    return lines[:2]


def _other_float_dtype(o: Outcome, names) -> list[str]:
    """Floating-point parts whose values are right but in float64 where a narrower float is
    expected: said with where such a float64 usually comes from (an array made without a
    dtype). Another dtype (a cast to the wrong format) is left to the headline, which names
    the expected one."""
    got_map = dict(parts(o.got, names)) if isinstance(o.want, (tuple, list)) else \
        {"the output": o.got}
    found = []
    for label, w in parts(o.want, names):
        g = got_map.get(label)
        if g is None or not (_is_array(g) and _is_array(w)) or _kind(w) != "f" or \
                _dtype_of(g) != "float64" or _dtype_of(w) == "float64":
            continue
        g64, w64 = _as64(g), _as64(w)
        if g64 is None or w64 is None or g64.shape != w64.shape or \
                not _close(g64, w64, *o.tolerance).all():
            continue
        found.append(f"{label} holds the right values, in float64 where {_dtype_of(w)} is "
                     f"expected: an array made without a dtype is float64 whatever the inputs "
                     f"are (np.zeros(shape), np.empty(shape)) — make it like the inputs "
                     f"(np.zeros_like(x), or dtype=x.dtype)")
    return found


def _discrete_transforms(o: Outcome, names) -> list[str]:
    """Boolean parts that are the right flags negated, and integer parts (indices, counts) that
    are the right ones plus one constant everywhere."""
    got_map = dict(parts(o.got, names)) if isinstance(o.want, (tuple, list)) else \
        {"the output": o.got}
    found = []
    for label, w in parts(o.want, names):
        g = got_map.get(label)
        if g is None or _kind(g) != _kind(w) or _kind(w) not in "bi":
            continue
        g64, w64 = _as64(g) if _kind(g) == "i" else None, _as64(w) if _kind(w) == "i" else None
        if _kind(w) == "b":
            gb, wb = np.asarray(to_numpy64(g)) != 0, np.asarray(to_numpy64(w)) != 0
            if gb.shape == wb.shape and gb.size and np.array_equal(gb, ~wb):
                found.append(f"{label} is exactly the right flags negated (True wherever False "
                             f"belongs and the other way round)")
        elif g64 is not None and w64 is not None and g64.shape == w64.shape and g64.size > 1:
            shift = np.unique(g64 - w64)
            if shift.size == 1 and shift[0] != 0:
                found.append(f"{label} is the right one {'plus' if shift[0] > 0 else 'minus'} "
                             f"{abs(int(shift[0]))} on every element (an index or count off by "
                             f"{abs(int(shift[0]))})")
    return found


def _float_for_int(o: Outcome, names) -> list[str]:
    """Integer outputs (counts, indices) handed back as floats, said with what their values
    are: the right integers as floats, or the right ones before rounding down (a true division
    ``/`` where ``//`` belongs)."""
    got_map = dict(parts(o.got, names)) if isinstance(o.want, (tuple, list)) else \
        {"the output": o.got}
    found = []
    for label, w in parts(o.want, names):
        g = got_map.get(label)
        if g is None or _kind(w) != "i" or _kind(g) != "f":
            continue
        g64, w64 = _as64(g), _as64(w)
        if g64 is None or w64 is None or g64.shape != w64.shape:
            continue
        with np.errstate(invalid="ignore"):
            if np.array_equal(g64, w64):
                found.append(f"{label} holds the right values as floats ({_dtype_of_any(g)}): "
                             f"integers are expected (a float crept in: a `/`, a float constant "
                             f"or an array made without an integer dtype)")
            elif np.array_equal(np.floor(g64), w64):
                found.append(f"{label} holds the right integers before rounding down (e.g. "
                             f"{_example_fraction(g64, w64)}): a true division `/` where the "
                             f"floor division `//` belongs")
    return found


def _dtype_of_any(x: Any) -> str:
    return _dtype_of(x) if _is_array(x) else type(x).__name__


def _example_fraction(g: np.ndarray, w: np.ndarray) -> str:
    diff = np.flatnonzero(g.ravel() != w.ravel())
    i = int(diff[0]) if diff.size else 0
    return f"{g.ravel()[i]:g} for {w.ravel()[i]:g}"


def _shape_story(label: str, g: np.ndarray, w: np.ndarray, o: Outcome) -> str | None:
    """What a wrong shape is, read from the right output and the case's sizes: the right
    values transposed, or with an axis of size 1 added or dropped; or each axis of another
    length that is a size of the inputs (an axis of another input dim, a tile count rounded
    down, a length cut to a multiple of the tile)."""
    atol, rtol = o.tolerance
    if g.ndim >= 2 and w.ndim >= 2 and g.shape == np.swapaxes(w, -1, -2).shape and \
            g.shape != w.shape and \
            np.isclose(g, np.swapaxes(w, -1, -2), atol=atol, rtol=rtol, equal_nan=True).all():
        return f"{label} is the right one transposed (shape {g.shape} for {w.shape})"
    if g.ndim == 0 and w.size > 1:
        return _reduced_everywhere(label, float(g), w, atol, rtol)
    if g.size == w.size and g.ndim != w.ndim and \
            tuple(n for n in g.shape if n != 1) == tuple(n for n in w.shape if n != 1):
        same = bool(np.isclose(g.reshape(w.shape), w, atol=atol, rtol=rtol, equal_nan=True).all())
        how = ("an axis of size 1 too many (a reduction with keepdims=True or keepdim=True, or "
               "a [..., None], keeps or adds it)" if g.ndim > w.ndim else
               "an axis of size 1 missing (keepdims=True, keepdim=True or [..., None] keeps it)")
        return (f"{label} has shape {g.shape} for {w.shape}: {how}"
                + ("; its values are right" if same else ""))
    if g.ndim != w.ndim:
        return None
    sizes = _input_sizes(o.inputs)
    said = []
    for axis, (got_n, want_n) in enumerate(zip(g.shape, w.shape)):
        if got_n == want_n:
            continue
        story = _axis_story(got_n, want_n, sizes, o.inputs)
        if story is None:
            return None  # one axis unexplained: say nothing rather than half a story
        said.append(f"axis {axis} has {got_n} where {want_n} is expected: {story}")
    return f"{label} {'; '.join(said)}" if said else None


# The reductions a single number handed back for an array is compared with, by name.
_REDUCTIONS = (("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min))


def _reduced_everywhere(label: str, got: float, w: np.ndarray, atol: float,
                        rtol: float) -> str | None:
    """A single number where an array belongs, said when it is one reduction of every element
    of the right output (a sum, mean, max or min without its ``axis``); else None."""
    if not np.isfinite(w).all():
        return None
    named = [name for name, reduce in _REDUCTIONS
             if np.isclose(got, float(reduce(w)), atol=atol * w.size, rtol=rtol)]
    if len(named) != 1:
        return None
    return (f"{label} is one number, the {named[0]} of every element of the right output "
            f"(shape {w.shape}): the reduction ran over every axis — give it the axis it "
            f"reduces (axis=…, dim=…) so the others stay")


def _input_sizes(inputs: dict) -> dict[str, int]:
    """``{"axis a of `x`": n}`` for every array input's axes, and ``{"`name`": n}`` for every
    integer input."""
    sizes = {}
    for name, x in inputs.items():
        if _is_array(x):
            for a, n in enumerate(x.shape):
                sizes[f"axis {a} of `{name}`"] = int(n)
        elif _int(x) is not None:
            sizes[f"`{name}`"] = _int(x)
    return sizes


def _axis_story(got_n: int, want_n: int, sizes: dict[str, int], inputs: dict) -> str | None:
    """Why an axis has ``got_n`` elements where ``want_n`` are expected, from the inputs'
    sizes; None when no single relation explains it."""
    tiles = {k: n for k, n in sizes.items() if k.startswith("`") and n > 1}
    for tile_name, b in tiles.items():
        for name, n in sizes.items():
            if name == tile_name or n <= b or n % b == 0:
                continue
            if got_n == n // b and want_n == -(-n // b):
                return (f"{got_n} = {n} // {b} ({name} over {tile_name}) rounds down; the "
                        f"ragged last tile needs ceil({n} / {b}) = {want_n}")
            if got_n == n - n % b and want_n == n:
                return (f"{got_n} = {n} cut to a multiple of {tile_name}={b}: the last, "
                        f"shorter tile of {n % b} is dropped")
    # another axis of the same input: an operation (a sum, a max, a product) over the wrong axis
    for name, x in inputs.items():
        if not _is_array(x):
            continue
        axes_got = [a for a, n in enumerate(x.shape) if n == got_n]
        axes_want = [a for a, n in enumerate(x.shape) if n == want_n]
        if len(axes_got) == 1 and len(axes_want) == 1:
            return (f"{got_n} is the length of axis {axes_got[0]} of `{name}`, {want_n} that of "
                    f"its axis {axes_want[0]}: an operation that keeps axis {axes_got[0]} where "
                    f"axis {axes_want[0]} should stay (a sum or max over the wrong axis?)")
    return None


def _same_transform(a: str | None, b: str) -> bool:
    """Whether two cases' transforms are the same rule: the same text, or the same named
    constant whose value differs with the case (1/√d with another d)."""
    if a is None:
        return False
    name = re.compile(r"times ([^=,(]+?)(?: = [-\d.]+)?(?:$|,| \()")
    found_a, found_b = name.search(a), name.search(b)
    return a == b or bool(found_a and found_b and found_a.group(1) == found_b.group(1)
                          and not re.match(r"[-\d.]+$", found_a.group(1).strip()))


def _shape_mismatches(o: Outcome, names):
    want_parts = parts(o.want, names)
    got_map = dict(parts(o.got, names)) if isinstance(o.want, (tuple, list)) else \
        {"the output": o.got}
    for label, w in want_parts:
        g64, w64 = _as64(got_map.get(label)), _as64(w)
        if g64 is not None and w64 is not None and g64.shape != w64.shape:
            yield label, g64, w64


# ---- invariants of the math


def _row_sums(x: np.ndarray) -> np.ndarray:
    return x.sum(axis=-1)


# How closely the right output must have a sum rule before it counts as one (relative to the
# row's Σ|x|): far tighter than the checks' tolerances, so that a coarse dtype's loose tolerance
# never makes a chance into a rule. Softmax rows in float16 sum to 1 within ~1e-4.
ESTABLISHED_SUM = 1e-3
ESTABLISHED_ZERO_SUM = 1e-5


def _probability_rows(o: Outcome, label: str, x: np.ndarray, tol: float, strict: bool = False):
    """Rows of probabilities: entries ≥ 0 that sum to 1 along the last axis. ``strict``: the
    right output's test (:data:`ESTABLISHED_SUM`), else the answer's (``tol`` per element)."""
    if x.ndim < 1 or x.shape[-1] < 2:
        return None
    sums = _row_sums(x)
    bound = ESTABLISHED_SUM if strict else tol * x.shape[-1] + 1e-9
    ok = (np.abs(sums - 1.0) <= bound) & (x >= -tol).all(axis=-1)
    if (x < -tol).any():
        text = (f"{label} has negative entries (down to {np.nanmin(x):.4g} on case {o.n}); as "
                f"the right answer's, its rows are probabilities: ≥ 0, summing to 1")
    else:
        text = (f"the rows of {label} should each sum to 1, as the right answer's do (they are "
                f"probabilities); yours sum to {np.nanmin(sums):.4g} … {np.nanmax(sums):.4g} on "
                f"case {o.n}")
    return ok, text


def _zero_rows(o: Outcome, label: str, x: np.ndarray, tol: float, strict: bool = False):
    """Rows that sum to 0 along the last axis (as Σ_j dS_ij does); ``strict`` as in
    :func:`_probability_rows` (:data:`ESTABLISHED_ZERO_SUM` of the row's Σ|x|)."""
    if x.ndim < 1 or x.shape[-1] < 2 or not np.abs(x).max(initial=0) > tol:
        return None
    sums = _row_sums(x)
    bound = (ESTABLISHED_ZERO_SUM * np.abs(x).sum(axis=-1) + 1e-12 if strict
             else tol * x.shape[-1] + 1e-9)
    return np.abs(sums) <= bound, (
        f"the rows of {label} should each sum to 0, as the right answer's do; yours sum to "
        f"{np.nanmin(sums):.4g} … {np.nanmax(sums):.4g} on case {o.n}")


def _averaged_rows(o: Outcome, label: str, x: np.ndarray, tol: float, strict: bool = False):
    """The part lies within the per-column range of the rows it averages: `v`'s (attention), or
    the union of the inputs named o… (merged partial outputs). Never a gradient (dq, dk, dv, …):
    a gradient is no weighted average, whatever the right answer happens to do on a case."""
    if x.ndim < 1 or re.match(r"d[a-z]", label.strip("` ")):
        return None
    sources = [name for name, val in o.inputs.items() if _is_array(val) and val.ndim >= 2
               and val.shape[-1] == x.shape[-1] and (name == "v" or name.startswith("o"))]
    if not sources:
        return None
    stack = [to_numpy64(o.inputs[name]).reshape(-1, x.shape[-1]) for name in sources]
    values = np.concatenate(stack, axis=0)
    values = np.where(np.isfinite(values), values, np.nan)
    with np.errstate(all="ignore"):
        lo, hi = np.nanmin(values, axis=0), np.nanmax(values, axis=0)  # (d,)
    inside = (x >= lo - tol) & (x <= hi + tol)
    what = " and ".join(f"`{name}`" for name in sources)
    bad = np.argwhere(~inside)
    where = ""
    if len(bad):
        idx = tuple(int(i) for i in bad[0])
        col = idx[-1]
        where = (f" (on case {o.n}, index {idx} is {x[idx]:.4g}, outside [{lo[col]:.4g}, "
                 f"{hi[col]:.4g}])")
    return inside, (f"{label} leaves the range of the rows of {what}{where}: a weighted average "
                    f"of rows whose weights are ≥ 0 and sum to 1 stays inside it")


def _lse_bounds(o: Outcome, label: str, x: np.ndarray, tol: float, strict: bool = False):
    """lse ≥ the row's largest visible score and ≤ that + ln(#visible keys) — or, for a merge
    of log-sum-exps (inputs named lse…), ≥ their max and ≤ max + ln(#inputs)."""
    if "lse" not in label and label != "the output":
        return None
    merged = [to_numpy64(v) for name, v in o.inputs.items() if name.startswith("lse")
              and _is_array(v)]
    if merged and all(m.shape == x.shape for m in merged):
        with np.errstate(invalid="ignore"):
            lower = np.max(np.stack(merged), axis=0)
        upper = lower + math.log(len(merged))
        what = "the larger of the log-sum-exps it merges"
    else:
        scored = _scores(o.inputs)
        if scored is None:
            return None
        s, visible = scored
        if s.shape[:-1] != x.shape:
            return None
        with np.errstate(invalid="ignore"):
            lower = np.where(visible, s, -np.inf).max(axis=-1)
            upper = lower + np.log(np.maximum(visible.sum(axis=-1), 1))
        what = "the row's largest visible score"
    keep = np.isfinite(lower)
    ok = np.ones(x.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        ok[keep] = (x[keep] >= lower[keep] - tol) & (x[keep] <= upper[keep] + tol)
    bad = np.argwhere(~ok)
    if len(bad):
        idx = tuple(int(i) for i in bad[0])
        below = x[idx] < lower[idx]
        text = (f"{label} is below {what} at index {idx} on case {o.n} ({x[idx]:.5g} < "
                f"{lower[idx]:.5g}): a log-sum-exp is never below its largest term"
                if below else
                f"{label} exceeds the largest it can be — {what} plus ln(#terms) — at index "
                f"{idx} on case {o.n} ({x[idx]:.5g} > {upper[idx]:.5g})")
    else:
        text = ""
    return ok, text


_RULES = (_probability_rows, _zero_rows, _averaged_rows, _lse_bounds)


def _invariants(outcomes, first, names) -> list[str]:
    compared = [o for o in outcomes if o.status in (RIGHT, WRONG)]
    failing = [o for o in compared if o.status == WRONG]
    if not failing:
        return []
    labels = [label for label, value in parts(first.want, names) if _floating_value(value)]
    lines = []
    for label in labels:
        for rule in _RULES:
            holds_everywhere, applies = True, False
            for o in compared:
                w = _as64(dict(parts(o.want, names)).get(label))
                if w is None:
                    continue
                result = rule(o, label, w, _tol(o, w), strict=True)
                if result is None:
                    holds_everywhere = False
                    break
                ok, _ = result
                applies = True
                if not np.all(ok):
                    holds_everywhere = False
                    break
            if not (holds_everywhere and applies):
                continue
            for o in failing:
                got_map = dict(parts(o.got, names)) if isinstance(o.want, (tuple, list)) else \
                    {"the output": o.got}
                g, w = _as64(got_map.get(label)), _as64(dict(parts(o.want, names)).get(label))
                if g is None or w is None or g.shape != w.shape or not np.isfinite(g).all():
                    continue
                result = rule(o, label, g, _tol(o, w))
                if result is not None and not np.all(result[0]):
                    lines.append(result[1])
                    break
            if lines:
                return lines
    return lines


def _tol(o: Outcome, w: np.ndarray) -> float:
    """A tolerance for an invariant: the case's atol plus its rtol of the part's size."""
    atol, rtol = o.tolerance
    finite = w[np.isfinite(w)]
    return 4 * (atol + rtol * float(np.abs(finite).max(initial=0)))
