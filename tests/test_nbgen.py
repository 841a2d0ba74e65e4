"""The notebook generator: stripping, clearing, --check, and its errors."""

import json
import re
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_lib.teaching import nbgen

pytestmark = pytest.mark.ch00


def _write(path, cells):
    nb = new_notebook(cells=cells)
    nbformat.write(nb, str(path))
    return path


SOLVED = '''# Exercise 3.1: the running update
def update(m, l, x):
    """docstring stays"""
    ### BEGIN SOLUTION
    m_new = max(m, x)
    return m_new, l
    ### END SOLUTION'''


def test_block_becomes_indented_not_implemented():
    out = nbgen.strip_solutions(SOLVED, "nb, cell 0")
    assert 'raise NotImplementedError("Exercise 3.1: the running update")' in out
    assert "    raise NotImplementedError" in out  # the block's indentation
    assert "m_new" not in out and "docstring stays" in out
    compile(out, "<cell>", "exec")  # still valid Python


def test_dedented_comment_inside_a_block_is_allowed():
    src = "# Exercise 1.3: c\nfor j in r:\n    ### BEGIN SOLUTION\n# a note\n    s = 1\n    ### END SOLUTION\n"
    compile(nbgen.strip_solutions(src, "w"), "<cell>", "exec")


def test_two_blocks_and_top_level_block():
    src = "# Exercise 1.2: two parts\nx = 1\n### BEGIN SOLUTION\ny = 2\n### END SOLUTION\nif x:\n    ### BEGIN SOLUTION\n    z = 3\n    ### END SOLUTION\n"
    out = nbgen.strip_solutions(src, "w")
    assert out.count("NotImplementedError") == 2
    compile(out, "<cell>", "exec")


@pytest.mark.parametrize("src, message", [
    ("# Exercise 1.1: a\n### BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("# Exercise 1.1: a\nx = 1\n### END SOLUTION\n", "without a matching"),
    ("# Exercise 1.1: a\n### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "nested"),
    ("x = 1\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION\n", "Exercise N.M"),
    # chapter 04's old exercise 4.1: a block opened inside a loop that runs on past the loop's end
    ("# Exercise 4.1: a\nfor j in r:\n    ### BEGIN SOLUTION\n    s = 1\no = s\n    ### END SOLUTION\n",
     r"line 5: the solution dedents below its '### BEGIN SOLUTION' marker \(4 spaces\)"),
])
def test_malformed_markers_name_the_place(src, message):
    with pytest.raises(nbgen.NotebookError, match=message) as info:
        nbgen.strip_solutions(src, "07_x.ipynb, cell 4")
    assert "07_x.ipynb, cell 4" in str(info.value)


def test_markers_outside_code_cell_name_notebook_and_cell():
    nb = new_notebook(cells=[new_markdown_cell("intro"), new_markdown_cell("### BEGIN SOLUTION")])
    with pytest.raises(nbgen.NotebookError, match=r"03_x.ipynb, cell 1: solution markers in a markdown cell"):
        nbgen.generate(nb, "03_x.ipynb")


def test_outputs_cleared_except_check_output_text():
    plain = new_code_cell("print(1)", execution_count=3,
                          outputs=[nbformat.v4.new_output("stream", name="stdout", text="1\n")])
    checked = new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(2)", execution_count=4, outputs=[
        nbformat.v4.new_output("stream", name="stdout", text="2\n"),
        nbformat.v4.new_output("display_data", data={"image/png": "AAAA", "text/plain": "<Figure>"})])
    nb = new_notebook(cells=[plain, checked])
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {}}
    nb.metadata["kernelspec"] = {"name": "myenv", "display_name": "x", "language": "python"}
    out = nbgen.generate(nb, "n.ipynb")
    assert out["cells"][0]["outputs"] == [] and out["cells"][0]["execution_count"] is None
    kept = out["cells"][1]["outputs"]
    assert [o["output_type"] for o in kept] == ["stream", "display_data"]
    assert "image/png" not in kept[1]["data"]
    assert "widgets" not in out["metadata"]
    assert out["metadata"]["kernelspec"]["name"] == "python3"


