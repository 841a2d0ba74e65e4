"""Launches by the compiled kernel's handle (course_lib/kernels/launch.py): in the interpreter
they stay on Triton's own path; on the GPU path (cross-compiled for sm_90 here) they hand the
kernel's launcher exactly what Triton's own launch hands it; descriptor copies keep every field."""

from __future__ import annotations

import pytest
import torch

from course_lib.kernels import forward, launch

pytestmark = [pytest.mark.ch06, pytest.mark.ch07, pytest.mark.ch09]


def test_interpreter_launches_stay_on_triton(device):
    """The interpreter returns no compiled kernel: a launch made to cache stops trying after its
    first call and every call runs the interpreted kernel."""
    if device != "cpu":
        pytest.skip("the interpreter's case; the GPU's is test_handle_launch_passes_what_triton_passed")
    q, k, v = (torch.randn(1, 1, 20, 16) for _ in range(3))
    made = forward.ForwardLaunch(q, k, v, False, cache=True)
    o1, _ = made(q, k, v, 0.25)
    o2, _ = made(q, k, v, 0.25)
    assert not made.launch.by_handle and not made.launch.cache and torch.equal(o1, o2)


def test_descriptor_copies_keep_every_field_but_the_base():
    from triton.tools.tensor_descriptor import TensorDescriptor

    x, y = torch.zeros(2, 64, dtype=torch.float16), torch.ones(2, 64, dtype=torch.float16)
    desc = TensorDescriptor(x, shape=[2, 64], strides=[64, 1], block_shape=[2, 64])
    copy = launch.rebased(desc, y)
    assert type(copy) is TensorDescriptor and copy.base is y and desc.base is x
    assert {k: v for k, v in vars(copy).items() if k != "base"} == {k: v for k, v in vars(desc).items() if k != "base"}


# Compiled for sm_90 in a child process with the stand-in driver of course_lib.measure.reach (compiles and
# "loads", never runs; Gluon cannot compile where the interpreter already ran). Every launch of the
# library's forward and backward (Triton, TMA descriptors and Gluon) is made twice with cache=True: the first goes
# through Triton's JITFunction.run, the second by the compiled kernel's handle. The launcher sees
# the same arguments both times: the constexprs appended by the handle are Triton's own.
HANDLE_CHECK = """
import torch
from triton.runtime import driver
from course_lib.platform import runtime, stand_in
runtime.use_stand_in_gpu("sm_90 (stand-in)")
driver.set_active(stand_in.StandInDriver(90))
from course_lib.kernels import backward, forward, gluon_backward, gluon_hopper, hopper
hopper.tma_unsupported_reason = lambda *tensors: None  # CPU tensors stand in for the GPU's (as reach does)

calls = []
def record(self, *args, **kwargs):
    calls.append(args)
stand_in._Launcher.__call__ = record

def described(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(["tensor", list(a.shape), list(a.stride()), str(a.dtype), a.data_ptr() % 16])
        elif hasattr(a, "block_shape"):  # a host-side tensor descriptor
            out.append(["descriptor", described([a.base])[0], list(a.shape), list(a.strides), list(a.block_shape),
                        str(getattr(a, "layout", None))])
        else:
            out.append(repr(a))
    return out

def twice(name, make, call):
    made = make()
    before = len(calls)
    call(made)
    first = calls[before:]
    call(made)
    second = calls[before + len(first):]
    result[name] = {"first": [described(c) for c in first], "second": [described(c) for c in second]}
    return made

result = {}
q = torch.zeros(1, 2, 200, 64, dtype=torch.float16)
fw = twice("forward", lambda: forward.ForwardLaunch(q, q, q, True, cache=True), lambda m: m(q, q, q, 0.125))
result["forward_by_handle"] = fw.launch.by_handle
o, lse = fw(q, q, q, 0.125)
bw = twice("backward", lambda: backward.BackwardLaunch(q, q, q, True, cache=True),
           lambda m: m(q, q, q, q, o, lse, 0.125))
result["backward_by_handle"] = [bw.dkdv.by_handle, bw.dq.by_handle, bw.delta.by_handle]
q = torch.zeros(1, 2, 200, 128, dtype=torch.float16)
gf = twice("gluon_forward", lambda: gluon_hopper.ForwardLaunch(q, q, q, True, "pingpong", cache=True),
           lambda m: gluon_hopper.attention_forward_gluon(q, q, q, True, 0.125, "pingpong", m))
result["gluon_forward_by_handle"] = gf.launch.by_handle
tma = twice("tma_forward", lambda: hopper.TmaForwardLaunch(q, q, q, True, cache=True), lambda m: m(q, q, q, 0.125))
result["tma_forward_by_handle"] = tma.kernel.launch.by_handle
lse = torch.zeros(1, 2, 200, dtype=torch.float32)
gb = twice("gluon_backward", lambda: gluon_backward.BackwardLaunch(q, q, q, q, q, lse, True, cache=True),
           lambda m: gluon_backward.attention_backward_gluon(q, q, q, q, q, lse, True, 0.125, launch=m))
result["gluon_backward_by_handle"] = gb.launch.by_handle
"""


