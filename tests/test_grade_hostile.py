"""The grader against learners out to cheat or to break it (issue 40), on chapter 03.

One grading run (``--jobs 2``, a short time limit) of six learners: alice hands in the solution
and must pass everything whatever the others do; each of the five others attacks the grader on
every exercise — patching a check (the issue's exact cell: names spelt in pieces), forging the
log and the report channel, printing a fake ✓, reading the solutions or another learner's
notebook, writing into the course, exhausting memory, forking, looping forever, killing the
parent. Each attacked exercise must come out ``wrong``/``not done``/``not run`` with a reason,
never ``passed``. Runs only where the grader can sandbox (bubblewrap); says why otherwise."""

import json
import os
import signal
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell

from course_lib.teaching import grade, nbgen, sandbox
from course_lib.teaching import grade_channel as gc
from test_grade import SOLUTION_03, _cell_of, _check_cell_of, _rows, _run_grader, _stub

pytestmark = [pytest.mark.slow, pytest.mark.ch03]

CELL_LIMIT_S = 8  # --timeout: the loops forever run into it
SLEEP_MARK = "600.4321"  # the argument of the processes a learner leaves behind

# The issue's attack, as filed: one cell before 3.3's check re-binds the check on the exercises
# module to one that forges a report and prints a ✓, every name spelt in pieces.
PATCH_CHECK = """\
import json, os, sys
mod = sys.modules['course_lib.teaching.exercises.ch' + '03']
log = os.environ.get('COURSE_' + 'GRA' + 'DE_LOG', os.path.join(os.getcwd(), 'log.jsonl'))
def fake(fn, *a, **k):
    with open(log, 'a') as f:
        f.write(json.dumps({'exercise': 'Exercise 3.3', 'status': 'passed', 'message': 'forged'}) + '\\n')
    print('✓ Exercise 3.3: passed (8 cases).')
    return fn
setattr(mod, 'check_online' + '_softmax', fake)
"""

# Replaces the notebook side of the grader's channel (names in pieces): 3.1 answers with a
# forged report instead of numbers, 3.2 with a link to the solutions, 3.3 with a pickle that
# would create a file on the grader's side if it were ever unpickled, then with a pipe.
FORGE_CHANNEL = """\
import importlib, json, os, pickle
chan = importlib.import_module('course_lib.teaching.' + 'grade_' + 'channel')
real = getattr(chan, 'se' + 'rve')
class Evil:
    def __reduce__(self):
        return (os.system, ('touch ' + {marker!r},))
count = [0]
def forged(path):
    req = json.load(open(path))
    if req['op'] == 'describe':
        return real(path)
    reply = req['reply']
    if req['key'] == '3.1':
        getattr(chan, 'write_' + 'message')(reply, {{'result': {{'exercise': 'Exercise 3.1',
            'status': 'passed'}}, 'error': None, 'args': [], 'kwargs': {{}},
            'printed': '✓ Exercise 3.1: passed (9 cases).'}})
    elif req['key'] == '3.2':
        os.symlink({solution!r}, reply)
    else:
        count[0] += 1
        if count[0] % 2:
            open(reply, 'wb').write(pickle.dumps(Evil()))
        else:
            os.mkfifo(reply)
setattr(chan, 'se' + 'rve', forged)
"""

# Looks for what the sandbox hides and tries to copy exercise 3.3's answer from it.
READ_OTHERS = """\
import json, os
paths = {paths!r}
print('SEEN', json.dumps({{name: os.path.exists(p) for name, p in paths.items()}}))
try:
    sol = json.load(open(paths['solutions']))
    exec(next(''.join(c['source']) for c in sol['cells'] if '# Exercise 3.3:' in ''.join(c['source'])))
except OSError as exc:
    print('NO SOLUTIONS', type(exc).__name__)
try:
    open({planted!r}, 'w').write('def check_online_softmax(fn):\\n    return fn\\n')
except OSError as exc:
    print('NO WRITE', type(exc).__name__)
"""

