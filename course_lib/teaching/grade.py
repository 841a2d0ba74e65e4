"""Grade a folder of learner notebooks: one row per learner per exercise.

Layout of ``SUBMISSIONS`` (both may be mixed)::

    SUBMISSIONS/alice/03_online_softmax.ipynb      # one folder per learner
    SUBMISSIONS/bob__03_online_softmax.ipynb       # or flat files: <learner>__<notebook>

A notebook's chapter is the two digits its file name starts with (``03_...``; a copy named
``03_online_softmax-Copy1.ipynb`` still counts as chapter 03). The chapter's exercises are read from
``solutions/NN_*.ipynb`` (each code cell with ``### BEGIN SOLUTION`` names one, ``# Exercise N.M:``),
and so is each exercise's check call (``X = chNN.check_foo(X)``: the check, and the names the
learner's answer goes by).

**Where the checks run.** The learner's notebook runs in a Python process of its own — in a
sandbox where the machine allows it (:mod:`course_lib.teaching.sandbox`: no network, the file system
read-only, ``solutions/`` and the other submissions hidden, memory/CPU/file limits) — and that
process only *computes*. The checks run in the grader's own process: just before the learner's
check cell of an exercise runs, the grader looks up the answer by its name in the notebook's
process and runs the chapter's check (``course_lib.teaching.exercises.chNN``) here, on proxies
(:mod:`course_lib.teaching.grade_channel`): calling one sends the case's inputs to the notebook's process,
which calls the learner's function (or launches the learner's Triton kernel, under the memory
guard, or runs a function of the library named by the check on the answer: a kernel of the
check's that calls the learner's ``@triton.jit`` helpers, an ``autograd.Function`` trained) and
sends back numbers, decoded without executing anything. Whatever the learner's code
does in its own process — patch the checks, forge the old grading log, print a ✓ — is never read.
The learner's own check cells still run there, so the executed notebooks show the usual messages.

An exercise that cannot be handed to a check this way (:data:`NOT_ISOLATED` says which and why;
none today) is graded as before, from the report the check writes inside the notebook's process,
and its rows say so (``not isolated``).

For each notebook the grader

1. drops every output the learner saved (they are never trusted) and ignores its kernel choice;
2. runs it top to bottom in a fresh kernel (nbclient, errors allowed so one broken cell does not
   sink the rest, a time limit per cell and one for the notebook), in an empty working folder,
   with a minimal environment (no ``COURSE_STRICT``: an unfinished exercise is its own row);
3. grades each exercise just before its check cell runs, on what the cell is about to hand the
   check (the cell with the solution's check cell id, else the first cell calling the check; a
   later call, such as chapter 00's demonstration of a wrong answer, changes nothing) — or, when
   that cell defines the answer itself, just after it ran.

Each exercise of the chapter gets one row with status ``passed``, ``not done``, ``wrong`` (the
message is the check's diagnosis) or ``not run`` (the message says why: the answer is not defined
when its check cell runs — which cells raised before it —, the run stopped before it (the process
died, a cell ran past the time limit), no cell calls its check, or the process died while the check
ran the answer).

Output in ``--out``: ``grades.csv`` and ``grades.json`` (the rows, the isolation used, seconds per
notebook), ``summary.csv`` (one line per learner), and ``executed/<learner>/<notebook>`` (the
notebooks as the grader ran them, to read the learners' own messages in context).

Usage::

    python -m course_lib.teaching.grade SUBMISSIONS --out RESULTS_DIR [--timeout 300] [--jobs 2]
        [--isolation auto|bubblewrap|none] [--memory-gib 4] [--notebook-timeout 1800]
        [--hide FOLDER ...] [--solutions DIR --checks-package PACKAGE]  # a course of your own
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import csv
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course_lib.teaching import nbgen, sandbox

STATUSES = ("passed", "not done", "wrong", "not run")
SYMBOLS = {"passed": "✓", "not done": "–", "wrong": "✗", "not run": "·"}
CHAPTER_RE = re.compile(r"^(\d\d)_")
EXERCISE_ID_RE = nbgen.EXERCISE_ID_RE
FLAT_SEPARATOR = "__"
LOG_ENV = "COURSE_GRADE_LOG"
CHECKS_PACKAGE = "course_lib.teaching.exercises"  # where chNN (the chapters' checks) are imported from
# Code in a submission that reaches for the grading machinery instead of answering an exercise
# (named in the flags column; the grading itself no longer depends on it).
SUSPICIOUS = ("COURSE_GRADE_LOG", "GRADE_LOG", "checks.report", "checks.passed", "checks.not_done",
              "checks.failed_with", "learner_check", "_LIBRARY_ANSWER", "is_library_object",
              "grade_channel")
CSV_COLUMNS = ["learner", "chapter", "notebook", "exercise", "status", "message"]
# The exercises whose check cannot be handed proxies ({exercise: why}): graded from the report
# their check writes inside the notebook's process, as the grader did before it had a trust
# boundary, their rows marked. None today: the last two, 12.1 and 12.2, hand over code (an adapter
# transformers calls with its module; a function that makes a custom operator), and their checks
# now run it through library functions sent by name (ch12.run_adapter; ch12.op_outputs, op_kind,
# opcheck_problem, compile_probe), which return only data.
NOT_ISOLATED: dict[str, str] = {}
NOT_ISOLATED_MARK = "not isolated"  # starts the message of such a row
NOTEBOOK_TIMEOUT_S = 1800  # default wall-clock limit for one notebook
# CPU seconds per wall second a notebook may use (its threads: torch's and ipykernel's)
CPU_PER_WALL = 2


class GradeError(ValueError):
    """The grading command cannot start (bad folder, no submissions); the message says why."""


@dataclass
class Submission:
    learner: str
    chapter: str
    path: Path
    name: str  # the notebook's name without the learner's prefix of a flat file


@dataclass
class Row:
    learner: str
    chapter: str
    notebook: str
    exercise: str
    status: str
    message: str


@dataclass
class Result:
    """What grading one notebook produced."""
    learner: str
    chapter: str
    notebook: str
    rows: list[Row]
    flags: list[str] = field(default_factory=list)
    seconds: float = 0.0


def exercise_key(ex: str) -> tuple[int, int]:
    major, minor = ex.split(".")
    return int(major), int(minor)


@dataclass
class Chapter:
    notebook: str            # the solution notebook's name, e.g. "03_online_softmax.ipynb"
    exercises: list[str]     # ["3.1", "3.2", "3.3"], in number order
    check_calls: dict[str, str] = field(default_factory=dict)  # "3.2" -> "ch03.check_merge"
    check_ids: dict[str, str] = field(default_factory=dict)    # "3.2" -> the check cell's id
    # "3.2" -> ["merge"]: the names the solution's check cell passes (None: not plain names)
    check_args: dict[str, list[str] | None] = field(default_factory=dict)


def chapter_exercises(solutions: Path) -> dict[str, Chapter]:
    """Each chapter's exercises and check calls, read from the solution notebooks: every code cell
    holding a solution block names its exercise, and the next cell calling a check checks it."""
    chapters = {}
    for path in sorted(Path(solutions).glob("*.ipynb")):
        m = CHAPTER_RE.match(path.name)
        if not m:
            continue
        nb = nbgen.load_notebook(path)
        calls, ids, names = {}, {}, {}
        for ex, _, check in nbgen.exercise_cells(nb):
            src = nbgen._source(nb["cells"][check]) if check is not None else ""
            call = nbgen.CHECK_CALL_RE.search(src)
            calls.setdefault(ex, call.group(1) if call else "")
            names.setdefault(ex, check_arguments(src, call.group(1)) if call else None)
            if check is not None and nb["cells"][check].get("id"):
                ids.setdefault(ex, nb["cells"][check]["id"])
        chapters[m.group(1)] = Chapter(path.name, sorted(calls, key=exercise_key), calls, ids,
                                       names)
    if not chapters:
        raise GradeError(f"{solutions}: no solution notebooks (NN_name.ipynb) to read the "
                         f"exercises from")
    return chapters


def check_arguments(source: str, call: str) -> list[str] | None:
    """The names a check cell passes to ``call`` (``["update", "finish"]`` for
    ``update, finish = ch06.check_online_softmax(update, finish)``); None when the call passes
    anything but plain names, or cannot be read."""
    for line in source.splitlines():
        if call not in line:
            continue
        try:
            tree = ast.parse(line.strip())
        except SyntaxError:
            return None
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == call:
                if node.keywords or not all(isinstance(a, ast.Name) for a in node.args):
                    return None
                return [a.id for a in node.args]
    return None


def find_submissions(folder: Path, chapters: dict) -> tuple[list[Submission], list[str]]:
    """The notebooks to grade in ``folder``, and a warning for each file that is skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        raise GradeError(f"{folder}: not a folder")
    found: dict[tuple[str, str], list[tuple[Path, str]]] = {}
    warnings = []

    def add(learner: str, path: Path, name: str):
        m = CHAPTER_RE.match(name)
        if not m:
            warnings.append(f"skipped {path}: the file name does not start with a chapter "
                            f"number (NN_...)")
        elif m.group(1) not in chapters:
            warnings.append(f"skipped {path}: no solution notebook for chapter {m.group(1)}")
        else:
            found.setdefault((learner, m.group(1)), []).append((path, name))

    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            for nb in sorted(entry.glob("*.ipynb")):  # .ipynb_checkpoints/ is not searched
                add(entry.name, nb, nb.name)
        elif entry.suffix == ".ipynb":
            learner, sep, rest = entry.name.partition(FLAT_SEPARATOR)
            if not sep or not learner:
                warnings.append(f"skipped {entry}: a file at the top level is named "
                                f"<learner>{FLAT_SEPARATOR}<notebook>.ipynb")
            else:
                add(learner, entry, rest)
    subs = []
    for (learner, chapter), paths in sorted(found.items()):
        official = chapters[chapter].notebook
        # two notebooks for one chapter: the one with the course's own name, else the newest
        exact = [p for p in paths if p[1] == official]
        chosen = exact[0] if exact else max(paths, key=lambda p: p[0].stat().st_mtime)
        for p, _ in paths:
            if p != chosen[0]:
                warnings.append(f"skipped {p}: {learner} has another chapter {chapter} notebook, "
                                f"{chosen[0].name}, which is graded")
        subs.append(Submission(learner, chapter, *chosen))
    return subs, warnings


