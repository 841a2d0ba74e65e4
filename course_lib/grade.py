"""Grade a folder of learner notebooks: one row per learner per exercise.

Layout of ``SUBMISSIONS`` (both may be mixed)::

    SUBMISSIONS/alice/03_online_softmax.ipynb      # one folder per learner
    SUBMISSIONS/bob__03_online_softmax.ipynb       # or flat files: <learner>__<notebook>

A notebook's chapter is the two digits its file name starts with (``03_...``; a copy named
``03_online_softmax-Copy1.ipynb`` still counts as chapter 03). The chapter's exercises are read from
``solutions/NN_*.ipynb`` (each code cell with ``### BEGIN SOLUTION`` names one, ``# Exercise N.M:``).

For each notebook the grader

1. drops every output the learner saved (they are never trusted) and ignores its kernel choice;
2. runs it top to bottom in a fresh kernel (nbclient, errors allowed so one broken cell does not
   sink the rest, a time limit per cell), in an empty working folder, with
   ``COURSE_GRADE_LOG`` naming a log file the grader created: every check appends one JSON line
   ``{"exercise", "status", "message"}`` to it. ``COURSE_STRICT`` is removed from the kernel's
   environment: an unfinished exercise is already its own row;
3. reads the log: a report counts only when it names an exercise of *that* chapter and was
   written while that exercise's check cell ran (the cell with the solution's check cell id, else
   the first cell calling the check; a later call, such as chapter 00's demonstration of a wrong
   answer, does not count); when the check cell reports more than once, the last report counts.

Each exercise of the chapter gets one row with status ``passed``, ``not done``, ``wrong`` (the
message is the check's diagnosis) or ``not run``: its check never reported, and the message says
why — its check cell raised before checking (and which cells raised before it), the run stopped
before it (the kernel died, or a cell ran past the time limit), or no cell calls it.

Output in ``--out``: ``grades.csv`` and ``grades.json`` (the rows), ``summary.csv`` (one line per
learner), and ``executed/<learner>/<notebook>`` (the notebooks as the grader ran them, to read
the diagnoses in context).

Limits: the learner's code runs in the same Python process as the checks, so this is not a
sandbox. Run submissions in a container or a VM; a notebook whose code mentions the grading log
or patches the checks is named in the ``flags`` column of ``summary.csv``.

Usage::

    python -m course_lib.grade SUBMISSIONS --out RESULTS_DIR [--timeout 300] [--jobs 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course_lib import nbgen

STATUSES = ("passed", "not done", "wrong", "not run")
SYMBOLS = {"passed": "✓", "not done": "–", "wrong": "✗", "not run": "·"}
CHAPTER_RE = re.compile(r"^(\d\d)_")
EXERCISE_ID_RE = nbgen.EXERCISE_ID_RE
FLAT_SEPARATOR = "__"
LOG_ENV = "COURSE_GRADE_LOG"
# Code in a submission that reaches for the grading machinery instead of answering an exercise.
SUSPICIOUS = ("COURSE_GRADE_LOG", "GRADE_LOG", "checks.report", "checks.passed", "checks.not_done",
              "checks.failed_with", "learner_check", "_LIBRARY_ANSWER", "is_library_object")
CSV_COLUMNS = ["learner", "chapter", "notebook", "exercise", "status", "message"]


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


def chapter_exercises(solutions: Path) -> dict[str, Chapter]:
    """Each chapter's exercises and check calls, read from the solution notebooks: every code cell
    holding a solution block names its exercise, and the next cell calling a check checks it."""
    chapters = {}
    for path in sorted(Path(solutions).glob("*.ipynb")):
        m = CHAPTER_RE.match(path.name)
        if not m:
            continue
        nb = nbgen.load_notebook(path)
        calls, ids = {}, {}
        for ex, _, check in nbgen.exercise_cells(nb):
            src = nbgen._source(nb["cells"][check]) if check is not None else ""
            call = nbgen.CHECK_CALL_RE.search(src)
            calls.setdefault(ex, call.group(1) if call else "")
            if check is not None and nb["cells"][check].get("id"):
                ids.setdefault(ex, nb["cells"][check]["id"])
        chapters[m.group(1)] = Chapter(path.name, sorted(calls, key=exercise_key), calls, ids)
    if not chapters:
        raise GradeError(f"{solutions}: no solution notebooks (NN_name.ipynb) to read the "
                         f"exercises from")
    return chapters


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


def _kernel_env(log: Path) -> dict:
    env = dict(os.environ)
    env.pop("COURSE_STRICT", None)
    env[LOG_ENV] = str(log)
    # the kernel checks with this grader's course_lib, whatever the folder it runs in
    lib_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([lib_root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return env


def grade_notebook(sub: Submission, chapter: Chapter, timeout: int,
                   executed_dir: Path | None = None) -> Result:
    """Run one learner notebook in a fresh kernel and turn its checks' reports into rows."""
    import nbformat
    from nbclient import NotebookClient
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
    with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
        log = Path(tmp) / "grade_log.jsonl"
        log.write_text("", encoding="utf-8")
        workdir = Path(tmp) / "work"
        workdir.mkdir()
        kernel_err = Path(tmp) / "kernel_stderr.txt"
        running = [0]  # the index of the cell sent to the kernel last
        starts: list[tuple[int, int]] = []  # (cell index, size of the log when it started)

        def on_cell_execute(cell, cell_index, **_):
            running[0] = cell_index
            starts.append((cell_index, log.stat().st_size))

        client = NotebookClient(nb, timeout=timeout, allow_errors=True, kernel_name="python3",
                                record_timing=False, resources={"metadata": {"path": str(workdir)}},
                                on_cell_execute=on_cell_execute)
        try:
            with open(kernel_err, "w", encoding="utf-8") as err:
                client.execute(env=_kernel_env(log), stderr=err)
        except CellTimeoutError:
            stopped = f"cell {running[0]} ran past the {timeout} s limit per cell"
        except DeadKernelError:
            stopped = f"the Python process running the notebook died at cell {running[0]}"
            last = _last_words(kernel_err)
            stopped += f" (its last words: {last})" if last else ""
        except Exception as exc:  # the kernel could not start, ...
            stopped = f"the run stopped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        reports, ignored = read_log(log, exercises, starts)
    if ignored:
        flags.append(f"{ignored} line(s) of the log ignored: not a report on an exercise of "
                     f"chapter {sub.chapter}")
    # only what an exercise's own check cell reported counts, and its last report
    checking = {ex: check_cell(nb, chapter, ex) for ex in exercises}
    counted = {r.exercise: r for r in reports if r.cell is not None and r.cell == checking[r.exercise]}
    for r in reports:
        if r.status == "passed" and r.cell != checking[r.exercise]:
            flags.append(f"cell {r.cell} reported Exercise {r.exercise} passed, but it is not that "
                         f"exercise's check cell (ignored)")
    errors = dict(_errors(nb))

    def status_of(ex: str) -> tuple[str, str]:
        if ex in counted:
            return counted[ex].status, counted[ex].message
        return "not run", "its check never reported: " + _why_not_run(
            nb, checking[ex], chapter.check_calls.get(ex), errors, stopped,
            running[0] if stopped else None)

    if executed_dir is not None:
        out = Path(executed_dir) / sub.learner / name
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(out))
    return Result(sub.learner, sub.chapter, name, rows(status_of), flags,
                  seconds=time.perf_counter() - start)


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
    ipykernel's start-up warnings."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    lines = [l.strip() for l in lines if l.strip() and "[IPKernelApp]" not in l]
    fatal = [l for l in lines if l.startswith("Fatal Python error")]
    return (fatal or lines[-1:] or [""])[0][:200]


