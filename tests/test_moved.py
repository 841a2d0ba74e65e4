"""The module paths from before the layout (issue 38) still import, as the same module objects
(course_lib/_moved.py), so notebooks saved before it keep running."""

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib import _moved

ROOT = Path(__file__).resolve().parents[1]


def test_new_name_follows_a_moved_package_and_leaves_the_rest():
    assert _moved.new_name("course_lib.runtime") == "course_lib.platform.runtime"
    assert _moved.new_name("course_lib.exercises.ch05") == "course_lib.teaching.exercises.ch05"
    assert _moved.new_name("course_lib.kernels.sweep") == "course_lib.measure.sweep"
    assert _moved.new_name("course_lib.kernels.api") is None
    assert _moved.new_name("course_lib.ring_resultsx") is None  # a longer name is another module
    assert _moved.new_name("course_lib.ring_results") == "course_lib.measure.ring_results"


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_every_old_name_has_its_module_at_the_new_place(old):
    new = _moved.MOVED[old]
    spec = importlib.util.find_spec(new)
    assert spec is not None and spec.name == new
    assert not (ROOT / Path(*old.split("."))).with_suffix(".py").exists(), f"{old} is still at its old place"
    alias = importlib.util.find_spec(old)  # answered by the finder, without importing the module
    assert alias is not None and alias.origin == spec.origin


def test_an_old_path_is_the_same_module_object():
    from course_lib import checks as old_checks  # as a notebook saved before the layout says it
    from course_lib.exercises import ch03
    from course_lib.teaching import checks
    from course_lib.teaching.exercises import ch03 as new_ch03
    from course_lib.widgets.quiz import concept_check

    import course_lib.exercises.ch03 as dotted  # the other spelling: through the finder itself

    assert old_checks is checks and ch03 is new_ch03 and dotted is new_ch03
    assert sys.modules["course_lib.exercises.ch03"] is new_ch03
    assert ch03.__name__ == ch03.__spec__.name == "course_lib.teaching.exercises.ch03"
    assert concept_check is importlib.import_module("course_lib.teaching.widgets.quiz").concept_check


def test_the_finder_answers_nothing_when_the_new_module_is_missing(monkeypatch):
    monkeypatch.setitem(_moved.MOVED, "course_lib.not_a_module", "course_lib.platform.not_a_module")
    assert _moved._Finder().find_spec("course_lib.not_a_module") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("course_lib.not_a_module")


def test_python_m_with_an_old_path_runs_the_moved_module():
    done = subprocess.run([sys.executable, "-m", "course_lib.nbgen", "--check"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "in step" in done.stdout