@dataclass
class Report:
    cell: int | None  # the cell that was running when the line was written
    exercise: str
    status: str
    message: str


def read_log(path: Path, exercises: list[str],
             starts: list[tuple[int, int]] = ()) -> tuple[list[Report], int]:
    """The reports in the JSON-lines log on ``exercises``, in order, each with the cell that was
    running when it was written (``starts``: (cell index, log size when that cell started), in
    order); and how many lines were ignored (unreadable, an unknown status, or an exercise of
    another chapter)."""
    reports: list[Report] = []
    ignored = 0
    try:
        data = Path(path).read_bytes()
    except OSError:
        return reports, 0
    offset = 0
    for raw in data.splitlines(keepends=True):
        at, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        cell = None
        for index, start in starts:
            if start <= at:
                cell = index
        try:
            entry = json.loads(raw.decode("utf-8", errors="replace"))
            m = EXERCISE_ID_RE.search(str(entry["exercise"]))
            status = entry["status"]
        except (ValueError, KeyError, TypeError):
            ignored += 1
            continue
        if not m or m.group(1) not in exercises or status not in ("passed", "not done", "wrong"):
            ignored += 1
            continue
        reports.append(Report(cell, m.group(1), status, str(entry.get("message", ""))))
    return reports, ignored


def check_cell(nb, chapter: Chapter, ex: str) -> int | None:
    """The cell of ``nb`` that checks exercise ``ex``: the cell with the solution's check cell id
    when it still calls the check, else the first cell that calls it (a chapter may call a check
    again later, e.g. to show what a wrong answer looks like: that one does not count)."""
    call = chapter.check_calls.get(ex)
    if not call:
        return None
    pattern = re.compile(rf"\b{re.escape(call)}\s*\(")
    calling = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and pattern.search(c.source)]
    by_id = [i for i in calling if chapter.check_ids.get(ex) and nb.cells[i].get("id") == chapter.check_ids[ex]]
    return (by_id or calling or [None])[0]


