"""The instructor's grading command, run as an instructor would: on a folder of learner notebooks.

The main test grades three learners of chapter 03 (real notebooks, real checks, run by the grader
in its own process); a two-exercise toy chapter, with toy checks imported by the grader
(``--checks-package``), covers time limits, crashes and the learner's saved outputs cheaply; one
grading run shared by several tests covers the answers the checks use through library functions
(chapters 06, 07, 11) and a pasted check cell (chapter 10). Hostile notebooks:
tests/test_grade_hostile.py."""

import contextlib
import copy
import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_lib.teaching import checks, grade, nbgen

pytestmark = pytest.mark.slow
SOLUTION_03 = nbgen.ROOT / "solutions" / "03_online_softmax.ipynb"


def _cell_of(nb, exercise):
    """Index of the code cell holding ``# Exercise N.M:``'s solution."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and f"# Exercise {exercise}:" in cell.source:
            return i
    raise AssertionError(f"no exercise {exercise} in {SOLUTION_03.name}")


def _check_cell_of(nb, exercise):
    """Index of the code cell that calls exercise ``exercise``'s check (the first check call
    after the exercise cell)."""
    for i in range(_cell_of(nb, exercise) + 1, len(nb.cells)):
        if nb.cells[i].cell_type == "code" and ".check_" in nb.cells[i].source:
            return i
    raise AssertionError(exercise)


def _stub(nb, exercise):
    i = _cell_of(nb, exercise)
    nb.cells[i].source = nbgen.strip_solutions(nb.cells[i].source, "test")


def _run_grader(submissions, out, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "course_lib.teaching.grade", str(submissions),
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=300,
                          env=env)


def _rows(out):
    with open(out / "grades.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


NO_RESCALE = "l_new = l * correction +"  # exercise 3.1's wrong answer drops the rescale of l


@pytest.fixture(scope="module")
def expected_messages(tmp_path_factory):
    """What the chapter-03 checks themselves report (in this process) for the answers the learners
    below hand in: the grader must pass these messages on unchanged."""
    sol = nbformat.read(str(SOLUTION_03), as_version=4)
    log = tmp_path_factory.mktemp("log") / "log.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv(checks.GRADE_LOG_ENV, str(log))
    mp.delenv("COURSE_STRICT", raising=False)
    try:
        from course_lib.teaching.exercises import ch03
        ns: dict = {}
        exec("import numpy as np\n" + sol.cells[_cell_of(sol, "3.1")].source.replace(NO_RESCALE, "l_new = l +"), ns)
        with pytest.raises(checks.ExerciseFailed):
            ch03.check_online_update(ns["online_update"])
        stubbed = copy.deepcopy(sol)
        for ex in ("3.2", "3.3"):
            _stub(stubbed, ex)
            exec("import numpy as np\n" + stubbed.cells[_cell_of(stubbed, ex)].source, ns)
        ch03.check_merge(ns["merge"])
        ch03.check_online_softmax(ns["online_softmax"])
    finally:
        mp.undo()
    return {(r["exercise"].split()[-1], r["status"]): r["message"]
            for r in map(json.loads, log.read_text().splitlines())}


@pytest.mark.ch03
def test_three_learners_of_chapter_03(tmp_path, expected_messages):
    sol = nbformat.read(str(SOLUTION_03), as_version=4)
    sub = tmp_path / "submissions"

    # alice finished everything (the solution notebook, with outputs she saved)
    (sub / "alice").mkdir(parents=True)
    nbformat.write(sol, str(sub / "alice" / SOLUTION_03.name))

    # bob did 3.1 only; a flat file <learner>__<notebook> in the top folder
    bob = copy.deepcopy(sol)
    _stub(bob, "3.2")
    _stub(bob, "3.3")
    nbformat.write(bob, str(sub / f"bob__{SOLUTION_03.name}"))

    # carol: a wrong 3.1 (which she tries to cover with a forged report, and one for another
    # chapter: the grader no longer reads any), a scratch cell that raises, a 3.2 cell that raises
    # before defining `merge`, and a cell that kills the Python process (as an out-of-bounds
    # kernel can) before 3.3's check
    carol = copy.deepcopy(sol)
    i31 = _cell_of(carol, "3.1")
    assert NO_RESCALE in carol.cells[i31].source
    forge = ("import json, os\n"
             "with open(os.environ.get('COURSE_GRADE_LOG', 'log.jsonl'), 'a') as f:\n"
             "    f.write(json.dumps({'exercise': 'Exercise 3.1', 'status': 'passed', 'message': 'forged'}) + '\\n')\n"
             "    f.write(json.dumps({'exercise': 'Exercise 4.4', 'status': 'passed', 'message': 'forged'}) + '\\n')\n")
    carol.cells[i31].source = forge + carol.cells[i31].source.replace(NO_RESCALE, "l_new = l +")
    i32 = _cell_of(carol, "3.2")
    carol.cells[i32].source = "merge = build_merge()   # a helper she never wrote\n"
    i33 = _check_cell_of(carol, "3.3")
    carol.cells.insert(i33, new_code_cell("import os\nos._exit(1)"))
    scratch = _check_cell_of(carol, "3.1") + 1
    carol.cells.insert(scratch, new_code_cell("print(my_scratch_value)"))
    (sub / "carol").mkdir()
    nbformat.write(carol, str(sub / "carol" / SOLUTION_03.name))
    crash_cell, check_32, check_33 = (
        next(i for i, c in enumerate(carol.cells) if text in c.source)
        for text in ("os._exit(1)", "ch03.check_merge(", "ch03.check_online_softmax("))

    out = tmp_path / "results"
    run = _run_grader(sub, out, "--jobs", "2", "--timeout", "120")
    assert run.returncode == 0, run.stderr[-3000:]

    got = {(r["learner"], r["exercise"]): (r["status"], r["message"]) for r in _rows(out)}
    assert {k: v[0] for k, v in got.items()} == {
        ("alice", "3.1"): "passed", ("alice", "3.2"): "passed", ("alice", "3.3"): "passed",
        ("bob", "3.1"): "passed", ("bob", "3.2"): "not done", ("bob", "3.3"): "not done",
        ("carol", "3.1"): "wrong", ("carol", "3.2"): "not run", ("carol", "3.3"): "not run",
    }
    assert all(got[(who, ex)][1].startswith(f"✓ Exercise {ex}: passed")
               for who, ex in [("alice", "3.1"), ("alice", "3.2"), ("alice", "3.3"), ("bob", "3.1")])
    assert got[("bob", "3.2")][1] == expected_messages[("3.2", "not done")]
    assert got[("bob", "3.3")][1] == expected_messages[("3.3", "not done")]
    # the check's own diagnosis, not the "passed" forged in another cell
    assert got[("carol", "3.1")][1] == expected_messages[("3.1", "wrong")]
    assert got[("carol", "3.2")][1] == (
        f"its check never reported: its check cell (cell {check_32}) raised NameError: name "
        f"'merge' is not defined (before it, cell {scratch} raised NameError: name "
        f"'my_scratch_value' is not defined; cell {check_32 - 1} raised NameError: name "
        f"'build_merge' is not defined)")
    assert got[("carol", "3.3")][1] == (f"its check never reported: the Python process running the "
                                        f"notebook died at cell {crash_cell} (before its check "
                                        f"cell, cell {check_33})")
    assert "4.4" not in {r["exercise"] for r in _rows(out)}

    rows = _rows(out)
    assert [r["notebook"] for r in rows if r["learner"] == "bob"] == [SOLUTION_03.name] * 3
    assert all(r["chapter"] == "03" for r in rows)
    data = json.loads((out / "grades.json").read_text())
    assert [(r["learner"], r["exercise"], r["status"]) for r in data["rows"]] == \
        [(r["learner"], r["exercise"], r["status"]) for r in rows]
    assert {k: (v["passed"], v["not done"], v["wrong"], v["not run"]) for k, v in data["learners"].items()} == \
        {"alice": (3, 0, 0, 0), "bob": (1, 2, 0, 0), "carol": (0, 0, 1, 2)}
    assert data["learners"]["alice"]["flags"] == [] and data["learners"]["bob"]["flags"] == []
    assert data["learners"]["carol"]["flags"] == [
        f"{SOLUTION_03.name}: cell {i31} mentions COURSE_GRADE_LOG, GRADE_LOG"]
    assert data["isolation"].startswith("isolation: ") and data["isolation"] in run.stdout
    with open(out / "summary.csv", newline="", encoding="utf-8") as f:
        summary = {r["learner"]: r for r in csv.DictReader(f)}
    assert (summary["bob"]["passed"], summary["bob"]["not done"], summary["bob"]["exercises"]) == ("1", "2", "3")
    # the printed table
    assert "alice       ✓    ✓    ✓  3/3" in run.stdout
    assert "carol       ✗    ·    ·  0/3" in run.stdout
    # the executed notebooks are kept, with the check's diagnosis in carol's
    executed = nbformat.read(str(out / "executed" / "carol" / SOLUTION_03.name), as_version=4)
    shown = [o for o in executed.cells[_check_cell_of(carol, "3.1")].outputs if o.output_type == "error"]
    assert shown and shown[0].ename == "ExerciseFailed"


TOY_SOLUTION = [
    new_markdown_cell("# toy chapter"),
    new_code_cell("# Exercise 1.1: one\ndef one():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"),
    new_code_cell("one = ch01.check_one(one)"),
    new_code_cell("# Exercise 1.2: two\ndef two():\n    ### BEGIN SOLUTION\n    return 2\n    ### END SOLUTION"),
    new_code_cell("two = ch01.check_two(two)"),
]
# The toy chapter's checks, imported by the grader (--checks-package toychecks): real checks
TOY_CHECKS = """\
from course_lib.teaching.checks import Case, check_function, learner_check