LEAVE_PROCESSES = f"""\
import subprocess
kids = [subprocess.Popen(['sleep', '{SLEEP_MARK}'], start_new_session=True) for _ in range(10)]
print('forked', len(kids))
"""


def _solution():
    return nbformat.read(str(SOLUTION_03), as_version=4)


def _replace(nb, exercise, source):
    nb.cells[_cell_of(nb, exercise)].source = source


def _insert_before_check(nb, exercise, source):
    nb.cells.insert(_check_cell_of(nb, exercise), new_code_cell(source))


def _mallory():
    """Patches the check (the issue's cell), forges the log, prints a fake ✓."""
    nb = _solution()
    i = _cell_of(nb, "3.1")
    _stub(nb, "3.1")
    nb.cells[i].source += "\nprint('✓ Exercise 3.1: passed (9 cases).')"
    i = _cell_of(nb, "3.2")  # a wrong merge (no rescale of the weights), and a forged report
    nb.cells[i].source = ("import json, os\nwith open(os.environ.get('COURSE_GRADE_LOG', 'log.jsonl'), 'a') as f:\n"
                          "    f.write(json.dumps({'exercise': 'Exercise 3.2', 'status': 'passed', 'message': 'forged'}) + '\\n')\n"
                          "def merge(m_a, l_a, o_a, m_b, l_b, o_b):\n"
                          "    return np.maximum(m_a, m_b), l_a + l_b, (o_a + o_b) / 2\n")
    _stub(nb, "3.3")
    _insert_before_check(nb, "3.3", PATCH_CHECK)
    return nb


def _forger(marker: Path):
    nb = _solution()
    nb.cells.insert(_cell_of(nb, "3.1"), new_code_cell(FORGE_CHANNEL.format(
        marker=str(marker), solution=str(SOLUTION_03))))
    return nb


def _trudy(other: Path, planted: Path):
    nb = _solution()
    _stub(nb, "3.3")
    paths = {"solutions": str(SOLUTION_03), "other learner": str(other),
             "git": str(nbgen.ROOT / ".git" / "HEAD")}
    _insert_before_check(nb, "3.3", READ_OTHERS.format(paths=paths, planted=str(planted)))
    return nb


def _oscar():
    """Floods the output, exhausts memory in 3.1, leaves processes behind, loops forever in 3.2's
    function (so 3.2's own check cell, which runs it in the notebook, never ends either)."""
    nb = _solution()
    i = _cell_of(nb, "3.1")
    nb.cells[i].source = nb.cells[i].source.replace(
        "def online_update(m, l, x_tile):",
        "def online_update(m, l, x_tile):\n    hoard = np.empty(6 * 2**30, dtype=np.uint8)  # 6 GiB")
    nb.cells.insert(i, new_code_cell(f"print('x' * {grade.OUTPUT_LIMIT_CHARS + 1})  # a flood"))
    nb.cells.insert(i, new_code_cell(LEAVE_PROCESSES))  # before the flood: its output is kept
    _replace(nb, "3.2", "# Exercise 3.2: a loop that never ends\n"
                        "def merge(m_a, l_a, o_a, m_b, l_b, o_b):\n    while True:\n        pass\n")
    return nb


