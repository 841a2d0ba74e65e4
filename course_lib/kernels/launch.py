"""A kernel launch made once through Triton, then straight through the compiled kernel (issue 33).

``kernel[grid](*args, **meta)`` does a lot of host work on every call: Triton binds the arguments to
the kernel's signature, works out each argument's specialization (its dtype, whether a pointer is
16-byte aligned, whether an integer is 1 or a multiple of 16), builds a cache key from them, looks
the compiled kernel up, and only then launches it. For a small attention call that host work is a
large share of the call (measured on an H100: a bare Triton launch costs 18.6 µs, FACTS.md).

A :class:`CachedLaunch` is one launch site whose grid, constexprs and options are fixed. Its first
call goes through ``kernel[grid](...)`` as before (compiling, checking shared memory, loading the
kernel); it keeps the compiled kernel that Triton returns, and later calls go straight to the compiled
kernel's launcher: ``compiled.run(grid, stream, function, metadata, launch metadata, hooks, *args)``,
the call Triton's own ``run`` ends with, on the stream of the current device. That is only right
while every later call's arguments would get the same specialization, so the caller keeps one
:class:`CachedLaunch` per *call signature* (shapes, strides, dtypes, pointer alignment: see
:mod:`course_lib.kernels.plan`) and never shares one across signatures.

Triton 3.6, 3.7 and 3.9 launch a compiled kernel the same way (``CompiledKernel.run``, ``function``,
``packed_metadata``, ``launch_metadata``; the positional arguments are every parameter of the
kernel, constexprs included, in order). Their launch hooks (``knobs.runtime.launch_enter_hook``,
what profilers such as Proton add to) are a chain that is never None: Triton builds the launch's
metadata for it on every launch; here it is built only when a hook is in the chain. Where there is
no compiled kernel (the interpreter), or the kernel has pre-run hooks or an autotuner, every call
goes through ``kernel[grid]`` as before. What Triton would check again on each call and a launch by
handle does not: that the kernel's source and globals, and compile-time knobs (``knobs.runtime.debug``,
instrumentation), are unchanged; after changing those, start from fresh launches
(:func:`course_lib.kernels.plan.clear` for the library's).
"""

from __future__ import annotations

import inspect


class CachedLaunch:
    """``kernel[grid](*args, **meta)`` for one call signature; ``cache=True`` launches later calls by
    the compiled kernel's handle.

    Args:
        kernel: a ``@triton.jit`` or ``@gluon.jit`` kernel (or an autotuner: never cached).
        grid: the launch grid: a tuple (fixed for the signature), or a function of the config (an
            autotuner's launch, never cached).
        meta: constexpr keyword arguments and launch options (``num_warps``, ``num_stages``, ...).
        cache: False keeps every call on ``kernel[grid]`` (the launchers' direct use: tests,
            cross-compiling, chapter tools).
    """

    __slots__ = ("kernel", "grid", "meta", "cache", "compiled", "_runner", "_tail")

    def __init__(self, kernel, grid, meta: dict, cache: bool = True):
        self.kernel, self.grid, self.meta = kernel, grid, meta
        self.cache = cache and isinstance(grid, tuple)  # a callable grid (the autotuner's) changes per config
        self.compiled = None  # what Triton returned from the first launch (None in the interpreter)
        self._runner = None  # the compiled kernel's launcher for self.grid, once known
        self._tail = ()  # the values of the parameters after the positional ones, in order

    def __call__(self, *args):
        """Launch with the positional runtime arguments ``args``; return the compiled kernel (None
        in the interpreter)."""
        if self._runner is not None:
            self._runner(*args, *self._tail)
            return self.compiled
        self.compiled = self.kernel[self.grid](*args, **self.meta)
        if self.cache:
            self._runner, self._tail = _handle(self.kernel, self.compiled, self.grid, len(args), self.meta)
            self.cache = self._runner is not None  # no handle now, none later: stop asking
        return self.compiled

    @property
    def by_handle(self) -> bool:
        """Whether later calls skip Triton's ``JITFunction.run``."""
        return self._runner is not None


