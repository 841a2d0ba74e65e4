"""A sandbox for one learner notebook's Python process (the grader's kernel).

With Debian's ``bubblewrap`` (``bwrap``, unprivileged user namespaces) the notebook's process gets:

* no network (its own, empty network namespace) and its own process, IPC and host-name
  namespaces: it sees only its own processes, and all of them die with it;
* the file system read-only, with an empty private ``/tmp`` (and ``/var/tmp``, ``/dev/shm``);
  the folders the grader names hidden behind empty ones: the course's ``solutions/`` and
  ``.git``, the submissions folder (other learners' notebooks), the results folder;
* one writable folder of its own (its working folder, home and the grader's exchange files);
* limits (``setrlimit``, set inside the sandbox before the kernel starts): address space
  (memory), CPU seconds, file size, no core files and — when the grader does not run as root,
  which the kernel exempts from it — the number of processes.

Without ``bwrap`` (or when it cannot start: no user namespaces) the grader says so in one line
and runs the notebook with the limits only: ``isolation: none``. :func:`detect` decides, once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30
# Defaults, per notebook: a course notebook's kernel peaks near 1 GiB of address space (torch,
# Triton's interpreter, chapter 10's checks: 0.92 GiB VmPeak measured on the CPU machine,
# torch 2.13, 2026-11-27); four times that leaves room for a learner's experiments.
DEFAULT_MEMORY_BYTES = 4 * GIB
DEFAULT_FILE_BYTES = 1 * GIB  # the largest file the notebook may write
# Processes and threads a notebook may add to those its user already runs (torch and ipykernel
# start a few dozen threads; a fork bomb needs thousands).
PROCESS_HEADROOM = 512
HIDDEN_TMPFS_BYTES = 2**20  # the empty folders laid over hidden ones (nothing is written there)
PROBE_TIMEOUT_S = 30.0
MODES = ("auto", "bubblewrap", "none")

# Set the limits, then become the kernel (run with `python -I -S -c`, before any import of the
# learner's environment): argv is NAME=VALUE ... -- command...
_LIMITS_LAUNCHER = """\
import os, resource, sys
i = sys.argv.index('--')
for spec in sys.argv[1:i]:
    name, value = spec.split('=')
    limit = getattr(resource, 'RLIMIT_' + name)
    soft, hard = resource.getrlimit(limit)
    value = int(value)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(limit, (value, value))
os.execv(sys.argv[i + 1], sys.argv[i + 1:])
"""


class SandboxError(RuntimeError):
    """The sandbox asked for cannot be used here; the message says why."""


@dataclass
class Limits:
    """What one notebook's process may use.

    Args:
        memory_bytes: address space (RLIMIT_AS).
        cpu_s: CPU seconds (RLIMIT_CPU), over all its threads.
        file_bytes: the largest file it may write (RLIMIT_FSIZE).
        processes: processes and threads of its user (RLIMIT_NPROC); None: not limited.
    """

    memory_bytes: int = DEFAULT_MEMORY_BYTES
    cpu_s: int = 3600
    file_bytes: int = DEFAULT_FILE_BYTES
    processes: int | None = None

    def argv(self) -> list[str]:
        specs = [f"AS={self.memory_bytes}", f"CPU={self.cpu_s}", f"FSIZE={self.file_bytes}",
                 "CORE=0"]
        if self.processes is not None:
            specs.append(f"NPROC={self.processes}")
        return specs

    def describe(self) -> str:
        procs = (f", at most {self.processes} processes of its user" if self.processes
                 else ", no process limit (the grader runs as root, whom the kernel exempts)")
        return (f"memory ≤ {self.memory_bytes / GIB:g} GiB, CPU ≤ {self.cpu_s} s, files ≤ "
                f"{self.file_bytes / GIB:g} GiB{procs}")


def default_process_limit() -> int | None:
    """RLIMIT_NPROC for a notebook: what its user runs now plus :data:`PROCESS_HEADROOM`; None
    for root (the kernel does not apply the limit to root)."""
    if os.geteuid() == 0:
        return None
    uid, used = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            used += int(fields.get("Threads", "1").strip() or 1)
    return used + PROCESS_HEADROOM


@dataclass
class Isolation:
    """How the grader runs each notebook's process: ``kind`` "bubblewrap" or "none"."""

    kind: str
    detail: str  # what it guarantees, or why there is none
    bwrap: str | None = None
    hidden: list[Path] = field(default_factory=list)

    def line(self, limits: Limits) -> str:
        """The one line the grader prints about it."""
        if self.kind == "none":
            return (f"isolation: none — {self.detail}. Each notebook runs as this user, with "
                    f"this user's files and network ({limits.describe()}): grade only trusted "
                    f"notebooks this way, or in a container (tools/grader.Dockerfile)")
        return f"isolation: {self.detail}; {limits.describe()}"

    def command(self, cmd: list[str], private: Path, limits: Limits,
                readonly: list[Path] = ()) -> list[str]:
        """``cmd`` wrapped: in the sandbox (its one writable folder ``private``, in which the
        folders ``readonly`` are read-only) with ``limits``."""
        launcher = [sys.executable, "-I", "-S", "-c", _LIMITS_LAUNCHER, *limits.argv(), "--"]
        if self.kind == "none":
            return [*launcher, *cmd]
        return [*bubblewrap_args(self.bwrap, self.hidden, private, limits.file_bytes, readonly),
                *launcher, *cmd]


