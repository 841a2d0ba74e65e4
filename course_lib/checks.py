"""Exercise checks: run a learner's function on prepared cases and say pass, not done, or wrong.

Three outcomes, one per call of :func:`check_function`:

* **pass** — one line is printed and the learner's function is returned;
* **not done yet** — the function raises ``NotImplementedError`` (what the learner notebook's
  stubs do): one line is printed and ``fallback`` (the library's implementation) is returned, so
  the rest of the notebook still runs;
* **wrong** — :class:`ExerciseFailed` is raised with a diagnosis: exercise id, the case, shapes,
  max error, the first bad index and, when one of the known ``mistakes`` reproduces the learner's
  output, the likely cause. In Jupyter only the diagnosis is shown, not a traceback.

Whatever the learner's code does, the check ends with one of those outcomes. It runs on copies of
the case's inputs (an in-place ``q *= 2`` cannot poison the reference or later cases, and is
itself reported unless the exercise lists that argument as ``writable``); what it prints goes to a
bounded buffer and only a short excerpt is shown (:class:`CapturedOutput`); ``sys.exit()`` and a
``KeyboardInterrupt`` it raises become diagnoses; stdout/stderr, the signal handlers of the time
limit and the NumPy/torch settings it may change are restored before the next call.

Tolerances: each output dtype has a default (``TOLERANCES``), chosen well above the rounding
error an exact algorithm makes in that precision and well below what the classic mistakes
produce (those are off by O(1) relative error). A check can override them.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Sequence

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

# What a check keeps of the learner's printing: the first OUTPUT_KEEP_CHARS characters (the rest
# is only counted, so a print in a loop cannot fill memory), of which a diagnosis shows at most
# OUTPUT_EXCERPT_LINES lines of OUTPUT_EXCERPT_LINE_CHARS characters: enough to recognise one's
# own debugging print, short enough that a message stays a few lines.
OUTPUT_KEEP_CHARS = 4096
OUTPUT_EXCERPT_LINES = 6
OUTPUT_EXCERPT_LINE_CHARS = 120


class ExerciseFailed(AssertionError):
    """A learner's answer is wrong; the message is the diagnosis."""

    def _render_traceback_(self):  # IPython shows this instead of the traceback
        return [f"\x1b[31m{line}\x1b[0m" if i == 0 else line
                for i, line in enumerate(str(self).splitlines())]


class TimeLimitExceeded(Exception):
    """Raised inside a learner's function when :func:`call_with_time_limit` runs out of time."""


_TimeLimit = TimeLimitExceeded  # short internal name


class _UserInterrupt(KeyboardInterrupt):
    """A real Ctrl-C / Interrupt button during the learner's call (not a ``raise`` in its code)."""


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
    """Call ``fn``; raise :class:`_TimeLimit` after ``seconds`` (only from the main thread).

    From the main thread a real interrupt (Ctrl-C, Jupyter's Interrupt button) during the call
    raises :class:`_UserInterrupt`, so that it can be told apart from a ``KeyboardInterrupt`` the
    learner's code raises itself. Both signal handlers are restored afterwards, whatever ``fn``
    did (returned, raised, called ``sys.exit()``).
    """
    if seconds is None or threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)

    def _alarm(signum, frame):
        raise _TimeLimit()

    def _interrupt(signum, frame):
        raise _UserInterrupt()

    previous_alarm = signal.signal(signal.SIGALRM, _alarm)
    # take over SIGINT only where it raises KeyboardInterrupt anyway (Python's default; what
    # ipykernel installs while a cell runs), never where someone chose to ignore it
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        # None: the previous handler was not installed from Python; the default is the nearest
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_alarm is None else previous_alarm)
        if previous_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous_int)


class CapturedOutput(io.TextIOBase):
    """Stands in for ``sys.stdout``/``sys.stderr`` while the learner's code runs.

    Keeps the first ``keep`` characters and only counts the rest, so a ``print`` in a loop costs
    no memory and cannot flood the notebook; :meth:`excerpt` is what a check shows of it.
    """

    encoding = "utf-8"

    def __init__(self, keep: int = OUTPUT_KEEP_CHARS):
        super().__init__()
        self.keep = keep
        self.total_bytes = 0  # everything written, in UTF-8 bytes
        self._kept: list[str] = []
        self._kept_chars = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self.total_bytes += len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
        room = self.keep - self._kept_chars
        if room > 0 and text:
            self._kept.append(text[:room])
            self._kept_chars += min(room, len(text))
        return len(text)

    def close(self) -> None:  # the learner's code may not close the check's stream
        pass

    @property
    def text(self) -> str:
        """The part that was kept (the first ``keep`` characters)."""
        return "".join(self._kept)

    def excerpt(self, subject: str = "your function") -> list[str]:
        """Lines for a message: nothing when nothing was printed, else the first few lines
        (each clipped) and how much more output there was."""
        if not self.total_bytes:
            return []
        lines = self.text.splitlines()[:OUTPUT_EXCERPT_LINES] or [""]
        clipped = [line[:OUTPUT_EXCERPT_LINE_CHARS] for line in lines]
        hidden = self.total_bytes - sum(len(c.encode("utf-8", "replace")) + 1 for c in clipped)
        out = [f"  {subject} printed {_size(self.total_bytes)}:" if hidden > 0
               else f"  {subject} printed:"]
        out += [f"  | {c}{'…' if len(c) < len(line) else ''}" for c, line in zip(clipped, lines)]
        if hidden > 0:
            out.append(f"  … {_size(hidden)} more output hidden")
        return out


