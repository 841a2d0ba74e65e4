"""Start and stop the course's JupyterLab exactly as `make lab` does (shared by the lab tests)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from course_lib.platform.lab import ROOT, install_settings, lab_command

START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def stop_process_group(proc: subprocess.Popen, timeout: float) -> None:
    """Stop a process started with ``start_new_session=True`` and all its children, by PID:
    SIGTERM to the group, then SIGKILL if it has not exited within ``timeout`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


@contextmanager
def running_lab(log_path: Path | None = None):
    """Yield the base URL of a running course JupyterLab; stop it (and its kernels) by PID."""
    install_settings()  # as `make lab` does before it starts the server
    port = free_port()
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(lab_command(port=port, token=""), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with code {proc.returncode}; see {log_path}")
            try:
                get_json(f"{base}/api/status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not answer on {base} in {START_TIMEOUT_S} s")
                time.sleep(0.5)
        yield base, proc.pid
    finally:
        # the server was started in its own session: signal the whole group (kernels included)
        stop_process_group(proc, timeout=20)
        log.close()
