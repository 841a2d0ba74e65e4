"""Choose where Triton kernels run: natively on a CUDA GPU, or in Triton's CPU interpreter.

This is the library's one deliberate side effect. Every notebook's first code cell calls
:func:`setup`; every module that defines a ``@triton.jit`` kernel calls :func:`ensure_configured`
before its first kernel, so the choice is made before any of *our* kernels is decorated.

Why that alone is not enough: Triton reads the interpreter switch when ``@triton.jit`` decorates
a function, and ``import triton`` already decorates Triton's own standard library (``tl.cdiv``,
``tl.max``, ``tl.sum``, ``tl.zeros``, ... are ``@jit`` functions in ``triton.language``). A
program that imported triton before the switch (a script that does ``import triton`` first, or a
kernel module whose ``import triton`` runs before it calls :func:`ensure_configured`) holds a
standard library compiled for the other mode: an interpreted kernel that calls ``tl.cdiv`` then
fails with "Cannot call @triton.jit'd outside of the scope of a kernel", and a compiled kernel
cannot call an interpreter function. So :func:`_set_interpreter` also re-decorates those
standard-library functions for the chosen mode (:func:`_redecorate_triton_language`), with
``triton.jit`` itself, exactly as importing triton after the switch would have. Import order no
longer matters.
"""

from __future__ import annotations

import os
import platform
import sys
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
    forced_by: str | None = None  # "COURSE_LIB_MODE=cpu" or "setup(force=...)" when not detected
    capability: tuple[int, int] | None = None  # the GPU's compute capability, e.g. (9, 0)

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
            return f"GPU mode: Triton kernels run natively on {self.gpu_name}{self._gpu_note()} · {versions}"
        if self.versions.get("triton") == "not installed":
            system = {"Darwin": "macOS"}.get(platform.system(), platform.system())
            return (f"CPU mode without Triton (no {system} wheel): chapters 00-04 run; the "
                    f"Triton chapters need Linux or WSL2 · torch {v['torch']}, numpy {v['numpy']}")
        if self.forced_by:
            return (f"CPU mode ({self.forced_by}): Triton runs in its interpreter on CPU tensors "
                    f"(small sizes) · {versions}")
        from course_lib.platform.colab import GPU_RUNTIMES, on_colab

        choose = f"; for GPU mode choose {GPU_RUNTIMES}" if on_colab() else ""
        if self.gpu_name:  # a GPU below Triton's supported compute capability
            return (f"CPU mode: {self.gpu_name} is below the compute capability Triton supports "
                    f"({MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]}+), so Triton runs "
                    f"in its interpreter on CPU tensors (small sizes){choose} · {versions}")
        return f"CPU mode: no CUDA GPU, Triton runs in its interpreter (small sizes){choose} · {versions}"

    def _gpu_note(self) -> str:
        """What the GPU-mode line says after the GPU's name: which Colab runtime it is, and on a GPU
        newer than Hopper (Blackwell: B200, RTX 50xx, RTX PRO 6000), that chapter 09's Hopper-only
        kernels (wgmma, Gluon) stay off there."""
        from course_lib.platform.colab import on_colab, runtime_name
        from course_lib.platform.hardware import compute_target

        notes = []
        colab_runtime = runtime_name(self.gpu_name) if on_colab() else None
        if colab_runtime:
            notes.append(f"Colab's {colab_runtime} runtime")
        if self.capability is not None and tuple(self.capability) >= (10, 0):
            target = compute_target(self.capability)
            smem = f", {target.max_shared_kib_per_block} KiB of shared memory per block" if target else ""
            notes.append(f"compute capability {self.capability[0]}.{self.capability[1]}{smem}: "
                         f"the Hopper-only kernels (wgmma, Gluon) stay off")
        return f" ({'; '.join(notes)})" if notes else ""


_RUNTIME: Runtime | None = None
_KERNELS_DEFINED = False


# Triton supports NVIDIA GPUs of compute capability 8.0 (A100) and newer; below (e.g. Colab's free
# T4, 7.5) its maintainers say it "may work at times", and bf16 and fp8 do not compile there.
MIN_COMPUTE_CAPABILITY = (8, 0)


def choose_mode(cuda_available: bool, force: str | None = None,
                capability: tuple | None = None) -> str:
    """Decide the mode. ``force`` ("gpu" or "interpreter") overrides detection; ``capability``
    is the GPU's compute capability: below :data:`MIN_COMPUTE_CAPABILITY` the course uses the
    interpreter (and refuses ``force="gpu"`` with the reason)."""
    if force is not None:
        if force not in (GPU, INTERPRETER):
            raise ValueError(f"force must be 'gpu', 'interpreter' or None, got {force!r}")
        if force == GPU and not cuda_available:
            raise ValueError("force='gpu' but torch sees no CUDA GPU on this machine")
        if force == GPU and capability is not None and tuple(capability) < MIN_COMPUTE_CAPABILITY:
            raise ValueError(f"force='gpu' but this GPU's compute capability "
                             f"{capability[0]}.{capability[1]} is below Triton's supported "
                             f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]}")
        return force
    if cuda_available and capability is not None and tuple(capability) < MIN_COMPUTE_CAPABILITY:
        return INTERPRETER
    return GPU if cuda_available else INTERPRETER


