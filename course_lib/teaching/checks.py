"""Exercise checks: run a learner's function on prepared cases and say pass, not done, or wrong.

Three outcomes, one per call of :func:`check_function`:

* **pass** — one line is printed and the learner's function is returned;
* **not done yet** — the function raises ``NotImplementedError`` (what the learner notebook's
  stubs do): one line is printed and ``fallback`` (the library's implementation) is returned, so
  the rest of the notebook still runs;
* **wrong** — :class:`ExerciseFailed` is raised with a diagnosis: exercise id, the case, shapes,
  max error, the first bad index and, when one of the known ``mistakes`` reproduces the learner's
  output, the likely cause; then the differential diagnosis of :mod:`course_lib.teaching.diagnosis`,
  from every case (each runs, even after a crash): what sets the failing cases apart, which
  parts of the output are right, where the wrong entries lie, a known factor or transform, an
  invariant of the math the answer breaks. In Jupyter only the diagnosis is shown, not a
  traceback.

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

import ast
import collections
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import inspect
import io
import json
import linecache
import math
import os
import re
import signal
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Sequence

import numpy as np

from course_lib.teaching import diagnosis
from course_lib.teaching.diagnosis import is_tensor, to_numpy64  # noqa: F401 - part of this module's API

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
# An experiment of the differential diagnosis (a failing case rerun with one feature switched
# off) may take this long at most: it adds evidence to a failure, never a wait of its own.
EXPERIMENT_TIME_LIMIT_S = 10.0

# What a check keeps of the learner's printing: the first OUTPUT_KEEP_CHARS characters (the rest
# is only counted, so a print in a loop cannot fill memory), of which a diagnosis shows at most
# OUTPUT_EXCERPT_LINES lines of OUTPUT_EXCERPT_LINE_CHARS characters: enough to recognise one's
# own debugging print, short enough that a message stays a few lines.
OUTPUT_KEEP_CHARS = 4096
OUTPUT_EXCERPT_LINES = 6
OUTPUT_EXCERPT_LINE_CHARS = 120


class Diagnosed(Exception):
    """Raised by a check's runner that has recognised what went wrong; the message is the whole
    diagnosis (exercise 7.6's autograd glue). The grader's channel rebuilds it as itself."""


class ExerciseFailed(AssertionError):
    """A learner's answer is wrong; the message is the diagnosis. ``evidence``: the lines of the
    differential diagnosis and the other failing cases, when :func:`check_function` raised it."""

    evidence: list = []
    outcomes: list | None = None  # the diagnosis's evidence per case (course_lib.teaching.diagnosis)
    experiments: dict | None = None  # and its experiments (course_lib.teaching.diagnosis.toggle)
    output_names = None
    headline: int | None = None

    def _render_traceback_(self):  # IPython shows this instead of the traceback
        return [f"\x1b[31m{line}\x1b[0m" if i == 0 else line
                for i, line in enumerate(str(self).splitlines())]


class TimeLimitExceeded(Exception):
    """Raised inside a learner's function when :func:`call_with_time_limit` runs out of time."""


_TimeLimit = TimeLimitExceeded  # short internal name


class _UserInterrupt(KeyboardInterrupt):
    """A real Ctrl-C / Interrupt button during the learner's call (not a ``raise`` in its code)."""


# ----------------------------------------------------------------------------------------------
# No false ✓: telling the learner's answer from the library's


def is_library_object(obj: Any) -> bool:
    """True when ``obj`` is the library's own code: a function, a class, a Triton kernel (or its
    ``.fn``), a ``functools.partial``, a wrapper (``__wrapped__``), an object that carries a kernel
    (``.kernel``, as chapter 10's switched model kernels do), or anything the checks handed back
    as a fallback. A learner's answer is defined in the notebook (module ``__main__``) or in a
    file of their own."""
    for _ in range(6):  # unwrap Triton's JITFunction/Autotuner (.fn), partials (.func), wrappers
        if obj is None or isinstance(obj, _PLAIN_DATA):
            return False
        if id(obj) in _HANDED_BACK:
            return True
        module = getattr(obj, "__module__", None)
        if isinstance(module, str) and (module == "course_lib" or module.startswith("course_lib.")):
            return True
        inner = next((getattr(obj, name) for name in _WRAPPER_ATTRS
                      if getattr(obj, name, None) is not None), None)
        if inner is None or inner is obj:
            return False
        obj = inner
    return False


# What a check is handed besides code: numbers, text, arrays, tensors, devices, dtypes.
_PLAIN_DATA = (str, bytes, int, float, complex, bool, type(None))
# Attributes through which code wraps other code (Triton kernels, partials, decorators, the
# switched model kernels of chapter 10).
_WRAPPER_ATTRS = ("fn", "func", "__wrapped__", "kernel")
# id -> object of every fallback a check handed back ("not done yet"): the library's own code,
# whatever wraps it. Kept alive here so that an id is never reused by another object.
_HANDED_BACK: dict[int, Any] = {}


def _answers_in(values: Iterable[Any]) -> list[Any]:
    """Everything among ``values`` (through tuples, lists and dict values, one level deep) that
    can be code: callables, classes, kernels, and objects that merely carry code (a switched
    kernel is subscriptable, not callable) — not numbers, text, arrays or tensors."""
    found = []
    for v in values:
        items = (v if isinstance(v, (tuple, list)) else
                 list(v.values()) if isinstance(v, dict) else (v,))
        found += [e for e in items if not _is_data(e)]
    return found


def _is_data(obj: Any) -> bool:
    if isinstance(obj, _PLAIN_DATA):
        return True
    kind = type(obj)
    return kind.__module__.split(".")[0] in ("numpy", "torch") and not callable(obj)


# True inside :func:`library_answers_allowed`: the library's test suite hands the checks mistake
# models and answer keys that live in ``course_lib.teaching.exercises`` as if a learner had written them.
_LIBRARY_ANSWERS_ALLOWED: contextvars.ContextVar = contextvars.ContextVar(
    "library_answers_allowed", default=False)


@contextlib.contextmanager
def library_answers_allowed(allowed: bool = True):
    """Within the block, checks judge objects defined in ``course_lib`` like a learner's answer
    (for the library's own tests of its mistake models and answer keys, never for notebooks)."""
    token = _LIBRARY_ANSWERS_ALLOWED.set(allowed)
    try:
        yield
    finally:
        _LIBRARY_ANSWERS_ALLOWED.reset(token)


# The library objects handed to the check that runs now (set by :func:`learner_check`).
_LIBRARY_ANSWER: contextvars.ContextVar = contextvars.ContextVar("library_answer", default=None)


def learner_check(check: Callable) -> Callable:
    """Decorate a notebook-facing ``check_…`` function so that it never passes the library's code.

    A check cell reads ``answer = chNN.check_answer(answer)``: when the exercise is not done, the
    check hands back the library's version, so the name ``answer`` is then the library's. Run the
    same check cell again (without running the exercise cell first) and the check would test the
    library's code and print ✓. Under this decorator every check that is handed an object defined
    in ``course_lib`` says "not done yet" (with what to do) and returns its fallback instead."""

    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        library = [] if _LIBRARY_ANSWERS_ALLOWED.get() else [
            a for a in _answers_in([*args, *kwargs.values()]) if is_library_object(a)]
        if library:  # name them as the learner's cell does, not by the library's own names
            library = _Handed(library, _names_in_cell(sys._getframe(1), check.__name__, args,
                                                      kwargs, library))
        token = _LIBRARY_ANSWER.set(library or None)
        try:
            return check(*args, **kwargs)
        except _LibraryAnswer as handed:  # raised by the first check_function it reached
            return not_done(handed.exercise, handed.fallback)
        except ExerciseFailed as exc:  # every wrong answer is recorded, whoever raised it
            found = _EXERCISE_ID.search(str(exc))
            if found and _REPORTED.get(str(exc)) is None:
                report(found.group(1), "wrong", str(exc))
            raise
        finally:
            _LIBRARY_ANSWER.reset(token)

    wrapper.__learner_check__ = True
    return wrapper


_EXERCISE_ID = re.compile(r"^✗ (Exercise [\w.]+):")


class _LibraryAnswer(BaseException):
    """Raised by :func:`check_function` when it is handed the library's own code, and caught by
    :func:`learner_check`, which says "not done yet" (a BaseException: chapter code that catches
    ``Exception`` around a check cannot turn it into a pass)."""

    def __init__(self, exercise: str, fallback: Any):
        super().__init__(exercise)
        self.exercise, self.fallback = exercise, fallback


class _Handed(list):
    """The library objects a check was handed, with the names the learner's cell gave them."""

    def __init__(self, objects: Sequence[Any], names: Sequence[str]):
        super().__init__(objects)
        self.names = list(names)


def _names_in_cell(frame, check_name: str, args: tuple, kwargs: dict,
                   library: Sequence[Any]) -> list[str]:
    """The names the calling line passes the ``library`` objects under (``block_sparse_kernel``
    in ``block_sparse_kernel = ch10.check_block_sparse_kernel(block_sparse_kernel)``); [] when
    the line cannot be read (no source) or passes expressions instead of names."""
    try:
        source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        tree = ast.parse(source)
    except (SyntaxError, ValueError, AttributeError):
        return []
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and
             (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == check_name]
    if len(calls) != 1:
        return []
    call, names = calls[0], []
    given = [*zip(call.args, args), *((k.value, kwargs.get(k.arg)) for k in call.keywords)]
    for node, value in given:
        if isinstance(node, ast.Name) and any(value is obj for obj in library):
            names.append(node.id)
    return names


def _library_names(library: Sequence[Any]) -> str:
    """How "not done yet" names what it was handed: the learner's own names for it, else "the
    answer this cell passed" (never the library's internal names, which the learner never
    wrote)."""
    names = getattr(library, "names", None)
    if names:
        return ", ".join(f"`{name}`" for name in names) + (" is" if len(names) == 1 else " are")
    return "the answer this cell passed is"


def strict_mode() -> bool:
    """``COURSE_STRICT=1`` (or true/yes): "not done yet" is a failure, for a learner or a grader
    who wants the notebook to stop at the first unfinished exercise."""
    return os.environ.get("COURSE_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


GRADE_LOG_ENV = "COURSE_GRADE_LOG"


def report(exercise: str, status: str, message: str = "") -> None:
    """Record one check's outcome (``passed``, ``not done``, ``wrong``) as a JSON line in the file
    named by ``$COURSE_GRADE_LOG``, when set (what ``python -m course_lib.teaching.grade`` reads)."""
    path = os.environ.get(GRADE_LOG_ENV)
    if not path:
        return
    line = json.dumps({"exercise": exercise, "status": status, "message": message})
    if _LAST_REPORT.get(path) == line:  # the same outcome told twice (a check and its wrapper)
        return
    _LAST_REPORT[path] = line
    if len(_REPORTED) > 256:
        _REPORTED.clear()
    _REPORTED[message] = status
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


_LAST_REPORT: dict[str, str] = {}
# messages already recorded in this process (so that learner_check does not record a wrong
# answer a second time); bounded: cleared when it grows large
_REPORTED: dict[str, str] = {}


def not_done(exercise: str, fallback: Any, lines: Sequence[str] = ()) -> Any:
    """The "not done yet" outcome: say so (and what to do), record it, return ``fallback``; under
    :func:`strict_mode` raise :class:`ExerciseFailed` instead."""
    library = _LIBRARY_ANSWER.get()
    if library:
        head = (f"… {exercise}: not done yet — {_library_names(library)} still the library's "
                f"version (this cell handed it on because your exercise was not done). Run the "
                f"exercise cell (the one that defines your answer), then this one.")
    else:
        head = (f"… {exercise}: not done yet — the notebook continues with the library's "
                f"implementation. Fill in the exercise, run its cell, then this one.")
    text = "\n".join([head, *lines])
    report(exercise, "not done", text)
    if strict_mode():
        raise ExerciseFailed(f"✗ {exercise}: not done (COURSE_STRICT=1 makes an unfinished "
                             f"exercise a failure)\n" + text)
    print(text)
    if fallback is not None and not _is_data(fallback):
        _HANDED_BACK[id(fallback)] = fallback
    return fallback


def passed(exercise: str, text: str) -> None:
    """The pass outcome: print ``text`` and record it."""
    report(exercise, "passed", text)
    print(text)


def failed_with(exercise: str, message: str) -> "ExerciseFailed":
    """The wrong-answer outcome: record it and return the exception to raise."""
    report(exercise, "wrong", message)
    return ExerciseFailed(message)


@dataclass
class Case:
    """One input for an exercise: positional args, keyword args, a label for messages and,
    optionally, ``features``: what this case varies that the inputs alone do not show (e.g.
    ``{"padded rows": True}``), added to those :func:`course_lib.teaching.diagnosis.derive_features`
    reads from the inputs (a feature set to None is removed)."""

    args: tuple
    kwargs: dict | None = None
    label: str = ""
    features: dict | None = None

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
    if callable(x) and not isinstance(x, type):  # a function: its name, not its address
        name = getattr(x, "__name__", None) or type(x).__name__
        return f"function `{name}`"
    return repr(x) if len(repr(x)) <= 40 else type(x).__name__


_is_tensor = is_tensor  # the check layer's short name (diagnosis owns the definition)


def _dtype_name(x: Any) -> str:
    if _is_tensor(x):
        return str(x.dtype).replace("torch.", "")
    return str(np.asarray(x).dtype)


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


def copy_with_strides(x: np.ndarray) -> np.ndarray:
    """A copy of ``x`` with the same strides (a transposed or strided view stays one), so that a
    check's non-contiguous case reaches the learner's function as it was built. ``x.copy()``
    would hand every function a contiguous array."""
    if x.flags.c_contiguous or x.size == 0 or any(st < 0 for st in x.strides) \
            or any(st % x.itemsize for st in x.strides) or x.dtype.hasobject:
        return x.copy()
    span = sum((n - 1) * st for n, st in zip(x.shape, x.strides)) // x.itemsize + 1
    buffer = np.zeros(span, dtype=x.dtype)
    y = np.lib.stride_tricks.as_strided(buffer, shape=x.shape, strides=x.strides)
    y[...] = x
    return y


def _copy_value(x: Any) -> Any:
    """A copy of every array/tensor in ``x`` (through tuples, lists and dicts); other values as
    they are (numbers, strings, None are immutable)."""
    if isinstance(x, np.ndarray):
        return copy_with_strides(x)
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


def compare(got: Any, want: Any, atol: float, rtol: float, equal_nan: bool = False,
            names: Sequence[str] | None = None) -> str | None:
    """None when ``got`` matches ``want`` (type, shape, dtype, values); else what is wrong.

    ``equal_nan`` makes NaNs at the same places agree: used to recognise a known mistake that
    itself produces NaN, never to accept an answer. ``names``: the names of a tuple output's
    parts, used in the message (`` `lse`: …``; default ``output [1]: …``, nested
    ``output [0][1]: …``)."""
    return _compare(got, want, atol, rtol, equal_nan, names, "")


def _compare(got, want, atol, rtol, equal_nan, names, path, values=True) -> str | None:
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)) \
            and len(got) == len(want):  # each part says where it is itself
        # kinds first (type, shape, dtype of every part), values after: a dtype slip in one part
        # can change the values of another, and is then reported where it is
        for check_values in ((False, True) if values else (False,)):
            for i, (g, w) in enumerate(zip(got, want)):
                problem = _compare(g, w, atol, rtol, equal_nan, None,
                                   diagnosis.part_label(path, i, names), check_values)
                if problem:
                    return problem
        return None
    problem = _compare_leaf(got, want, atol, rtol, equal_nan, names, path, values)
    return f"{path}: {problem}" if problem and path else problem


