"""The oldest versions of its dependencies the course supports, named once.

``pyproject.toml`` pins the versions the course is developed and tested with (the newest). This
module says how far back each dependency may go: Google Colab's installer
(:mod:`course_lib.platform.colab`) installs only what is missing or older than these, and
``make test-oldest`` builds ``.venv-oldest`` from :func:`oldest_pins` and runs the kernels, the
widgets and notebook 00 there. ``make test-newest`` puts the newest Triton (:func:`newest_pins`)
in front of the pinned environment and runs the kernels and the Gluon and Blackwell cross-compiles
with it.

It imports nothing from the course (nor numpy, torch or triton): the Makefile runs it as a script
before the course is installed (``python course_lib/platform/versions.py --oldest``).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The oldest supported version of each dependency, with why it is the floor.
MINIMUM = {
    # Colab's image (2026-08): torch 2.11.0+cu128 and triton 3.6.0 on Python 3.13, also the GPU
    # machine's image, where every GPU test and notebook runs.
    "torch": "2.11",
    "triton": "3.6",
    # The first numpy 2 release, the oldest tested (numpy 1.x is not); Colab has 2.1.3.
    "numpy": "2.0",
    # Colab's; with 3.9 the softmax stepper's score axis starts at 0 (Axes.stairs' baseline).
    "matplotlib": "3.10",
    # Colab's widget frontend supports ipywidgets 7 only (googlecolab/colabtools#3020, #4525).
    "ipywidgets": "7.7.1",
    # tqdm.auto as course_lib.measure.bench uses it; Colab has 4.67.
    "tqdm": "4.66",
    # The GPU machine's image (chapter 12 runs there); tests/test_integrations_hf.py passes with 5.17.0
    # and with the pin, 5.23.0 (AttentionInterface and AttentionMaskInterface as both have them).
    "transformers": "5.17",
}

# triton 3.6's interpreter fails with numpy 2.4 ("only 0-dimensional arrays can be converted to
# Python scalars", triton issue 9171); triton 3.7 works with it. So numpy stays below this while
# the installed triton is older than FIXED_TRITON.
NUMPY_BELOW_WITH_OLD_TRITON = "2.4"
FIXED_TRITON = "3.7"

# What `make test-oldest` installs: the floors above, except torch. PyPI's Linux torch 2.11 is the
# CUDA build (530 MB plus GBs of nvidia-* packages) and download.pytorch.org is not reachable from
# CI, so CI uses the CPU wheel of the course's own pin; torch 2.11 + triton 3.6 is exercised on the
# GPU machine, whose image has exactly that.
OLDEST_TESTED = {
    "torch": "2.13.0",
    "triton": "3.6.0",
    "numpy": "2.0.2",
    "matplotlib": "3.10.0",
    "ipywidgets": "7.7.1",
    "tqdm": "4.66.0",
}


# What `make test-newest` puts in front of the pinned environment: the newest Triton release
# (2026-10). torch stays the pinned CPU wheel: PyPI's Linux torch 2.14/2.15 are the CUDA builds
# (GBs), and torch 2.13's CUDA build pins triton 3.7.1, so pyproject.toml keeps that pair.
NEWEST_TESTED = {
    "triton": "3.9.0",
}


# The test tools make test-oldest needs, pinned as pyproject.toml pins them (its test and lab
# extras): pytest and its plugins, nbval and a Jupyter kernel for notebook 00.
TEST_TOOLS = ("pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "nbval", "nbformat",
              "nbclient", "ipykernel")


def oldest_pins() -> list[str]:
    """``name==version`` for each dependency of :data:`OLDEST_TESTED`, in a stable order."""
    return [f"{name}=={version}" for name, version in OLDEST_TESTED.items()]


def newest_pins() -> list[str]:
    """``name==version`` for each package of :data:`NEWEST_TESTED`."""
    return [f"{name}=={version}" for name, version in NEWEST_TESTED.items()]


def tool_pins(pyproject: str | Path | None = None) -> list[str]:
    """The pins of :data:`TEST_TOOLS` in ``pyproject.toml``'s optional dependencies."""
    import tomllib

    root = Path(__file__).resolve().parent.parent.parent
    path = Path(pyproject) if pyproject is not None else root / "pyproject.toml"
    extras = tomllib.loads(path.read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    pins = {}
    for requirement in (r.split(";")[0].strip() for group in extras.values() for r in group):
        pins[requirement.split("==")[0].strip()] = requirement
    missing = [name for name in TEST_TOOLS if name not in pins]
    if missing:
        raise ValueError(f"pyproject: {path} pins none of {missing} in its optional dependencies")
    return [pins[name] for name in TEST_TOOLS]


USAGE = ("usage: python course_lib/platform/versions.py --oldest      the oldest pins make test-oldest installs\n"
         "       python course_lib/platform/versions.py --newest      the newest releases make test-newest installs\n"
         "       python course_lib/platform/versions.py --test-tools  the test tools, as pyproject.toml pins them")

if __name__ == "__main__":
    flags = {"--oldest": oldest_pins, "--newest": newest_pins, "--test-tools": tool_pins}
    if len(sys.argv) != 2 or sys.argv[1] not in flags:
        sys.exit(USAGE)
    print(" ".join(flags[sys.argv[1]]()))
