"""The instructor's grading command, run as an instructor would: on a folder of learner notebooks.

The main test grades three learners of chapter 03 (real notebooks, real checks); the others use
a two-cell toy chapter to cover time limits and the learner's saved outputs cheaply."""

import copy
import csv
import json
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_lib import checks, grade, nbgen

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


def _run_grader(submissions, out, *extra):
    return subprocess.run([sys.executable, "-m", "course_lib.grade", str(submissions),
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=300)


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
        from course_lib.exercises import ch03
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
    # chapter), a scratch cell that raises, a 3.2 cell that raises before defining `merge`, and a
    # cell that kills the Python process (as an out-of-bounds kernel can) before 3.3's check
    carol = copy.deepcopy(sol)
    i31 = _cell_of(carol, "3.1")
    assert NO_RESCALE in carol.cells[i31].source
    forge = ("import json, os\n"
             "with open(os.environ['COURSE_GRADE_LOG'], 'a') as f:\n"
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
        f"{SOLUTION_03.name}: cell {i31} mentions COURSE_GRADE_LOG, GRADE_LOG",
        f"{SOLUTION_03.name}: 1 line(s) of the log ignored: not a report on an exercise of chapter 03",
        f"{SOLUTION_03.name}: cell {i31} reported Exercise 3.1 passed, but it is not that "
        f"exercise's check cell (ignored)"]
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


def _toy(tmp_path):
    sol = tmp_path / "solutions"
    sol.mkdir()
    nbformat.write(new_notebook(cells=copy.deepcopy(TOY_SOLUTION)), str(sol / "01_toy.ipynb"))
    return sol


def _report(ex, *statuses):
    """A cell standing in for a check cell (the toy chapter has no checks): it appends reports."""
    call = {"1.1": "ch01.check_one(one)", "1.2": "ch01.check_two(two)"}[ex]
    lines = "".join(f"    f.write(json.dumps({{'exercise': 'Exercise {ex}', 'status': '{status}', "
                    f"'message': 'toy {status}'}}) + '\\n')\n" for status in statuses)
    return new_code_cell(f"# instead of {call}\nimport json, os\n"
                         f"with open(os.environ['COURSE_GRADE_LOG'], 'a') as f:\n{lines}")


@pytest.mark.ch00
def test_time_limit_stale_outputs_and_strict_mode(tmp_path, monkeypatch):
    sol = _toy(tmp_path)
    sub = tmp_path / "sub"
    (sub / "dan").mkdir(parents=True)
    # a saved output claiming success must not count; the run stops at a cell that never ends
    stale = _report("1.1", "passed")
    stale.outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ Exercise 1.2: passed\n")]
    nbformat.write(new_notebook(cells=[stale, new_code_cell("import time\ntime.sleep(60)"),
                                       _report("1.2", "passed")]),
                   str(sub / "dan" / "01_toy.ipynb"))
    # erin's strictness setting is the grader's business: COURSE_STRICT is not passed to the kernel
    nbformat.write(new_notebook(cells=[new_code_cell(
        "import os\nassert 'COURSE_STRICT' not in os.environ\nassert os.listdir('.') == []  # an empty folder"),
        _report("1.1", "not done", "passed"), _report("1.2", "blue"),
        _report("1.1", "wrong")]),  # a second call, e.g. to show a wrong answer: does not count
        str(sub / "erin__01_toy.ipynb"))
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1")]), str(sub / "gus__01_toy.ipynb"))
    (sub / "notes.txt").write_text("not a notebook")
    (sub / "frank__99_other.ipynb").write_text("{}")
    monkeypatch.setenv("COURSE_STRICT", "1")
    out = tmp_path / "out"
    run = _run_grader(sub, out, "--solutions", str(sol), "--timeout", "3")
    assert run.returncode == 0, run.stderr[-3000:]
    got = {(r["learner"], r["exercise"]): (r["status"], r["message"]) for r in _rows(out)}
    assert got == {
        ("dan", "1.1"): ("passed", "toy passed"),
        ("dan", "1.2"): ("not run", "its check never reported: cell 1 ran past the 3 s limit per "
                                    "cell (before its check cell, cell 2)"),
        ("erin", "1.1"): ("passed", "toy passed"),  # the last report of its check cell
        ("erin", "1.2"): ("not run", "its check never reported: its check cell (cell 2) ran, but "
                                     "the check did not report"),
        ("gus", "1.1"): ("not run", "its check never reported: no cell calls `ch01.check_one(...)`"),
        ("gus", "1.2"): ("not run", "its check never reported: no cell calls `ch01.check_two(...)`"),
    }
    executed = (out / "executed" / "dan" / "01_toy.ipynb").read_text()
    assert "✓ Exercise 1.2" not in executed  # the saved output was dropped before the run
    data = json.loads((out / "grades.json").read_text())
    assert "warning: skipped" in run.stdout and any("99_other" in w for w in data["warnings"])
    assert data["learners"]["erin"]["flags"] == [
        "01_toy.ipynb: cell 1 mentions COURSE_GRADE_LOG, GRADE_LOG",
        "01_toy.ipynb: cell 2 mentions COURSE_GRADE_LOG, GRADE_LOG",
        "01_toy.ipynb: cell 3 mentions COURSE_GRADE_LOG, GRADE_LOG",
        "01_toy.ipynb: 1 line(s) of the log ignored: not a report on an exercise of chapter 01"]


@pytest.mark.ch00
def test_no_submissions_is_a_clear_error(tmp_path):
    sol = _toy(tmp_path)
    (tmp_path / "empty").mkdir()
    run = _run_grader(tmp_path / "empty", tmp_path / "out", "--solutions", str(sol))
    assert run.returncode == 2
    assert "no learner notebooks found" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.ch00
def test_exercise_lists_come_from_the_solutions():
    chapters = grade.chapter_exercises(nbgen.ROOT / "solutions")
    sol = nbformat.read(str(SOLUTION_03), as_version=4)
    assert chapters["03"] == grade.Chapter("03_online_softmax.ipynb", ["3.1", "3.2", "3.3"], {
        "3.1": "ch03.check_online_update", "3.2": "ch03.check_merge", "3.3": "ch03.check_online_softmax"},
        {ex: sol.cells[_check_cell_of(sol, ex)].id for ex in ("3.1", "3.2", "3.3")})
    assert chapters["09"].exercises == ["9.1", "9.2", "9.3"]  # in number order, whatever the notebook's
    for chapter, ch in chapters.items():
        assert ch.notebook.startswith(chapter) and ch.exercises, chapter
        assert all(ex.split(".")[0] == str(int(chapter)) for ex in ch.exercises), ch.notebook
        # every exercise has a check call, from the chapter's own module
        assert all(ch.check_calls[ex].startswith(f"ch{chapter}.check_") for ex in ch.exercises), ch.notebook


@pytest.mark.ch00
def test_a_check_cell_that_kills_the_process(tmp_path):
    """A crash inside a check (an out-of-bounds kernel could once do this) is named as such."""
    sol = _toy(tmp_path)
    (tmp_path / "sub").mkdir()
    nbformat.write(new_notebook(cells=[_report("1.1", "passed"), new_code_cell(
        "# instead of ch01.check_two(two)\nimport os\nos._exit(3)")]), str(tmp_path / "sub" / "hal__01_toy.ipynb"))
    run = _run_grader(tmp_path / "sub", tmp_path / "out", "--solutions", str(sol))
    assert run.returncode == 0, run.stderr[-3000:]
    assert [(r["exercise"], r["status"], r["message"]) for r in _rows(tmp_path / "out")] == [
        ("1.1", "passed", "toy passed"),
        ("1.2", "not run", "its check never reported: the Python process running the notebook died "
                           "at cell 1, its check cell")]


@pytest.mark.ch10
def test_a_check_cell_pasted_twice_over_an_untouched_exercise_is_not_done(tmp_path):
    """Chapter 10's checks hand back a switched model kernel (not callable) when an exercise is not
    done; a learner who pastes the check cell twice (or runs it again) must still be graded "not
    done", never "passed" (it once was: the switched kernel was not recognised as the library's)."""
    learner = nbformat.read(str(nbgen.ROOT / "notebooks" / "10_masks_in_triton.ipynb"), as_version=4)
    for exercise in ("10.2", "10.3"):
        i = next(j for j, c in enumerate(learner.cells) if c.cell_type == "code"
                 and f"check_{'varlen' if exercise == '10.2' else 'block_sparse'}_kernel(" in c.source)
        twin = copy.deepcopy(learner.cells[i])
        twin.id = f"pasted-{exercise.replace('.', '-')}"
        learner.cells.insert(i + 1, twin)
    (tmp_path / "sub").mkdir()
    nbformat.write(learner, str(tmp_path / "sub" / "pat__10_masks_in_triton.ipynb"))
    run = _run_grader(tmp_path / "sub", tmp_path / "out")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["exercise"]: r for r in _rows(tmp_path / "out")}
    for exercise in ("10.2", "10.3"):
        assert rows[exercise]["status"] == "not done", rows[exercise]
    assert all(r["status"] != "passed" for r in rows.values()), rows