# COURSE_LIB_MODE=cpu (or interpreter) / gpu forces a mode for every notebook and script; unset or
# "auto": decide from the machine.
MODE_ENV = "COURSE_LIB_MODE"
_MODE_NAMES = {"cpu": INTERPRETER, "interpreter": INTERPRETER, "gpu": GPU, "auto": None, "": None}


def mode_from_environment() -> str | None:
    """The mode ``COURSE_LIB_MODE`` forces (None: decide from the machine)."""
    value = os.environ.get(MODE_ENV, "").strip().lower()
    if value not in _MODE_NAMES:
        raise ValueError(f"{MODE_ENV} must be 'cpu', 'gpu' or 'auto', got {os.environ[MODE_ENV]!r}")
    return _MODE_NAMES[value]


def triton_installed() -> bool:
    """False on macOS and Windows, where PyPI has no triton wheel (the course installs without it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:
        return False


def _set_interpreter(on: bool) -> None:
    # The environment variable covers triton versions that read it at decoration time; the knob
    # covers versions that cached it. Assign, never setdefault: an exported TRITON_INTERPRET=0
    # on a CPU-only machine would otherwise leave kernels unable to run.
    already_imported = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    if not triton_installed():
        return  # nothing to switch: chapters 00-04 use NumPy and torch only
    import triton

    triton.knobs.runtime.interpret = on
    if already_imported:  # triton's own @jit functions were decorated before the switch
        _redecorate_triton_language(on)
    if on:
        _patch_language_once_per_launch()


def _patch_language_once_per_launch() -> bool:
    """Make Triton's interpreter patch ``triton.language`` once per kernel launch, not again at
    every call of a ``@triton.jit`` helper inside the kernel.

    The interpreter swaps ``triton.language``'s builtins for NumPy versions around a launch
    (``_patch_lang``, undone by the launch's ``restore()``); a helper's call (``InterpretedFunction
    .__call__``) patches them again, though the launch's patch is still in force, and that second
    patch is never undone (the launch's restore puts back the originals it saved first). The
    repeat is pure work: ``inspect.getmembers`` over the language modules per helper call, 40%
    of the time of a chapter 06 check on our 2-core CPU (cProfile, 2026-11-27: 5.1 of 12.9 s;
    every tile load is a helper call). Here a helper's patch is skipped while a launch's patch of
    the same language modules is in force; anything else (another module, no launch) is patched
    as before. Triton 3.6-3.9 have this structure; on one without it nothing changes. Returns
    whether the patch is in place.
    """
    import inspect

    try:
        from triton.runtime import interpreter as interp
        import triton.language as tl
    except ImportError:
        return False
    original = getattr(interp, "_patch_lang", None)
    executor = getattr(interp, "GridExecutor", None)
    if getattr(original, "_course_once_per_launch", False):
        return True
    if original is None or executor is None or not hasattr(interp, "_LangPatchScope"):
        return False
    # "launch": the language modules the running launch's patch covers (None outside a launch);
    # "entering": a launch has begun and its own patch (the first inside it) is still to come
    state = {"launch": None, "entering": False}
    launch_call = executor.__call__

    def launch(self, *args, **kwargs):
        state["entering"], state["launch"] = True, None
        try:
            return launch_call(self, *args, **kwargs)
        finally:  # the launch's patch is undone by then (Triton restores it in a finally)
            state["entering"], state["launch"] = False, None

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if state["launch"] is not None and langs and langs <= state["launch"]:
            return interp._LangPatchScope()  # a helper inside a launch: already patched, nothing to undo
        scope = patch_lang.original(fn)
        if state["entering"]:  # the launch's own patch
            state["entering"], state["launch"] = False, langs
        elif state["launch"] is not None:  # a helper that sees other modules: patched as Triton does
            state["launch"] |= langs
        return scope

    executor.__call__ = launch
    patch_lang._course_once_per_launch = True
    patch_lang.original = original  # Triton's (tests count its calls through this attribute)
    interp._patch_lang = patch_lang
    return True


def _triton_jit_classes():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return JITFunction, InterpretedFunction


def _jit_options(fn) -> dict:
    """The keyword arguments ``triton.jit`` was given for ``fn`` (either class keeps them)."""
    _, interpreted_cls = _triton_jit_classes()
    if isinstance(fn, interpreted_cls):
        return dict(fn.kwargs)
    return {"version": fn.version, "do_not_specialize": fn.do_not_specialize,
            "do_not_specialize_on_alignment": fn.do_not_specialize_on_alignment,
            "debug": fn.debug, "noinline": fn.noinline, "repr": fn._repr,
            "launch_metadata": fn.launch_metadata}


def _redecorate_triton_language(on: bool) -> int:
    """Re-decorate ``triton.language``'s own ``@jit`` functions for the mode just chosen.

    Walks every loaded ``triton.language*`` module and the member functions of ``tl.tensor``
    (``x.sum()`` is the same object as ``tl.sum``), and replaces each function decorated for the
    other mode with ``triton.jit(fn.fn, **same options)``, called now that the switch is set. One
    replacement per function, so ``tl.max`` and ``triton.language.standard.max`` stay the same
    object. Returns how many functions were replaced (0 when they already match the mode).
    """
    import triton
    import triton.language as tl

    triton.knobs.runtime.interpret = on  # triton.jit below reads it to pick the class
    jit_cls, interpreted_cls = _triton_jit_classes()
    wrong = jit_cls if on else interpreted_cls
    replaced: dict[int, object] = {}

    def fixed(value):
        if type(value) is not wrong:  # exact type: autotuners and heuristics wrap, they are not jit'd
            return None
        if id(value) not in replaced:
            replaced[id(value)] = triton.jit(value.fn, **_jit_options(value))
        return replaced[id(value)]

    namespaces = [vars(m) for name, m in list(sys.modules.items())
                  if m is not None and (name == "triton.language" or name.startswith("triton.language."))]
    for namespace in namespaces:
        for name, value in list(namespace.items()):
            new = fixed(value)
            if new is not None:
                namespace[name] = new
    # Member functions (x.sum(), x.to(...)): triton's _tensor_member_fn stores a jit'd function
    # itself, but an interpreted one inside a plain wrapper function. Re-register through it.
    for name, value in list(vars(tl.core.tensor).items()):
        inner = [c.cell_contents for c in (getattr(value, "__closure__", None) or ())
                 if type(c.cell_contents) is wrong]
        new = fixed(inner[0] if inner else value)
        if new is not None:
            tl.core._tensor_member_fn(new)
            if getattr(tl.core.tensor, name) is value:  # registered under another name
                setattr(tl.core.tensor, name, vars(tl.core.tensor)[new.__name__])
    return len(replaced)


def _versions() -> dict:
    import numpy
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # macOS and Windows: no triton wheel
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

    cuda = torch.cuda.is_available() and triton_installed()  # no triton, no kernels on the GPU
    capability = torch.cuda.get_device_capability() if cuda else None
    from_env = mode_from_environment()
    wanted = force if force is not None else from_env
    try:
        mode = choose_mode(cuda, wanted, capability)
    except ValueError as exc:
        if force is not None:
            raise
        raise ValueError(f"{MODE_ENV}={os.environ[MODE_ENV].strip()}: "
                         + str(exc).replace("force='gpu' but ", "")) from None
    forced_by = None
    if wanted is not None and mode != choose_mode(cuda, None, capability):
        forced_by = (f"setup(force={force!r})" if force is not None
                     else f"{MODE_ENV}={os.environ[MODE_ENV].strip()}")
    if _RUNTIME is not None and _RUNTIME.mode != mode and _KERNELS_DEFINED:
        raise RuntimeError(
            f"Triton kernels were already defined in {_RUNTIME.mode} mode; restart the kernel "
            f"and call setup() before importing any kernel module")
    _set_interpreter(mode == INTERPRETER)
    _RUNTIME = Runtime(
        mode=mode,
        device="cuda" if mode == GPU else "cpu",
        gpu_name=torch.cuda.get_device_name() if cuda else None,
        versions=_versions(),
        sizes=dict(_DEFAULT_SIZES[mode]),
        forced_by=forced_by,
        capability=tuple(capability) if capability is not None else None,
    )
    if verbose:
        print(_RUNTIME.describe())
    return _RUNTIME


def use_stand_in_gpu(name: str) -> Runtime:
    """GPU mode on a machine without that GPU, for compiling only (``python -m course_lib.measure.reach``):
    kernels are defined for the compiler, not the interpreter; the caller installs a stand-in
    driver for the target, and launches do nothing. Call it before any kernel module is imported."""
    global _RUNTIME
    if _KERNELS_DEFINED and _RUNTIME is not None and _RUNTIME.mode != GPU:
        raise RuntimeError("kernels were already defined for the interpreter; use a fresh process")
    _set_interpreter(False)
    _RUNTIME = Runtime(mode=GPU, device="cpu", gpu_name=name, versions=_versions(),
                       sizes=dict(_DEFAULT_SIZES[GPU]))
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
