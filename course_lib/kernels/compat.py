"""Which Triton gets which spelling of Gluon: the one place that knows how Gluon's API moved.

Gluon (``triton.experimental.gluon``, chapter 09's last section) is experimental, and some of its
names changed between the Triton releases the course supports. The Gluon kernels
(:mod:`~course_lib.kernels.gluon_hopper`, :mod:`~course_lib.kernels.gluon_backward`,
:mod:`~course_lib.kernels.gluon_masked`) take every name that moved from this module, never from
Triton directly. :data:`SPELLINGS` says, for each, from which Triton release on which spelling
holds; the installed Triton gets the newest spelling at or below its version, so a Triton newer
than every entry gets the newest spelling. Today (names under ``triton.experimental.gluon.language``):

- ``tma_load``: ``nvidia.hopper.tma.async_copy_global_to_shared`` up to 3.7, ``async_load`` from 3.8;
- ``tma_store``: ``nvidia.hopper.tma.async_copy_shared_to_global`` up to 3.7, ``async_store`` from 3.8;
- ``cp_async_load``: ``nvidia.ampere.async_copy.async_copy_global_to_shared`` up to 3.7,
  ``async_load`` from 3.8;
- ``sync_warps``: ``thread_barrier`` in 3.6, ``barrier`` from 3.7.

(Triton 3.8 removed the old copy names; 3.9 has them again as stubs that raise "has been removed;
call async_load instead" when a kernel is compiled, which is why the choice goes by version and not
by whether a name exists.)

If a Gluon kernel still fails to compile (a Triton the course has not seen), the learner must not
get a compiler error from :func:`course_lib.flash_attention`: each Gluon launcher launches inside
:class:`FallBack`, which catches an error raised while Triton compiled, warns once naming the
Triton version, turns the Gluon kernels off for the rest of the process (:func:`gluon_failure`)
and lets the launcher run the library's Triton kernel instead.
"""

from __future__ import annotations

import importlib
import re
import warnings

import triton

# The Triton releases the Gluon kernels were compiled with: tests/test_gluon_*.py cross-compile them
# for sm_90 on CPU in `make test` (the pinned 3.7.1) and `make test-newest` (3.9.0); 3.6.0 and 3.8.0
# were run by hand (2026-11-27), and 3.6.0 runs them on the H100.
TESTED_TRITON = ("3.6.0", "3.7.1", "3.8.0", "3.9.0")

_GLUON_LANGUAGE = "triton.experimental.gluon.language"
# name -> ((first Triton (major, minor) of a spelling, its path under triton.experimental.gluon.language), ...),
# oldest first. Each spelling holds from its version until the next entry's.
SPELLINGS: dict[str, tuple[tuple[tuple[int, int], str], ...]] = {
    # TMA copy of one tile, global -> shared, arriving on an mbarrier (Hopper and newer)
    "tma_load": (((3, 6), "nvidia.hopper.tma.async_copy_global_to_shared"), ((3, 8), "nvidia.hopper.tma.async_load")),
    # TMA copy of one tile, shared -> global
    "tma_store": (((3, 6), "nvidia.hopper.tma.async_copy_shared_to_global"), ((3, 8), "nvidia.hopper.tma.async_store")),
    # cp.async of a pointer tensor into shared memory (Ampere and newer)
    "cp_async_load": (((3, 6), "nvidia.ampere.async_copy.async_copy_global_to_shared"),
                      ((3, 8), "nvidia.ampere.async_copy.async_load")),
    # a barrier of the warps of one partition (bar.sync)
    "sync_warps": (((3, 6), "thread_barrier"), ((3, 7), "barrier")),
}


