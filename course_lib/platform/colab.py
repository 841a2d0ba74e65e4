"""Google Colab: install the course beside Colab's own torch and triton.

Colab ships its own torch (a CUDA build) and triton. ``pip install`` of the course's pins would
replace them (torch 2.13 on PyPI needs CUDA 13, so the GPU could be lost), so each notebook's
first code cell (written by :mod:`course_lib.teaching.nbgen`) does, on Colab only::

    pip install --no-deps git+<the course's repository>     # course_lib alone
    from course_lib.platform import colab; colab.install()           # then only what is missing or too old

:func:`install` asks :func:`requirements_to_install` which of numpy, matplotlib, ipywidgets and
tqdm are missing or older than :data:`course_lib.platform.versions.MINIMUM` (never torch or triton), has
pip install those and prints one line (:func:`report`). Elsewhere the cell does nothing.

The repository's address is written once, in ``pyproject.toml`` (``[project.urls] Repository``):
nbgen copies it into the cell and :func:`repository_url` reads it. While it is not published the
cell says so on Colab and how to install the course by hand.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path

from course_lib.platform import versions

ROOT = Path(__file__).resolve().parent.parent.parent
DISTRIBUTION = "course_lib"

# Colab's own builds, matched to its CUDA driver: never installed or upgraded by the course.
KEPT = ("torch", "triton")
# The import name of each package the installer may install (to tell when a restart is needed).
MODULES = {"numpy": "numpy", "matplotlib": "matplotlib", "ipywidgets": "ipywidgets", "tqdm": "tqdm",
           "transformers": "transformers"}
RESTART = "Runtime → Restart session"
# Colab's GPUs of compute capability 8.0+ (its T4 is 7.5: CPU mode), as the mode line names them.
GPU_RUNTIMES = "an A100, L4, H100 or G4 runtime (Runtime → Change runtime type)"
# Colab's GPU runtime types, found in the name torch gives their GPU. The G4 is an RTX PRO 6000
# Blackwell (compute capability 12.0, 99 KiB of shared memory per block): the paid runtimes often
# hand it out when no H100 is free; the library runs its Triton kernels there.
RUNTIMES = {"G4": r"RTX PRO 6000", "H100": r"H100", "A100": r"A100", "L4": r"\bL4\b", "T4": r"\bT4\b"}


def on_colab() -> bool:
    """True inside a Google Colab notebook (its ``google.colab`` module is loaded)."""
    return "google.colab" in sys.modules


def runtime_name(gpu_name: str | None) -> str | None:
    """The Colab runtime type (:data:`RUNTIMES`) of a GPU named as torch names it, e.g.
    ``"NVIDIA RTX PRO 6000 Blackwell Server Edition"`` -> ``"G4"``; None for other GPUs."""
    for name, pattern in RUNTIMES.items():
        if gpu_name and re.search(pattern, gpu_name):
            return name
    return None


def installed_versions() -> dict[str, str | None]:
    """The installed version of torch, triton and each package of :data:`MODULES` (None: missing)."""
    found = {}
    for name in (*KEPT, *MODULES):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _older(version: str, than: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) < Version(than)
    except InvalidVersion:  # a version pip cannot read: install ours
        return True


def requirements_to_install(installed: Mapping[str, str | None]) -> list[str]:
    """pip requirements for the course's packages that are missing or too old; never torch or triton.

    Args:
        installed: package name -> installed version, or None when missing
            (:func:`installed_versions`). ``triton`` there decides numpy's upper bound: with a
            triton older than :data:`~course_lib.platform.versions.FIXED_TRITON`, numpy must stay below
            :data:`~course_lib.platform.versions.NUMPY_BELOW_WITH_OLD_TRITON` (triton issue 9171).
    Returns:
        e.g. ``["numpy>=2.0,<2.4", "ipywidgets>=7.7.1"]``; empty when nothing is needed.
    """
    if not isinstance(installed, Mapping):
        raise TypeError(f"installed must map package names to versions, got {type(installed).__name__}")
    triton = installed.get("triton")
    old_triton = triton is not None and _older(triton, versions.FIXED_TRITON)
    wanted = []
    for name in MODULES:
        have, minimum = installed.get(name), versions.MINIMUM[name]
        below = versions.NUMPY_BELOW_WITH_OLD_TRITON if name == "numpy" and old_triton else None
        if have is None or _older(have, minimum) or (below and not _older(have, below)):
            wanted.append(f"{name}>={minimum}" + (f",<{below}" if below else ""))
    return wanted


def repository_url(pyproject: str | Path | None = None) -> str:
    """The course's public repository (``""`` while it is not published).

    Read from ``pyproject.toml``'s ``[project.urls] Repository`` (``pyproject``, or the one beside
    this package when the course is a checkout), else from the installed package's metadata.
    """
    path = Path(pyproject) if pyproject is not None else ROOT / "pyproject.toml"
    if pyproject is not None and not path.is_file():
        raise ValueError(f"pyproject: {path} is not a file")
    if path.is_file():
        import tomllib

        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
        return str(project.get("urls", {}).get("Repository", "")).strip()
    try:
        entries = metadata.metadata(DISTRIBUTION).get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return ""
    for entry in entries:
        label, _, url = entry.partition(",")
        if label.strip().lower() == "repository":
            return url.strip()
    return ""


def report(installed: Mapping[str, str | None], installed_now: list[str], restart: bool) -> str:
    """The one line :func:`install` prints: Colab's torch/triton kept, what was installed, and
    whether the session must restart (a package it replaced was already imported)."""
    kept = " and ".join(f"{name} {installed.get(name) or 'not installed'}" for name in KEPT)
    line = f"Colab: course_lib is installed beside Colab's own {kept} (left as they are); "
    if not installed_now:
        return line + "nothing else was missing."
    line += f"also installed {', '.join(installed_now)}"
    if restart:
        return line + f": restart ({RESTART}) and run this notebook again."
    return line + "."


def install(run: Callable[[list[str]], object] = subprocess.check_call) -> list[str]:
    """Install what :func:`requirements_to_install` lists with pip, print :func:`report`'s line.

    Args:
        run: runs a command (a list of strings); :func:`subprocess.check_call` by default.
    Returns:
        the requirements installed (empty when nothing was needed).
    """
    before = installed_versions()
    wanted = requirements_to_install(before)
    if wanted:
        run([sys.executable, "-m", "pip", "install", "--quiet", *wanted])
    from packaging.requirements import Requirement

    # a package already imported in this session keeps its old version until the session restarts
    restart = any(MODULES[Requirement(r).name] in sys.modules for r in wanted)
    print(report(before, wanted, restart))
    return wanted
