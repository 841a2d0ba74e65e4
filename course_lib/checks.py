"""Exercise checks: run a learner's function on prepared cases and say pass, not done, or wrong.

Three outcomes, one per call of :func:`check_function`:

* **pass** — one line is printed and the learner's function is returned;
* **not done yet** — the function raises ``NotImplementedError`` (what the learner notebook's
  stubs do): one line is printed and ``fallback`` (the library's implementation) is returned, so
  the rest of the notebook still runs;
* **wrong** — :class:`ExerciseFailed` is raised with a diagnosis: exercise id, the case, shapes,
  max error, the first bad index and, when one of the known ``mistakes`` reproduces the learner's
  output, the likely cause. In Jupyter only the diagnosis is shown, not a traceback.

Tolerances: each output dtype has a default (``TOLERANCES``), chosen well above the rounding
error an exact algorithm makes in that precision and well below what the classic mistakes
produce (those are off by O(1) relative error). A check can override them.
"""

from __future__ import annotations

import math
import signal
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

# (atol, rtol) by dtype name. float64/float32 results of an exact algorithm agree with a float64
# reference to ~1e-12 / ~1e-6; half precisions keep 11 (fp16) and 8 (bf16) mantissa bits, so
# their rounding error is ~5e-4 and ~4e-3 relative to values of order 1.
TOLERANCES = {
    "float64": (1e-9, 1e-7),
    "float32": (2e-5, 2e-4),
    "float16": (2e-3, 1e-2),
    "bfloat16": (1.6e-2, 4e-2),
}

DEFAULT_TIME_LIMIT_S = 60.0


class ExerciseFailed(AssertionError):
    """A learner's answer is wrong; the message is the diagnosis."""

    def _render_traceback_(self):  # IPython shows this instead of the traceback
        return [f"\x1b[31m{line}\x1b[0m" if i == 0 else line
                for i, line in enumerate(str(self).splitlines())]


class TimeLimitExceeded(Exception):
    """Raised inside a learner's function when :func:`call_with_time_limit` runs out of time."""


_TimeLimit = TimeLimitExceeded  # short internal name


@dataclass
class Case:
    """One input for an exercise: positional args, keyword args, and a label for messages."""

    args: tuple
    kwargs: dict | None = None
    label: str = ""

    def describe(self) -> str:
        parts = [describe_value(a) for a in self.args]
        parts += [f"{k}={describe_value(v)}" for k, v in (self.kwargs or {}).items()]
        text = ", ".join(parts)
        return f"{self.label}: ({text})" if self.label else f"({text})"


def describe_value(x: Any) -> str:
    """Short description of a value for messages: type, shape and dtype, not the numbers."""
    if isinstance(x, np.ndarray):
        return f"ndarray{tuple(x.shape)} {x.dtype}"
    if _is_tensor(x):
        return f"Tensor{tuple(x.shape)} {str(x.dtype).replace('torch.', '')} on {x.device}"
    if isinstance(x, (tuple, list)) and len(x) <= 4:
        inner = ", ".join(describe_value(e) for e in x)
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    if isinstance(x, float):
        return f"{x:.6g}"
    return repr(x) if len(repr(x)) <= 40 else type(x).__name__


def _is_tensor(x: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, torch.Tensor)


def _dtype_name(x: Any) -> str:
    if _is_tensor(x):
        return str(x.dtype).replace("torch.", "")
    return str(np.asarray(x).dtype)


