"""Packaging stays consistent: environment.yml pins == pyproject pins; make's Python check."""

import os
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


@pytest.mark.parametrize("platform", ["aarch64-apple-darwin", "x86_64-pc-windows-msvc"])
def test_pins_resolve_on_macos_and_windows_without_triton(platform):
    """PyPI has no triton wheel for macOS or Windows: there the course installs without it (and
    runs chapters 00-04). uv resolves for another platform with its markers (pip's --platform
    would evaluate them for this machine)."""
    uv = Path(sys.executable).parent / "uv"
    done = subprocess.run([str(uv if uv.exists() else "uv"), "pip", "compile", "pyproject.toml", "--extra", "lab",
                           "--extra", "test", "--python-platform", platform, "--python-version", "3.12",
                           "--no-python-downloads", "--quiet", "--index-url", "https://pypi.org/simple"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MACOSX_DEPLOYMENT_TARGET="14.0"))  # torch 2.13: macOS 14+
    if done.returncode != 0 and re.search(r"dns error|Connect|network|timed out", done.stderr, re.I):
        pytest.skip(f"PyPI is not reachable from here, so the {platform} resolution cannot run: "
                    f"{done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-2000:]
    resolved = dict(PIN.match(line).groups() for line in done.stdout.splitlines() if PIN.match(line))
    pins = pyproject_pins()
    assert "triton" not in resolved
    for name in ("torch", "numpy", "matplotlib", "ipywidgets", "jupyterlab"):
        assert resolved[name] == pins[name], name


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


def test_dev_container_uses_the_readme_set_up():
    """The dev container (macOS/Windows hosts) installs with the README's own command, in CPU
    mode, with a supported Python; it is JSON with comments, as dev containers allow."""
    import json

    text = (ROOT / ".devcontainer" / "devcontainer.json").read_text()
    config = json.loads("\n".join(line for line in text.splitlines() if not line.strip().startswith("//")))
    assert config["postCreateCommand"] == "make setup"
    assert config["containerEnv"]["COURSE_LIB_MODE"] == "cpu"
    version = re.search(r"python:3\.(\d+)", config["image"])
    assert version and int(version.group(1)) >= 11
    assert 8888 in config["forwardPorts"]
