"""macOS and Windows: PyPI has no triton wheel there, so the course installs without it
(pyproject.toml's platform marker). Chapters 00-04 (NumPy and torch) must run all the same, and
the set-up line must say why the Triton chapters need Linux or WSL2. Here triton is hidden from a
fresh Python (an import hook in sitecustomize.py, as if it were not installed); the learner
notebooks 00-04 run top to bottom so, stubs and all, in tests/test_no_false_pass.py (its one run
of every learner notebook)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ch00

HIDE_TRITON = '''
import sys

class _NoTriton:
    """Finds no triton: as on macOS and Windows."""
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, _NoTriton())
'''


def environment_without_triton(folder: Path) -> dict:
    """This process's environment with triton hidden from any Python started with it (a
    sitecustomize.py in ``folder``)."""
    (folder / "sitecustomize.py").write_text(HIDE_TRITON)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))


# The learner notebooks that must run without triton. tests/test_no_false_pass.py runs 01-04 so
# (its one run of every learner notebook) and asserts the set-up line; chapter 00, whose Triton
# smoke test prints another line without triton (an output nbval compares), runs below.
NUMPY_CHAPTERS = sorted(p.stem for p in (ROOT / "notebooks").glob("0[0-4]_*.ipynb"))
RUN_HERE = NUMPY_CHAPTERS[:1]
RUN_HERE_WITHOUT_TRITON = NUMPY_CHAPTERS[1:]


@pytest.fixture(scope="module")
def env_without_triton(tmp_path_factory):
    return environment_without_triton(tmp_path_factory.mktemp("no_triton"))


def test_setup_says_why_and_the_numpy_chapters_import(env_without_triton):
    code = ("import sys\n"
            "from course_lib.platform import runtime\n"
            "rt = runtime.setup()\n"
            "try:\n    import triton\nexcept ImportError:\n    pass\nelse:\n    raise AssertionError('triton is not hidden')\n"
            "from course_lib.teaching.exercises import ch00, ch01, ch02, ch03, ch04\n"
            "from course_lib.teaching import checks, concept_questions\n"
            "from course_lib.attention import costmodel, iomodel, reference, softmax, tiled\n"
            "from course_lib.teaching.widgets import hints, memory, quiz, roofline, softmax_stepper, tiling\n"
            "assert 'triton' not in sys.modules\n"
            "print('mode', rt.mode)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env_without_triton, capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CPU mode without Triton" in done.stdout and "need Linux or WSL2" in done.stdout
    assert "mode interpreter" in done.stdout


def test_the_numpy_chapters_are_run_without_triton():
    """Every NumPy chapter runs without triton, here or in test_no_false_pass.py."""
    import test_no_false_pass

    assert RUN_HERE == ["00_setup_and_roadmap"] and len(NUMPY_CHAPTERS) == 5
    assert set(RUN_HERE_WITHOUT_TRITON) <= set(test_no_false_pass.LEARNER_NOTEBOOKS)


@pytest.mark.parametrize("name", RUN_HERE)
def test_numpy_chapters_run_without_triton(name, env_without_triton):
    import nbformat
    from nbclient import NotebookClient

    path = ROOT / "notebooks" / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env_without_triton)  # raises CellExecutionError naming the failing cell
    setup = next(c for c in nb.cells if c.cell_type == "code" and "runtime.setup()" in c.source)
    first = "".join(o.get("text", "") for o in setup.outputs)
    assert "CPU mode without Triton" in first

