"""Packaging stays consistent: environment.yml pins == pyproject pins; make's Python check."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ch00
PIN = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)")


def pyproject_pins() -> dict:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = list(data["project"]["dependencies"])
    for extra in data["project"]["optional-dependencies"].values():
        reqs += extra
    pins = {}
    for req in reqs:
        m = PIN.match(req)
        assert m, f"pyproject.toml: {req!r} is not pinned with =="
        pins[m.group(1).lower()] = m.group(2)
    return pins


def environment_pins() -> dict:
    pins = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        stripped = line.split("#")[0].strip()
        if stripped.startswith("- "):
            m = PIN.match(stripped[2:])
            if m:
                pins[m.group(1).lower()] = m.group(2)
    return pins


def test_environment_yml_matches_pyproject():
    py, env = pyproject_pins(), environment_pins()
    assert py == env, (f"only in pyproject: {sorted(set(py) - set(env))}; "
                       f"only in environment.yml: {sorted(set(env) - set(py))}; "
                       f"different: {[(k, py[k], env[k]) for k in set(py) & set(env) if py[k] != env[k]]}")


def test_torch_is_pinned_to_the_cpu_wheel_version():
    assert pyproject_pins()["torch"] == "2.13.0"  # an unpinned torch pulls a multi-GB CUDA build


def test_environment_python_is_supported():
    text = (ROOT / "environment.yml").read_text()
    assert re.search(r"-\s*python=3\.1[1-9]", text)


def test_installed_versions_match_pins():
    from importlib.metadata import version
    for name, pinned in pyproject_pins().items():
        assert version(name).split("+")[0] == pinned, name


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("python, message", [
    ("/nonexistent/python3", "not found. Install Python 3.11"),
    ("/bin/false", "the course needs Python 3.11 or newer"),
])
def test_make_stops_with_a_message_when_python_is_missing_or_old(python, message):
    out = subprocess.run(["make", "-s", "check-python", f"PYTHON={python}"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert message in out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_accepts_this_python():
    out = subprocess.run(["make", "-s", "check-python", f"PYTHON={sys.executable}"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme and "make lab" in readme