def test_build_and_check_cycle(tmp_path):
    sol, nbs = tmp_path / "solutions", tmp_path / "notebooks"
    sol.mkdir()
    _write(sol / "01_a.ipynb", [new_code_cell(SOLVED)])
    stale = ["solutions/01_a.ipynb (nbgrader metadata)", "01_a.ipynb"]
    before = (sol / "01_a.ipynb").read_text()
    assert nbgen.build(sol, nbs, check=True) == stale  # missing, and the solution not yet stamped
    assert (sol / "01_a.ipynb").read_text() == before  # --check writes nothing
    assert nbgen.build(sol, nbs) == stale
    assert nbgen.build(sol, nbs, check=True) == []
    # the solution is stamped, and the learner notebook carries the same metadata
    stamped = json.loads((sol / "01_a.ipynb").read_text())["cells"][-1]["metadata"]["nbgrader"]
    assert stamped["grade_id"] == "exercise_3_1" and stamped["solution"] is True
    learner = json.loads((nbs / "01_a.ipynb").read_text())["cells"][-1]  # after nbgen's Colab cell
    assert learner["metadata"]["nbgrader"] == stamped and "m_new" not in nbgen._source(learner)
    # a hand edit of the learner notebook is detected
    target = nbs / "01_a.ipynb"
    target.write_text(target.read_text().replace("running update", "edited"))
    assert nbgen.build(sol, nbs, check=True) == ["01_a.ipynb"]
    # a learner notebook without a solution is detected
    (nbs / "09_orphan.ipynb").write_text("{}")
    assert "09_orphan.ipynb (has no solution notebook)" in nbgen.build(sol, nbs, check=True)


def test_corrupt_json_names_the_file(tmp_path):
    sol = tmp_path / "solutions"
    sol.mkdir()
    (sol / "02_bad.ipynb").write_text('{"cells": [ this is not json')
    out = subprocess.run([sys.executable, "-m", "course_lib.teaching.nbgen", "--solutions", str(sol),
                          "--notebooks", str(tmp_path / "nb")], capture_output=True, text=True)
    assert out.returncode == 2
    assert "02_bad.ipynb: not a readable notebook" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_check_names_out_of_step_notebook(tmp_path):
    sol, nbs = tmp_path / "solutions", tmp_path / "notebooks"
    sol.mkdir()
    _write(sol / "05_b.ipynb", [new_code_cell(SOLVED)])
    args = [sys.executable, "-m", "course_lib.teaching.nbgen", "--solutions", str(sol), "--notebooks", str(nbs)]
    out = subprocess.run(args + ["--check"], capture_output=True, text=True)
    assert out.returncode == 1 and "out of step: notebooks/05_b.ipynb" in out.stderr
    assert subprocess.run(args, capture_output=True).returncode == 0
    assert subprocess.run(args + ["--check"], capture_output=True).returncode == 0


def test_repository_notebooks_are_in_step():
    """notebooks/ must be exactly what the generator makes from solutions/."""
    stale = nbgen.build(nbgen.ROOT / "solutions", nbgen.ROOT / "notebooks", check=True)
    assert not stale, f"run `python -m course_lib.teaching.nbgen`; out of step: {stale}"


def test_every_solution_notebook_has_matching_learner_exercises():
    for path in sorted((nbgen.ROOT / "solutions").glob("*.ipynb")):
        sol = json.loads(path.read_text())
        learner = json.loads((nbgen.ROOT / "notebooks" / path.name).read_text())
        n_blocks = sum(nbgen._source(c).count(nbgen.BEGIN) for c in sol["cells"])
        n_stubs = sum(nbgen._source(c).count("raise NotImplementedError(\"Exercise")
                      for c in learner["cells"])
        assert n_blocks == n_stubs, path.name


# --------------------------------------------------------------------------------------------
# nbgrader metadata (what `nbgrader generate_assignment` needs: its schema version 3)
# --------------------------------------------------------------------------------------------

NBGRADER_KEYS = {"schema_version", "grade", "locked", "solution", "task", "grade_id", "points"}


