"""Shared test configuration: chapter markers for notebooks, GPU skipping, fresh RNG seeds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_CHAPTER_RE = re.compile(r"^(\d\d)_")


def pytest_configure(config):
    """Choose GPU or interpreter once, before any test module imports torch.optim, triton or a
    kernel module (as every notebook's first cell does)."""
    from course_lib import runtime

    runtime.setup(verbose=False)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (its hook has no order of its own)
def pytest_collection_modifyitems(config, items):
    """Give every nbval item its chapter marker (from the notebook's file name), so that
    ``pytest -m ch03`` runs chapter 03's unit tests *and* both versions of its notebook.

    For ``-n 2 --dist loadgroup`` (pyproject's addopts): every item not already in an
    ``xdist_group`` joins its file's group (a notebook's cells, and a module's fixtures, stay in
    one worker, as ``--dist loadfile`` would keep them; a test may name a finer group, as the
    learner-notebook runs of test_no_false_pass.py do, one per notebook). Items run longest
    first (browser and slow tests, then notebooks), so that at the end both workers are busy
    with short files rather than one waiting for the other's long one."""
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            m = _CHAPTER_RE.match(path.name)
            if m:
                item.add_marker(getattr(pytest.mark, f"ch{m.group(1)}"))
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_relative(path)))
    items.sort(key=_expected_length)


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _expected_length(item) -> int:
    """0 for the long items (a real browser, or marked slow), 1 for notebook cells, 2 for the rest."""
    if item.get_closest_marker("browser") or item.get_closest_marker("slow"):
        return 0
    return 1 if Path(str(item.fspath)).suffix == ".ipynb" else 2


def _gpu_mode() -> bool:
    """True when the course runs its kernels on a GPU (a CUDA GPU Triton supports)."""
    from course_lib import runtime

    return runtime.current().on_gpu


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and not _gpu_mode():
        pytest.skip("needs a CUDA GPU of compute capability 8.0+ (this machine has none; run on "
                    "the GPU machine, see README)")


@pytest.fixture
def device() -> str:
    """The torch device tests run kernels on: CUDA when present, else CPU (Triton interpreter)."""
    from course_lib import runtime

    return runtime.current().device


@pytest.fixture(autouse=True)
def _library_answers_allowed(request):
    """The tests hand the checks mistake models and answer keys defined in course_lib.exercises
    as if a learner had written them; a test marked ``library_answers_refused`` sees the checks
    as a notebook does (library objects are "not done yet", never ✓)."""
    from course_lib import checks

    allowed = request.node.get_closest_marker("library_answers_refused") is None
    with checks.library_answers_allowed(allowed):
        yield