def _compare_leaf(got, want, atol, rtol, equal_nan, names, path, values=True) -> str | None:
    if got is None:
        return ("the function returned None — did you forget a `return`?" if not path
                else "None where a value is expected")
    if _is_tensor(want) and isinstance(got, np.ndarray):
        return "returned a NumPy array where a torch.Tensor is expected (use torch operations)"
    if isinstance(want, np.ndarray) and _is_tensor(got):
        return "returned a torch.Tensor where a NumPy array is expected (use NumPy operations)"
    if isinstance(want, (tuple, list)):
        return f"expected a tuple of {len(want)} values, got {describe_value(got)}"
    if isinstance(want, (np.ndarray,)) or _is_tensor(want):
        if not (isinstance(got, np.ndarray) or _is_tensor(got)):
            return f"expected an array, got {describe_value(got)}"
        if tuple(got.shape) != tuple(want.shape):
            return f"shape {tuple(got.shape)} but expected {tuple(want.shape)}"
        if _dtype_name(got) != _dtype_name(want):
            return f"dtype {_dtype_name(got)} but expected {_dtype_name(want)}"
    if not values:
        return None
    g, w = to_numpy64(got), to_numpy64(want)
    if g.shape != w.shape:
        return f"shape {g.shape} but expected {w.shape}"
    nonfinite = ~np.isfinite(g) & np.isfinite(w)
    if nonfinite.any():
        idx = tuple(int(i) for i in np.argwhere(nonfinite)[0])
        kind = "NaN" if np.isnan(g[idx] if idx else g) else "inf"
        return (f"{int(nonfinite.sum())} value(s) are NaN/inf where the answer is finite; first at "
                f"index {idx} ({kind})")
    idx = first_bad_index(g, w, atol, rtol, equal_nan)
    if idx is None:
        return None
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN at both places: "All-NaN slice"
        err = float(np.nanmax(np.abs(g - w))) if g.size else 0.0
    where = f"index {idx}" if idx else "the value"
    got_v = g[idx] if idx else g.item()
    want_v = w[idx] if idx else w.item()
    return (f"max abs error {err:.3g} (tolerance atol={atol:g}, rtol={rtol:g}); first bad "
            f"element at {where}: got {got_v:.6g}, expected {want_v:.6g}")