def _assert_valid_nbgrader(nb, name):
    """The rules nbgrader 0.9's MetadataValidatorV3 and ClearSolutions apply, restated."""
    ids = []
    for i, cell in enumerate(nb["cells"]):
        meta = cell.get("metadata", {}).get("nbgrader")
        src = nbgen._source(cell)
        if nbgen.BEGIN in src:  # "Solution region detected in a non-solution cell" otherwise
            assert meta and meta["solution"] is True, f"{name}, cell {i}"
        if meta is None:
            continue
        assert set(meta) <= NBGRADER_KEYS and {"schema_version", "grade", "locked", "solution"} <= set(meta)
        assert meta["schema_version"] == 3
        assert re.fullmatch(r"[a-zA-Z0-9_\-]+", meta["grade_id"])
        if meta["grade"]:
            assert isinstance(meta["points"], (int, float)) and meta["points"] >= 0
        else:
            assert "points" not in meta
        assert cell["cell_type"] == "code"  # markdown solution/grade cells have further rules
        ids.append(meta["grade_id"])
    assert len(ids) == len(set(ids)), f"{name}: duplicate grade ids {ids}"
    return ids


@pytest.mark.parametrize("path", sorted((nbgen.ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.name[:2])
def test_stamped_solutions_are_what_nbgrader_needs(path):
    """Stamped in memory (the repository's files are not written): every exercise cell becomes a
    solution cell, the cell calling its check a locked test cell worth 1 point; nothing else
    changes, and stamping again changes nothing."""
    nb = nbgen.load_notebook(path)
    for cell in nb["cells"]:  # as if never stamped
        cell.get("metadata", {}).pop("nbgrader", None)
    stamped = nbgen.stamp_nbgrader(nb)
    assert nbgen.stamp_nbgrader(stamped) == stamped
    ids = _assert_valid_nbgrader(stamped, path.name)
    exercises = nbgen.exercise_cells(nb)
    assert exercises and len(ids) == 2 * len(exercises)  # every exercise has its check cell
    for ex, i, check in exercises:
        tag = ex.replace(".", "_")
        assert stamped["cells"][i]["metadata"]["nbgrader"] == {
            "grade": False, "grade_id": f"exercise_{tag}", "locked": False, "schema_version": 3,
            "solution": True, "task": False}
        assert stamped["cells"][check]["metadata"]["nbgrader"] == {
            "grade": True, "grade_id": f"check_{tag}", "locked": True, "points": 1,
            "schema_version": 3, "solution": False, "task": False}
        assert f".check_" in nbgen._source(stamped["cells"][check])
    touched = {i for _, i, _ in exercises} | {c for _, _, c in exercises}
    for i, (a, b) in enumerate(zip(nb["cells"], stamped["cells"])):
        if i not in touched:
            assert a == b, f"{path.name}, cell {i} changed"
        else:
            assert {k: v for k, v in a.items() if k != "metadata"} == {k: v for k, v in b.items() if k != "metadata"}


def test_stamping_keeps_an_instructors_points_and_drops_stale_ids():
    nb = new_notebook(cells=[new_code_cell(SOLVED), new_code_cell("update = ch03.check_online_update(update)"),
                             new_code_cell("print('a cell that used to be a check')")])
    nb.cells[1].metadata["nbgrader"] = {"grade": True, "grade_id": "check_3_1", "locked": True,
                                        "points": 4, "schema_version": 3, "solution": False}
    nb.cells[2].metadata["nbgrader"] = {"grade": True, "grade_id": "check_3_9", "locked": True,
                                        "points": 1, "schema_version": 3, "solution": False}
    manual = {"grade": True, "grade_id": "essay_1", "locked": False, "points": 2,
              "schema_version": 3, "solution": True}
    nb.cells.append(new_markdown_cell("Explain.", metadata={"nbgrader": manual}))
    out = nbgen.stamp_nbgrader(nb)
    assert out["cells"][1]["metadata"]["nbgrader"]["points"] == 4
    assert "nbgrader" not in out["cells"][2]["metadata"]
    assert out["cells"][3]["metadata"]["nbgrader"] == manual  # an instructor's own cell stays
    assert nb.cells[2].metadata["nbgrader"]["grade_id"] == "check_3_9"  # the input is not modified
