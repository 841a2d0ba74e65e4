"""The module paths from before the library was grouped by layer (issue 38), still importable.

Notebooks saved before the new layout say ``from course_lib import runtime`` or
``from course_lib.exercises import ch05``; those lines keep working: each old name in :data:`MOVED`
is answered with the module at its new name — the same module object, not a second copy, so a
kernel is decorated once and a switch set through one name is seen through the other. ``python -m
course_lib.nbgen`` (and every old ``python -m`` path) runs the module at its new place.

The library, its tests, tools and notebooks use the new names only (``tests/test_import_cycles.py``
fails on an old one inside ``course_lib``); ``tools/relayout.py`` reads :data:`MOVED` to move the
files and rewrite the old names. ``course_lib/__init__.py`` calls :func:`install` once; it adds one
finder to ``sys.meta_path`` that answers for the old names only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old module (or package: its submodules follow it) -> new module
MOVED = {
    # platform: the machine and the environment the course runs in
    "course_lib.runtime": "course_lib.platform.runtime",
    "course_lib.hardware": "course_lib.platform.hardware",
    "course_lib.versions": "course_lib.platform.versions",
    "course_lib.colab": "course_lib.platform.colab",
    "course_lib.lab": "course_lib.platform.lab",
    "course_lib.envcheck": "course_lib.platform.envcheck",
    # attention: the algorithm in NumPy and PyTorch, and its cost models
    "course_lib.reference": "course_lib.attention.reference",
    "course_lib.softmax": "course_lib.attention.softmax",
    "course_lib.tiled": "course_lib.attention.tiled",
    "course_lib.tiled_backward": "course_lib.attention.tiled_backward",
    "course_lib.iomodel": "course_lib.attention.iomodel",
    "course_lib.costmodel": "course_lib.attention.costmodel",
    "course_lib.masks": "course_lib.attention.masks",
    "course_lib.blockmask": "course_lib.attention.blockmask",
    "course_lib.kvcache": "course_lib.attention.kvcache",
    "course_lib.decoding": "course_lib.attention.decoding",
    "course_lib.gqa": "course_lib.attention.gqa",
    "course_lib.fp8": "course_lib.attention.fp8",
    "course_lib.fp_emulation": "course_lib.attention.fp_emulation",
    # kernels: Triton and Gluon
    "course_lib.primer": "course_lib.kernels.primer",
    # integrations: the kernels inside larger systems (several GPUs, a model, Hugging Face)
    "course_lib.ring": "course_lib.integrations.ring",
    "course_lib.tinylm": "course_lib.integrations.tinylm",
    # measure: benchmarks, the cross-compiled survey and the recorded results
    "course_lib.bench": "course_lib.measure.bench",
    "course_lib.reach": "course_lib.measure.reach",
    "course_lib.kernels.sweep": "course_lib.measure.sweep",
    "course_lib.hopper_results": "course_lib.measure.hopper_results",
    "course_lib.mask_results": "course_lib.measure.mask_results",
    "course_lib.ring_results": "course_lib.measure.ring_results",
    "course_lib.model_bench": "course_lib.measure.model_bench",
    # teaching: checks, diagnosis, exercises, questions, widgets, grading, the notebook generator
    "course_lib.checks": "course_lib.teaching.checks",
    "course_lib.kernel_checks": "course_lib.teaching.kernel_checks",
    "course_lib.diagnosis": "course_lib.teaching.diagnosis",
    "course_lib.grade": "course_lib.teaching.grade",
    "course_lib.grade_channel": "course_lib.teaching.grade_channel",
    "course_lib.sandbox": "course_lib.teaching.sandbox",
    "course_lib.nbgen": "course_lib.teaching.nbgen",
    "course_lib.quiz_types": "course_lib.teaching.quiz_types",
    "course_lib.concept_questions": "course_lib.teaching.concept_questions",
    "course_lib.exercises": "course_lib.teaching.exercises",
    "course_lib.widgets": "course_lib.teaching.widgets",
}


def new_name(old: str) -> str | None:
    """The current name of the module once called ``old`` (a submodule of a moved package
    follows it), or None when ``old`` was not moved."""
    for prefix in sorted(MOVED, key=len, reverse=True):
        if old == prefix or old.startswith(prefix + "."):
            return MOVED[prefix] + old[len(prefix):]
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module already at its new name (importing it if needed)."""

    def __init__(self, new: str, spec):
        self.new, self.spec = new, spec
        self.own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # the import system has just set module.__spec__ to the old name's: give it back its own
        module.__spec__ = self.own_spec

    def get_code(self, fullname):
        """What ``python -m <old name>`` runs: the module's code at its new place."""
        return self.spec.loader.get_code(self.new)

    def is_package(self, fullname):
        return self.spec.submodule_search_locations is not None


class _Finder(importlib.abc.MetaPathFinder):
    """Answers for the old names of :data:`MOVED`, and for nothing else."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        try:
            spec = importlib.util.find_spec(new)
        except ModuleNotFoundError:  # its new package is not there (a tree from before the moves)
            return None
        if spec is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new, spec), origin=spec.origin,
                                               is_package=spec.submodule_search_locations is not None)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): before the path finder, which would
    otherwise load a moved package's submodule a second time under its old name."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