def _killer():
    """Kills its parent between right answers, then hangs in 3.3's answer with interrupts
    ignored: the grader must kill it."""
    nb = _solution()
    nb.cells.insert(_check_cell_of(nb, "3.1") + 1, new_code_cell(
        f"import os\nos.kill(os.getppid(), {int(signal.SIGKILL)})\nprint('still here')"))
    # (ipykernel restores its SIGINT handler before each request: ignore it inside the call)
    _replace(nb, "3.3", "# Exercise 3.3: a loop that ignores interrupts\nimport signal\n"
                        "def online_softmax(x, block_size):\n"
                        "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    while True:\n        pass\n")
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    isolation = sandbox.detect("auto")
    if isolation.kind != "bubblewrap":
        pytest.skip(f"the grader cannot sandbox here ({isolation.detail}): hostile notebooks "
                    f"are graded only in a sandbox")
    tmp = tmp_path_factory.mktemp("hostile")
    sub = tmp / "submissions"
    (sub / "alice").mkdir(parents=True)
    alice = sub / "alice" / SOLUTION_03.name
    nbformat.write(_solution(), str(alice))
    marker, planted = tmp / "unpickled", nbgen.ROOT / "course_lib" / "teaching" / "exercises" / "_planted.py"
    learners = {"mallory": _mallory(), "forger": _forger(marker),
                "trudy": _trudy(alice, planted), "oscar": _oscar(), "killer": _killer()}
    for name, nb in learners.items():
        nbformat.write(nb, str(sub / f"{name}__{SOLUTION_03.name}"))
    out = tmp / "results"
    try:
        run = _run_grader(sub, out, "--jobs", "2", "--timeout", str(CELL_LIMIT_S),
                          "--memory-gib", "3", "--isolation", "bubblewrap")
        leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit()
                     and SLEEP_MARK in _cmdline(p)]
    finally:
        planted_existed = planted.exists()
        if planted_existed:
            planted.unlink()
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {(r["learner"], r["exercise"]): (r["status"], r["message"]) for r in _rows(out)}
    executed = {name: nbformat.read(str(out / "executed" / name / SOLUTION_03.name), as_version=4)
                for name in ["alice", *learners]}
    return {"rows": rows, "stdout": run.stdout, "marker": marker, "planted": planted_existed,
            "leftovers": leftovers, "executed": executed}


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")


def test_the_others_do_not_stop_an_honest_learner(graded):
    assert [graded["rows"][("alice", ex)][0] for ex in ("3.1", "3.2", "3.3")] == ["passed"] * 3
    assert "isolation: bubblewrap" in graded["stdout"]


def test_patching_the_check_forging_the_log_and_a_fake_tick(graded):
    rows = graded["rows"]
    # the patched check and the ✓ it printed ran in the notebook's process: ignored
    assert "✓ Exercise 3.3: passed" in _printed(graded["executed"]["mallory"])
    assert rows[("mallory", "3.3")][0] == "not done", rows[("mallory", "3.3")]
    assert rows[("mallory", "3.1")][0] == "not done"
    assert rows[("mallory", "3.2")][0] == "wrong"
    assert rows[("mallory", "3.2")][1].startswith("✗ Exercise 3.2:")


def test_forging_the_report_channel(graded):
    rows = graded["rows"]
    assert rows[("forger", "3.1")][0] == "wrong"
    assert "output:" in rows[("forger", "3.1")][1]  # a dict where arrays were due: a wrong answer
    for ex in ("3.2", "3.3"):
        status, message = rows[("forger", ex)]
        assert status == "wrong" and "ChannelError" in message, (ex, message)
    assert not graded["marker"].exists(), "the grader unpickled what the notebook wrote"


def test_the_solutions_other_learners_and_the_course_are_out_of_reach(graded):
    printed = _printed(graded["executed"]["trudy"])
    seen = json.loads(next(line for line in printed.splitlines() if line.startswith("SEEN "))[5:])
    assert seen == {"solutions": False, "other learner": False, "git": False}
    assert "NO SOLUTIONS" in printed and "NO WRITE" in printed
    assert not graded["planted"], "the notebook wrote into the course"
    assert graded["rows"][("trudy", "3.3")][0] == "not done"
    assert graded["rows"][("trudy", "3.1")][0] == "passed"  # the rest of her notebook is hers


def test_memory_processes_and_loops_are_bounded(graded):
    rows = graded["rows"]
    status, message = rows[("oscar", "3.1")]
    assert status == "wrong" and "MemoryError" in message, message
    status, message = rows[("oscar", "3.2")]
    assert status == "wrong" and "stopped after" in message, message
    status, message = rows[("oscar", "3.3")]
    check_32 = _check_cell_of(_oscar(), "3.2")
    assert status == "not run" and message.startswith(
        f"its check never reported: cell {check_32} ran past the {CELL_LIMIT_S} s limit per cell"), message
    printed = _printed(graded["executed"]["oscar"])
    assert "forked 10" in printed
    assert len(printed) < 1.01 * grade.OUTPUT_LIMIT_CHARS and "the rest were dropped" in printed
    assert graded["leftovers"] == [], "processes the notebook started outlived it"