def write_results(results: list[Result], out: Path, warnings: list[str]) -> dict:
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
    sub, chapter, timeout, executed = args
    return grade_notebook(sub, chapter, timeout, executed)


def grade(submissions: Path, out: Path, solutions: Path, timeout: int = 300, jobs: int = 1,
          log=print) -> dict:
    chapters = chapter_exercises(solutions)
    subs, warnings = find_submissions(submissions, chapters)
    for w in warnings:
        log(f"warning: {w}")
    if not subs:
        raise GradeError(f"{submissions}: no learner notebooks found (expected "
                         f"<learner>/NN_name.ipynb or <learner>{FLAT_SEPARATOR}NN_name.ipynb)")
    executed = Path(out) / "executed"
    work = [(s, chapters[s.chapter], timeout, executed) for s in subs]
    results = []
    if jobs <= 1:
        for item in work:
            log(f"grading {item[0].learner}/{item[0].name} ...")
            results.append(_grade_one(item))
    else:
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
            for item, res in zip(work, pool.map(_grade_one, work)):
                log(f"graded {item[0].learner}/{item[0].name} ({res.seconds:.0f} s)")
                results.append(res)
    return write_results(results, out, warnings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.grade",
        description="Execute learner notebooks and grade every exercise (see the module docstring).")
    parser.add_argument("submissions", type=Path,
                        help="folder of <learner>/NN_name.ipynb or <learner>__NN_name.ipynb")
    parser.add_argument("--out", type=Path, required=True, help="folder for grades.csv, grades.json, ...")
    parser.add_argument("--timeout", type=int, default=300, help="seconds allowed per cell (default 300)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at once (default 1)")
    parser.add_argument("--solutions", type=Path, default=nbgen.ROOT / "solutions",
                        help="where the chapters' exercise lists are read (default: the course's solutions/)")
    args = parser.parse_args(argv)
    try:
        data = grade(args.submissions, args.out, args.solutions, args.timeout, max(1, args.jobs))
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
