"""Fit each launch config to the GPU it runs on.

The tables of :mod:`course_lib.kernels.tuning` were measured on an H100, which has 227 KiB of
shared memory per block. Other GPUs the course runs on have less: an A100 163 KiB; an A10, RTX
3090, RTX 4090 or L4 99 KiB. A config that fits an H100 can need more than that (the d=128
backward tiles need 129 KiB on an RTX 3090), and then Triton fails at the first launch with "out
of resource: shared memory"; or it fits but spills registers to slow local memory on a chip whose
matmul instructions keep more in registers.

So the launchers do not launch the table's config blindly. Before the first launch of each kernel
shape, :func:`choose` compiles the candidates in order (the H100 choice first, then
:func:`course_lib.kernels.tuning.gpu_candidates`' smaller ones), asks the driver to load each one
on this device (which is where Triton checks the shared-memory limit and where the driver reports
registers and spills), and keeps the first that loads without spilling — or, if every one that
loads spills, the one that spills least. On the GPU the tables were measured on (compute
capability 9.0, :data:`~course_lib.kernels.tuning.TABLE_ARCH`) the table's config is kept whenever
it loads: its speed was measured with whatever few bytes it spills, so the H100 choice stays the
H100 choice and nothing extra is compiled. The answer is cached per device and kernel shape, so
later calls cost a dictionary lookup.

``python -m course_lib.measure.reach`` runs the same choice for GPUs we do not have, by giving Triton a
stand-in driver for the target (:mod:`course_lib.measure.reach`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.kernels import tuning


@dataclass(frozen=True)
class Loaded:
    """What the driver reported for one compiled candidate (``shared`` None: did not fit)."""

    blocks: tuning.Blocks
    shared: int  # bytes of shared memory the kernel needs per block
    limit: int  # bytes of shared memory a block may use on this device
    registers: int | None = None  # per thread
    spill_bytes: int | None = None  # local memory per thread (register spills)
    compile_s: float = 0.0
    # why the driver refused to load it although Triton's shared-memory count fits (another
    # resource ran out); None when it loaded
    refused: str | None = None

    @property
    def fits(self) -> bool:
        return self.shared <= self.limit and self.refused is None


@dataclass
class Choice:
    """The config chosen for one kernel shape on one device, and every candidate tried."""

    kernel: str
    meta: dict
    chosen: Loaded
    tried: list[Loaded] = field(default_factory=list)


# (device target, kernel name, constexprs, arg dtypes, candidates) -> Choice. Read by reach.py.
CHOICES: dict[tuple, Choice] = {}


class NoConfigFits(RuntimeError):
    """No candidate config of a kernel fits this GPU's shared memory."""


def _shared_limit(device: int) -> int:
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device)["max_shared_mem"]


def _load(kernel, blocks: tuning.Blocks, args: tuple, meta: dict, block_args) -> Loaded:
    """Compile ``kernel`` with ``blocks`` for the current device and load it there."""
    import time

    from triton.runtime import driver
    from triton.runtime.errors import OutOfResources

    start = time.perf_counter()
    compiled = kernel.warmup(*args, grid=(1,), **meta, **block_args(blocks),
                             num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    seconds = time.perf_counter() - start
    limit = _shared_limit(driver.active.get_current_device())
    try:
        compiled._init_handles()  # Triton's own check of the shared-memory limit, then the load
    except OutOfResources as exc:
        return Loaded(blocks, compiled.metadata.shared, limit, compile_s=seconds, refused=str(exc))
    # the driver reports local memory per thread in 4-byte words (triton's n_spills)
    return Loaded(blocks, compiled.metadata.shared, limit, compiled.n_regs, 4 * compiled.n_spills,
                  seconds)


def _tile_args(blocks: tuning.Blocks) -> dict:
    return {"BLOCK_M": blocks.block_m, "BLOCK_N": blocks.block_n}


def choose(kernel, candidates, args: tuple, meta: dict, block_args=_tile_args) -> tuning.Blocks:
    """The first of ``candidates`` that this GPU loads without spilling registers.

    Args:
        kernel: a ``@triton.jit`` kernel; args: its positional arguments for this launch;
            meta: its constexpr keyword arguments other than the tile sizes.
        candidates: :class:`~course_lib.kernels.tuning.Blocks` in order of preference.
        block_args: maps a candidate to the kernel's tile-size keyword arguments.

    Raises:
        NoConfigFits: when no candidate fits the device's shared memory (names the kernel, the
            smallest need and the limit).
    """
    from triton.runtime import driver

    # The cache key is built on every launch, so it stays cheap: the dtypes of the arguments that
    # have one (tensors), not a string per argument.
    candidates = tuple(candidates)
    target = driver.active.get_current_target()
    device = driver.active.get_current_device()
    dtypes = tuple(getattr(a, "dtype", None) for a in args)
    key = (target.arch, device, kernel.fn.__name__, tuple(sorted(meta.items())), dtypes, candidates)
    found = CHOICES.get(key)
    if found is not None:
        return found.chosen.blocks
    candidates = tuple(dict.fromkeys(candidates))  # keep order, drop repeats
    tried = []
    for blocks in candidates:
        loaded = _load(kernel, blocks, args, meta, block_args)
        tried.append(loaded)
        measured_here = len(tried) == 1 and target.arch == tuning.TABLE_ARCH
        if loaded.fits and (loaded.spill_bytes == 0 or measured_here):
            CHOICES[key] = Choice(kernel.fn.__name__, dict(meta), loaded, tried)
            return blocks
    loadable = [t for t in tried if t.fits]
    if not loadable:
        smallest = min(tried, key=lambda t: t.shared)
        refused = next((t.refused for t in tried if t.refused), None)
        raise NoConfigFits(
            f"{kernel.fn.__name__}: no launch config fits this GPU's shared memory: the smallest "
            f"candidate ({smallest.blocks}) needs {smallest.shared / 1024:.1f} KiB, the GPU allows "
            f"{smallest.limit / 1024:.1f} KiB per block"
            + (f" (the driver also refused a candidate: {refused})" if refused else ""))
    chosen = min(loadable, key=lambda t: t.spill_bytes)  # every candidate spills: the least
    CHOICES[key] = Choice(kernel.fn.__name__, dict(meta), chosen, tried)
    return chosen.blocks