def _default_tolerance(want: Any) -> tuple[float, float]:
    sample = want[0] if isinstance(want, (tuple, list)) and want else want
    return TOLERANCES.get(_dtype_name(sample), TOLERANCES["float32"])


def _outputs_match(a: Any, b: Any, atol: float, rtol: float, want: Any = None) -> bool:
    """Whether a mistake model's output ``b`` reproduces the learner's ``a``: the same structure,
    shapes and values (NaN where NaN), and the same dtypes — except that a model which keeps the
    right dtype (that of ``want``, the reference's output) also fits a learner whose dtype is off
    too: a wrong formula and a dtype slip are two mistakes, and the model names the first. A
    model that *is* a dtype slip must match the learner's dtype exactly."""
    try:
        if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
            wants = want if isinstance(want, (tuple, list)) and len(want) == len(b) else [None] * len(b)
            return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list))
                    and len(a) == len(b)
                    and all(_outputs_match(x, y, atol, rtol, w) for x, y, w in zip(a, b, wants)))
        if a is None or b is None:
            return a is b
        if _dtype_name(a) != _dtype_name(b) and (want is None
                                                 or _dtype_name(b) != _dtype_name(want)):
            return False
        g, w = to_numpy64(a), to_numpy64(b)
        if g.shape != w.shape:
            return False
        return first_bad_index(g, w, atol, rtol, equal_nan=True) is None
    except Exception:  # a mistake model that cannot even be compared does not match
        return False


