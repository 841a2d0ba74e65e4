"""The instructor's grading command, run as an instructor would: on a folder of learner notebooks.

The main test grades three learners of chapter 03 (real notebooks, real checks, run by the grader
in its own process); the others use a two-exercise toy chapter, with toy checks imported by the
grader (``--checks-package``), to cover time limits and the learner's saved outputs cheaply.
Hostile notebooks: tests/test_grade_hostile.py."""

import copy
import csv
import json
import os
import re
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


def _run_grader(submissions, out, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "course_lib.grade", str(submissions),
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
from course_lib.checks import Case, check_function, learner_check

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


@pytest.mark.ch00
def test_time_limit_stale_outputs_and_strict_mode(tmp_path):
    sol, env = _toy(tmp_path)
    sub = tmp_path / "sub"
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
    (sub / "notes.txt").write_text("not a notebook")
    (sub / "frank__99_other.ipynb").write_text("{}")
    env["COURSE_STRICT"] = "1"
    toy_checks: dict = {}
    exec(TOY_CHECKS, toy_checks)
    with pytest.raises(checks.ExerciseFailed) as failed:  # the check's own message, in this process
        toy_checks["check_two"](lambda: 3)
    wrong_two = str(failed.value)
    out = tmp_path / "out"
    run = _run_grader(sub, out, "--solutions", str(sol), "--timeout", "3", "--checks-package",
                      "toychecks", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = {(r["learner"], r["exercise"]): (r["status"], r["message"]) for r in _rows(out)}
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
    # ... and the README's instructors are told which ("6.1–6.4" is a range)
    said = re.search(r"- Exercises (.+?) are graded as before", " ".join(
        (nbgen.ROOT / "README.md").read_text().split())).group(1).replace(" and ", ", ").split(", ")
    named = set()
    for item in said:
        first, _, last = item.partition("–")
        major, low = first.split(".")
        named |= {f"{major}.{n}" for n in range(int(low), int((last or first).split(".")[1]) + 1)}
    assert named == set(grade.NOT_ISOLATED)


@pytest.mark.ch00
def test_a_check_cell_that_kills_the_process(tmp_path):
    """A crash inside a check cell (an out-of-bounds kernel could once do this) is named as such."""
    sol, env = _toy(tmp_path)
    (tmp_path / "sub").mkdir()
    nbformat.write(new_notebook(cells=[_toy_cell("1.1", "def one():\n    return 1"), new_code_cell(
        "# instead of ch01.check_two(two)\nimport os\nos._exit(3)")]), str(tmp_path / "sub" / "hal__01_toy.ipynb"))
    # without a sandbox (asked for: the grader says so) the checks still run in its own process
    run = _run_grader(tmp_path / "sub", tmp_path / "out", "--solutions", str(sol),
                      "--checks-package", "toychecks", "--isolation", "none", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("isolation: none — asked for with --isolation none. Each notebook "
                                 "runs as this user, with this user's files and network")
    assert [(r["exercise"], r["status"], r["message"]) for r in _rows(tmp_path / "out")] == [
        ("1.1", "passed", "✓ Exercise 1.1: passed (1 case)."),
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


@pytest.mark.ch07
@pytest.mark.ch11
def test_answers_used_through_library_functions_are_graded_outside_the_notebook(tmp_path):
    """11.2's check hands the learner's loop the library's ``attend``; 7.6's answer is an
    ``autograd.Function`` class, which the check runs through ``ch07.run_function`` and the tiny
    LM's training. The grader sends those library functions by name, the notebook's process looks
    them up and runs them, and only numbers come back: the exercises are graded in the grader's
    process (no row "not isolated"). The solutions pass; a loop that attends the wrong shard and
    gradients returned in the wrong order are wrong, with the checks' causes."""
    ring = _reduced("11_ring_attention.ipynb", lambda src: "import course_lib" in src or "runtime.setup()" in src
                    or "# Exercise 11." in src or "ch11.check_" in src)
    prelude = nbformat.v4.new_code_cell(
        "import torch\nfrom course_lib import runtime\nrt = runtime.setup()\n"
        "from course_lib.exercises import ch07\n"
        "from course_lib.kernels.backward import dkdv_kernel, dq_kernel   # as if Exercise 7.5 were done")
    glue = _reduced("07_backward.ipynb", lambda src: "# Exercise 7.6:" in src or "ch07.check_autograd_function(" in src)
    changes = {"11": ("(r - step) % world", "(r + step) % world"),
               "07": ("return dq, dk, dv, None, None", "return dk, dq, dv, None, None")}
    (tmp_path / "sub").mkdir()
    for chapter, cells, name in (("11", ring, "11_ring_attention"), ("07", [prelude, *glue], "07_backward")):
        for learner in ("alice", "bob"):
            nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.source) for c in cells])
            if learner == "bob":
                old, new = changes[chapter]
                cell = next(c for c in nb.cells if old in c.source)
                cell.source = cell.source.replace(old, new)
            nbformat.write(nb, str(tmp_path / "sub" / f"{learner}__{name}.ipynb"))
    run = _run_grader(tmp_path / "sub", tmp_path / "out", "--isolation", "none", "--jobs", "2")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {(r["learner"], r["exercise"]): r for r in _rows(tmp_path / "out")}
    for ex in ("11.1", "11.2", "7.6"):
        assert rows["alice", ex]["status"] == "passed", rows["alice", ex]
    assert rows["bob", "11.2"]["status"] == "wrong", rows["bob", "11.2"]
    assert "the plan it computes disagree" in rows["bob", "11.2"]["message"]
    assert rows["bob", "7.6"]["status"] == "wrong" and "wrong order" in rows["bob", "7.6"]["message"], rows["bob", "7.6"]
    assert not any(rows[who, ex]["message"].startswith(grade.NOT_ISOLATED_MARK)
                   for who in ("alice", "bob") for ex in ("11.1", "11.2", "7.6"))


def test_the_channel_sends_library_functions_by_name_and_only_from_the_grader():
    """A top-level function of course_lib crosses as its name and is looked up only where the
    reader allows it (the notebook's process); any other function is not data; a name that
    arrives at the grader, or names something outside the library, is refused."""
    from course_lib import grade_channel as gc
    from course_lib.exercises import ch11

    message = gc.encode((1, ch11._attend))
    assert gc.decode(message, library_functions=True)[1] is ch11._attend
    with pytest.raises(gc.ChannelError, match="unknown kind"):
        gc.decode(message)  # the grader's side never looks a name up
    with pytest.raises(gc.ChannelError, match="is not data"):
        gc.encode(lambda q: q)  # a function of the test's, not the library's
    assert isinstance(gc.decode(gc.encode(ch11._attend, strict=False)), gc.Opaque)  # the notebook's side
    forged = message.replace(b"course_lib.exercises.ch11", b"course_lib.exercises.os__")
    with pytest.raises(gc.ChannelError):
        gc.decode(forged, library_functions=True)
    with pytest.raises(gc.ChannelError, match="bad library function name"):
        gc.resolve_library_function("os", "system")
