"""Generate a class of 30 chapter-10 submissions and grade it as an instructor would.

The class: 8 finished notebooks (the solution), 6 half-finished (the learner notebook with 10.1,
or 10.1 and 10.2, filled in), 2 untouched, 8 with one classic mistake each, and 6 hostile ones
(a patched check, a forged log with a fake ✓, a copy of the solutions attempted, a cell that
never ends, memory exhausted, the process killed). Every learner's expected row is known; the
tool grades the class with ``python -m course_lib.teaching.grade --jobs N``, compares, and prints the
time per notebook.

Usage::

    python tools/grade_class_demo.py [--out DIR] [--jobs 2] [--timeout 60]

Exit status 0 when every row is as expected, 1 otherwise (the mismatches are printed).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "10_masks_in_triton.ipynb"
LEARNER = ROOT / "notebooks" / "10_masks_in_triton.ipynb"
EXERCISES = ("10.1", "10.2", "10.3")
DONE, NOT_DONE, WRONG, NOT_RUN = "passed", "not done", "wrong", "not run"


def _read(path: Path):
    return nbformat.read(str(path), as_version=4)


def _exercise_cell(nb, exercise: str) -> int:
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and f"# Exercise {exercise}:" in cell.source:
            return i
    raise ValueError(f"no exercise {exercise} in the notebook")


def _check_cell(nb, exercise: str) -> int:
    for i in range(_exercise_cell(nb, exercise) + 1, len(nb.cells)):
        if nb.cells[i].cell_type == "code" and ".check_" in nb.cells[i].source:
            return i
    raise ValueError(f"no check cell for exercise {exercise}")


def _mistake(exercise: str, old: str, new: str):
    """The solution with ``old`` replaced by ``new`` in exercise ``exercise``'s cell."""
    def build():
        nb = _read(SOLUTION)
        cell = nb.cells[_exercise_cell(nb, exercise)]
        if old not in cell.source:
            raise ValueError(f"exercise {exercise}: {old!r} is not in the solution")
        cell.source = cell.source.replace(old, new, 1)
        return nb
    return build


def _half(done: tuple[str, ...]):
    """The learner notebook with the exercises ``done`` filled in from the solution."""
    def build():
        nb, sol = _read(LEARNER), _read(SOLUTION)
        for exercise in done:
            nb.cells[_exercise_cell(nb, exercise)].source = \
                sol.cells[_exercise_cell(sol, exercise)].source
        return nb
    return build


def _before_check(exercise: str, source: str, base=lambda: _read(SOLUTION), stub=()):
    """``base`` with a cell of ``source`` before exercise ``exercise``'s check cell, and the
    exercises ``stub`` left as the learner notebook has them."""
    def build():
        nb, learner = base(), _read(LEARNER)
        for ex in stub:
            nb.cells[_exercise_cell(nb, ex)].source = learner.cells[_exercise_cell(learner, ex)].source
        nb.cells.insert(_check_cell(nb, exercise), new_code_cell(source))
        return nb
    return build


PATCH_CHECK = """\
import json, os, sys
mod = sys.modules['course_lib.teaching.exercises.ch' + '10']
log = os.environ.get('COURSE_' + 'GRA' + 'DE_LOG', os.path.join(os.getcwd(), 'log.jsonl'))
def fake(kernel, *a, **k):
    with open(log, 'a') as f:
        f.write(json.dumps({'exercise': 'Exercise 10.3', 'status': 'passed', 'message': 'forged'}) + '\\n')
    print('✓ Exercise 10.3: passed (4 cases).')
    return kernel
setattr(mod, 'check_block' + '_sparse_kernel', fake)
"""
FORGE_LOG = """\
import json, os
with open(os.environ.get('COURSE_GRADE_LOG', 'log.jsonl'), 'a') as f:
    f.write(json.dumps({'exercise': 'Exercise 10.1', 'status': 'passed', 'message': 'forged'}) + '\\n')
print('✓ Exercise 10.1: passed (7 cases).')
"""
COPY_SOLUTIONS = f"""\
import json
try:
    sol = json.load(open({str(SOLUTION)!r}))
    exec(next(''.join(c['source']) for c in sol['cells'] if '# Exercise 10.3:' in ''.join(c['source'])))
except OSError as exc:
    print('the solutions are out of reach:', type(exc).__name__)
"""