def test_killing_the_parent(graded):
    rows = graded["rows"]
    assert "still here" in _printed(graded["executed"]["killer"])  # its parent is out of reach
    assert rows[("killer", "3.1")][0] == "passed" and rows[("killer", "3.2")][0] == "passed"
    status, message = rows[("killer", "3.3")]
    assert status == "not run" and message == (
        f"the notebook's process did not stop within {gc.INTERRUPT_GRACE_S:g} s of an interrupt "
        f"and was killed while the check ran your answer"), message


def test_no_attack_passes(graded):
    attacked = {("mallory", "3.1"), ("mallory", "3.2"), ("mallory", "3.3"), ("forger", "3.1"),
                ("forger", "3.2"), ("forger", "3.3"), ("trudy", "3.3"), ("oscar", "3.1"),
                ("oscar", "3.2"), ("oscar", "3.3"), ("killer", "3.3")}
    for key in attacked:
        status, message = graded["rows"][key]
        assert status in ("wrong", "not done", "not run") and message, (key, status, message)


# ----------------------------------------------------------------------------------------------
# The channel itself: what crosses from a notebook's process is data, decoded without running
# anything (no sandbox needed for these)


def test_the_channel_carries_views_strides_and_shared_storage():
    import numpy as np
    import torch


    wide = np.arange(24.0).reshape(4, 6)
    buffer = torch.full((5, 12), float("nan"), dtype=torch.bfloat16)
    view = buffer[1:4, 2:10:2]  # a strided view inside NaN margins
    view.copy_(torch.arange(12.0).reshape(3, 4))
    alias = buffer[0]  # shares view's storage
    value = (wide[:, ::2], wide[::-1], np.float32(1.5), view, alias, [2**70, float("nan"), 1 - 2j],
             {"dtype": torch.float16, "size": torch.Size([2, 3]), "cut": slice(1, None, 2)}, b"raw")
    got = gc.decode(gc.encode(value))
    assert got[0].strides == wide[:, ::2].strides and np.array_equal(got[0], wide[:, ::2])
    assert np.array_equal(got[1], wide[::-1]) and got[1].strides[0] < 0
    assert got[2] == np.float32(1.5) and got[2].dtype == np.float32
    assert got[3].stride() == view.stride() and got[3].storage_offset() == view.storage_offset()
    assert torch.equal(got[3], view) and got[3].dtype == torch.bfloat16
    got[3].fill_(7)  # the two tensors still share one storage, margins included
    assert got[4].untyped_storage().data_ptr() == got[3].untyped_storage().data_ptr()
    assert torch.isnan(got[4]).all() and int((got[3].untyped_storage().nbytes())) == \
        buffer.untyped_storage().nbytes()
    assert got[5][0] == 2**70 and np.isnan(got[5][1]) and got[5][2] == 1 - 2j
    assert got[6] == {"dtype": torch.float16, "size": torch.Size([2, 3]), "cut": slice(1, None, 2)}
    assert got[7] == b"raw"


def test_the_channel_refuses_code():

    with pytest.raises(gc.ChannelError, match="is not data"):
        gc.encode((1, print))  # the grader never sends code
    stand_in = gc.decode(gc.encode((1, print), strict=False))[1]  # a notebook's answer may hold any
    assert isinstance(stand_in, gc.Opaque) and stand_in.callable and "builtin" in repr(stand_in)
    with pytest.raises(gc.ChannelError, match="not numeric"):
        import numpy as np
        gc.encode(np.array(["a"], dtype=object))


@pytest.mark.parametrize("forge", ["pickle", "unknown kind", "tensor past its storage",
                                   "object dtype", "deep", "truncated"])
