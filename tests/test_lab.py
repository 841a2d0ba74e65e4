"""`make lab`'s server: answers on 127.0.0.1, lists the course notebooks, stops by PID."""

import os
from pathlib import Path

import pytest

from course_lib.lab import lab_command
from lab_server import get_json, running_lab

pytestmark = pytest.mark.ch00
ROOT = Path(__file__).resolve().parent.parent


def test_lab_command_is_loopback_and_browserless():
    cmd = lab_command(port=9999)
    assert "--ip=127.0.0.1" in cmd and "--no-browser" in cmd and "--port=9999" in cmd
    assert not any(a.startswith("--IdentityProvider.token") for a in cmd)  # make lab keeps a token


def test_makefile_lab_uses_the_same_launcher():
    assert "$(PY) -m course_lib.lab" in (ROOT / "Makefile").read_text()


def test_lab_serves_the_course(tmp_path):
    with running_lab(tmp_path / "lab.log") as (base, pid):
        listing = get_json(f"{base}/api/contents/notebooks")
        names = {item["name"] for item in listing["content"]}
        expected = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
        assert expected and expected <= names
        assert "00_setup_and_roadmap.ipynb" in names
        assert get_json(f"{base}/api/contents/solutions")["type"] == "directory"
        kernelspecs = get_json(f"{base}/api/kernelspecs")
        assert "python3" in kernelspecs["kernelspecs"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped
