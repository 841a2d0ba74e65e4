"""Choose where Triton kernels run: natively on a CUDA GPU, or in Triton's CPU interpreter.

This is the library's one deliberate side effect. Every notebook's first code cell calls
:func:`setup`; every module that defines a ``@triton.jit`` kernel calls :func:`ensure_configured`
before its first kernel, so the choice is made before any kernel is decorated (Triton reads the
interpreter switch at decoration time, not at ``import triton``).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

GPU = "gpu"
INTERPRETER = "interpreter"

# Problem sizes the notebooks use by default. The interpreter runs a forward pass at N=512, d=64
# in about 0.4 s (measured, see FACTS.md), so CPU sizes stay at or below 512.
_DEFAULT_SIZES = {
    GPU: {"seq_len": 4096, "head_dim": 64, "batch": 4, "heads": 16, "bench_repeats": 100},
    INTERPRETER: {"seq_len": 256, "head_dim": 64, "batch": 1, "heads": 2, "bench_repeats": 3},
}


@dataclass(frozen=True)
class Runtime:
    """What :func:`setup` decided: the mode, the torch device, versions and default sizes."""

    mode: str  # "gpu" or "interpreter"
    device: str  # torch device string: "cuda" or "cpu"
    gpu_name: str | None
    versions: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.mode == GPU

    @property
    def interpreted(self) -> bool:
        return self.mode == INTERPRETER

    def describe(self) -> str:
        """One line: mode, device and versions."""
        v = self.versions
        versions = f"torch {v['torch']}, triton {v['triton']}, numpy {v['numpy']}"
        if self.on_gpu:
            return f"GPU mode: Triton kernels run natively on {self.gpu_name} · {versions}"
        return f"CPU mode: no CUDA GPU, Triton runs in its interpreter (small sizes) · {versions}"


_RUNTIME: Runtime | None = None
_KERNELS_DEFINED = False


def choose_mode(cuda_available: bool, force: str | None = None) -> str:
    """Decide the mode. ``force`` ("gpu" or "interpreter") overrides detection."""
    if force is not None:
        if force not in (GPU, INTERPRETER):
            raise ValueError(f"force must be 'gpu', 'interpreter' or None, got {force!r}")
        if force == GPU and not cuda_available:
            raise ValueError("force='gpu' but torch sees no CUDA GPU on this machine")
        return force
    return GPU if cuda_available else INTERPRETER


def _set_interpreter(on: bool) -> None:
    # The environment variable covers triton versions that read it at decoration time; the knob
    # covers versions that cached it. Assign, never setdefault: an exported TRITON_INTERPRET=0
    # on a CPU-only machine would otherwise leave kernels unable to run.
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        import triton

        triton.knobs.runtime.interpret = on
    except (ImportError, AttributeError):  # pragma: no cover - older triton without knobs
        pass


def _versions() -> dict:
    import numpy
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a pinned dependency
        triton_version = "not installed"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "triton": triton_version, "numpy": numpy.__version__}


def setup(force: str | None = None, verbose: bool = True) -> Runtime:
    """Configure Triton for this machine and return the :class:`Runtime`; print one line.

    Call it once, first. Calling it again returns the same decision; asking for a different mode
    after kernels have been defined raises, because those kernels were built for the old mode.
    """
    global _RUNTIME
    import torch

    mode = choose_mode(torch.cuda.is_available(), force)
    if _RUNTIME is not None and _RUNTIME.mode != mode and _KERNELS_DEFINED:
        raise RuntimeError(
            f"Triton kernels were already defined in {_RUNTIME.mode} mode; restart the kernel "
            f"and call setup() before importing any kernel module")
    _set_interpreter(mode == INTERPRETER)
    _RUNTIME = Runtime(
        mode=mode,
        device="cuda" if mode == GPU else "cpu",
        gpu_name=torch.cuda.get_device_name() if mode == GPU else None,
        versions=_versions(),
        sizes=dict(_DEFAULT_SIZES[mode]),
    )
    if verbose:
        print(_RUNTIME.describe())
    return _RUNTIME


def ensure_configured() -> Runtime:
    """Called by kernel modules at import: configure silently if nobody called :func:`setup`."""
    global _KERNELS_DEFINED
    rt = _RUNTIME if _RUNTIME is not None else setup(verbose=False)
    _KERNELS_DEFINED = True
    return rt


def current() -> Runtime:
    """The runtime chosen so far (configuring silently if needed)."""
    return _RUNTIME if _RUNTIME is not None else setup(verbose=False)
