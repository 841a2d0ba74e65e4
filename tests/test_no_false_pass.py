"""No false ✓: a check never passes the library's own code, whatever cell the learner re-runs.

A check cell reads ``answer = chNN.check_answer(answer)``. When the exercise is not done, the
check hands the library's version back, so ``answer`` is then the library's. Re-running only the
check cell (after editing the exercise cell without running it) must say "not done yet — run the
exercise cell, then this one", never ✓. Checked for every check of every chapter (in-process) and
end to end in real kernels on every learner notebook (nbclient), as a learner would do it.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

from course_lib.teaching import checks
from course_lib.attention import softmax
from course_lib.teaching.checks import ExerciseFailed

import test_without_triton as without_triton_module

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.stem for p in (Path(__file__).parents[1] / "course_lib" / "teaching" / "exercises")
                  .glob("ch[0-9][0-9].py"))
CHECK_CELL = re.compile(r"\bch\d\d\.check_\w+\(")


def all_checks():
    found = []
    for chapter in CHAPTERS:
        module = importlib.import_module(f"course_lib.teaching.exercises.{chapter}")
        for name, fn in vars(module).items():
            if name.startswith("check_") and inspect.isfunction(fn) and fn.__module__ == module.__name__:
                found.append(pytest.param(fn, id=f"{chapter}.{name}"))
    return found


@pytest.mark.parametrize("check", all_checks())
def test_every_check_is_a_learner_check(check):
    assert getattr(check, "__learner_check__", False), (
        f"{check.__name__} lacks @learner_check: re-running its cell could pass the library's code")


@pytest.mark.library_answers_refused
@pytest.mark.parametrize("check", all_checks())
def test_a_check_handed_the_library_version_says_not_done(check, capsys, tmp_path, monkeypatch):
    """Whatever library object comes back into a check (here: one of the library's functions, in
    every argument), the check prints "not done yet" with what to do, records it, never ✓."""
    log = tmp_path / "grades.jsonl"
    monkeypatch.setenv(checks.GRADE_LOG_ENV, str(log))
    params = [p for p in inspect.signature(check).parameters.values()
              if p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    check(*[softmax.online_softmax] * len(params))
    out = capsys.readouterr().out
    assert "✓" not in out
    assert "not done yet" in out and "still the library's version" in out, out
    assert "Run the exercise cell" in out
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows and all(r["status"] == "not done" for r in rows)


def test_library_answers_are_told_apart_from_learner_answers():
    assert checks.is_library_object(softmax.online_softmax)
    from course_lib.kernels import primer
    assert checks.is_library_object(primer.add_kernel)  # a Triton JITFunction: its .fn's module

    def mine(x, block_size):
        return softmax.online_softmax(x, block_size)  # uses the library, but is the learner's
    assert not checks.is_library_object(mine)
    assert not checks.is_library_object(3) and not checks.is_library_object(None)


def test_code_that_is_not_callable_is_still_recognised():
    """Chapter 10 hands back a switched model kernel (subscriptable, not callable): a check handed
    it, or anything wrapping library code, says "not done yet"."""
    import functools

    from course_lib.teaching.exercises import ch10
    assert not callable(ch10.VARLEN_KERNEL)
    answers = checks._answers_in([ch10.VARLEN_KERNEL, 3, "cuda", None, [ch10.BLOCK_SPARSE_KERNEL]])
    assert answers == [ch10.VARLEN_KERNEL, ch10.BLOCK_SPARSE_KERNEL]
    assert all(checks.is_library_object(a) for a in answers)
    wrapped = functools.wraps(softmax.online_softmax)(lambda *a: softmax.online_softmax(*a))
    assert checks.is_library_object(functools.partial(softmax.online_softmax, block_size=4))
    assert checks.is_library_object(wrapped)  # __wrapped__ leads back to the library

    class Holder:  # a learner's object that carries a handed-back fallback is the library's
        pass
    handed = Holder()
    assert not checks.is_library_object(handed)
    checks._HANDED_BACK[id(handed)] = handed
    try:
        assert checks.is_library_object(handed)
    finally:
        del checks._HANDED_BACK[id(handed)]


def test_strict_mode_makes_not_done_a_failure(monkeypatch, capsys):
    from course_lib.teaching.exercises import ch03

    def stub(m, l, x_tile):
        raise NotImplementedError("Exercise 3.1")

    assert ch03.check_online_update(stub) is softmax.online_update  # not done: the library's
    assert "not done yet" in capsys.readouterr().out
    monkeypatch.setenv("COURSE_STRICT", "1")
    with pytest.raises(ExerciseFailed, match="COURSE_STRICT=1"):
        ch03.check_online_update(stub)


def test_every_outcome_is_recorded_for_grading(monkeypatch, tmp_path, capsys):
    from course_lib.teaching.exercises import ch03

    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(checks.GRADE_LOG_ENV, str(log))

    def stub(m, l, x_tile):
        raise NotImplementedError

    def no_rescale(m, l, x_tile):
        import numpy as np
        m_new = np.maximum(m, x_tile.max(-1))
        return m_new, l + np.exp(x_tile - m_new[..., None]).sum(-1)

    ch03.check_online_update(stub)
    ch03.check_online_update(softmax.online_update.__wrapped__
                             if hasattr(softmax.online_update, "__wrapped__") else
                             (lambda m, l, x: softmax.online_update(m, l, x)))
    with pytest.raises(ExerciseFailed):
        ch03.check_online_update(no_rescale)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["exercise"], r["status"]) for r in rows] == [
        ("Exercise 3.1", "not done"), ("Exercise 3.1", "passed"), ("Exercise 3.1", "wrong")]
    assert "likely cause" in rows[-1]["message"]


# ---- end to end, in real kernels, as a learner does it ------------------------------------------

def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") == "error":
            parts.append("\n".join(out.get("traceback", [])))
        else:
            parts.append(str(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


LEARNER_NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _notebook_has_checks(name: str) -> bool:
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    return any(c.cell_type == "code" and CHECK_CELL.search(c.source) for c in nb.cells)


def _nbval_markers(cell) -> dict:
    """nbval's markers of a cell (its own parsers: ``# NBVAL_...`` comments and tags), e.g.
    ``{"check": True}`` for ``# NBVAL_CHECK_OUTPUT``, ``{"skip": True}``, ``{"check_exception": True}``."""
    from nbval.plugin import find_comment_markers, find_metadata_tags

    return {**dict(find_metadata_tags(cell.metadata) or ()), **dict(find_comment_markers(cell.source))}