def is_library_frame(filename: str) -> bool:
    """True for a traceback frame in NumPy, torch, Triton, the standard library or course_lib: not
    the learner's code (a notebook cell, or a file of their own)."""
    return any(part in filename for part in ("site-packages", "dist-packages", "/triton/",
                                             "/course_lib/", "<frozen", "/lib/python"))


def learner_frame(exc: BaseException):
    """The innermost traceback frame of ``exc`` in the learner's code, or None."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not is_library_frame(f.filename)]
    return frames[-1] if frames else None


def _short_error(exc: BaseException) -> str:
    """'TypeError: message (line N: `code`)': the line is the learner's own (the innermost frame
    outside NumPy, torch and the library), never NumPy's internals."""
    frame = learner_frame(exc)
    where = f" (line {frame.lineno}: `{(frame.line or '').strip()}`)" if frame else ""
    text = str(exc)
    return f"{type(exc).__name__}{': ' + text if text else ''}{where}"


# What the first invalid floating-point operation NumPy reports says about a NaN/inf.
_FP_EVIDENCE = (
    (("invalid value", "subtract"),
     "inf - inf: in a row whose scores are all -inf (fully masked) the max is -inf too, and "
     "s - max gives (-inf) - (-inf) = NaN; such a row needs a guard (e.g. use 0 as its max)"),
    (("invalid value", "add"), "inf + (-inf) = NaN"),
    (("overflow", "exp"),
     "exp() overflowed to inf: its argument was large (subtract the running max before exp)"),
    (("overflow", "power"), "a power overflowed to inf"),
    (("overflow", ""), "a result overflowed to inf (numbers beyond the dtype's range)"),
    (("invalid value", "divide"),
     "0/0 or inf/inf = NaN: a division by a sum that is 0 (a fully masked row?) or inf "
     "(an overflowed exp?)"),
    (("divide by zero", "log"), "log(0) = -inf: the log of a sum that is 0 (a fully masked row?)"),
    (("divide by zero", ""), "a division by zero gives inf"),
    (("invalid value", "multiply"), "0 · inf = NaN: a weight of 0 times an inf"),
    (("invalid value", "exp"), "exp of NaN"),
    (("invalid value", ""), "an operation with no defined result gave NaN"),
)


# What "inf - inf" means where the case has no fully masked row: the guard the usual meaning
# asks for is not what is missing (a correct answer meets no row of all -inf here).
NO_EMPTY_ROW_MEANING = (
    "inf - inf: a row whose scores are all -inf has max -inf, and s - max gives "
    "(-inf) - (-inf) = NaN. No row of this case is fully masked (every query sees at least one "
    "key), so such a row is either one tile's part of a row that sees no key in that tile — "
    "which needs a guard (a max of 0 where it is -inf) — or a mask that hides keys that are "
    "visible (np.where(condition, s, -inf) keeps s where the condition is True)")


NO_EMPTY_ROW_DIVISION = (
    "0/0: a division by a sum that is 0. No row of this case is fully masked, so the row's sum "
    "should have terms: either none were added (a loop that skips the row's keys, or a mask "
    "that hides them all), or each exp(s − m) underflowed to 0 (s − m below about −745 in "
    "float64, −103 in float32: an m far above the row's own scores, such as a max that starts "
    "above them or another row's)")


