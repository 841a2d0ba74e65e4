"""How the course's JupyterLab is started: one definition used by `make lab` and by the tests.

``python -m course_lib.lab`` starts JupyterLab on 127.0.0.1 with the course root as its
directory, opening no browser (it prints the URL to open). The tests start the very same
command with :func:`lab_command` (on a free port, without a token) and stop it by PID.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PORT = 8888


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
    parser = argparse.ArgumentParser(prog="python -m course_lib.lab", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", DEFAULT_PORT)))
    args = parser.parse_args(argv)
    print(f"Starting JupyterLab for the course on 127.0.0.1:{args.port} — open the URL printed below "
          f"(start with notebooks/00_setup_and_roadmap.ipynb). Stop with Ctrl-C.", flush=True)
    os.execv(sys.executable, lab_command(args.port))
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