# What nbval leaves out of a comparison (nbval.plugin.IPyNbFile.skip_compare, without --nbdime)
_NBVAL_SKIP_COMPARE = ("metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
                       "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg")


def _comparable(outputs) -> dict:
    """A cell's outputs as nbval compares them (``--nbval-lax``, no sanitizing): streams of one
    name merged, then ``{field or MIME type: [values in order]}`` without the fields nbval skips."""
    from nbval.plugin import coalesce_streams, transform_streams_for_comparison

    flat: dict = {}
    for out in transform_streams_for_comparison(coalesce_streams(copy.deepcopy(outputs))):
        for key, value in out.items():
            if key in _NBVAL_SKIP_COMPARE:
                continue
            items = value.items() if key == "data" else [(key, value)]
            for field, v in items:
                if field not in _NBVAL_SKIP_COMPARE:
                    flat.setdefault(field, []).append(v)
    return flat


def _chapter_param(name: str):
    return pytest.param(name, id=name, marks=[getattr(pytest.mark, f"ch{name[:2]}")])


@pytest.mark.slow
@pytest.mark.parametrize("name", [_chapter_param(n) for n in LEARNER_NOTEBOOKS])
def test_learner_notebook_runs_and_rerunning_a_check_cell_never_passes(name, tmp_path):
    """Run the learner notebook top to bottom in a real kernel, as ``pytest --nbval-lax`` would
    (this test is ``make test``'s run of ``notebooks/``: nbval runs ``solutions/``): no cell raises
    unless marked to, cells marked ``# NBVAL_CHECK_OUTPUT`` print what is stored, ``# NBVAL_SKIP``
    cells are not run. After every check cell (the stub untouched: "not done yet"), run that
    check cell again, as a learner who edited the exercise cell but did not run it would: still
    "not done yet", never ✓. Every learner notebook is run (found by name), so a chapter added
    later is covered."""
    import nbformat
    from nbclient import NotebookClient

    path = ROOT / "notebooks" / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    seen, unexpected, differ = [], [], []
    # The NumPy chapters run as on macOS and Windows, where PyPI has no triton (test_without_triton):
    # one run of each proves both (the browser tests run them with triton, in JupyterLab)
    without_triton = name in without_triton_module.RUN_HERE_WITHOUT_TRITON
    env = {"env": without_triton_module.environment_without_triton(tmp_path)} if without_triton else {}
    with client.setup_kernel(**env):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            markers = _nbval_markers(cell)
            if markers.get("skip"):
                continue
            stored = copy.deepcopy(cell.outputs)
            client.execute_cell(cell, index)
            first = _text(cell)
            raised = any(o.get("output_type") == "error" for o in cell.outputs)
            if raised != bool(markers.get("check_exception")):
                unexpected.append(f"cell {index}: {'raised' if raised else 'did not raise'}: {first[-600:]}")
            if markers.get("check") and _comparable(cell.outputs) != _comparable(stored):
                differ.append(f"cell {index}: stored {_comparable(stored)}\n  now {_comparable(cell.outputs)}")
            if not CHECK_CELL.search(cell.source) or "not done yet" not in first:
                continue  # not a check cell, or one that shows a wrong answer on purpose
            assert "✓" not in first, first
            again = copy.deepcopy(cell)
            client.execute_cell(again, index)
            second = _text(again)
            assert "✓" not in second, f"cell {index} re-run alone passed:\n{second}"
            assert "still the library's version" in second and "Run the exercise cell" in second, second
            seen.append(index)
    assert not unexpected, "\n".join(unexpected)
    assert not differ, "outputs of # NBVAL_CHECK_OUTPUT cells changed:\n" + "\n".join(differ)
    if without_triton:  # the set-up line says why the Triton chapters need Linux or WSL2
        setup = next(c for c in nb.cells if c.cell_type == "code" and "runtime.setup()" in c.source)
        assert "CPU mode without Triton" in _text(setup), _text(setup)
    if _notebook_has_checks(name):
        assert seen, f"{name}: no check cell said 'not done yet' in the learner notebook"