def _size(n_bytes: int) -> str:
    """'512 bytes', '4.1 kB', '3.2 MB' (decimal units, as file browsers show them)."""
    if n_bytes < 1000:
        return f"{n_bytes} byte{'' if n_bytes == 1 else 's'}"
    for unit, factor in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if n_bytes < 1000 * factor or unit == "GB":
            return f"{n_bytes / factor:.1f} {unit}"
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _isolated(output: CapturedOutput):
    """Run learner code with its printing going to ``output`` and the global settings it may
    change (NumPy's floating-point error handling, torch's default dtype and grad mode) put back
    afterwards. ``sys.stdout``/``sys.stderr`` are restored even if the code replaced them."""
    torch = sys.modules.get("torch")  # only when already imported: no torch import from here
    saved = (torch.get_default_dtype(), torch.is_grad_enabled()) if torch is not None else None
    try:
        with np.errstate(), contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            yield
    finally:
        if saved is not None:
            torch.set_default_dtype(saved[0])
            torch.set_grad_enabled(saved[1])


def _copy_value(x: Any) -> Any:
    """A copy of every array/tensor in ``x`` (through tuples, lists and dicts); other values as
    they are (numbers, strings, None are immutable)."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if _is_tensor(x):
        return x.detach().clone().requires_grad_(x.requires_grad)
    if isinstance(x, tuple):
        items = (_copy_value(e) for e in x)
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)  # namedtuple or plain
    if isinstance(x, list):
        return [_copy_value(e) for e in x]
    if isinstance(x, dict):
        return {k: _copy_value(v) for k, v in x.items()}
    return x


def same_value(a: Any, b: Any) -> bool:
    """True when ``b`` still equals ``a`` exactly: same type, shape, dtype and values (NaN equal
    to NaN), through tuples, lists and dicts. Values other than arrays/tensors compare equal."""
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype
                and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if _is_tensor(a):
        if not (_is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype
                and a.device == b.device):
            return False
        a, b = a.detach(), b.detach()
        equal = a == b
        if a.is_floating_point() or a.is_complex():
            equal |= a.isnan() & b.isnan()
        return bool(equal.all())
    if isinstance(a, (tuple, list)):
        return (isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same_value(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(same_value(a[k], b[k]) for k in a))
    return True


def _argument_names(n: int, *fns: Callable) -> list[str]:
    """Names of the first ``n`` positional parameters of the first of ``fns`` that has them
    (the reference's names are the exercise's; a wrapper with ``*args`` has none)."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for fn in fns:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        names = [p.name for p in params if p.kind in positional]
        if len(names) >= n:
            return names[:n]
    return [f"#{i}" for i in range(1, n + 1)]


def _changed_inputs(case: "Case", args: tuple, kwargs: dict, names: list[str],
                    writable: Collection[str]) -> list[str]:
    """Names of the arguments whose copy the learner's function changed, except ``writable``."""
    given = list(zip(names, case.args, args))
    given += [(k, v, kwargs[k]) for k, v in (case.kwargs or {}).items()]
    return [name for name, before, after in given
            if name not in writable and not same_value(before, after)]


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
    text = str(exc)
    return f"{type(exc).__name__}{': ' + text if text else ''}{where}"


