"""How the course's JupyterLab is started: one definition used by `make lab` and by the tests.

``python -m course_lib.platform.lab`` starts JupyterLab on 127.0.0.1 with the course root as its
directory, opening no browser (it prints the URL to open). The tests start the very same
command with :func:`lab_command` (on a free port, without a token) and stop it by PID.

Before it starts, :func:`install_settings` writes the course's default JupyterLab settings
(:data:`SETTINGS_OVERRIDES`) into the environment's ``share/jupyter/lab/settings/overrides.json``:
JupyterLab 4 asks "Would you like to get notified about official Jupyter news?" in a pop-up
whenever the setting ``fetchNews`` is still "none" (undecided), whatever ``--LabApp.news_url`` says,
and that pop-up covers the widgets' plots. The overrides are defaults only: a learner can still
change them in Settings → Settings Editor → Notifications.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_PORT = 8888
# JupyterLab settings the course changes from JupyterLab's defaults (plugin id -> {setting: value}).
SETTINGS_OVERRIDES = {
    "@jupyterlab/apputils-extension:notification": {
        "fetchNews": "false",  # "none" (the default) shows the news pop-up; "false" is "Never"
        "checkForUpdates": False,  # no request to the internet for a newer JupyterLab
    },
}


def app_settings_dir() -> Path:
    """The environment's JupyterLab application settings folder (``<app dir>/settings``), where
    JupyterLab reads ``overrides.json``; ``JUPYTERLAB_DIR`` moves it, as it moves the app dir."""
    from jupyterlab.commands import get_app_dir

    return Path(get_app_dir()) / "settings"


def install_settings(settings_dir: Path | None = None) -> Path:
    """Merge :data:`SETTINGS_OVERRIDES` into ``overrides.json`` in ``settings_dir`` (default:
    :func:`app_settings_dir`); other plugins' and other settings' overrides are kept.

    Returns:
        The path of ``overrides.json`` (rewritten only when something changed).
    """
    path = (app_settings_dir() if settings_dir is None else Path(settings_dir)) / "overrides.json"
    current = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    merged = {**current}
    for plugin, values in SETTINGS_OVERRIDES.items():
        merged[plugin] = {**current.get(plugin, {}), **values}
    if merged != current:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
    return path


def lab_command(port: int = DEFAULT_PORT, token: str | None = None, root: Path = ROOT) -> list[str]:
    """The argv that starts the course's JupyterLab server.

    Args:
        port: TCP port on 127.0.0.1.
        token: ``None`` lets Jupyter generate one (printed in the URL); ``""`` disables it
            (only for tests on a private loopback port).
    """
    cmd = [sys.executable, "-m", "jupyterlab",
           "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
           f"--ServerApp.root_dir={root}",
           "--ServerApp.open_browser=False",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if token is not None:
        cmd.append(f"--IdentityProvider.token={token}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers often run as root
        cmd.append("--allow-root")
    return cmd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.platform.lab", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", DEFAULT_PORT)))
    args = parser.parse_args(argv)
    install_settings()
    print(f"Starting JupyterLab for the course on 127.0.0.1:{args.port} — open the URL printed below "
          f"(start with notebooks/00_setup_and_roadmap.ipynb). Stop with Ctrl-C.", flush=True)
    os.execv(sys.executable, lab_command(args.port))
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