def _strip(nb) -> None:
    """Forget everything the learner's saved run left behind."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = dict(nbgen.KERNELSPEC)


def _flags(nb) -> list[str]:
    flags = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        hits = sorted({s for s in SUSPICIOUS if s in cell.source})
        if hits:
            flags.append(f"cell {i} mentions {', '.join(hits)}")
    return flags


def _errors(nb) -> list[tuple[int, str]]:
    """(cell index, "Name: value") of every cell that ended with an exception."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                value = str(out.get("evalue", "")).strip().split("\n")[0]
                if len(value) > 160:
                    value = value[:157] + "..."
                found.append((i, f"{out.get('ename', 'Error')}: {value}" if value else out.get("ename", "Error")))
                break
    return found


# Environment variables the notebook's process keeps (everything else, such as the instructor's
# tokens, stays out): the locale, the search paths, and the settings of Triton, CUDA and the course.
_ENV_KEPT = re.compile(r"^(PATH|LANG|LANGUAGE|LC_\w+|TZ|PYTHONPATH|PYTHONHASHSEED|VIRTUAL_ENV|"
                       r"CONDA_PREFIX|LD_LIBRARY_PATH|TRITON_\w+|CUDA_\w+|NVIDIA_\w+|COURSE_\w+|"
                       r"OMP_NUM_THREADS|MKL_NUM_THREADS)$")