@pytest.mark.slow
def test_handle_launch_passes_what_triton_passed():
    """On the GPU path (cross-compiled for sm_90), a launch by handle hands the kernel's launcher
    exactly what Triton's own launch handed it: same count, order, grid, constexprs and
    descriptors (copies over the same tensors)."""
    from course_lib.measure import hopper_results
    from course_lib.kernels import gluon_hopper

    if not gluon_hopper.available():
        pytest.skip(f"gluon not importable: {gluon_hopper.GLUON_IMPORT_ERROR}")
    result = hopper_results.in_fresh_process(HANDLE_CHECK)
    assert result["forward_by_handle"] and all(result["backward_by_handle"])
    assert result["gluon_forward_by_handle"] and result["gluon_backward_by_handle"] and result["tma_forward_by_handle"]
    for name in ("forward", "backward", "tma_forward", "gluon_forward", "gluon_backward"):
        first, second = result[name]["first"], result[name]["second"]
        assert first and len(first) == len(second), name
        for a, b in zip(first, second):
            # the launcher's arguments: grid (3), stream, function, packed metadata, launch metadata,
            # 2 hooks, then the kernel's parameters in order, constexprs included
            assert a[:3] == b[:3] and a[9:] == b[9:], (name, a, b)


class _Launcher36:
    """A launcher shaped as Triton 3.6's ``CudaLauncher`` (its ``__call__`` copied), recording what
    reaches its C ``launch``."""

    def __init__(self, scratch: int = 0):
        self.calls = []
        self.launch = lambda *args: self.calls.append(args)
        self.num_ctas, self.launch_cooperative_grid, self.launch_pdl = 1, 0, 1
        self.global_scratch_size = self.profile_scratch_size = scratch
        self.global_scratch_align = self.profile_scratch_align = 1

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        def allocate_scratch(size, align, allocator):
            return ("scratch", gridX * gridY * gridZ * self.num_ctas * size) if size > 0 else None

        global_scratch = allocate_scratch(self.global_scratch_size, self.global_scratch_align, None)
        profile_scratch = allocate_scratch(self.profile_scratch_size, self.profile_scratch_align, None)
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


def test_a_direct_launch_hands_the_c_launcher_what_tritons_call_would():
    """Triton 3.6's launcher without scratch: the direct call passes the C launch the same arguments
    as the launcher's ``__call__``; with scratch, or a launcher of another shape, no direct call."""
    runner = _Launcher36()
    c_launch, cooperative, pdl = launch._direct(runner)
    args = (7, 3, 1, "stream", "function", "packed", None, "enter", "leave", "q_ptr", 64)
    runner(*args)
    c_launch(*args[:5], cooperative, pdl, None, None, *args[5:])
    assert runner.calls[0] == runner.calls[1] and len(runner.calls[0]) == len(args) + 4
    assert launch._direct(_Launcher36(scratch=16)) is None

    class Moved(_Launcher36):  # Triton 3.7's shape: the metadata arguments named, args packed
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                     launch_enter_hook, launch_exit_hook, *args):
            self.launch(gridX, gridY, gridZ, stream, function, kernel_metadata, args)

    assert launch._direct(Moved()) is None and launch._direct(lambda *a: None) is None


def test_the_installed_tritons_launcher_is_recognised_only_in_the_shape_it_was_checked_in():
    """The direct launch is taken for Triton 3.6's ``CudaLauncher`` (checked on an H100) and for no
    other installed Triton's, whose launchers keep going through their own ``__call__``."""
    import triton
    from triton.backends.nvidia.driver import CudaLauncher

    runner = object.__new__(CudaLauncher)
    runner.global_scratch_size = runner.profile_scratch_size = 0
    runner.launch, runner.launch_cooperative_grid, runner.launch_pdl = print, 0, 0
    expected = triton.__version__.startswith("3.6.")
    assert (launch._direct(runner) is not None) == expected, triton.__version__
