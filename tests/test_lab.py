"""`make lab`'s server: answers on 127.0.0.1, lists the course notebooks, stops by PID."""

import json
import os
from pathlib import Path

import pytest

from course_lib.platform.lab import SETTINGS_OVERRIDES, app_settings_dir, install_settings, lab_command
from lab_server import get_json, running_lab

pytestmark = pytest.mark.ch00
ROOT = Path(__file__).resolve().parent.parent
NOTIFICATION = "@jupyterlab/apputils-extension:notification"


def test_lab_command_is_loopback_and_browserless():
    cmd = lab_command(port=9999)
    assert "--ip=127.0.0.1" in cmd and "--no-browser" in cmd and "--port=9999" in cmd
    assert not any(a.startswith("--IdentityProvider.token") for a in cmd)  # make lab keeps a token


def test_makefile_lab_uses_the_same_launcher():
    assert "$(PY) -m course_lib.platform.lab" in (ROOT / "Makefile").read_text()


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


def test_install_settings_merges_into_overrides(tmp_path):
    overrides = tmp_path / "overrides.json"
    overrides.write_text(json.dumps({"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"},
                                     NOTIFICATION: {"doNotDisturbMode": True}}))
    assert install_settings(tmp_path) == overrides
    merged = json.loads(overrides.read_text())
    assert merged["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}  # kept
    assert merged[NOTIFICATION] == {"doNotDisturbMode": True, **SETTINGS_OVERRIDES[NOTIFICATION]}
    stamp = overrides.stat().st_mtime_ns
    install_settings(tmp_path)  # nothing to change: the file is not rewritten
    assert overrides.stat().st_mtime_ns == stamp


def test_lab_never_asks_about_news(tmp_path):
    """JupyterLab 4 shows its news pop-up while the composite `fetchNews` is "none"; the course's
    lab serves "false" as the setting's default (overrides replace the schema's defaults; the
    browser test checks that no pop-up shows)."""
    assert SETTINGS_OVERRIDES[NOTIFICATION]["fetchNews"] == "false"
    with running_lab(tmp_path / "lab.log") as (base, pid):
        setting = get_json(f"{base}/lab/api/settings/{NOTIFICATION}")
    defaults = {name: prop.get("default") for name, prop in setting["schema"]["properties"].items()}
    assert defaults["fetchNews"] == "false" and defaults["checkForUpdates"] is False
    assert "fetchNews" not in setting["settings"]  # the user's own choice, if any, still wins
    assert app_settings_dir().joinpath("overrides.json").exists()