def _kernel_env(private: Path, log: Path | None, threads: int) -> dict:
    """The notebook's environment: the kept variables, its own home and temporary folders, and
    ``COURSE_GRADE_LOG`` only when the chapter has exercises graded inside it."""
    env = {k: v for k, v in os.environ.items() if _ENV_KEPT.match(k)}
    env.pop("COURSE_STRICT", None)
    env.pop(LOG_ENV, None)
    if log is not None:
        env[LOG_ENV] = str(log)
    # the kernel imports this grader's course_lib, whatever the folder it runs in
    lib_root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([lib_root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    home, tmp = private / "home", private / "tmp"
    for folder in (home, tmp):
        folder.mkdir(exist_ok=True)
    env.update(HOME=str(home), TMPDIR=str(tmp), IPYTHONDIR=str(home / ".ipython"),
               MPLCONFIGDIR=str(home / ".matplotlib"), XDG_CACHE_HOME=str(home / ".cache"),
               XDG_CONFIG_HOME=str(home / ".config"), TRITON_CACHE_DIR=str(home / ".triton"))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # --jobs notebooks share the cores
        env.setdefault(name, str(threads))
    return env


@dataclass
class Settings:
    """How each notebook is run: the limits, the isolation and where the checks come from."""

    timeout: int = 300                     # seconds per cell (and per call of a check)
    notebook_timeout: int = NOTEBOOK_TIMEOUT_S
    isolation: sandbox.Isolation = field(default_factory=lambda: sandbox.Isolation(
        "none", "not chosen"))
    limits: sandbox.Limits = field(default_factory=sandbox.Limits)
    checks_package: str = CHECKS_PACKAGE
    threads: int = 1


@dataclass
class Outcome:
    """What the grader's run of one exercise's check found."""

    status: str
    message: str


# How much of a notebook's outputs the grader keeps (the executed notebook is for reading the
# learner's messages; a cell printing in a loop must not fill the grader's memory), and of one
# error (its message and traceback).
OUTPUT_LIMIT_CHARS = 8 * 2**20
ERROR_LIMIT_CHARS = 8192
LAST_WORDS_BYTES = 65536  # the end of a dead kernel's stderr that is read for its last words


def _bounded_client_class():
    """nbclient's NotebookClient, keeping at most :data:`OUTPUT_LIMIT_CHARS` of a notebook's
    outputs (then one line saying so) and every error, shortened."""
    import nbformat
    from nbclient import NotebookClient

    class BoundedClient(NotebookClient):
        def output(self, outs, msg, display_id, cell_index):
            content = msg.get("content", {})
            if msg.get("msg_type") == "error":  # kept: the rows quote it
                content["evalue"] = str(content.get("evalue", ""))[:ERROR_LIMIT_CHARS]
                content["traceback"] = [str(line)[:ERROR_LIMIT_CHARS]
                                        for line in content.get("traceback", [])[-20:]]
                return super().output(outs, msg, display_id, cell_index)
            kept = getattr(self, "_kept_chars", 0) + len(str(content))
            self._kept_chars = kept
            if kept > OUTPUT_LIMIT_CHARS:
                if not getattr(self, "_said_truncated", False):
                    self._said_truncated = True
                    outs.append(nbformat.v4.new_output("stream", name="stderr", text=(
                        f"[the grader keeps the first {OUTPUT_LIMIT_CHARS} characters of a "
                        f"notebook's outputs; the rest were dropped]\n")))
                return None
            return super().output(outs, msg, display_id, cell_index)

    return BoundedClient


def _kernel_manager(settings: Settings, private: Path, inbox: Path):
    """A kernel manager whose kernel starts in the sandbox (``inbox`` read-only there), talking
    over Unix sockets in ``private`` (a network-less sandbox has no TCP to the grader)."""
    from jupyter_client.manager import AsyncKernelManager

    class SandboxedKernelManager(AsyncKernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)
            return settings.isolation.command(cmd, private, settings.limits, [inbox])

    return SandboxedKernelManager(kernel_name="python3", transport="ipc",
                                  ip=str(private / "ipc"),
                                  connection_file=str(private / "kernel.json"))


def grade_notebook(sub: Submission, chapter: Chapter, settings: Settings,
                   executed_dir: Path | None = None) -> Result:
    """Run one learner notebook in a fresh (sandboxed) kernel and grade each exercise in this
    process, just before its check cell runs (just after, when that cell defines the answer)."""
    import nbformat
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    start = time.perf_counter()
    name = sub.name
    exercises = chapter.exercises
    rows = lambda status_of: [Row(sub.learner, sub.chapter, name, ex, *status_of(ex)) for ex in exercises]
    try:
        nb = nbformat.read(str(sub.path), as_version=4)
    except Exception as exc:  # a corrupt file is a row per exercise, not a crash of the grader
        msg = f"the notebook could not be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return Result(sub.learner, sub.chapter, name, rows(lambda ex: ("not run", msg)),
                      seconds=time.perf_counter() - start)
    _strip(nb)
    flags = _flags(nb)
    stopped = None  # why the run ended early: "cell 12 ran past the 300 s limit", ...
    checking = {ex: check_cell(nb, chapter, ex) for ex in exercises}
    isolated = [ex for ex in exercises if _isolable(chapter, ex)]
    due: dict[int, list[str]] = {}  # cell index -> the exercises graded just before it runs
    for ex in isolated:
        if checking[ex] is not None:
            due.setdefault(checking[ex], []).append(ex)
    outcomes: dict[str, Outcome] = {}
    deadline = time.monotonic() + settings.notebook_timeout
    with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
        private = Path(tmp) / "sandbox"  # the one folder the notebook's process may write
        (private / "work").mkdir(parents=True)
        # the grader's requests (read-only in the sandbox) and the notebook's answers
        inbox, outbox = private / "inbox", private / "outbox"
        inbox.mkdir()
        outbox.mkdir()
        inside = len(isolated) < len(exercises)  # some exercises report from inside the notebook
        log = private / "grade_log.jsonl"
        log.write_text("", encoding="utf-8")
        kernel_err = Path(tmp) / "kernel_stderr.txt"
        running = [0]  # the index of the cell sent to the kernel last
        starts: list[tuple[int, int]] = []  # (cell index, size of the log when it started)

        def on_cell_execute(cell, cell_index, **_):
            running[0] = cell_index
            try:
                size = log.stat().st_size
            except OSError:  # the notebook removed it: it only harms its own inside reports
                size = 0
            starts.append((cell_index, size))

        def grade_at(index: int, session) -> None:
            for ex in due.get(index, []):
                if ex not in outcomes and not session.gone:
                    outcome = _grade_exercise(session, chapter, ex, settings)
                    if outcome is not None:
                        outcomes[ex] = outcome

        km = _kernel_manager(settings, private, inbox)
        client = _bounded_client_class()(nb, km=km, timeout=settings.timeout, allow_errors=True,
                                kernel_name="python3", record_timing=False,
                                resources={"metadata": {"path": str(private / "work")}},
                                on_cell_execute=on_cell_execute)
        client.reset_execution_trackers()
        try:
            with open(kernel_err, "w", encoding="utf-8") as err, \
                    client.setup_kernel(env=_kernel_env(private, log if inside else None,
                                                        settings.threads),
                                        stderr=err, stdout=subprocess.DEVNULL, cleanup_kc=True):
                with _session(km, inbox, outbox, settings.timeout) as session:
                    for index, cell in enumerate(nb.cells):
                        grade_at(index, session)  # on what the check cell is about to hand over
                        if session.gone:
                            stopped = f"{session.gone} (while the grader ran a check, before cell {index})"
                            break
                        left = deadline - time.monotonic()
                        if left <= 0:
                            stopped = (f"the notebook ran past its limit of "
                                       f"{settings.notebook_timeout} s (before cell {index})")
                            break
                        client.timeout = int(max(1, min(settings.timeout, left)))
                        client.execute_cell(cell, index,
                                            execution_count=client.code_cells_executed + 1)
                        grade_at(index, session)  # a check cell that defined the answer itself
        except CellTimeoutError:
            limit = client.timeout
            stopped = (f"cell {running[0]} ran past the {limit} s limit per cell"
                       if limit >= settings.timeout else
                       f"the notebook ran past its limit of {settings.notebook_timeout} s at "
                       f"cell {running[0]}")
        except DeadKernelError:
            stopped = f"the Python process running the notebook died at cell {running[0]}"
            last = _last_words(kernel_err)
            stopped += f" (its last words: {last})" if last else ""
        except Exception as exc:  # the kernel could not start, ...
            stopped = f"the run stopped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        reports, ignored = read_log(log, exercises, starts) if inside else ([], 0)
    if ignored:
        flags.append(f"{ignored} line(s) of the log ignored: not a report on an exercise of "
                     f"chapter {sub.chapter}")
    # exercises graded inside: only what an exercise's own check cell reported, its last report
    counted = {r.exercise: r for r in reports if r.cell is not None and r.cell == checking[r.exercise]
               and r.exercise not in isolated}
    errors = dict(_errors(nb))

    def status_of(ex: str) -> tuple[str, str]:
        if ex in outcomes:
            return outcomes[ex].status, outcomes[ex].message
        mark = "" if ex in isolated else f"{NOT_ISOLATED_MARK} ({_why_not_isolated(chapter, ex)}): "
        if ex in counted:
            return counted[ex].status, mark + counted[ex].message
        return "not run", mark + "its check never reported: " + _why_not_run(
            nb, checking[ex], chapter.check_calls.get(ex), errors, stopped,
            running[0] if stopped else None)

    graded = rows(status_of)
    for row in graded:
        if row.exercise not in isolated:
            flags.append(f"Exercise {row.exercise} graded inside the notebook's process "
                         f"({NOT_ISOLATED_MARK})")
    if executed_dir is not None:
        out = Path(executed_dir) / sub.learner / name
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(out))
    return Result(sub.learner, sub.chapter, name, graded, flags,
                  seconds=time.perf_counter() - start)


def _isolable(chapter: Chapter, ex: str) -> bool:
    return ex not in NOT_ISOLATED and bool(chapter.check_calls.get(ex)) and \
        chapter.check_args.get(ex) is not None


def _why_not_isolated(chapter: Chapter, ex: str) -> str:
    if ex in NOT_ISOLATED:
        return NOT_ISOLATED[ex]
    return "its check cell passes more than plain names to the check"


@contextlib.contextmanager
def _session(km, inbox: Path, outbox: Path, time_limit: float):
    """A :class:`~course_lib.teaching.grade_channel.Session` to the kernel ``km`` started."""
    from jupyter_client.blocking import BlockingKernelClient

    from course_lib.teaching import grade_channel

    client = BlockingKernelClient()
    client.load_connection_info(km.get_connection_info())
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=True)

    def alive() -> bool:
        process = getattr(km.provisioner, "process", None)
        return process is not None and process.poll() is None

    def kill(reason: str) -> None:
        process = getattr(km.provisioner, "process", None)
        if process is not None and process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, 9)
            with contextlib.suppress(OSError):
                process.kill()

    try:
        yield grade_channel.Session(client, inbox, outbox, alive, kill, time_limit)
    finally:
        client.stop_channels()


def _check_function(chapter: Chapter, ex: str, package: str):
    """The check of exercise ``ex``, imported in this process (``ch03.check_merge`` ->
    ``course_lib.teaching.exercises.ch03.check_merge``)."""
    module, _, attr = chapter.check_calls[ex].partition(".")
    return getattr(importlib.import_module(f"{package}.{module}"), attr)