def test_the_learner_notebooks_comparison_is_nbvals():
    """The comparison above fails where nbval's would: a changed line of a stream, a changed
    execute result, an extra output; and ignores what nbval ignores (execution counts, images)."""
    from nbformat.v4 import new_output

    stored = [new_output("stream", name="stdout", text="a\n"), new_output("stream", name="stdout", text="b\n"),
              new_output("execute_result", data={"text/plain": "3", "image/png": "xx"}, execution_count=1)]
    same = [new_output("stream", name="stdout", text="a\nb\n"),
            new_output("execute_result", data={"text/plain": "3", "image/png": "yy"}, execution_count=7)]
    assert _comparable(same) == _comparable(stored)
    for changed in ([new_output("stream", name="stdout", text="a\nc\n"), same[1]],
                    [same[0], new_output("execute_result", data={"text/plain": "4"}, execution_count=1)],
                    [*same, new_output("stream", name="stderr", text="warning\n")]):
        assert _comparable(changed) != _comparable(stored)
    assert _nbval_markers(nbformat_cell("# NBVAL_CHECK_OUTPUT\nprint(1)")) == {"check": True}
    assert _nbval_markers(nbformat_cell("x = 1", tags=["raises-exception"])) == {"check_exception": True}


def nbformat_cell(source: str, tags=()):
    from nbformat.v4 import new_code_cell

    return new_code_cell(source, metadata={"tags": list(tags)} if tags else {})


def test_make_test_runs_every_learner_notebook_once():
    """nbval runs ``solutions/``; the learner notebooks run in the test above (not a second time
    through nbval): pytest's paths are ``tests`` and ``solutions``."""
    import tomllib

    paths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    assert "solutions" in paths and "notebooks" not in paths and "tests" in paths