def trace_nonfinite(fn: Callable, args: tuple, kwargs: dict,
                    no_empty_rows: bool = False) -> str | None:
    """Re-run ``fn`` with NumPy raising on the first invalid floating-point operation; return
    what it was and where in the learner's code ("invalid value in subtract at line 7: `s - m`
    — ..."), or None when NumPy reports nothing (torch code, or no NaN made by arithmetic).
    ``no_empty_rows``: the case is known to have no fully masked row, so a row of all -inf
    is explained by :data:`NO_EMPTY_ROW_MEANING`, not by a missing guard."""
    output = CapturedOutput()
    try:
        with _isolated(output), np.errstate(over="raise", divide="raise", invalid="raise",
                                            under="ignore"), _TorchNonfinite() as torch_trace:
            call_with_time_limit(fn, _copy_value(tuple(args)), _copy_value(kwargs),
                                 DEFAULT_TIME_LIMIT_S)
    except FloatingPointError as exc:
        text = str(exc)
        frame = learner_frame(exc)
        where = f" at line {frame.lineno}: `{(frame.line or '').strip()}`" if frame else ""
        meaning = next((m for (kind, op), m in _FP_EVIDENCE if kind in text and op in text),
                       "an invalid floating-point operation")
        if no_empty_rows and "subtract" in text:
            meaning = NO_EMPTY_ROW_MEANING
        elif no_empty_rows and "invalid value" in text and "divide" in text:
            meaning = NO_EMPTY_ROW_DIVISION
        return f"the first invalid operation NumPy saw: {text}{where} — {meaning}"
    except _UserInterrupt:
        raise KeyboardInterrupt from None
    except BaseException:  # noqa: BLE001 - no evidence from this run
        return None
    return torch_trace.evidence(no_empty_rows)


class _TorchNonfinite:
    """While active, watch every torch operation (a ``TorchFunctionMode``) and remember the first
    that made a NaN (or an inf) out of inputs that had none, with the learner's line."""

    _MEANING = {
        "exp": "exp() overflowed to inf: its argument was large (subtract the running max "
               "before exp)",
        "sub": "inf - inf: a row whose scores are all -inf (fully masked) has max -inf, and "
               "s - max gives (-inf) - (-inf) = NaN; such a row needs a guard",
        "div": "0/0 or inf/inf = NaN: a division by a sum that is 0 (a fully masked row?) or "
               "inf (an overflowed exp?)",
        "log": "log(0) = -inf: the log of a sum that is 0 (a fully masked row?)",
        "mul": "0 · inf = NaN",
        "softmax": "softmax of a row that is all -inf (fully masked) is NaN",
    }

    def __enter__(self):
        self.first: dict[str, tuple[str, Any]] = {}
        torch = sys.modules.get("torch")
        self.mode = None
        if torch is None:
            return self
        watcher = self

        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                if len(watcher.first) < 2 and isinstance(result, torch.Tensor) \
                        and result.is_floating_point():
                    watcher.inspect(func, args, kwargs or {}, result)
                return result

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def inspect(self, func, args, kwargs, result):
        import torch

        tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)
                   and a.is_floating_point()]
        for kind, test in (("NaN", torch.isnan), ("inf", torch.isinf)):
            if kind in self.first or not bool(test(result).any()):
                continue
            if any(bool(test(t).any()) for t in tensors):
                continue
            # only an operation the learner's own code called: not the check's NaN margins
            # (torch.full), not torch's or the library's internals
            stack = traceback.extract_stack()[:-2]  # without this method and __torch_function__
            caller = next((f for f in reversed(stack) if "/torch/" not in f.filename), None)
            if caller is None or is_library_frame(caller.filename):
                continue
            self.first[kind] = (getattr(func, "__name__", str(func)), caller)

    def __exit__(self, *exc):
        if self.mode is not None:
            self.mode.__exit__(*exc)
        return False

    def evidence(self, no_empty_rows: bool = False) -> str | None:
        """'the first inf came from torch's exp at line N: `...` — meaning; then the first NaN
        from div at line M: `...`', in the order they appeared; None when torch saw neither."""
        parts = []
        for kind, (name, frame) in self.first.items():  # insertion order: first made, first
            where = f" at line {frame.lineno}: `{(frame.line or '').strip()}`" if frame else ""
            meaning = next((m for key, m in self._MEANING.items() if key in name), None)
            if no_empty_rows and "sub" in name:
                meaning = NO_EMPTY_ROW_MEANING
            parts.append(f"the first {kind} came from torch's {name}{where}"
                         + (f" — {meaning}" if meaning else ""))
        return "; then ".join(parts) or None


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
    hint = _broadcast_hint(exc)
    return [f"✗ {exercise}: {subject} raised{where}", f"  {_short_error(exc)}",
            *([f"  {hint}"] if hint else [])]


_NUMPY_BROADCAST = re.compile(r"could not be broadcast together with shapes \(([\d, ]*)\) "
                              r"\(([\d, ]*)\)")