def _grade_exercise(session, chapter: Chapter, ex: str, settings: Settings) -> Outcome | None:
    """Run exercise ``ex``'s check here on proxies for the learner's answer; None when the
    answer is not there to grade (not defined, or the process is gone: the rows say why)."""
    from course_lib.teaching import checks, grade_channel

    names = chapter.check_args[ex]
    session.misuse = session.overtime = None  # what they say is about this exercise's check
    try:
        check = _check_function(chapter, ex, settings.checks_package)
    except (ImportError, AttributeError) as exc:
        return Outcome("not run", f"the grader has no check `{chapter.check_calls[ex]}` "
                                  f"({type(exc).__name__}: {exc})")
    try:
        objects, values = session.describe(ex, names)
    except grade_channel.LearnerProcessGone:
        return None
    except (grade_channel.ChannelError, checks.TimeLimitExceeded) as exc:
        why = str(exc) or "it did not answer in time"
        return Outcome("not run", f"the grader could not look up your answer in the notebook's "
                                  f"process: {why}")
    if any(n not in objects for n in names):
        return None  # the check cell raises NameError: the row says which cells raised before
    args = [grade_channel.proxy_for(session, ex, n, objects[n], values) for n in names]
    library = any(objects[n].get("library") for n in names)
    with tempfile.TemporaryDirectory(prefix="course-check-") as tmp:
        log = Path(tmp) / "report.jsonl"
        saved = {k: os.environ.pop(k, None) for k in (LOG_ENV, "COURSE_STRICT")}
        os.environ[LOG_ENV] = str(log)
        problem = None
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                    checks.library_answers_allowed(not library):
                check(*args)
        except checks.ExerciseFailed:
            pass  # reported
        except (grade_channel.NotIsolable, grade_channel.LearnerProcessGone):
            pass  # the session knows
        except Exception as exc:  # noqa: BLE001 - the check itself failed: the row says how
            problem = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            os.environ.pop(LOG_ENV, None)
            os.environ.update({k: v for k, v in saved.items() if v is not None})
        reports, _ = read_log(log, [ex])
    if session.gone:
        return Outcome("not run", f"{session.gone} while the check ran your answer")
    if session.misuse:
        return Outcome("not run", f"the grader cannot run this check outside the notebook: "
                                  f"{session.misuse}")
    if reports:
        message = reports[-1].message
        if session.overtime:  # the grader stopped the call, before the check's own limit
            message = re.sub(r"stopped after [\d.]+ s", f"stopped after {session.overtime:g} s "
                             f"(the grader's limit per call, --timeout)", message, count=1)
        return Outcome(reports[-1].status, message)
    return Outcome("not run", f"the check did not report ({problem or 'no outcome'})")


def _why_not_run(nb, cell: int | None, call: str | None, errors: dict[int, str],
                 stopped: str | None, stopped_at: int | None = None) -> str:
    """Why the check cell ``cell`` never reported, from the executed notebook: it raised, the run
    stopped before it or while it ran, or the notebook has no cell calling the check."""
    if cell is None:
        what = f"no cell calls `{call}(...)`" if call else "its check cell is missing"
        return what + (f"; {stopped}" if stopped else "")
    if stopped and stopped_at == cell:
        return f"{stopped}, its check cell"
    if nb.cells[cell].get("execution_count") is None:
        return f"{stopped} (before its check cell, cell {cell})" if stopped else \
            f"its check cell (cell {cell}) never ran"
    if cell in errors:
        # the cells that raised between the previous check cell (or the start) and this one
        prev = max([i for i, c in enumerate(nb.cells[:cell]) if c.cell_type == "code"
                    and nbgen.CHECK_CALL_RE.search(c.source)] or [-1])
        near = [f"cell {i} raised {e}" for i, e in sorted(errors.items()) if prev < i < cell][-2:]
        return f"its check cell (cell {cell}) raised {errors[cell]}" + \
            (f" (before it, {'; '.join(near)})" if near else "")
    return f"its check cell (cell {cell}) ran, but the check did not report" + \
        (f"; {stopped}" if stopped else "")