def triton_version(text: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of a Triton version string (the installed one by default): ``"3.9.0"``,
    ``"3.10.0+git1a2b"`` -> ``(3, 10)``. Raises ValueError naming ``text`` when it has none."""
    text = triton.__version__ if text is None else text
    found = re.match(r"\s*(\d+)\.(\d+)", str(text))
    if found is None:
        raise ValueError(f"text must be a version like '3.9.0', got {text!r}")
    return int(found.group(1)), int(found.group(2))


def spelling(name: str, version: tuple[int, int] | None = None) -> str:
    """The path (under ``triton.experimental.gluon.language``) of ``name`` for a Triton version
    (the installed one by default): the newest entry of :data:`SPELLINGS` at or below it; the
    oldest entry for a version older than all of them."""
    if name not in SPELLINGS:
        raise ValueError(f"name must be one of {sorted(SPELLINGS)}, got {name!r}")
    version = triton_version() if version is None else tuple(version)
    entries = SPELLINGS[name]
    chosen = entries[0][1]
    for first, path in entries:
        if version >= first:
            chosen = path
    return chosen


def resolve(name: str):
    """The installed Triton's object for ``name`` (:func:`spelling`); ImportError naming the
    Triton version and the path when that Triton has no such name."""
    path = spelling(name)
    module_path, _, attribute = f"{_GLUON_LANGUAGE}.{path}".rpartition(".")
    try:
        return getattr(importlib.import_module(module_path), attribute)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"triton {triton.__version__} has no gluon {path} (course_lib/kernels/compat.py, "
                          f"SPELLINGS[{name!r}]): {err}") from err


try:
    tma_load = resolve("tma_load")
    tma_store = resolve("tma_store")
    cp_async_load = resolve("cp_async_load")
    sync_warps = resolve("sync_warps")
    API_ERROR = None
except ImportError as _err:  # pragma: no cover - depends on the installed Triton
    API_ERROR = str(_err)  # gluon_hopper.GLUON_IMPORT_ERROR reports it; the library keeps its Triton kernels


# ----------------------------------------------------------------------------------------------
# Falling back to the Triton kernels when a Gluon kernel does not compile


class GluonFallbackWarning(RuntimeWarning):
    """A Gluon kernel did not compile with the installed Triton; the Triton kernels run instead."""


# The first Gluon compile failure of this process (a one-line reason), or None. A dict, so that
# tests can put a fresh state in with monkeypatch.setitem.
_STATE: dict[str, str | None] = {"failure": None}

# Where Triton compiles: the driver of the compile (triton/compiler/) and each backend's passes and
# ptxas call (triton/backends/<name>/compiler.py). A launch error (a CUDA error, say) comes from
# the launcher, which is in neither.
_COMPILER_FILES = re.compile(r"[/\\]triton[/\\](compiler[/\\]|backends[/\\][^/\\]+[/\\]compiler\.py$)")


def gluon_failure() -> str | None:
    """Why the Gluon kernels are off for the rest of this process (one of them failed to compile
    with this Triton), or None while none has failed."""
    return _STATE["failure"]


def is_compile_error(err: BaseException) -> bool:
    """Whether ``err`` was raised while Triton compiled a kernel (its front end, passes, ptxas, or
    the check that the compiled kernel fits the GPU), not while the kernel ran."""
    from triton.compiler.errors import CompilationError

    if isinstance(err, CompilationError):
        return True
    tb = err.__traceback__
    while tb is not None:
        if _COMPILER_FILES.search(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


def _first_line(err: BaseException) -> str:
    """The line of an error message that says what went wrong (Triton's compile errors end with it)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


def record_failure(what: str, err: BaseException) -> None:
    """Turn the Gluon kernels off for this process and warn, once, naming the Triton version."""
    if _STATE["failure"] is not None:
        return
    _STATE["failure"] = (f"{what} did not compile with triton {triton.__version__} earlier in this process "
                         f"({_first_line(err)})")
    warnings.warn(f"course_lib: {what} does not compile with triton {triton.__version__} ({_first_line(err)}). "
                  f"The library runs its Triton kernels instead, for this and every later call (same results, "
                  f"somewhat slower on Hopper). The Gluon kernels were tested with triton "
                  f"{', '.join(TESTED_TRITON)}.", GluonFallbackWarning, stacklevel=3)


class FallBack:
    """Launch a Gluon kernel inside it; a compile error is caught, recorded and warned about once.

    ``with FallBack("the Gluon forward") as launch: kernel[grid](...)``, then ``if launch.failed:``
    run the Triton kernel. Anything raised that is not a compile error (a bad argument, a CUDA
    error) goes through untouched, and so does every error with ``strict=True`` (cross-compiling
    for the tests: a kernel that does not compile must fail there)."""

    def __init__(self, what: str, strict: bool = False):
        self.what = what
        self.strict = strict
        self.failed = False

    def __enter__(self) -> FallBack:
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if err is None or self.strict or not isinstance(err, Exception) or not is_compile_error(err):
            return False
        record_failure(self.what, err)
        self.failed = True
        return True  # swallowed: the launcher runs the Triton kernel


__all__ = ["TESTED_TRITON", "SPELLINGS", "API_ERROR", "triton_version", "spelling", "resolve", "tma_load",
           "tma_store", "cp_async_load", "sync_warps", "GluonFallbackWarning", "gluon_failure",
           "is_compile_error", "record_failure", "FallBack"]