def one():
    return 1

def two():
    return 2

@learner_check
def check_one(fn):
    return check_function("Exercise 1.1", fn, one, [Case(())])

@learner_check
def check_two(fn):
    return check_function("Exercise 1.2", fn, two, [Case(())])
"""


def _toy(tmp_path):
    """The toy chapter's solutions folder, and the environment in which the grader finds its
    checks."""
    sol = tmp_path / "solutions"
    sol.mkdir()
    nbformat.write(new_notebook(cells=copy.deepcopy(TOY_SOLUTION)), str(sol / "01_toy.ipynb"))
    (tmp_path / "toychecks").mkdir()
    (tmp_path / "toychecks" / "__init__.py").write_text("")
    (tmp_path / "toychecks" / "ch01.py").write_text(TOY_CHECKS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    return sol, env


def _toy_cell(exercise, body):
    """A learner's cell that defines the toy answer and stands in for its check cell (the toy
    checks exist only in the grader's process)."""
    call = {"1.1": "ch01.check_one(one)", "1.2": "ch01.check_two(two)"}[exercise]
    return new_code_cell(f"{body}\n# {call}")


def _forged(exercise, status):
    """Code that appends a forged report to the old grading log (ignored now)."""
    return ("import json, os\nwith open(os.environ.get('COURSE_GRADE_LOG', 'log.jsonl'), 'a') as f:\n"
            f"    f.write(json.dumps({{'exercise': 'Exercise {exercise}', 'status': '{status}', "
            f"'message': 'forged'}}) + '\\n')")


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """One grading run of the toy chapter (``--timeout 3``, no sandbox, ``COURSE_STRICT`` set)
    shared by the two tests below: dan, erin and gus (time limit, saved outputs, strictness) and
    hal (a check cell that kills the process)."""
    tmp = tmp_path_factory.mktemp("toy")
    sol, env = _toy(tmp)
    sub = tmp / "sub"
    (sub / "dan").mkdir(parents=True)
    # a saved output claiming success must not count; the run stops at a cell that never ends
    stale = _toy_cell("1.1", "def one():\n    return 1")
    stale.outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ Exercise 1.2: passed\n")]
    nbformat.write(new_notebook(cells=[stale, new_code_cell("import time\ntime.sleep(60)"),
                                       _toy_cell("1.2", "def two():\n    return 2")]),
                   str(sub / "dan" / "01_toy.ipynb"))
    # erin's strictness setting is the grader's business: COURSE_STRICT is not passed to the
    # kernel (her unfinished 1.1 is "not done", not a failure), and no forged report counts
    nbformat.write(new_notebook(cells=[new_code_cell(
        "import os\nassert 'COURSE_STRICT' not in os.environ\nassert os.listdir('.') == []  # an empty folder"),
        _toy_cell("1.1", "def one():\n    raise NotImplementedError('Exercise 1.1')\n" + _forged("1.1", "passed")),
        _toy_cell("1.2", "def two():\n    return 3\n" + _forged("1.2", "passed")),
        _toy_cell("1.1", "def one():\n    return 1")]),  # a second call (e.g. to show a wrong answer): does not count
        str(sub / "erin__01_toy.ipynb"))
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1")]), str(sub / "gus__01_toy.ipynb"))
    nbformat.write(new_notebook(cells=[_toy_cell("1.1", "def one():\n    return 1"), new_code_cell(
        "# instead of ch01.check_two(two)\nimport os\nos._exit(3)")]), str(sub / "hal__01_toy.ipynb"))
    (sub / "notes.txt").write_text("not a notebook")
    (sub / "frank__99_other.ipynb").write_text("{}")
    env["COURSE_STRICT"] = "1"
    out = tmp / "out"
    # without a sandbox (asked for: the grader says so) the checks still run in its own process
    run = _run_grader(sub, out, "--solutions", str(sol), "--timeout", "3", "--checks-package",
                      "toychecks", "--isolation", "none", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {(r["learner"], r["exercise"]): (r["status"], r["message"]) for r in _rows(out)}
    return {"run": run, "out": out, "rows": rows}


@pytest.mark.ch00
def test_time_limit_stale_outputs_and_strict_mode(toy_run):
    toy_checks: dict = {}
    exec(TOY_CHECKS, toy_checks)
    with pytest.raises(checks.ExerciseFailed) as failed:  # the check's own message, in this process
        toy_checks["check_two"](lambda: 3)
    wrong_two = str(failed.value)
    run, out = toy_run["run"], toy_run["out"]
    got = {key: row for key, row in toy_run["rows"].items() if key[0] != "hal"}
    assert got == {
        ("dan", "1.1"): ("passed", "✓ Exercise 1.1: passed (1 case)."),
        ("dan", "1.2"): ("not run", "its check never reported: cell 1 ran past the 3 s limit per "
                                    "cell (before its check cell, cell 2)"),
        ("erin", "1.1"): ("not done", "… Exercise 1.1: not done yet — the notebook continues with "
                                      "the library's implementation. Fill in the exercise, run its "
                                      "cell, then this one."),
        ("erin", "1.2"): ("wrong", wrong_two),
        ("gus", "1.1"): ("not run", "its check never reported: no cell calls `ch01.check_one(...)`"),
        ("gus", "1.2"): ("not run", "its check never reported: no cell calls `ch01.check_two(...)`"),
    }
    executed = (out / "executed" / "dan" / "01_toy.ipynb").read_text()
    assert "✓ Exercise 1.2" not in executed  # the saved output was dropped before the run
    data = json.loads((out / "grades.json").read_text())
    assert "warning: skipped" in run.stdout and any("99_other" in w for w in data["warnings"])
    assert data["learners"]["erin"]["flags"] == [
        "01_toy.ipynb: cell 1 mentions COURSE_GRADE_LOG, GRADE_LOG",
        "01_toy.ipynb: cell 2 mentions COURSE_GRADE_LOG, GRADE_LOG"]


@pytest.mark.ch00
def test_a_check_cell_that_kills_the_process(toy_run):
    """A crash inside a check cell (an out-of-bounds kernel could once do this) is named as such."""
    said = [line for line in toy_run["run"].stdout.splitlines() if not line.startswith("warning: ")]
    assert said[0].startswith("isolation: none — asked for with --isolation none. Each notebook "
                              "runs as this user, with this user's files and network"), said[0]
    assert [(ex, *row) for (learner, ex), row in toy_run["rows"].items() if learner == "hal"] == [
        ("1.1", "passed", "✓ Exercise 1.1: passed (1 case)."),
        ("1.2", "not run", "its check never reported: the Python process running the notebook died "
                           "at cell 1, its check cell")]


@pytest.mark.ch00
def test_no_submissions_is_a_clear_error(tmp_path):
    sol, _ = _toy(tmp_path)
    (tmp_path / "empty").mkdir()
    run = _run_grader(tmp_path / "empty", tmp_path / "out", "--solutions", str(sol))
    assert run.returncode == 2
    assert "no learner notebooks found" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.ch00
@pytest.mark.parametrize("option, message", [
    (("--isolation", "docker"), "argument --isolation: invalid choice: 'docker'"),
    (("--timeout", "0"), "--timeout: expected a positive number, got 0"),
    (("--memory-gib", "-1"), "--memory-gib: expected a positive number, got -1.0")])
def test_bad_options_are_clear_errors(tmp_path, option, message):
    run = _run_grader(tmp_path, tmp_path / "out", *option)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


@pytest.mark.ch00
def test_exercise_lists_come_from_the_solutions():
    chapters = grade.chapter_exercises(nbgen.ROOT / "solutions")
    sol = nbformat.read(str(SOLUTION_03), as_version=4)
    assert chapters["03"] == grade.Chapter("03_online_softmax.ipynb", ["3.1", "3.2", "3.3"], {
        "3.1": "ch03.check_online_update", "3.2": "ch03.check_merge", "3.3": "ch03.check_online_softmax"},
        {ex: sol.cells[_check_cell_of(sol, ex)].id for ex in ("3.1", "3.2", "3.3")},
        {"3.1": ["online_update"], "3.2": ["merge"], "3.3": ["online_softmax"]})
    assert chapters["06"].check_args["6.1"] == ["update_tile", "finish_rows"]
    assert chapters["09"].exercises == ["9.1", "9.2", "9.3"]  # in number order, whatever the notebook's
    for chapter, ch in chapters.items():
        assert ch.notebook.startswith(chapter) and ch.exercises, chapter
        assert all(ex.split(".")[0] == str(int(chapter)) for ex in ch.exercises), ch.notebook
        # every exercise has a check call, from the chapter's own module, handed plain names (the
        # grader looks the answers up by them)
        assert all(ch.check_calls[ex].startswith(f"ch{chapter}.check_") for ex in ch.exercises), ch.notebook
        assert all(ch.check_args[ex] for ex in ch.exercises), ch.notebook
    # every exercise the grader cannot isolate exists, and says why
    listed = {ex for ch in chapters.values() for ex in ch.exercises}
    assert set(grade.NOT_ISOLATED) <= listed and all(grade.NOT_ISOLATED.values())
    # ... and the README's instructors are told which ("6.1–6.4" is a range; "none")
    said = re.search(r"- Exercises graded as before, [^:]*: (none|[\d.,– and]+)\.", " ".join(
        (nbgen.ROOT / "README.md").read_text().split())).group(1)
    named = set()
    for item in [] if said == "none" else said.replace(" and ", ", ").split(", "):
        first, _, last = item.partition("–")
        major, low = first.split(".")
        named |= {f"{major}.{n}" for n in range(int(low), int((last or first).split(".")[1]) + 1)}
    assert named == set(grade.NOT_ISOLATED)


@pytest.mark.ch10
def test_the_class_demo_builds_its_class(tmp_path):
    """tools/grade_class_demo.py (run by hand: it grades 30 notebooks) still finds the lines its
    wrong and hostile notebooks change in chapter 10's solution."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("grade_class_demo",
                                                  nbgen.ROOT / "tools" / "grade_class_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    expected = demo.write_class(tmp_path)
    assert len(expected) == len(list(tmp_path.glob("*/10_masks_in_triton.ipynb"))) == 30
    solution = nbformat.read(str(demo.SOLUTION), as_version=4)
    for learner, statuses in expected.items():
        nb = nbformat.read(str(tmp_path / learner / demo.SOLUTION.name), as_version=4)
        changed = [c.source for c in nb.cells] != [c.source for c in solution.cells]
        assert changed == (statuses != (demo.DONE,) * 3), learner


def _reduced(solution: str, keep) -> list:
    """The code cells of a solution notebook that ``keep(source)`` selects."""
    nb = nbformat.read(str(nbgen.ROOT / "solutions" / solution), as_version=4)
    return [cell for cell in nb.cells if cell.cell_type == "code" and keep(cell.source)]


# Chapter 06's learner (the checks of 6.1-6.4 launch the teaching kernel with the learner's
# @triton.jit helpers): mallory hands in the right 6.1, then patches, in her own process, the four
# checks (each prints a ✓ and passes) and the memory guard (a no-op), and hands in a wrong 6.2 and
# 6.3 and a stub 6.4
WRONG_06 = {"6.2": ("mask=offs_rows[:, None] < n_rows, other=0.0)", ")"),  # an unmasked load
            "6.3": ("return tl.minimum(n_k, start_m + BLOCK_M)", "return n_k")}  # visits every tile
CHECKS_06 = {"6.1": "check_online_softmax", "6.2": "check_ragged", "6.3": "check_causal",
             "6.4": "check_exp2"}
PATCH_06 = """\
import contextlib, sys
chapter = sys.modules['course_lib.teaching.exercises.ch' + '06']
guards = sys.modules['course_lib.teaching.kernel_' + 'checks']
def passed(*answers):
    print('✓ Exercise 6.x: passed (5 cases).')
    return answers
for name in ('check_online_softmax', 'check_ragged', 'check_causal', 'check_exp2'):
    setattr(chapter, name, passed)
@contextlib.contextmanager
def unguarded():
    yield guards.MemoryGuard()
setattr(guards, 'memory_' + 'guard', unguarded)
"""


def _changed(cells, changes=(), stubs=(), before=None):
    """A notebook of ``cells`` (copies) with each (old, new) of ``changes`` made in the first cell
    holding ``old``, the exercises ``stubs`` stubbed, and ``before`` = (exercise, code): the code
    inserted before that exercise's cell."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.source) for c in cells])
    for old, new in changes:
        cell = next(c for c in nb.cells if old in c.source)
        cell.source = cell.source.replace(old, new, 1)
    for exercise in stubs:
        cell = next(c for c in nb.cells if f"# Exercise {exercise}:" in c.source)
        cell.source = nbgen.strip_solutions(cell.source, "test")
    if before is not None:
        at = next(i for i, c in enumerate(nb.cells) if f"# Exercise {before[0]}:" in c.source)
        nb.cells.insert(at, nbformat.v4.new_code_cell(before[1]))
    return nb


SKIP_74 = ("            if causal and q_end - 1 < k_start:               # every query before every key\n"
           "                continue\n")


def _graded_only(cells, call: str) -> list:
    """``cells`` with each check cell that calls ``call`` left as a comment: the grader finds the
    call there and grades just before it; the notebook's own run of the check is not what the
    tests of these rows read (and costs a second run of every case)."""
    return [nbformat.v4.new_code_cell("# " + c.source) if call in c.source else c for c in cells]


def _pasted_twice_10():
    """Chapter 10's learner notebook, untouched, reduced to its set-up, exercise and check cells,
    with the check cells of 10.2 and 10.3 pasted twice."""
    learner = nbformat.read(str(nbgen.ROOT / "notebooks" / "10_masks_in_triton.ipynb"), as_version=4)
    learner.cells = [c for c in learner.cells if c.cell_type == "code" and any(
        text in c.source for text in ("runtime.setup()", "from course_lib.teaching.exercises import ch10",
                                      "# Exercise 10.", "ch10.check_"))]
    for exercise in ("10.2", "10.3"):
        i = next(j for j, c in enumerate(learner.cells) if c.cell_type == "code"
                 and f"check_{'varlen' if exercise == '10.2' else 'block_sparse'}_kernel(" in c.source)
        twin = copy.deepcopy(learner.cells[i])
        twin.id = f"pasted-{exercise.replace('.', '-')}"
        learner.cells.insert(i + 1, twin)
    return learner


# Chapter 12's learners (the checks run the adapter and the op factory through library functions):
# alice's adapter aligns the causal mask to the top-left on a decoding step, bob's fake copies q's
# strides (torch.empty_like), which opcheck finds on the case with a transposed q
WRONG_12 = {"alice": [("causal=n_q > 1, scale=scaling)", "causal=True, scale=scaling)")],
            "bob": [("return q.new_empty(q.shape), q.new_empty(",
                     "return torch.empty_like(q), q.new_empty(")]}
PRELUDE_12 = ("import torch\nimport course_lib\nfrom course_lib.platform import runtime\nrt = runtime.setup()\n"
              "from course_lib.teaching.exercises import ch12\nfrom course_lib.kernels import teaching")


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """One grading run (two notebooks at a time) shared by the tests below: chapters 06, 07, 11
    and 12 (answers the checks use through library functions) and chapter 10 (a pasted check
    cell). The rows, and the notebooks as the grader executed them."""
    tmp = tmp_path_factory.mktemp("shared-run")
    ring = _graded_only(_reduced("11_ring_attention.ipynb", lambda src: "import course_lib" in src
                                 or "runtime.setup()" in src or "# Exercise 11." in src
                                 or "ch11.check_" in src), "ch11.check_")
    prelude = nbformat.v4.new_code_cell(
        "import numpy as np\nimport torch\nfrom course_lib.platform import runtime\nrt = runtime.setup()\n"
        "from course_lib.teaching.exercises import ch07\n"
        "from course_lib.kernels.backward import dkdv_kernel, dq_kernel   # as if Exercise 7.5 were done")
    glue = _reduced("07_backward.ipynb", lambda src: any(
        text in src for text in ("# Exercise 7.4:", "ch07.check_flash_backward(", "# Exercise 7.6:",
                                 "ch07.check_autograd_function(")))
    glue = _graded_only(glue, "ch07.check_autograd_function(")  # (it trains the tiny LM again)
    pieces = [nbformat.v4.new_code_cell(  # the chapter's imports that 6.1-6.4 need
        "from course_lib.platform import runtime\nrt = runtime.setup()\nimport triton\nimport triton.language as tl\n"
        "from course_lib.teaching.exercises import ch06\nfrom course_lib.kernels.tiles import LOG2_E"),
        *_reduced("06_flash_forward_triton.ipynb", lambda src: any(
            f"# Exercise {ex}:" in src or f"ch06.{check}(" in src for ex, check in CHECKS_06.items()))]
    changes = {"11": [("(r - step) % world", "(r + step) % world")],
               "07": [("return dq, dk, dv, None, None", "return dk, dq, dv, None, None"),
                      (SKIP_74, "")]}  # 7.4 computes the tiles the causal mask hides
    notebooks = {"06_flash_forward_triton": {
        "mallory": _changed(pieces, WRONG_06.values(), stubs=["6.4"], before=("6.2", PATCH_06))}}
    for chapter, cells, name in (("11", ring, "11_ring_attention"), ("07", [prelude, *glue], "07_backward")):
        notebooks[name] = {"alice": _changed(cells), "bob": _changed(cells, changes[chapter])}
    notebooks["10_masks_in_triton"] = {"pat": _pasted_twice_10()}
    real_model = [nbformat.v4.new_code_cell(PRELUDE_12), *_reduced(
        "12_your_kernel_in_a_real_model.ipynb", lambda src: "# Exercise 12." in src or "ch12.check_" in src)]
    notebooks["12_your_kernel_in_a_real_model"] = {
        who: _changed(real_model, changes) for who, changes in WRONG_12.items()}
    (tmp / "sub").mkdir()
    for name, learners in notebooks.items():
        for learner, nb in learners.items():
            nbformat.write(nb, str(tmp / "sub" / f"{learner}__{name}.ipynb"))
    run = _run_grader(tmp / "sub", tmp / "out", "--isolation", "none", "--jobs", "2")
    assert run.returncode == 0, run.stderr[-2000:]
    return {"rows": {(r["learner"], r["exercise"]): r for r in _rows(tmp / "out")},
            "executed": tmp / "out" / "executed"}


@pytest.mark.ch07
@pytest.mark.ch11
def test_answers_used_through_library_functions_are_graded_outside_the_notebook(shared_run):
    """11.2's check hands the learner's loop the library's ``attend``; 7.6's answer is an
    ``autograd.Function`` class, which the check runs through ``ch07.run_function`` and the tiny
    LM's training. The grader sends those library functions by name, the notebook's process looks
    them up and runs them, and only numbers come back: the exercises are graded in the grader's
    process (no row "not isolated"). The solutions pass; a loop that attends the wrong shard and
    gradients returned in the wrong order are wrong, with the checks' causes."""
    rows = shared_run["rows"]
    for ex in ("11.1", "11.2", "7.6"):
        assert rows["alice", ex]["status"] == "passed", rows["alice", ex]
    assert rows["bob", "11.2"]["status"] == "wrong", rows["bob", "11.2"]
    assert "the plan it computes disagree" in rows["bob", "11.2"]["message"]
    assert rows["bob", "7.6"]["status"] == "wrong" and "wrong order" in rows["bob", "7.6"]["message"], rows["bob", "7.6"]
    assert not any(rows[who, ex]["message"].startswith(grade.NOT_ISOLATED_MARK)
                   for who in ("alice", "bob") for ex in ("11.1", "11.2", "7.6"))


@pytest.mark.ch12
def test_an_adapter_and_an_op_factory_are_run_in_the_notebook_and_judged_in_the_grader(shared_run):
    """12.1: the check calls the learner's adapter through ``ch12.run_adapter`` (the module that
    transformers would pass rebuilt there from its sizes); 12.2: it makes and runs the learner's
    op, opcheck and torch.compile through ``ch12.op_outputs``, ``op_kind``, ``opcheck_problem`` and
    ``compile_probe``. All are sent by name, only data comes back, and the rows are graded in the
    grader (not "not isolated") with exactly what each learner's check cell showed: alice's right
    op passes and her adapter's top-left causal mask is named, bob's right adapter passes and his
    fake's copied strides are named."""
    rows, executed = shared_run["rows"], shared_run["executed"]
    calls = {"12.1": "ch12.check_adapter", "12.2": "ch12.check_custom_op"}
    statuses = {("alice", "12.1"): "wrong", ("alice", "12.2"): "passed",
                ("bob", "12.1"): "passed", ("bob", "12.2"): "wrong"}
    for (who, ex), status in statuses.items():
        shown = _check_cell_outputs(executed / who / "12_your_kernel_in_a_real_model.ipynb", calls[ex])
        assert (rows[who, ex]["status"], rows[who, ex]["message"]) == (status, shown), (who, ex)
    assert "likely cause: the causal mask is aligned to the top-left" in rows["alice", "12.1"]["message"]
    assert "torch.library.opcheck fails on case 2" in rows["bob", "12.2"]["message"]
    assert "the fake's o (output 0) has strides" in rows["bob", "12.2"]["message"]
    assert not any(row["message"].startswith(grade.NOT_ISOLATED_MARK) for row in rows.values())


@pytest.mark.ch07
def test_a_record_of_the_work_comes_back_as_data_and_is_judged_in_the_grader(shared_run):
    """7.4 (as 4.4 and 4.5): the check judges which rows of q the backward multiplies with which
    rows of k, recorded by watched arrays where the function runs (the notebook's process, through
    ``read_watch.watched_call`` sent by name) and sent back as data. Graded in the grader, with exactly
    the message each learner's own check cell showed: alice passes, bob's backward that computes
    the tiles the causal mask hides is wrong. (A record forged in the notebook's process:
    test_a_record_of_loads_is_judged_in_the_grader_and_a_forged_one_is_refused.)"""
    rows, executed = shared_run["rows"], shared_run["executed"]
    for who, status in (("alice", "passed"), ("bob", "wrong")):
        shown = _check_cell_outputs(executed / who / "07_backward.ipynb", "ch07.check_flash_backward")
        assert (rows[who, "7.4"]["status"], rows[who, "7.4"]["message"]) == (status, shown)
    assert "right numbers, but hidden tiles computed" in rows["bob", "7.4"]["message"]


@pytest.mark.ch10
def test_a_check_cell_pasted_twice_over_an_untouched_exercise_is_not_done(shared_run):
    """Chapter 10's checks hand back a switched model kernel (not callable) when an exercise is not
    done; a learner who pastes the check cell twice (or runs it again) must still be graded "not
    done", never "passed" (it once was: the switched kernel was not recognised as the library's)."""
    rows = {ex: r for (learner, ex), r in shared_run["rows"].items() if learner == "pat"}
    assert sorted(rows) == ["10.1", "10.2", "10.3"]
    for exercise in ("10.2", "10.3"):
        assert rows[exercise]["status"] == "not done", rows[exercise]
    assert all(r["status"] != "passed" for r in rows.values()), rows


def _check_cell_outputs(path, call: str) -> str:
    """What the first cell calling ``call`` (``"ch07.check_flash_backward"``) showed in the
    executed notebook ``path``: its error message (a wrong answer) or its printed text."""
    nb = nbformat.read(str(path), as_version=4)
    cell = next(c for c in nb.cells if f"{call}(" in c.source)
    return "".join(o.get("evalue") or o.get("text") or "" for o in cell.outputs).strip()


@pytest.mark.ch06
def test_device_helpers_are_launched_in_the_notebook_and_checked_in_the_grader(shared_run):
    """6.1-6.4: the check's kernel calls the learner's @triton.jit helpers, so the grader sends the
    launch (``ch06.launch_answer``, the helpers named) to the notebook's process and gets back only
    the tensors (and the memory guard's findings); cases, reference, diagnosis and messages stay in
    the grader, and no row is "not isolated". Mallory's right 6.1 passes with her check cell's
    message. Her patched checks printed a ✓ for the rest, and her patched guard let an unmasked load
    through: it is still wrong (the NaN of the inputs' margins reaches her outputs, which the
    grader checks), the extra tiles too, and the stub is not done. (A load whose values are
    discarded passes once the guard is off, as on a GPU: README. That a check on proxies says
    exactly what the check cell says, guard included: test_a_check_on_proxies_says_what_the_check_cell_says.)"""
    from course_lib.teaching.exercises import ch06

    rows, executed = shared_run["rows"], shared_run["executed"] / "mallory" / "06_flash_forward_triton.ipynb"
    got = {ex: (rows["mallory", ex]["status"], rows["mallory", ex]["message"]) for ex in CHECKS_06}
    assert got["6.1"] == ("passed", _check_cell_outputs(executed, "ch06.check_online_softmax"))
    assert got["6.1"][1] == f"✓ Exercise 6.1: passed ({len(ch06.ONLINE_SOFTMAX_SPECS)} cases)."
    for ex in ("6.2", "6.3", "6.4"):
        assert _check_cell_outputs(executed, f"ch06.{CHECKS_06[ex]}") == "✓ Exercise 6.x: passed (5 cases).", ex
    assert got["6.2"][0] == "wrong" and got["6.2"][1].startswith(
        "✗ Exercise 6.2: the output depends on memory outside the inputs"), got["6.2"]
    assert got["6.3"][0] == "wrong" and "visits 3 K/V tiles where 1 suffice" in got["6.3"][1], got["6.3"]
    assert got["6.4"][0] == "not done" and got["6.4"][1].startswith(
        "… Exercise 6.4: not done yet"), got["6.4"]
    assert not any(message.startswith(grade.NOT_ISOLATED_MARK) for _, message in got.values())


def test_the_channel_sends_library_functions_by_name_and_only_from_the_grader():
    """A top-level function of course_lib crosses as its name and is looked up only where the
    reader allows it (the notebook's process); any other function is not data; a name that
    arrives at the grader, or names something outside the library, is refused."""
    from course_lib.teaching import grade_channel as gc
    from course_lib.teaching.exercises import ch11

    message = gc.encode((1, ch11._attend))
    assert gc.decode(message, library_functions=True)[1] is ch11._attend
    with pytest.raises(gc.ChannelError, match="unknown kind"):
        gc.decode(message)  # the grader's side never looks a name up
    with pytest.raises(gc.ChannelError, match="is not data"):
        gc.encode(lambda q: q)  # a function of the test's, not the library's
    assert isinstance(gc.decode(gc.encode(ch11._attend, strict=False)), gc.Opaque)  # the notebook's side
    forged = message.replace(b"course_lib.teaching.exercises.ch11", b"course_lib.teaching.exercises.os__")
    with pytest.raises(gc.ChannelError):
        gc.decode(forged, library_functions=True)
    with pytest.raises(gc.ChannelError, match="bad library function name"):
        gc.resolve_library_function("os", "system")


class _Loopback:
    """A kernel client that runs the grader's requests in this very process: both ends of the
    channel (encode, the request and answer files, ``serve``, decode) without a notebook.
    ``forge(result) -> result``: what a notebook's process that lies sends back instead."""

    def __init__(self, forge=None):
        self.replies, self.requests, self.forge = [], 0, forge

    def execute(self, code, **_):
        from triton.runtime import interpreter

        from course_lib.teaching import kernel_checks

        self.requests += 1
        msg_id = f"request-{self.requests}"
        # as in a process of its own: none of the check's memory guards (nor its wrapping of the
        # interpreter's loads and stores) apply to the request, only the guard it makes itself
        guards, builder = kernel_checks._ACTIVE_GUARDS, interpreter.interpreter_builder
        saved = guards[:], {n: f for n, f in vars(builder).items() if n.startswith("create_")}
        guards.clear()
        for name in saved[1]:
            delattr(builder, name)
        try:
            exec(code, {})  # noqa: S102 - the grader's own one-line request
            status = "ok"
        except Exception:  # noqa: BLE001 - as a kernel reports a request that raised
            status = "error"
        finally:
            guards[:] = saved[0]
            for name, method in saved[1].items():
                setattr(builder, name, method)
        if self.forge is not None and status == "ok":
            from course_lib.teaching import grade_channel as gc

            request = json.loads(Path(re.search(r"serve\('([^']+)'\)", code).group(1)).read_text())
            if request["op"] == "with":
                reply = gc.read_message(Path(request["reply"]))
                gc.write_message(Path(request["reply"]), {**reply, "result": self.forge(reply["result"])},
                                 strict=False)
        self.replies.append({"parent_header": {"msg_id": msg_id}, "content": {"status": status}})
        return msg_id

    def get_shell_msg(self, timeout):
        return self.replies.pop(0)


# Exercise 6.5's launchers with one mistake each (changes to the solution's cell): a Q load without
# its mask, which reads rows it then discards (the numbers come out right: only the memory guard
# sees it), and a grid of one program per (batch, head) (rows never written: the sentinels)
FORWARD_6_5 = {"q-load-unmasked": [("q = tl.load(q_ptrs, mask=offs_m[:, None] < n_q, other=0.0)",
                                    "q = tl.load(q_ptrs)")],
               "grid-too-small": [("grid = (triton.cdiv(n_q, block_m) * batch * heads,)",
                                   "grid = (batch * heads,)")]}


@pytest.mark.ch06
@pytest.mark.parametrize("exercise, check, answer", [
    ("6.2", "check_ragged", ("_load_unmasked", "mask_ragged")),  # the guard stops a load
    ("6.3", "check_causal", ("mask_causal", "_kv_loop_end_always_all")),  # too many tiles
    ("6.4", "check_exp2", ("update_tile_exp2", "_finish_exp2_lse_in_log2")),  # a named cause
    ("6.5", "check_forward_kernel", "q-load-unmasked"),
    ("6.5", "check_forward_kernel", "grid-too-small"),
])
def test_a_check_on_proxies_says_what_the_check_cell_says(tmp_path, exercise, check, answer):
    """A check of chapter 06 run on proxies of wrong answers (as the grader runs it), its launches
    crossing the channel by name with the memory guard's allowances (6.2-6.4: the teaching kernel
    with the learner's helpers, ``ch06.launch_answer``; 6.5: the learner's launcher, with its
    allocations filled with the sentinel and allowed to its kernel, ``ch06.call_launcher``), fails
    with exactly the message of the check run on the answers themselves (as the check cell runs
    it): the guard's diagnosis, the tile count, a named cause, rows never written. (6.5's launcher
    once ran unguarded in the notebook's process: the grader passed its unmasked Q load.) Both ends
    of the channel run in this process (:class:`_Loopback`), so this costs no notebook; a right
    answer passing through a notebook: the test above."""
    from test_exercises_ch06 import _learner_module

    from course_lib.teaching import grade_channel as gc
    from course_lib.platform import runtime
    from course_lib.teaching.exercises import ch06

    if exercise == "6.5":
        answers = {"flash_forward": _learner_module(tmp_path, FORWARD_6_5[answer]).flash_forward}
        channel = tmp_path / "channel"
        channel.mkdir()
    else:
        answers, channel = {name: getattr(ch06, name) for name in answer}, tmp_path
    client = _Loopback()
    try:
        session, proxies = _loopback_session(client, channel, exercise, answers)
        in_process = _judged(getattr(ch06, check), *answers.values())
        through_channel = _judged(getattr(ch06, check), *proxies)
    finally:
        del gc._SNAPSHOT[exercise]
    # how many of a stray tile's lanes fall outside every tensor depends on where the allocator put
    # the others (two runs in one process differ too): the rest of the diagnosis must not
    lanes = re.compile(r"would (read|write) \d+ of its")
    assert [lanes.sub(r"would \1 N of its", text) for text in through_channel] == \
        [lanes.sub(r"would \1 N of its", text) for text in in_process]
    # (on a GPU the guard is off: a load whose values are discarded passes there, in both)
    assert in_process[0] == "wrong" or not runtime.current().interpreted
    assert client.requests > 0 and session.misuse is None and not list(channel.iterdir())


def _loopback_session(client, folder, exercise, answers: dict):
    """A grader's session whose notebook is this process (``client``: a :class:`_Loopback`), with
    ``answers`` ({name: object}) as exercise ``exercise``'s answers there; and their proxies."""
    from course_lib.teaching import grade_channel as gc

    session = gc.Session(client, folder, folder, alive=lambda: True, kill=lambda why: None,
                         time_limit=60)
    gc._SNAPSHOT[exercise] = answers
    return session, [gc.proxy_for(session, exercise, name, gc.describe_object(obj), {})
                     for name, obj in answers.items()]


def _judged(check, *answers):
    """("passed", what it printed) or ("wrong", the diagnosis) of ``check(*answers)``."""
    with checks.library_answers_allowed(), contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            check(*answers)
        except checks.ExerciseFailed as failed:
            return "wrong", str(failed)
    return "passed", out.getvalue().strip()


@pytest.mark.ch04
def test_a_record_of_loads_is_judged_in_the_grader_and_a_forged_one_is_refused(tmp_path):
    """4.4 (as 4.5 and 7.4): the learner's function runs in the notebook's process on watched
    arrays (``read_watch.watched_call``, sent by name) and the record of its loads comes back as data,
    judged in the grader: a forward that loads the tiles right of the diagonal gets exactly the
    check cell's diagnosis. A record the notebook's process forges in its place is refused: one
    that leaves out a load the right numbers need, and one that is not a record at all."""
    from test_exercises_ch04 import FA2_WRONG, LEARNER_FA2, learner_answer

    from course_lib.teaching import grade_channel as gc
    from course_lib.teaching.exercises import ch04

    no_skip = learner_answer(LEARNER_FA2, FA2_WRONG[0][1], "no skip")
    in_process = _judged(ch04.check_flash_forward, no_skip)
    assert in_process[0] == "wrong" and "hidden tile loaded" in in_process[1]

    def unread(result):  # the right numbers, with a record of no loads at all
        out, record = result
        return out, {**record, "touches": [], "counts": {n: 0 * c for n, c in record["counts"].items()}}

    outcomes = {}
    try:
        for name, forge in (("honest", None), ("unread", unread),
                            ("not a record", lambda result: (result[0], "passed"))):
            client = _Loopback(forge)
            session, proxies = _loopback_session(client, tmp_path, "4.4", {"flash_forward": no_skip})
            outcomes[name] = _judged(ch04.check_flash_forward, *proxies)
            assert client.requests > 0 and session.misuse is None
    finally:
        del gc._SNAPSHOT["4.4"]
    assert outcomes["honest"] == in_process
    assert outcomes["unread"][0] == "wrong" and "no load of row 0 of q in the record" in outcomes["unread"][1]
    assert outcomes["not a record"][0] == "wrong" and \
        "the record of your function's loads is malformed: not a record" in outcomes["not a record"][1]
