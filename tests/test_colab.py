"""Google Colab: the first cell of every notebook, the installer it calls (course_lib.platform.colab), the
supported version range (course_lib.platform.versions) and the mode line on Colab's GPUs. Colab is faked
here (a ``google.colab`` module in ``sys.modules``, pip replaced by a recorder)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from course_lib.platform import colab, runtime, versions
from course_lib.teaching import nbgen

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ch00

# Colab's published image (2026-08, FACTS.md): what its runtime has before the course installs.
COLAB_IMAGE = {"torch": "2.11.0+cu128", "triton": "3.6.0", "numpy": "2.1.3", "matplotlib": "3.10.0",
               "ipywidgets": "7.7.1", "tqdm": "4.67.1"}
# The same image once chapter 12's transformers is there (its version on Colab is not recorded).
COLAB_WITH_HF = {**COLAB_IMAGE, "transformers": "5.23.0"}


@pytest.fixture
def on_colab(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))


def _notebooks():
    return sorted(ROOT.glob("solutions/*.ipynb")) + sorted(ROOT.glob("notebooks/*.ipynb"))


# -- detection and the requirements -----------------------------------------------------------

def test_colab_is_detected_by_its_module(monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    assert not colab.on_colab()
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert colab.on_colab()


def test_colabs_image_needs_only_transformers_for_chapter_12():
    # FACTS.md records no transformers version for Colab's image: the installer asks for the
    # course's floor (chapter 12), and nothing else.
    assert colab.requirements_to_install(COLAB_IMAGE) == [f"transformers>={versions.MINIMUM['transformers']}"]
    assert colab.requirements_to_install(COLAB_WITH_HF) == []


@pytest.mark.parametrize("changes, wanted", [
    ({"ipywidgets": None}, ["ipywidgets>=7.7.1"]),                       # missing
    ({"numpy": "1.26.4"}, ["numpy>=2.0,<2.4"]),                          # older than the floor
    ({"numpy": "2.4.1"}, ["numpy>=2.0,<2.4"]),                           # too new for triton 3.6
    ({"numpy": "2.4.1", "triton": "3.7.1"}, []),                         # fine with triton 3.7
    ({"numpy": None, "triton": "3.7.1"}, ["numpy>=2.0"]),
    ({"matplotlib": "3.8.4", "tqdm": "4.64.1"}, ["matplotlib>=3.10", "tqdm>=4.66"]),
    ({"torch": None, "triton": None}, []),                               # never torch or triton
    ({"torch": "2.0.0", "triton": "2.0.0"}, []),                         # numpy 2.1.3 is < 2.4 already
])
def test_only_what_is_missing_or_out_of_range_is_installed(changes, wanted):
    got = colab.requirements_to_install({**COLAB_WITH_HF, **changes})
    assert got == wanted
    assert not any(Requirement(r).name in colab.KEPT for r in got)


def test_on_an_empty_machine_each_package_gets_its_floor():
    reqs = {Requirement(r).name: Requirement(r) for r in colab.requirements_to_install({})}
    assert sorted(reqs) == sorted(set(versions.MINIMUM) - set(colab.KEPT))
    for name, req in reqs.items():
        floor = Version(versions.MINIMUM[name])
        below = f"{floor.major}.{floor.minor - 1}" if floor.minor else f"{floor.major - 1}.99"
        assert req.specifier.contains(str(floor)) and not req.specifier.contains(below), req


def test_requirements_need_a_mapping():
    with pytest.raises(TypeError, match="installed must map package names"):
        colab.requirements_to_install(["numpy"])


def test_the_course_pins_lie_within_the_supported_range():
    """pyproject.toml's pins (the newest we test) are at or above every floor."""
    pins = {Requirement(r).name: Requirement(r) for r in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for name, floor in versions.MINIMUM.items():
        pinned = next(iter(pins[name].specifier)).version
        assert Version(pinned) >= Version(floor), f"{name} {pinned} is below the floor {floor}"
    for name, tested in versions.OLDEST_TESTED.items():
        assert Version(tested) >= Version(versions.MINIMUM[name]), name
    assert versions.oldest_pins()[0] == f"torch=={versions.OLDEST_TESTED['torch']}"


def test_versions_script_prints_the_oldest_pins():
    out = subprocess.run([sys.executable, str(ROOT / "course_lib" / "platform" / "versions.py"), "--oldest"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == versions.oldest_pins()
    bad = subprocess.run([sys.executable, str(ROOT / "course_lib" / "platform" / "versions.py")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "usage" in bad.stderr


# -- install() and its one line ---------------------------------------------------------------

def test_install_runs_pip_for_the_missing_only_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(colab, "installed_versions", lambda: {**COLAB_WITH_HF, "numpy": "2.4.1"})
    commands = []
    assert colab.install(run=commands.append) == ["numpy>=2.0,<2.4"]
    assert commands == [[sys.executable, "-m", "pip", "install", "--quiet", "numpy>=2.0,<2.4"]]
    line = capsys.readouterr().out
    assert line.count("\n") == 1
    assert "torch 2.11.0+cu128 and triton 3.6.0 (left as they are)" in line
    assert "numpy>=2.0,<2.4" in line and colab.RESTART in line  # numpy is imported here already


def test_install_with_nothing_missing_runs_no_pip(monkeypatch, capsys):
    monkeypatch.setattr(colab, "installed_versions", lambda: dict(COLAB_WITH_HF))
    commands = []
    assert colab.install(run=commands.append) == [] and commands == []
    assert "nothing else was missing" in capsys.readouterr().out


def test_report_without_restart_when_the_package_was_not_imported():
    line = colab.report(COLAB_IMAGE, ["tqdm>=4.66"], restart=False)
    assert line.endswith("also installed tqdm>=4.66.") and "Restart" not in line


# -- where the course comes from --------------------------------------------------------------

def test_repository_url_is_read_from_pyproject(tmp_path):
    with_url = tmp_path / "with.toml"
    with_url.write_text('[project]\nname = "course_lib"\n[project.urls]\n'
                        'Repository = "https://github.com/someone/course"\n')
    assert colab.repository_url(with_url) == "https://github.com/someone/course"
    without = tmp_path / "without.toml"
    without.write_text('[project]\nname = "course_lib"\n')
    assert colab.repository_url(without) == ""
    with pytest.raises(ValueError, match="pyproject: .* is not a file"):
        colab.repository_url(tmp_path / "missing.toml")


def test_colab_link_needs_a_github_repository():
    assert (nbgen.colab_link("https://github.com/someone/course.git", "03_online_softmax.ipynb")
            == "https://colab.research.google.com/github/someone/course/blob/main/notebooks/"
               "03_online_softmax.ipynb")
    with pytest.raises(ValueError, match="repository must be https://github.com/OWNER/NAME"):
        nbgen.colab_link("https://gitlab.com/someone/course", "x.ipynb")
    with pytest.raises(TypeError, match="repository must be a str"):
        nbgen.colab_cell_source(None)


def test_colab_links_for_the_readme(monkeypatch, capsys):
    monkeypatch.setattr(colab, "repository_url", lambda pyproject=None: "")
    assert nbgen.main(["--colab-links"]) == 2
    assert "no [project.urls] Repository" in capsys.readouterr().err
    monkeypatch.setattr(colab, "repository_url", lambda pyproject=None: "https://github.com/a/b")
    assert nbgen.main(["--colab-links"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(list(ROOT.glob("solutions/*.ipynb")))
    assert all(line.startswith(f"[![Open In Colab]({nbgen.COLAB_BADGE})](") for line in lines)
    assert "github/a/b/blob/main/notebooks/00_setup_and_roadmap.ipynb" in lines[0]


# -- the cell in every notebook ---------------------------------------------------------------

@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_notebook_opens_with_the_colab_cell(path):
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code[0]["id"] == nbgen.COLAB_CELL_ID and cells[0]["cell_type"] == "markdown"
    assert nbgen._source(code[0]) == nbgen.colab_cell_source(colab.repository_url())
    assert nbgen._source(code[1]).startswith("from course_lib.platform import runtime")


def _run_cell(repository: str) -> dict:
    namespace = {}
    exec(compile(nbgen.colab_cell_source(repository), "colab-cell", "exec"), namespace)
    return namespace


def test_the_cell_does_nothing_outside_colab(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setattr(subprocess, "check_call", lambda *a, **k: pytest.fail("pip ran"))
    _run_cell("https://github.com/someone/course")
    assert capsys.readouterr().out == ""


def _course_lib_not_installed(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "course_lib" else find_spec(name, *a))


def test_on_colab_unpublished_the_cell_says_how_to_install_by_hand(on_colab, monkeypatch):
    _course_lib_not_installed(monkeypatch)
    with pytest.raises(RuntimeError, match=re.escape("not published yet")) as err:
        _run_cell("")
    assert "pip install --no-deps -e <folder>" in str(err.value) and str(err.value).count(". ") == 0


def test_on_colab_the_cell_installs_without_dependencies_then_the_missing(on_colab, monkeypatch):
    _course_lib_not_installed(monkeypatch)
    commands, installs = [], []
    monkeypatch.setattr(subprocess, "check_call", commands.append)
    monkeypatch.setattr(colab, "install", lambda: installs.append(True))
    _run_cell("https://github.com/someone/course")
    assert commands == [[sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                         "git+https://github.com/someone/course"]]
    assert installs == [True]


def test_on_colab_an_installed_course_is_not_installed_again(on_colab, monkeypatch):
    monkeypatch.setattr(subprocess, "check_call", lambda *a, **k: pytest.fail("pip ran"))
    installs = []
    monkeypatch.setattr(colab, "install", lambda: installs.append(True))
    _run_cell("")  # installed by hand: no URL needed
    assert installs == [True]


# -- the mode line on Colab's GPUs -------------------------------------------------------------

VERSIONS = {"python": "3.13", "torch": "2.11.0+cu128", "triton": "3.6.0", "numpy": "2.1.3"}


@pytest.mark.parametrize("gpu, capability", [("NVIDIA A100-SXM4-40GB", (8, 0)),
                                             ("NVIDIA L4", (8, 9)), ("NVIDIA H100 80GB HBM3", (9, 0))])
def test_colab_gpus_of_8_0_and_up_get_gpu_mode(on_colab, gpu, capability):
    mode = runtime.choose_mode(True, capability=capability)
    line = runtime.Runtime(mode=mode, device="cuda", gpu_name=gpu, versions=VERSIONS).describe()
    assert line.startswith(f"GPU mode: Triton kernels run natively on {gpu}")


def test_colabs_t4_gets_cpu_mode_with_the_reason_and_what_to_choose(on_colab):
    mode = runtime.choose_mode(True, capability=(7, 5))
    line = runtime.Runtime(mode=mode, device="cpu", gpu_name="Tesla T4", versions=VERSIONS).describe()
    assert line.startswith("CPU mode: Tesla T4 is below the compute capability Triton supports (8.0+)")
    assert f"for GPU mode choose {colab.GPU_RUNTIMES}" in line and "\n" not in line
    no_gpu = runtime.Runtime(mode=runtime.INTERPRETER, device="cpu", gpu_name=None, versions=VERSIONS)
    assert colab.GPU_RUNTIMES in no_gpu.describe()


def test_outside_colab_the_line_names_no_colab_runtime(monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    line = runtime.Runtime(mode=runtime.INTERPRETER, device="cpu", gpu_name="Tesla T4",
                           versions=VERSIONS).describe()
    assert "Change runtime type" not in line