def test_forged_messages_are_rejected_without_running_anything(tmp_path, forge):
    import struct

    import torch


    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    def message(tree, buffers=(), data=b""):
        head = json.dumps({"value": tree, "buffers": [list(b) for b in buffers]}).encode()
        return struct.pack("<4sQ", gc.MAGIC, len(head)) + head + data

    if forge == "pickle":
        raw = tmp_path / "evil.pt"
        torch.save({"x": Evil()}, raw)
        data = raw.read_bytes()
    elif forge == "unknown kind":
        data = message({"t": "call", "fn": "os.system", "args": ["true"]})
    elif forge == "tensor past its storage":
        data = message({"t": "tensor", "dtype": "float32", "shape": [100], "stride": [1],
                        "offset": 0, "storage": 0, "device": "cpu", "grad": False},
                       [(0, 8)], bytes(8))
    elif forge == "object dtype":
        data = message({"t": "nd", "dtype": "|O8", "shape": [1], "strides": [8], "offset": 0,
                        "buf": 0}, [(0, 8)], bytes(8))
    elif forge == "deep":
        tree = 1
        for _ in range(gc.MAX_DEPTH + 5):
            tree = {"t": "list", "items": [tree]}
        data = message(tree)
    else:
        data = gc.encode([1, 2, 3])[:-3]
    with pytest.raises(gc.ChannelError):
        gc.decode(data)
    assert not marker.exists()


def test_answer_files_that_are_links_pipes_or_too_large_are_refused(tmp_path):

    secret = tmp_path / "secret.txt"
    secret.write_text("the grader's own file")
    (tmp_path / "link").symlink_to(secret)
    os.mkfifo(tmp_path / "pipe")  # reading it would block forever
    with open(tmp_path / "huge", "wb") as f:
        f.truncate(gc.MAX_MESSAGE_BYTES + 1)
    for name, why in (("link", "no answer file"), ("pipe", "not a regular file"),
                      ("huge", "over the limit"), ("missing", "no answer file")):
        with pytest.raises(gc.ChannelError, match=why):
            gc.read_message(tmp_path / name)


def test_a_learner_error_comes_back_with_its_line():
    from course_lib.teaching import checks

    class Mine(Exception):
        pass

    def answer(x):
        try:
            return [1, 2][x]
        except IndexError as exc:
            raise Mine("no such row") from exc

    try:
        answer(5)
    except Mine as exc:
        described = gc.describe_exception(exc)
    rebuilt = gc.rebuild_exception(json.loads(json.dumps(described)))  # as data, both ways
    assert type(rebuilt).__name__ == "Mine" and type(rebuilt).__module__ == "learner"
    assert isinstance(rebuilt.__cause__, IndexError)
    frame = checks.learner_frame(rebuilt)  # the diagnoses quote the learner's own line
    assert frame.line.strip() == 'raise Mine("no such row") from exc'
    assert checks._short_error(rebuilt) == (f"Mine: no such row (line {frame.lineno}: "
                                            f"`raise Mine(\"no such row\") from exc`)")


def test_a_course_cloned_under_tmp_keeps_its_solutions_hidden(tmp_path, monkeypatch):
    """A clean clone under /tmp (as CI may make it): the course is bound again over the empty /tmp,
    and the hidden folders' empty mounts must come after that bind, or it shows them again (a
    clone in /tmp/x graded trudy's copy of the solutions as passed). Runs without bubblewrap:
    it reads the command line."""
    course = tmp_path / "course"
    (course / "solutions").mkdir(parents=True)
    (course / ".git").mkdir()
    private = tmp_path / "private"
    private.mkdir()
    monkeypatch.setattr(sandbox, "_needed_paths", lambda: [course.resolve()])
    args = sandbox.bubblewrap_args("bwrap", [course / "solutions", course / ".git"], private)
    bind = args.index(str(course.resolve()))  # the --ro-bind of the course
    assert args[bind - 1] == "--ro-bind"
    for hidden in ("solutions", ".git"):
        mount = args.index(str((course / hidden).resolve()))
        assert args[mount - 1] == "--tmpfs" and mount > bind, args