def _broadcast_hint(exc: BaseException) -> str | None:
    """What NumPy's broadcasting error says when one operand's shape is the other's without
    its last axis (weights per row meeting rows of d values): broadcasting lines shapes up from
    the right, so the shorter one needs a trailing axis of 1."""
    found = _NUMPY_BROADCAST.search(str(exc)) if isinstance(exc, ValueError) else None
    if found is None:
        return None
    a, b = (tuple(int(n) for n in text.replace(" ", "").split(",") if n)
            for text in found.groups())
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    if len(long_) != len(short) + 1 or long_[:-1] != short or long_[-1] == 1:
        return None
    return (f"hint: shape {short} is shape {long_} without its last axis: NumPy lines shapes up "
            f"from the right, so {short[-1]} meets {long_[-1]} — give the {short} operand a "
            f"trailing axis of 1 ([..., None], shape {short + (1,)}) so it broadcasts over the "
            f"last")


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
    output_names: Sequence[str] | None = None,
    features: Callable | bool | None = None,
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
        output_names: the names of a tuple output's parts (``("o", "lse")``), for messages.
        features: how a case's features are found for the differential diagnosis
            (:mod:`course_lib.teaching.diagnosis`): None reads them from the inputs
            (:func:`~course_lib.teaching.diagnosis.derive_features`), a callable ``features(inputs) ->
            dict`` (inputs by argument name) replaces that, False uses only ``Case.features``.

    Returns:
        ``fn`` when it passes, ``fallback`` when it is not done yet.

    Raises:
        ExerciseFailed: with a diagnosis when ``fn`` is wrong, crashes, changes an input, exits
            or runs too long. Its ``evidence`` attribute holds the diagnosis's evidence lines
            (for checks that write a message of their own).
        KeyboardInterrupt: when the learner interrupts the check (Ctrl-C, Interrupt button).
    """
    fallback = reference if fallback is None else fallback
    cases = list(cases)
    output = CapturedOutput() if output is None else output  # all fn prints, over all cases
    if _LIBRARY_ANSWER.get():  # the library's own code was handed in: never a ✓ for it
        raise _LibraryAnswer(exercise, fallback)

    def failed(*lines: str, evidence: Sequence[str] = (), outcomes=None,
               experiments=None) -> ExerciseFailed:
        exc = failed_with(exercise, "\n".join([*lines, *output.excerpt(subject)]))
        exc.evidence, exc.outcomes, exc.experiments = list(evidence), outcomes, experiments
        exc.output_names, exc.headline = output_names, first.n if outcomes else None
        return exc

    runs: list[CaseRun] = []  # evidence: what fn returned (or how it crashed) on each case
    for n, case in enumerate(cases, 1):
        kwargs = case.kwargs or {}
        want = reference(*case.args, **kwargs)
        # fn gets its own copies: whatever it does to them, the case stays as the reference and
        # the mistake models see it
        args_copy, kwargs_copy = _copy_value(tuple(case.args)), _copy_value(kwargs)
        on_case = f"on case {n} {case.describe()}"
        failing = next((r for r in runs if r.problem), None)
        atol, rtol = tolerance or _default_tolerance(want)
        try:
            with _isolated(output):
                got = call_with_time_limit(fn, args_copy, kwargs_copy, time_limit)
        except NotImplementedError:
            if failing is not None:  # a later case is unfinished: no evidence from it
                continue
            if quiet:
                return fallback
            return not_done(exercise, fallback, output.excerpt(subject))
        except NoEvidence:  # the caller cannot run this case (e.g. after a GPU fault)
            continue
        except _TimeLimit:
            if failing is not None:
                continue
            raise failed(f"✗ {exercise}: stopped after {time_limit:g} s {on_case} — look for a "
                         f"loop that never ends (a tile index that never advances?)") from None
        except _UserInterrupt:  # the learner stopped the check: stop, as any interrupted cell
            raise KeyboardInterrupt from None
        except BaseException as exc:  # the learner's code crashed: one line, not a traceback wall
            if isinstance(exc, (SystemExit, KeyboardInterrupt)):  # not about the case: say it now
                if failing is not None:
                    continue
                raise failed(*_crash_diagnosis(exercise, subject, on_case, exc)) from None
            # kept as evidence; the other cases still run, so the diagnosis can say which
            # cases crash and which do not
            runs.append(CaseRun(n, case, want, None, f"crashed: {_short_error(exc)}",
                                (atol, rtol), crash=_crash_diagnosis(exercise, subject, on_case,
                                                                     exc)))
            continue
        names = _argument_names(len(case.args), reference, fn)
        changed = _changed_inputs(case, args_copy, kwargs_copy, names, writable)
        if changed and failing is None:
            name = changed[0]
            raise failed(f"✗ {exercise}: {subject} changed its input `{name}` in place {on_case}",
                         f"  a correct answer leaves its inputs as they are (the caller still "
                         f"needs them): write `{name} = {name} * s` rather than `{name} *= s`, "
                         f"and copy before assigning into it (`{name} = {name}.copy()`, or "
                         f"`.clone()` for a tensor)")
        runs.append(CaseRun(n, case, want, got,
                            compare(got, want, atol, rtol, names=output_names), (atol, rtol)))
    first = next((r for r in runs if r.problem), None)
    if first is None:
        if not quiet:
            passed(exercise, "\n".join([f"✓ {exercise}: passed ({len(cases)} "
                                        f"case{'s' if len(cases) != 1 else ''}).",
                                        *output.excerpt(subject)]))
        return fn
    outcomes = case_outcomes(runs, reference, fn, features)
    causes = [] if first.crash is not None else \
        cause_lines([r for r in runs if r.crash is None], mistakes or {})
    # experiments cost a run each: only where no known mistake already names the cause
    experiments = {} if causes else toggle_experiments(
        outcomes, first, fn, reference, output, min(time_limit, EXPERIMENT_TIME_LIMIT_S))
    # a known mistake that reproduces the answer on every case is the whole story: evidence
    # lines then only repeat it (or, worse, seem to point elsewhere)
    named = bool(causes) and causes[0].startswith("  likely cause:")
    evidence = [] if named else diagnosis.diagnose(outcomes, output_names, first.n, experiments)
    if first.crash is not None:
        lines = list(first.crash)
    else:
        lines = [f"✗ {exercise}: wrong answer on case {first.n} of {len(cases)}",
                 f"  inputs: {first.case.describe()}",
                 f"  output: {describe_value(first.got)}; expected {describe_value(first.want)}",
                 f"  {first.problem}"]
        if "NaN/inf" in first.problem:
            headline = next(o for o in outcomes if o.n == first.n)
            no_empty_rows = (headline.features.get("rows that see no key") is False
                             and not headline.features.get(diagnosis.EMPTY_CHUNK))
            trace = trace_nonfinite(fn, first.case.args, first.case.kwargs or {}, no_empty_rows)
            if trace:
                lines.append(f"  {trace}")
        lines += causes
    tail = evidence + also_wrong_lines(runs, first, len(cases))
    raise failed(*lines, *tail, evidence=tail, outcomes=outcomes, experiments=experiments)


class NoEvidence(Exception):
    """Raised by a check's wrapper around the learner's code when it cannot run a case (e.g. the
    GPU faulted on an earlier one): :func:`check_function` skips that case."""


def also_wrong_lines(runs: Sequence["CaseRun"], first: "CaseRun", n_cases: int) -> list[str]:
    """The "(also wrong on …; right on k of n)" line: every other failing case, crashed ones
    included (said as such)."""
    other = [r for r in runs if r.problem and r is not first]
    if not other:
        return []
    crashed = [r.n for r in other if r.crash is not None]
    said = ", ".join(map(str, (r.n for r in other)))
    verb = "wrong on"
    if crashed and len(crashed) == len(other):
        verb = "crashes on" if first.crash is not None else "wrong on"
        if first.crash is None:
            said += " (crashed)" if len(other) == 1 else " (all crashed)"
    elif crashed:
        said += f" ({', '.join(map(str, crashed))} crashed)"
    lines = [f"  (also {verb} case{'s' if len(other) > 1 else ''} {said}; right on "
             f"{len([r for r in runs if not r.problem])} of {n_cases})"]
    if crashed and first.crash is None:  # the headline is a wrong value: say how the others crashed
        why = next(r.problem for r in other if r.crash is not None).removeprefix("crashed: ")
        # the error itself, not the lines that only repeat which case it was
        said_lines = [x.strip() for x in why.splitlines()
                      if x.strip() and not re.match(r"(\w+: )?(your kernel failed )?on case \d", x.strip())]
        lines.append(f"  case {crashed[0]} crashed: {_clip(' '.join(said_lines) or why, CRASH_QUOTE_CHARS)}")
    return lines


# At most this many characters of another case's error are quoted under a wrong answer.
CRASH_QUOTE_CHARS = 240


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 1] + "…"


def toggle_experiments(outcomes: Sequence, first: "CaseRun", fn: Callable, reference: Callable,
                       output: CapturedOutput, time_limit: float) -> dict:
    """``{feature: passed}``: the first failing case rerun with each feature that sets the
    failing cases apart switched off (:func:`course_lib.teaching.diagnosis.toggle`), where that is
    possible; passed is True when the answer is then right."""
    results = {}
    headline = next((o for o in outcomes if o.n == first.n), None)
    if headline is None:
        return results
    names = _argument_names(len(first.case.args), reference, fn)
    for feature, value in diagnosis.separating(outcomes, absences=True):
        changed = (diagnosis.toggle(feature, headline.inputs) if value is True else
                   diagnosis.toggle(feature, headline.inputs, on=True) if value is False else None)
        if changed is None:
            continue
        args = tuple(changed.get(name, arg) for name, arg in zip(names, first.case.args))
        kwargs = {k: v for k, v in changed.items() if k not in names[:len(args)]}
        if "layouts" in (first.case.kwargs or {}):
            kwargs["layouts"] = first.case.kwargs["layouts"]
        try:
            want = reference(*args, **kwargs)
            with _isolated(output):
                got = call_with_time_limit(fn, _copy_value(args), _copy_value(kwargs), time_limit)
            results[feature] = compare(got, want, *first.tolerance) is None
        except _UserInterrupt:
            raise KeyboardInterrupt from None
        except BaseException:  # noqa: BLE001 - the experiment failed: the feature is not it
            results[feature] = False
    return results


def case_outcomes(runs: Sequence["CaseRun"], reference: Callable, fn: Callable,
                  features: Callable | bool | None = None) -> list:
    """The evidence of ``runs`` for :func:`course_lib.teaching.diagnosis.diagnose`: each case's inputs by
    the reference's argument names, its features and its outcome."""
    outcomes = []
    for r in runs:
        args, kwargs = tuple(r.case.args), dict(r.case.kwargs or {})
        names = _argument_names(len(args), reference, fn)
        inputs = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k != "layouts"}}
        try:
            found = ({} if features is False else
                     features(inputs) if callable(features) else diagnosis.derive_features(inputs))
        except Exception:  # noqa: BLE001 - features are evidence, not a requirement
            found = {}
        found.update(r.case.features or {})
        found = {k: v for k, v in found.items() if v is not None}
        status = (diagnosis.CRASHED if r.crash is not None else
                  diagnosis.WRONG if r.problem else diagnosis.RIGHT)
        outcomes.append(diagnosis.Outcome(r.n, found, status, r.got, r.want, r.tolerance, inputs))
    return outcomes