def _handle(kernel, compiled, grid: tuple, n_args: int, meta: dict):
    """``(runner, tail)``: the compiled kernel's launcher for ``grid`` and the values of the kernel's
    parameters after the first ``n_args`` (from ``meta`` or their defaults); ``(None, ())`` when the
    launch cannot skip Triton's ``run`` (see the module docstring)."""
    from triton.runtime.jit import JITFunction  # @gluon.jit kernels are JITFunctions too

    if (compiled is None or not isinstance(kernel, JITFunction) or not hasattr(compiled, "packed_metadata")
            or kernel.pre_run_hooks):
        return None, ()
    tail = []
    for param in list(kernel.signature.parameters.values())[n_args:]:
        if param.name in meta:
            tail.append(meta[param.name])
        elif param.default is not inspect.Parameter.empty:
            tail.append(param.default)
        else:  # a runtime argument passed by keyword: not a launch this class knows how to repeat
            return None, ()
    return _launcher(compiled, tuple(grid) + (1,) * (3 - len(grid))), tuple(tail)


def _launcher(compiled, grid: tuple):
    """``launch(*args)``: launch ``compiled`` on ``grid`` (three dims) as Triton's ``JITFunction.run``
    does, on the current device's stream, with the launch hooks in place."""
    from triton import knobs
    from triton.runtime import driver

    compiled._init_handles()  # loaded already by the first launch: returns at once
    grid_x, grid_y, grid_z = grid
    active = driver.active
    get_device, get_stream = active.get_current_device, active.get_current_stream
    import torch

    if get_device is torch.cuda.current_device and hasattr(torch._C, "_cuda_getDevice"):
        # the same index without current_device's _lazy_init (CUDA is up: this kernel was launched):
        # ~3 µs less per launch in the H100 profile; still read per launch (torch.cuda.set_device)
        get_device = torch._C._cuda_getDevice

    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    direct = _direct(run)  # (C launch, cooperative, pdl) for Triton 3.6's launcher, else None
    c_launch, cooperative, pdl = direct or (None, None, None)

    def launch(*args):
        device = get_device()
        stream = get_stream(device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        # a HookChain (Triton 3.6+) is empty unless a profiler hooked in; older Tritons: None or a hook
        hooked = getattr(enter, "calls", enter)
        metadata = compiled.launch_metadata(grid, stream, *args) if hooked else None
        if c_launch is not None:  # what run() would do, without its Python frame (no scratch to allocate)
            c_launch(grid_x, grid_y, grid_z, stream, function, cooperative, pdl, None, None, packed, metadata, enter,
                     leave, *args)
        else:
            run(grid_x, grid_y, grid_z, stream, function, packed, metadata, enter, leave, *args)

    return launch


# The parameters of Triton 3.6's CudaLauncher.__call__ and what its body reads: a launcher whose
# __call__ has exactly these takes the direct call of _direct.
_DIRECT_PARAMS = ("self", "gridX", "gridY", "gridZ", "stream", "function")
_DIRECT_NAMES = {"launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size"}


def _direct(runner):
    """``(launch, cooperative, pdl)``: what ``runner(gridX, gridY, gridZ, stream, function, *args)``
    calls, for a caller to call it directly; or None.

    Triton's ``CudaLauncher.__call__`` (3.6) allocates the kernel's global and profiling scratch when
    it has any, then calls its C extension's ``launch(gridX, gridY, gridZ, stream, function,
    cooperative, pdl, global_scratch, profile_scratch, *args)``. A kernel without scratch (the
    course's kernels: no device-side descriptors, no ``tl.device_print``) needs none of that Python
    per launch: the two flags are fixed at compile time and both pointers are None. Taken only for a
    launcher whose ``__call__`` has 3.6's parameters and reads what this copies (Triton 3.7 moved the
    metadata arguments: its launchers, the interpreter's and the stand-in's go through ``runner``).
    On an H100 host ``CudaLauncher.__call__`` took 13 µs of cProfile's own time per 4 launches
    (tools/profile_overhead.py, torch 2.11, triton 3.6, 2026-11-27).
    """
    call = getattr(type(runner), "__call__", None)
    code = getattr(call, "__code__", None)
    if (code is None or code.co_varnames[:code.co_argcount] != _DIRECT_PARAMS or not code.co_flags & 0x04
            or not _DIRECT_NAMES <= set(code.co_names)):
        return None
    if getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1):
        return None
    return runner.launch, runner.launch_cooperative_grid, runner.launch_pdl


def rebased(template, base):
    """A copy of the host-side tensor descriptor ``template`` over the tensor ``base``, which has the
    same shape, strides, dtype and 16-byte alignment as ``template.base`` (the caller's call
    signature says so): the descriptor's checks (``__post_init__``) ran when ``template`` was made
    and are not run again."""
    copy = object.__new__(type(template))
    copy.__dict__.update(template.__dict__)
    copy.base = base
    return copy


__all__ = ["CachedLaunch", "rebased"]
