"""Chapter 00: the environment report and a smoke test that Triton really computes.

Some triton/numpy combinations have been seen to run a kernel "successfully" and leave the
output untouched (all zeros). :func:`triton_smoke_test` catches that: it poisons the output with
NaN, launches a tiny kernel on a ragged size, and compares every element with NumPy.
"""

from __future__ import annotations

import numpy as np

import torch

from course_lib.platform import runtime

SMOKE_SIZE = 1000  # not a multiple of the block, so the tail mask is exercised
SMOKE_BLOCK = 128
_KERNEL = []  # the smoke kernel, defined at its first use (triton is absent on macOS/Windows)


def _smoke_kernel():
    if not _KERNEL:
        runtime.ensure_configured()  # before the first @triton.jit
        import triton
        import triton.language as tl

        @triton.jit
        def _axpb_kernel(x_ptr, out_ptr, n, a, b, BLOCK: tl.constexpr):
            # each program handles BLOCK consecutive elements: read BLOCK, write BLOCK
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask)
            tl.store(out_ptr + offs, a * x + b, mask=mask)

        _KERNEL.append(_axpb_kernel)
    return _KERNEL[0]


def triton_smoke_test(n: int = SMOKE_SIZE, seed: int = 0) -> float:
    """Run ``out = 2x + 1`` through Triton and return the max abs error against NumPy.

    Raises:
        RuntimeError: when the kernel leaves elements unwritten or computes wrong values.
    """
    if not runtime.triton_installed():
        raise RuntimeError("triton is not installed (PyPI has no macOS or Windows wheel): the Triton "
                           "chapters need Linux or WSL2")
    import triton

    kernel = _smoke_kernel()
    rt = runtime.current()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen).to(rt.device)
    out = torch.full_like(x, float("nan"))  # poison: an unwritten element stays NaN
    grid = (triton.cdiv(n, SMOKE_BLOCK),)
    kernel[grid](x, out, n, 2.0, 1.0, BLOCK=SMOKE_BLOCK)
    got = out.cpu().numpy()
    want = 2.0 * x.cpu().numpy() + 1.0
    if np.isnan(got).any():
        raise RuntimeError(f"Triton left {int(np.isnan(got).sum())} of {n} outputs unwritten — "
                           f"this triton/numpy/torch combination is broken; reinstall with `make test`")
    err = float(np.max(np.abs(got - want)))
    if err > 1e-5:
        raise RuntimeError(f"Triton computed wrong values (max error {err:.3g}); if every output "
                           f"is 0 this is the known silent-zeros failure: check the pinned versions")
    return err


def environment_report() -> dict:
    """Versions and device facts as a dict (the notebook prints it as a table)."""
    rt = runtime.current()
    cpu = "CPU (Triton interpreter)" if runtime.triton_installed() else "CPU (no Triton: chapters 00-04)"
    report = {"mode": "GPU (native Triton)" if rt.on_gpu else cpu,
              "device": rt.gpu_name if rt.on_gpu else "cpu", **rt.versions}
    if rt.on_gpu:
        props = torch.cuda.get_device_properties(0)
        report["gpu memory"] = f"{props.total_memory / 2**30:.1f} GiB"
        report["multiprocessors"] = props.multi_processor_count
    return report