# (learner, how the notebook is made, expected status of 10.1, 10.2, 10.3)
CLASS = (
    [(f"finished{i}", lambda: _read(SOLUTION), (DONE, DONE, DONE)) for i in range(1, 9)]
    + [(f"half{i}", _half(("10.1",)), (DONE, NOT_DONE, NOT_DONE)) for i in range(1, 4)]
    + [(f"most{i}", _half(("10.1", "10.2")), (DONE, DONE, NOT_DONE)) for i in range(1, 4)]
    + [(f"untouched{i}", lambda: _read(LEARNER), (NOT_DONE,) * 3) for i in range(1, 3)]
    + [
        ("partial_flag", _mistake("10.1", "kv_partial[i, slot] = not tile.all()",
                                  "kv_partial[i, slot] = False"), (WRONG, DONE, DONE)),
        ("crashing_lists", _mistake("10.1", "n_q, n_k = mask.shape", "n_q, n_k = mask.shape[2]"),
         (WRONG, DONE, DONE)),
        ("gqa_modulo", _mistake("10.2", "kv_h = h // (n_heads // n_kv_heads)",
                                "kv_h = h % n_kv_heads"), (DONE, WRONG, DONE)),
        ("k_from_start", _mistake("10.2", "k_base = K + start * stride_kt + kv_h * stride_kh",
                                  "k_base = K + kv_h * stride_kh"), (DONE, WRONG, DONE)),
        ("no_rescale", _mistake("10.3", "acc = acc * alpha[:, None] + tl.dot",
                                "acc = acc + tl.dot"), (DONE, DONE, WRONG)),
        ("lse_log2", _mistake("10.3", "lse = (m_i + tl.math.log2(l_i)) * LN_2",
                              "lse = m_i + tl.math.log2(l_i)"), (DONE, DONE, WRONG)),
        ("mask_unapplied", _mistake("10.3", "s = tl.where(visible != 0, s, float(\"-inf\"))",
                                    "s = s"), (DONE, DONE, WRONG)),
        ("unmasked_keys", _mistake("10.3", "k = tl.load(K + h * stride_kh + keys[:, None] * "
                                           "stride_kn + offs_d[None, :] * stride_kd,\n"
                                           "                    mask=keys[:, None] < n_k, other=0.0)",
                                   "k = tl.load(K + h * stride_kh + keys[:, None] * stride_kn + "
                                   "offs_d[None, :] * stride_kd)"), (DONE, DONE, WRONG)),
        ("patched_check", _before_check("10.3", PATCH_CHECK, stub=("10.3",)),
         (DONE, DONE, NOT_DONE)),
        ("forged_log", _before_check("10.1", FORGE_LOG, base=_mistake(
            "10.1", "kv_partial[i, slot] = not tile.all()", "kv_partial[i, slot] = False")),
         (WRONG, DONE, DONE)),
        ("copier", _before_check("10.3", COPY_SOLUTIONS, stub=("10.3",)), (DONE, DONE, NOT_DONE)),
        ("endless_cell", _before_check("10.3", "while True:\n    pass"), (DONE, DONE, NOT_RUN)),
        ("memory_hog", _mistake("10.1", "n_q, n_k = mask.shape",
                                "hoard = np.ones(2**31)  # 16 GiB\n    n_q, n_k = mask.shape"),
         (WRONG, DONE, DONE)),
        ("suicide", _before_check("10.2", "import os\nos._exit(9)"), (DONE, NOT_RUN, NOT_RUN)),
    ]
)


def write_class(folder: Path) -> dict[str, tuple[str, str, str]]:
    """Write the 30 notebooks into ``folder``; return each learner's expected statuses."""
    expected = {}
    for learner, build, statuses in CLASS:
        (folder / learner).mkdir(parents=True, exist_ok=True)
        nbformat.write(build(), str(folder / learner / SOLUTION.name))
        expected[learner] = statuses
    return expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the class and the results (default: a new temporary one)")
    parser.add_argument("--jobs", type=int, default=2, help="notebooks graded at once (default 2)")
    parser.add_argument("--timeout", type=int, default=60,
                        help="seconds per cell (default 60: chapter 10's cells take a few on CPU)")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.timeout < 1:
        parser.error("--jobs and --timeout must be positive")
    out = args.out or Path(tempfile.mkdtemp(prefix="grade-class-demo-"))
    class_dir, results = out / "class", out / "results"
    expected = write_class(class_dir)
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "course_lib.teaching.grade", str(class_dir), "--out",
                          str(results), "--jobs", str(args.jobs), "--timeout", str(args.timeout)],
                         capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    print(run.stdout)
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
        return 1
    with open(results / "grades.csv", newline="", encoding="utf-8") as f:
        got = {(r["learner"], r["exercise"]): (r["status"], r["message"]) for r in csv.DictReader(f)}
    wrong = [(learner, ex, want, got.get((learner, ex), ("missing", ""))) for learner, statuses
             in expected.items() for ex, want in zip(EXERCISES, statuses)
             if got.get((learner, ex), ("missing",))[0] != want]
    for learner, ex, want, (status, message) in wrong:
        print(f"MISMATCH {learner} {ex}: expected {want}, got {status}: {message[:300]}")
    seconds = json.loads((results / "grades.json").read_text())["seconds"]
    n = len(expected)
    summary = {
        "notebooks": n, "jobs": args.jobs, "timeout_s": args.timeout,
        "wall_s": round(wall, 1), "wall_per_notebook_s": round(wall / n, 1),
        "mean_notebook_s": round(sum(seconds.values()) / n, 1),
        "max_notebook_s": max(seconds.values()), "rows_as_expected": n * 3 - len(wrong),
        "rows": n * 3, "machine": f"{platform.node()} ({os.cpu_count()} CPUs), "
                                  f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        import torch
        import triton
        summary["versions"] = f"torch {torch.__version__}, triton {triton.__version__}"
    except ImportError:
        pass
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"class, results and summary.json in {out}")
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
