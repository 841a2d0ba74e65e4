"""Shared test configuration: chapter markers for notebooks, GPU skipping, fresh RNG seeds."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_CHAPTER_RE = re.compile(r"^(\d\d)_")


def pytest_configure(config):
    """Choose GPU or interpreter once, before any test module imports torch.optim, triton or a
    kernel module (as every notebook's first cell does) — in each process that runs tests: not
    in pytest-xdist's controller, which only hands files to its workers (torch and triton cost it
    seconds of CPU for nothing)."""
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", default=None):
        return  # the controller of -n N: every worker calls this itself
    from course_lib.platform import runtime

    runtime.setup(verbose=False)


# Workers per core for ``-n auto``: one more worker than cores keeps both cores busy while a
# worker waits on a child process of its own (a notebook kernel, a cross-compile, a grading run).
EXTRA_WORKERS = 1


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): the cores this process may use, plus
    :data:`EXTRA_WORKERS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) + EXTRA_WORKERS


def pytest_collection_modifyitems(config, items):
    """Give every nbval item its chapter marker (from the notebook's file name), so that
    ``pytest -m ch03`` runs chapter 03's unit tests *and* both versions of its notebook.

    Then order the files longest first, by the seconds each took in a recorded run
    (tests/durations.json; stable, so a notebook's cells keep their order): ``-n 2 --dist
    loadfile`` (pyproject's addopts) hands out files in this order, so both workers end on short
    files rather than one waiting for the other's long one.
    (``--dist loadgroup`` could split a file further, but xdist 3.8 marks a group by rewriting
    ``item._nodeid``, which pytest 9.2's ``nodeid`` no longer reads: every cell of a notebook
    became its own unit of work.)"""
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            m = _CHAPTER_RE.match(path.name)
            if m:
                item.add_marker(getattr(pytest.mark, f"ch{m.group(1)}"))
    by_file: dict = {}
    for item in items:  # a file is as long as its longest item; within a file the order stays
        by_file[item.fspath] = max(by_file.get(item.fspath, 0), _expected_seconds(item))
    items.sort(key=lambda item: -by_file[item.fspath])


# Seconds each file took in a make test run on the 2-core machine (tests/durations.json; refresh
# it with `python tools/test_durations.py` from a run with --durations=0 when files grow).
_DURATIONS = json.loads((Path(__file__).parent / "durations.json").read_text())


def _expected_seconds(item) -> float:
    """The file's recorded seconds; a file not recorded yet: 60 for the long items (a real browser,
    or marked slow), 10 for a notebook, 2 for the rest."""
    path = Path(str(item.fspath))
    try:
        recorded = _DURATIONS.get(path.relative_to(ROOT).as_posix())
    except ValueError:
        recorded = None
    if recorded is not None:
        return recorded
    if item.get_closest_marker("browser") or item.get_closest_marker("slow"):
        return 60
    return 10 if path.suffix == ".ipynb" else 2


def _gpu_mode() -> bool:
    """True when the course runs its kernels on a GPU (a CUDA GPU Triton supports)."""
    from course_lib.platform import runtime

    return runtime.current().on_gpu


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and not _gpu_mode():
        pytest.skip("needs a CUDA GPU of compute capability 8.0+ (this machine has none; run on "
                    "the GPU machine, see README)")


@pytest.fixture
def device() -> str:
    """The torch device tests run kernels on: CUDA when present, else CPU (Triton interpreter)."""
    from course_lib.platform import runtime

    return runtime.current().device


@pytest.fixture(autouse=True)
def _library_answers_allowed(request):
    """The tests hand the checks mistake models and answer keys defined in course_lib.teaching.exercises
    as if a learner had written them; a test marked ``library_answers_refused`` sees the checks
    as a notebook does (library objects are "not done yet", never ✓)."""
    from course_lib.teaching import checks

    allowed = request.node.get_closest_marker("library_answers_refused") is None
    with checks.library_answers_allowed(allowed):
        yield