def _last_words(path: Path) -> str:
    """What a dead kernel wrote on stderr outside the notebook's cells (ipykernel sends a cell's
    stderr to its output): a "Fatal Python error" line if any, else the last line, ignoring
    ipykernel's start-up warnings. Only the file's end is read (the notebook could fill it)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LAST_WORDS_BYTES))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    lines = [l.strip() for l in lines if l.strip() and "[IPKernelApp]" not in l]
    fatal = [l for l in lines if l.startswith("Fatal Python error")]
    return (fatal or lines[-1:] or [""])[0][:200]


def write_results(results: list[Result], out: Path, warnings: list[str],
                  isolation: str = "") -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for res in results for r in res.rows]
    rows.sort(key=lambda r: (r.learner, r.chapter, exercise_key(r.exercise)))
    with open(out / "grades.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
    learners: dict[str, dict] = {}
    for res in sorted(results, key=lambda r: (r.learner, r.chapter)):
        entry = learners.setdefault(res.learner, {"notebooks": [], "flags": [],
                                                  **{s: 0 for s in STATUSES}, "exercises": 0})
        entry["notebooks"].append(res.notebook)
        entry["flags"] += [f"{res.notebook}: {f}" for f in res.flags]
        for r in res.rows:
            entry[r.status] += 1
            entry["exercises"] += 1
    with open(out / "summary.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["learner", "notebooks", *STATUSES, "exercises", "flags"])
        for learner, e in learners.items():
            w.writerow([learner, " ".join(e["notebooks"]), *(e[s] for s in STATUSES),
                        e["exercises"], "; ".join(e["flags"])])
    data = {"rows": [asdict(r) for r in rows], "learners": learners, "warnings": warnings,
            "isolation": isolation,
            "seconds": {f"{r.learner}/{r.notebook}": round(r.seconds, 1) for r in results}}
    (out / "grades.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
    return data


def table(rows: list[dict]) -> str:
    """A learner × exercise grid: ✓ passed, ✗ wrong, – not done, · not run."""
    exercises = sorted({r["exercise"] for r in rows}, key=exercise_key)
    learners = sorted({r["learner"] for r in rows})
    cell = {(r["learner"], r["exercise"]): SYMBOLS[r["status"]] for r in rows}
    width = max([len(x) for x in learners] + [7])
    lines = [f"{'learner':<{width}}  " + " ".join(f"{e:>4}" for e in exercises) + "  passed"]
    for learner in learners:
        marks = [cell.get((learner, e), " ") for e in exercises]
        n = sum(1 for e in exercises if (learner, e) in cell)
        ok = sum(1 for m in marks if m == SYMBOLS["passed"])
        lines.append(f"{learner:<{width}}  " + " ".join(f"{m:>4}" for m in marks) + f"  {ok}/{n}")
    lines.append("✓ passed  ✗ wrong  – not done  · not run (blank: notebook not submitted)")
    return "\n".join(lines)


def _grade_one(args):
    sub, chapter, settings, executed = args
    return grade_notebook(sub, chapter, settings, executed)


def _not_graded(sub: Submission, chapter: Chapter, why: str) -> Result:
    """Rows for a notebook whose grading process itself died."""
    return Result(sub.learner, sub.chapter, sub.name,
                  [Row(sub.learner, sub.chapter, sub.name, ex, "not run", why)
                   for ex in chapter.exercises])


def _grade_in_pool(work: list, jobs: int, log) -> list[Result]:
    """Grade ``work`` in ``jobs`` processes. A process that dies (it should not: the learner's
    code runs in the kernel's process, not here) costs only the notebooks it was grading: they
    are tried once more, alone, and then get rows saying so."""
    results: dict[int, Result] = {}
    pending = list(range(len(work)))
    for attempt in range(2):
        workers = jobs if attempt == 0 else 1
        broken = []
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(_grade_one, work[i]): i for i in pending}
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                try:
                    results[i] = future.result()
                    log(f"graded {work[i][0].learner}/{work[i][0].name} "
                        f"({results[i].seconds:.0f} s)")
                except BrokenProcessPool:
                    broken.append(i)
        pending = sorted(broken)
        if not pending:
            break
    for i in pending:
        sub, chapter = work[i][0], work[i][1]
        results[i] = _not_graded(sub, chapter, "the grader's own process died while grading "
                                               "this notebook (twice)")
        log(f"not graded: {sub.learner}/{sub.name} (the grading process died)")
    return [results[i] for i in range(len(work))]


def grade(submissions: Path, out: Path, solutions: Path, timeout: int = 300, jobs: int = 1,
          log=print, isolation: str = "auto", memory_gib: float | None = None,
          notebook_timeout: int = NOTEBOOK_TIMEOUT_S, hide: list[Path] = (),
          checks_package: str = CHECKS_PACKAGE) -> dict:
    """Grade every notebook in ``submissions``; write the results to ``out`` (see the module
    docstring) and return them as grades.json holds them."""
    chapters = chapter_exercises(solutions)
    subs, warnings = find_submissions(submissions, chapters)
    for w in warnings:
        log(f"warning: {w}")
    if not subs:
        raise GradeError(f"{submissions}: no learner notebooks found (expected "
                         f"<learner>/NN_name.ipynb or <learner>{FLAT_SEPARATOR}NN_name.ipynb)")
    course = Path(__file__).resolve().parent.parent.parent
    Path(out).mkdir(parents=True, exist_ok=True)  # hidden from the notebooks: it must exist
    hidden = [Path(solutions), course / "solutions", course / ".git", Path(submissions),
              Path(out), *map(Path, hide)]
    try:
        chosen = sandbox.detect(isolation, hidden)
    except sandbox.SandboxError as exc:
        raise GradeError(str(exc)) from None
    limits = sandbox.Limits(
        memory_bytes=int((memory_gib or sandbox.DEFAULT_MEMORY_BYTES / sandbox.GIB) * sandbox.GIB),
        cpu_s=notebook_timeout * CPU_PER_WALL, processes=sandbox.default_process_limit())
    settings = Settings(timeout, notebook_timeout, chosen, limits, checks_package,
                        threads=max(1, (os.cpu_count() or 1) // max(1, jobs)))
    log(chosen.line(limits))
    executed = Path(out) / "executed"
    work = [(s, chapters[s.chapter], settings, executed) for s in subs]
    if jobs <= 1:
        results = []
        for item in work:
            log(f"grading {item[0].learner}/{item[0].name} ...")
            results.append(_grade_one(item))
    else:
        results = _grade_in_pool(work, jobs, log)
    data = write_results(results, out, warnings, chosen.line(limits))
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,  # "--check" must not silently mean --checks-package
        prog="python -m course_lib.teaching.grade",
        description="Execute learner notebooks and grade every exercise (see the module docstring).")
    parser.add_argument("submissions", type=Path,
                        help="folder of <learner>/NN_name.ipynb or <learner>__NN_name.ipynb")
    parser.add_argument("--out", type=Path, required=True, help="folder for grades.csv, grades.json, ...")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds allowed per cell and per call of a check (default 300)")
    parser.add_argument("--notebook-timeout", type=int, default=NOTEBOOK_TIMEOUT_S,
                        help=f"seconds allowed per notebook (default {NOTEBOOK_TIMEOUT_S})")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at once (default 1)")
    parser.add_argument("--isolation", choices=sandbox.MODES, default="auto",
                        help="auto: bubblewrap where it works, else none (said so); bubblewrap: "
                             "refuse to grade without it; none: no sandbox (default auto)")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help=f"address space per notebook in GiB (default "
                             f"{sandbox.DEFAULT_MEMORY_BYTES / sandbox.GIB:g})")
    parser.add_argument("--hide", type=Path, action="append", default=[],
                        help="a folder the notebooks must not see (repeatable; solutions/, .git, "
                             "the submissions and --out are always hidden)")
    parser.add_argument("--solutions", type=Path, default=nbgen.ROOT / "solutions",
                        help="where the chapters' exercise lists are read (default: the course's solutions/)")
    parser.add_argument("--checks-package", default=CHECKS_PACKAGE,
                        help=f"the package the chapters' checks chNN are imported from (default "
                             f"{CHECKS_PACKAGE})")
    args = parser.parse_args(argv)
    for name in ("timeout", "notebook_timeout", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive number, got "
                         f"{getattr(args, name)}")
    if args.memory_gib is not None and args.memory_gib <= 0:
        parser.error(f"--memory-gib: expected a positive number, got {args.memory_gib}")
    try:
        data = grade(args.submissions, args.out, args.solutions, args.timeout, args.jobs,
                     isolation=args.isolation, memory_gib=args.memory_gib,
                     notebook_timeout=args.notebook_timeout, hide=args.hide,
                     checks_package=args.checks_package)
    except (GradeError, nbgen.NotebookError) as exc:
        print(f"grade: error: {exc}", file=sys.stderr)
        return 2
    print(table(data["rows"]))
    for learner, e in data["learners"].items():
        for flag in e["flags"]:
            print(f"flag: {learner}: {flag}")
    print(f"wrote {args.out / 'grades.csv'}, grades.json, summary.csv and executed/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
