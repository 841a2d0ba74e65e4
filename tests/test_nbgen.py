"""The notebook generator: stripping, clearing, --check, and its errors."""

import json
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_lib import nbgen

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
    assert nbgen.build(sol, nbs, check=True) == ["01_a.ipynb"]  # missing
    assert nbgen.build(sol, nbs) == ["01_a.ipynb"]
    assert nbgen.build(sol, nbs, check=True) == []
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
    out = subprocess.run([sys.executable, "-m", "course_lib.nbgen", "--solutions", str(sol),
                          "--notebooks", str(tmp_path / "nb")], capture_output=True, text=True)
    assert out.returncode == 2
    assert "02_bad.ipynb: not a readable notebook" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_check_names_out_of_step_notebook(tmp_path):
    sol, nbs = tmp_path / "solutions", tmp_path / "notebooks"
    sol.mkdir()
    _write(sol / "05_b.ipynb", [new_code_cell(SOLVED)])
    args = [sys.executable, "-m", "course_lib.nbgen", "--solutions", str(sol), "--notebooks", str(nbs)]
    out = subprocess.run(args + ["--check"], capture_output=True, text=True)
    assert out.returncode == 1 and "out of step: notebooks/05_b.ipynb" in out.stderr
    assert subprocess.run(args, capture_output=True).returncode == 0
    assert subprocess.run(args + ["--check"], capture_output=True).returncode == 0


def test_repository_notebooks_are_in_step():
    """notebooks/ must be exactly what the generator makes from solutions/."""
    stale = nbgen.build(nbgen.ROOT / "solutions", nbgen.ROOT / "notebooks", check=True)
    assert not stale, f"run `python -m course_lib.nbgen`; out of step: {stale}"


def test_every_solution_notebook_has_matching_learner_exercises():
    for path in sorted((nbgen.ROOT / "solutions").glob("*.ipynb")):
        sol = json.loads(path.read_text())
        learner = json.loads((nbgen.ROOT / "notebooks" / path.name).read_text())
        n_blocks = sum(nbgen._source(c).count(nbgen.BEGIN) for c in sol["cells"])
        n_stubs = sum(nbgen._source(c).count("raise NotImplementedError(\"Exercise")
                      for c in learner["cells"])
        assert n_blocks == n_stubs, path.name
