"""A stand-in for Triton's CUDA driver: compile for a GPU this machine does not have, never launch.

Triton compiles for any NVIDIA GPU without one: the compiler only needs the target's compute
capability. With :class:`StandInDriver` active, a kernel launched on CPU tensors is compiled for
``arch`` and "loaded" (the stand-in reports the target's shared-memory limit, and the registers and
spills that the ``cuobjdump`` bundled with Triton reads from the compiled binary); the launch itself
does nothing. :mod:`course_lib.measure.reach` surveys every launch with it; the Gluon kernels'
``cross_compile`` use it to compile for sm_90 on a CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

from course_lib.platform.hardware import COMPUTE_TARGETS


def _bundled_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local-memory bytes per thread) of a compiled kernel, read by the
    ``cuobjdump`` that ships with Triton. Local memory here is what spilled registers use: the
    driver reports the same number as ``CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([_bundled_tool("cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    return int(found.group(1)), int(found.group(2))


class _Launcher:
    """Stands in for Triton's kernel launcher: launching does nothing."""

    def __init__(self, src, metadata):
        pass

    def __call__(self, *args, **kwargs):
        return None


class _Utils:
    def __init__(self, max_shared: int):
        self.max_shared = max_shared

    def get_device_properties(self, device):
        return {"max_shared_mem": self.max_shared, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32}

    def load_binary(self, name, cubin, shared, device):
        registers, local_bytes = resource_usage(cubin)
        return None, None, registers, local_bytes // 4, 1024  # n_spills in 4-byte words, as the driver


class StandInDriver:
    """Enough of Triton's CUDA driver for compiling and "loading" kernels for ``target``."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.utils = _Utils(COMPUTE_TARGETS[arch].max_shared_bytes_per_block)
        self.launcher_cls = _Launcher

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")