def _crash_diagnosis(exercise: str, subject: str, where: str, exc: BaseException) -> list[str]:
    """The lines of a diagnosis for learner code that raised ``exc`` (any exception, including
    ``SystemExit`` and a ``KeyboardInterrupt`` it raised itself)."""
    where = f" {where}" if where else ""
    if isinstance(exc, SystemExit):
        return [f"✗ {exercise}: {subject} called sys.exit(){where}",
                f"  {_short_error(exc)}",
                f"  sys.exit() would stop the notebook's Python process, not just {subject}: "
                f"let it finish (return its result) instead"]
    if isinstance(exc, KeyboardInterrupt):
        return [f"✗ {exercise}: {subject} raised KeyboardInterrupt{where}",
                f"  {_short_error(exc)}",
                "  KeyboardInterrupt means \"stop everything\" (it is what the Interrupt button "
                "sends); to report a problem, raise an ordinary exception such as ValueError"]
    return [f"✗ {exercise}: {subject} raised{where}", f"  {_short_error(exc)}"]


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
    writable: Collection[str] = (),
    subject: str = "your function",
    output: CapturedOutput | None = None,
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
        writable: names of the arguments (the reference's parameter names, or keyword names)
            that the exercise's contract lets ``fn`` update in place, e.g. an accumulator; any
            other argument ``fn`` changes fails the check. ``fn`` always gets copies.
        subject: how messages call ``fn`` (``"your kernel"`` for kernel checks).
        output: where what ``fn`` prints goes (default: a new :class:`CapturedOutput`); pass
            one to show its excerpt in a message of your own.

    Returns:
        ``fn`` when it passes, ``fallback`` when it is not done yet.

    Raises:
        ExerciseFailed: with a diagnosis when ``fn`` is wrong, crashes, changes an input, exits
            or runs too long.
        KeyboardInterrupt: when the learner interrupts the check (Ctrl-C, Interrupt button).
    """
    fallback = reference if fallback is None else fallback
    cases = list(cases)
    output = CapturedOutput() if output is None else output  # all fn prints, over all cases

    def failed(*lines: str) -> ExerciseFailed:
        return ExerciseFailed("\n".join([*lines, *output.excerpt(subject)]))

    for n, case in enumerate(cases, 1):
        kwargs = case.kwargs or {}
        want = reference(*case.args, **kwargs)
        # fn gets its own copies: whatever it does to them, the case stays as the reference and
        # the mistake models see it
        args_copy, kwargs_copy = _copy_value(tuple(case.args)), _copy_value(kwargs)
        on_case = f"on case {n} {case.describe()}"
        try:
            with _isolated(output):
                got = call_with_time_limit(fn, args_copy, kwargs_copy, time_limit)
        except NotImplementedError:
            if not quiet:
                print("\n".join([f"… {exercise}: not done yet — the notebook continues with the "
                                 f"library's implementation. Fill in the exercise and re-run "
                                 f"this cell.", *output.excerpt(subject)]))
            return fallback
        except _TimeLimit:
            raise failed(f"✗ {exercise}: stopped after {time_limit:g} s {on_case} — look for a "
                         f"loop that never ends (a tile index that never advances?)") from None
        except _UserInterrupt:  # the learner stopped the check: stop, as any interrupted cell
            raise KeyboardInterrupt from None
        except BaseException as exc:  # the learner's code crashed: one line, not a traceback wall
            raise failed(*_crash_diagnosis(exercise, subject, on_case, exc)) from None
        names = _argument_names(len(case.args), reference, fn)
        changed = _changed_inputs(case, args_copy, kwargs_copy, names, writable)
        if changed:
            name = changed[0]
            raise failed(f"✗ {exercise}: {subject} changed its input `{name}` in place {on_case}",
                         f"  a correct answer leaves its inputs as they are (the caller still "
                         f"needs them): write `{name} = {name} * s` rather than `{name} *= s`, "
                         f"and copy before assigning into it (`{name} = {name}.copy()`, or "
                         f"`.clone()` for a tensor)")
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
        raise failed(*lines)
    if not quiet:
        print("\n".join([f"✓ {exercise}: passed ({len(cases)} case{'s' if len(cases) != 1 else ''}).",
                         *output.excerpt(subject)]))
    return fn


def check_value(exercise: str, value: Any, expected: float, *, rtol: float = 1e-3,
                hint: str = "") -> Any:
    """Check a number the learner computed (e.g. an arithmetic intensity).

    ``value`` may be ``NotImplemented``/``None`` placeholders or come from a function that
    raises ``NotImplementedError``; pass a zero-argument callable to have that handled here.
    """
    output = CapturedOutput()
    if callable(value):
        try:
            with _isolated(output):
                value = call_with_time_limit(value, (), {}, DEFAULT_TIME_LIMIT_S)
        except NotImplementedError:
            print(f"… {exercise}: not done yet — expected value shown for reference: {expected:.6g}")
            return expected
        except _UserInterrupt:
            raise KeyboardInterrupt from None
        except _TimeLimit:
            raise ExerciseFailed(f"✗ {exercise}: your code was stopped after "
                                 f"{DEFAULT_TIME_LIMIT_S:g} s — look for a loop that never "
                                 f"ends") from None
        except BaseException as exc:
            raise ExerciseFailed("\n".join(_crash_diagnosis(exercise, "your code", "", exc)
                                           + output.excerpt("your code"))) from None
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
    print("\n".join([f"✓ {exercise}: passed ({v:.6g}).", *output.excerpt("your code")]))
    return v