@dataclass
class CaseRun:
    """One case the learner's function ran on: its number, inputs, the right output, what it
    returned, what is wrong with it (None: right), the tolerance used and, when it crashed, the
    crash's diagnosis lines."""

    n: int
    case: Case
    want: Any
    got: Any
    problem: str | None
    tolerance: tuple[float, float]
    crash: list[str] | None = None  # the crash's diagnosis lines, when fn raised on this case


# A mistake model's output depends only on the case's inputs, which a check rebuilds the same from
# its seed every time it runs: the next attempt at an exercise (and the next test of a wrong answer)
# gets the outputs from here instead of running the models again — in the interpreter, a kernel
# model is tenths of a second a case, and a check may try a dozen models.
_MODEL_OUTPUTS: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
MODEL_OUTPUTS_KEPT = 4096  # (model, case) pairs; the oldest are dropped first


def _fingerprint(x):
    """A hashable stand-in for an input ``x`` of a case: values, dtype, shape and strides of an
    array or CPU tensor (a digest of its bytes), scalars and strings as they are, containers item
    by item. None where there is none to make cheaply (a GPU tensor, a function, an object)."""
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return (type(x).__name__, x)
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.strides,
                hashlib.blake2b(np.ascontiguousarray(x).tobytes(), digest_size=16).digest())
    if is_tensor(x):
        import torch  # loaded already: x is a tensor

        if x.device.type != "cpu" or x.requires_grad or x.is_sparse:
            return None
        flat = x.detach().contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return ("tensor", str(x.dtype), tuple(x.shape), tuple(x.stride()), x.storage_offset(),
                hashlib.blake2b(raw, digest_size=16).digest())
    if isinstance(x, (tuple, list)):
        items = tuple(_fingerprint(i) for i in x)
        return None if any(i is None for i in items) else (type(x).__name__, items)
    if isinstance(x, dict):
        items = tuple((k, _fingerprint(v)) for k, v in sorted(x.items(), key=lambda kv: repr(kv[0])))
        return None if any(v is None for _, v in items) else ("dict", items)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # e.g. a case's memory layout
        fields = _fingerprint({f.name: getattr(x, f.name) for f in dataclasses.fields(x)})
        return None if fields is None else (type(x).__qualname__, fields)
    return None