def to_numpy64(x: Any) -> np.ndarray:
    """Any array-like (tensor on any device, ndarray, number) as a float64 ndarray."""
    if _is_tensor(x):
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def call_with_time_limit(fn: Callable, args: tuple, kwargs: dict, seconds: float):
    """Call ``fn``; raise :class:`_TimeLimit` after ``seconds`` (only from the main thread)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)

    def _alarm(signum, frame):
        raise _TimeLimit()

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def first_bad_index(got: np.ndarray, want: np.ndarray, atol: float, rtol: float,
                    equal_nan: bool = False):
    """Index of the first element outside tolerance (NaN counts as bad unless both are NaN and
    ``equal_nan``), or None."""
    bad = ~np.isclose(got, want, atol=atol, rtol=rtol, equal_nan=equal_nan)
    bad |= np.isnan(got) & ~np.isnan(want)
    idx = np.argwhere(bad)
    return tuple(int(i) for i in idx[0]) if len(idx) else None


def compare(got: Any, want: Any, atol: float, rtol: float, equal_nan: bool = False) -> str | None:
    """None when ``got`` matches ``want`` (type, shape, dtype, values); else what is wrong.

    ``equal_nan`` makes NaNs at the same places agree: used to recognise a known mistake that
    itself produces NaN, never to accept an answer."""
    if got is None:
        return "the function returned None — did you forget a `return`?"
    if _is_tensor(want) and isinstance(got, np.ndarray):
        return "returned a NumPy array where a torch.Tensor is expected (use torch operations)"
    if isinstance(want, np.ndarray) and _is_tensor(got):
        return "returned a torch.Tensor where a NumPy array is expected (use NumPy operations)"
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return (f"expected a tuple of {len(want)} values, got {describe_value(got)}")
        for i, (g, w) in enumerate(zip(got, want)):
            problem = compare(g, w, atol, rtol, equal_nan)
            if problem:
                return f"output [{i}]: {problem}"
        return None
    if isinstance(want, (np.ndarray,)) or _is_tensor(want):
        if not (isinstance(got, np.ndarray) or _is_tensor(got)):
            return f"expected an array, got {describe_value(got)}"
        if tuple(got.shape) != tuple(want.shape):
            return f"shape {tuple(got.shape)} but expected {tuple(want.shape)}"
        if _dtype_name(got) != _dtype_name(want):
            return f"dtype {_dtype_name(got)} but expected {_dtype_name(want)}"
    g, w = to_numpy64(got), to_numpy64(want)
    if g.shape != w.shape:
        return f"shape {g.shape} but expected {w.shape}"
    nonfinite = ~np.isfinite(g) & np.isfinite(w)
    if nonfinite.any():
        idx = tuple(int(i) for i in np.argwhere(nonfinite)[0])
        kind = "NaN" if np.isnan(g[idx] if idx else g) else "inf"
        return (f"{int(nonfinite.sum())} value(s) are NaN/inf where the answer is finite; first at "
                f"index {idx} ({kind}) — often exp() of a large number: subtract the max first")
    idx = first_bad_index(g, w, atol, rtol, equal_nan)
    if idx is None:
        return None
    err = float(np.nanmax(np.abs(g - w))) if g.size else 0.0
    where = f"index {idx}" if idx else "the value"
    got_v = g[idx] if idx else g.item()
    want_v = w[idx] if idx else w.item()
    return (f"max abs error {err:.3g} (tolerance atol={atol:g}, rtol={rtol:g}); first bad "
            f"element at {where}: got {got_v:.6g}, expected {want_v:.6g}")


def _default_tolerance(want: Any) -> tuple[float, float]:
    sample = want[0] if isinstance(want, (tuple, list)) and want else want
    return TOLERANCES.get(_dtype_name(sample), TOLERANCES["float32"])


def _outputs_match(a: Any, b: Any, atol: float, rtol: float) -> bool:
    try:
        return compare(a, b, atol, rtol, equal_nan=True) is None
    except Exception:  # a mistake model that cannot even be compared does not match
        return False


def _short_error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f" (line {last.lineno}: `{(last.line or '').strip()}`)"
    return f"{type(exc).__name__}: {exc}{where}"


def check_function(
    exercise: str,
    fn: Callable,
    reference: Callable,
    cases: Sequence[Case] | Iterable[Case],
    *,
    fallback: Callable | None = None,
    tolerance: tuple[float, float] | None = None,
    mistakes: dict[str, Callable] | None = None,
    time_limit: float = DEFAULT_TIME_LIMIT_S,
    quiet: bool = False,
) -> Callable:
    """Check ``fn`` against ``reference`` on each case and return the function to continue with.

    Args:
        exercise: the id shown to the learner, e.g. ``"Exercise 3.1"``.
        fn: the learner's function.
        reference: the correct implementation (same signature).
        cases: inputs to try; use irregular sizes so masking errors show.
        fallback: returned when the exercise is not done yet (default: ``reference``).
        tolerance: ``(atol, rtol)``; default by output dtype from ``TOLERANCES``.
        mistakes: ``{"likely cause": wrong_fn}``; when a wrong answer matches what ``wrong_fn``
            returns on the same case, the diagnosis names that cause.
        time_limit: seconds per case before the learner's function is stopped.

    Returns:
        ``fn`` when it passes, ``fallback`` when it is not done yet.

    Raises:
        ExerciseFailed: with a diagnosis when ``fn`` is wrong, crashes or runs too long.
    """
    fallback = reference if fallback is None else fallback
    cases = list(cases)
    for n, case in enumerate(cases, 1):
        kwargs = case.kwargs or {}
        want = reference(*case.args, **kwargs)
        try:
            got = call_with_time_limit(fn, case.args, kwargs, time_limit)
        except NotImplementedError:
            if not quiet:
                print(f"… {exercise}: not done yet — the notebook continues with the library's "
                      f"implementation. Fill in the exercise and re-run this cell.")
            return fallback
        except _TimeLimit:
            raise ExerciseFailed(
                f"✗ {exercise}: stopped after {time_limit:g} s on case {n} {case.describe()} — "
                f"look for a loop that never ends (a tile index that never advances?)") from None
        except Exception as exc:  # the learner's code crashed: one line, not a traceback wall
            raise ExerciseFailed(
                f"✗ {exercise}: your function raised on case {n} {case.describe()}\n"
                f"  {_short_error(exc)}") from None
        atol, rtol = tolerance or _default_tolerance(want)
        problem = compare(got, want, atol, rtol)
        if problem is None:
            continue
        lines = [f"✗ {exercise}: wrong answer on case {n} of {len(cases)}",
                 f"  inputs: {case.describe()}",
                 f"  output: {describe_value(got)}; expected {describe_value(want)}",
                 f"  {problem}"]
        for cause, wrong_fn in (mistakes or {}).items():
            try:
                mistaken = wrong_fn(*case.args, **kwargs)
            except Exception:
                continue
            if _outputs_match(got, mistaken, atol, rtol):
                lines.append(f"  likely cause: {cause}")
                break
        raise ExerciseFailed("\n".join(lines))
    if not quiet:
        print(f"✓ {exercise}: passed ({len(cases)} case{'s' if len(cases) != 1 else ''}).")
    return fn


def check_value(exercise: str, value: Any, expected: float, *, rtol: float = 1e-3,
                hint: str = "") -> Any:
    """Check a number the learner computed (e.g. an arithmetic intensity).

    ``value`` may be ``NotImplemented``/``None`` placeholders or come from a function that
    raises ``NotImplementedError``; pass a zero-argument callable to have that handled here.
    """
    if callable(value):
        try:
            value = value()
        except NotImplementedError:
            print(f"… {exercise}: not done yet — expected value shown for reference: {expected:.6g}")
            return expected
        except Exception as exc:
            raise ExerciseFailed(f"✗ {exercise}: your code raised {_short_error(exc)}") from None
    if value is None or isinstance(value, (str, bytes)):
        raise ExerciseFailed(f"✗ {exercise}: expected a number, got {describe_value(value)}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ExerciseFailed(f"✗ {exercise}: expected a number, got {describe_value(value)}") from None
    if not math.isfinite(v) or not math.isclose(v, expected, rel_tol=rtol):
        msg = f"✗ {exercise}: got {v:.6g}, expected {expected:.6g} (relative tolerance {rtol:g})"
        if hint:
            msg += f"\n  hint: {hint}"
        raise ExerciseFailed(msg)
    print(f"✓ {exercise}: passed ({v:.6g}).")
    return v