def bubblewrap_args(bwrap: str, hidden: list[Path], private: Path,
                    tmpfs_bytes: int = DEFAULT_FILE_BYTES, readonly: list[Path] = ()) -> list[str]:
    """The ``bwrap`` command line up to the ``--`` before the sandboxed command; the empty
    temporary folders hold at most ``tmpfs_bytes`` each (they live in memory); the folders
    ``readonly`` (inside ``private``) are mounted read-only there, so that the sandbox can
    neither write them nor swap them for links."""
    # JPY_PARENT_PID: inside its own process namespace the kernel's parent is process 1, which
    # ipykernel's parent poller would take for a dead parent (bwrap kills it with us instead)
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-all", "--cap-drop", "ALL",
            "--unsetenv", "JPY_PARENT_PID", "--ro-bind", "/", "/", "--dev", "/dev",
            "--proc", "/proc"]
    private = Path(private).resolve()
    temporary = [Path(p) for p in ("/tmp", "/var/tmp", tempfile.gettempdir()) if Path(p).is_dir()]
    for tmp in dict.fromkeys(p.resolve() for p in temporary):
        args += ["--size", str(tmpfs_bytes), "--tmpfs", str(tmp)]
    # what the notebook's Python needs that an empty /tmp would hide (a course or an environment
    # installed under /tmp), read-only again
    for needed in _needed_paths():
        if any(_inside(needed, t.resolve()) for t in temporary) and not _inside(needed, private):
            args += ["--ro-bind", str(needed), str(needed)]
    # after those binds: a later mount covers an earlier one, so a course cloned under /tmp,
    # bound again just above, must not bring its solutions/ and .git back into view
    for path in dict.fromkeys(Path(p).resolve() for p in hidden):
        if path.is_dir() and not _inside(private, path):
            args += ["--size", str(HIDDEN_TMPFS_BYTES), "--tmpfs", str(path)]
    args += ["--bind", str(private), str(private)]  # the working folder is inside it
    for folder in readonly:
        args += ["--ro-bind", str(Path(folder).resolve()), str(Path(folder).resolve())]
    args.append("--")
    return args


def _inside(path: Path, folder: Path) -> bool:
    try:
        Path(path).resolve().relative_to(Path(folder).resolve())
        return True
    except ValueError:
        return False


def _needed_paths() -> list[Path]:
    course = Path(__file__).resolve().parent.parent.parent
    paths = [course, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent]
    paths += [Path(p) for p in sys.path if p and Path(p).is_dir()]
    return [p.resolve() for p in dict.fromkeys(paths) if p.exists()]


_detected: dict[str, Isolation] = {}


def detect(mode: str = "auto", hidden: list[Path] = ()) -> Isolation:
    """The isolation to use.

    Args:
        mode: "auto" (bubblewrap when it works here, else none, said so), "bubblewrap" (raise
            :class:`SandboxError` when it does not work) or "none".
        hidden: folders the notebook must not see (solutions, submissions, results, ...).

    Returns:
        An :class:`Isolation`; its ``line()`` is what the grader prints.
    """
    if mode not in MODES:
        raise ValueError(f"isolation: expected one of {', '.join(MODES)}, got {mode!r}")
    hidden = list(dict.fromkeys(Path(p).resolve() for p in hidden))
    if mode == "none":
        return Isolation("none", "asked for with --isolation none")
    if "probe" not in _detected:
        _detected["probe"] = _probe()
    probe = _detected["probe"]
    if probe.kind == "none" and mode == "bubblewrap":
        raise SandboxError(f"--isolation bubblewrap: {probe.detail}")
    if probe.kind == "none":
        return probe
    shown = ", ".join(str(p) for p in hidden if p.is_dir())
    return Isolation("bubblewrap", f"bubblewrap ({probe.detail}): no network, own processes, "
                                   f"file system read-only, private /tmp"
                                   + (f", hidden: {shown}" if shown else ""),
                     probe.bwrap, hidden)


def _probe() -> Isolation:
    """Whether bubblewrap runs here: a sandboxed Python that must not reach the network."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Isolation("none", "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get "
                                 "install bubblewrap)")
    with tempfile.TemporaryDirectory(prefix="course-sandbox-probe-") as private:
        cmd = bubblewrap_args(bwrap, [], Path(private)) + [
            sys.executable, "-I", "-S", "-c",
            "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
            "    print('network')\nexcept OSError:\n    print('isolated')"]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Isolation("none", f"bubblewrap could not start ({type(exc).__name__})")
    if run.returncode != 0 or run.stdout.strip() != "isolated":
        why = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1][:200]
        return Isolation("none", f"bubblewrap is installed but cannot make a sandbox here ({why})")
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    return Isolation("bubblewrap", version or "bwrap", bwrap)