def _model_output(wrong_fn: Callable, case: "Case"):
    """``wrong_fn`` on the case's inputs, remembered by (model, inputs' fingerprint); an exception
    the model raised is remembered and raised again."""
    found = _fingerprint((case.args, case.kwargs or {}))
    key = None if found is None else (wrong_fn, found)
    if key is not None and key in _MODEL_OUTPUTS:
        _MODEL_OUTPUTS.move_to_end(key)
        ok, value = _MODEL_OUTPUTS[key]
        if ok:
            return value
        raise value
    try:
        value = wrong_fn(*case.args, **(case.kwargs or {}))
        outcome = (True, value)
    except Exception as exc:  # noqa: BLE001 - remembered, then raised to the caller as before
        outcome = (False, exc.with_traceback(None))
    if key is not None:
        _MODEL_OUTPUTS[key] = outcome
        while len(_MODEL_OUTPUTS) > MODEL_OUTPUTS_KEPT:
            _MODEL_OUTPUTS.popitem(last=False)
    if outcome[0]:
        return outcome[1]
    raise outcome[1]


def consistent_causes(runs: Sequence[CaseRun], mistakes: dict[str, Callable]) -> list[str]:
    """The causes whose mistake model reproduces the learner's output on every case where both
    ran: on the first wrong case (the one the diagnosis shows) and on every other case, right or
    wrong (a model that would have failed a case the learner got right is ruled out). A model
    that raises on a case gives no evidence there. Models are tried on the first wrong case first,
    so only the few that survive it run on the others."""
    wrong = [r for r in runs if r.problem]
    if not wrong:
        return []
    order = [wrong[0], *[r for r in runs if r is not wrong[0]]]
    survivors = []
    for cause, wrong_fn in mistakes.items():
        for i, run in enumerate(order):
            try:
                mistaken = _model_output(wrong_fn, run.case)
            except Exception:  # noqa: BLE001 - no evidence on this case
                if i == 0:
                    break
                continue
            if not _outputs_match(run.got, mistaken, *run.tolerance, run.want):
                break
        else:
            survivors.append(cause)
    return survivors


# When more causes than this reproduce an answer, naming them would be a guess.
MAX_CAUSES_SHOWN = 2


def cause_lines(runs: Sequence[CaseRun], mistakes: dict[str, Callable]) -> list[str]:
    """The diagnosis lines about the cause: one "likely cause" when the evidence singles one out,
    the two candidates when exactly two reproduce the output, nothing when none or many do."""
    causes = list(dict.fromkeys(consistent_causes(runs, mistakes)))
    if len(causes) == 1:
        return [f"  likely cause: {causes[0]}"]
    if 1 < len(causes) <= MAX_CAUSES_SHOWN:
        return ["  two known mistakes reproduce your output exactly on every case; the evidence "
                "does not tell them apart:", *[f"  - {c}" for c in causes]]
    return []


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
            return not_done(exercise, expected, [f"  expected value shown for reference: "
                                                 f"{expected:.6g}"])
        except _UserInterrupt:
            raise KeyboardInterrupt from None
        except _TimeLimit:
            raise failed_with(exercise, f"✗ {exercise}: your code was stopped after "
                                        f"{DEFAULT_TIME_LIMIT_S:g} s — look for a loop that "
                                        f"never ends") from None
        except BaseException as exc:
            raise failed_with(exercise, "\n".join(_crash_diagnosis(exercise, "your code", "", exc)
                                                  + output.excerpt("your code"))) from None
    if value is None or isinstance(value, (str, bytes)):
        raise failed_with(exercise, f"✗ {exercise}: expected a number, got {describe_value(value)}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise failed_with(exercise, f"✗ {exercise}: expected a number, got "
                                    f"{describe_value(value)}") from None
    if not math.isfinite(v) or not math.isclose(v, expected, rel_tol=rtol):
        msg = f"✗ {exercise}: got {v:.6g}, expected {expected:.6g} (relative tolerance {rtol:g})"
        if hint:
            msg += f"\n  hint: {hint}"
        raise failed_with(exercise, msg)
    passed(exercise, "\n".join([f"✓ {exercise}: passed ({v:.6g}).", *output.excerpt("your code")]))
    return v
