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


def pytest_collection_modifyitems(config, items):
    """Give every nbval item its chapter marker (from the notebook's file name), so that
    ``pytest -m ch03`` runs chapter 03's unit tests *and* both versions of its notebook."""
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            m = _CHAPTER_RE.match(path.name)
            if m:
                item.add_marker(getattr(pytest.mark, f"ch{m.group(1)}"))


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
