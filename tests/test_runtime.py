"""The GPU/interpreter switch: both branches of the decision, and the switch in a fresh process."""

import json
import os
import subprocess
import sys

import pytest

from course_lib.platform import runtime

pytestmark = pytest.mark.ch00


def test_choose_mode_follows_cuda():
    assert runtime.choose_mode(cuda_available=True) == runtime.GPU
    assert runtime.choose_mode(cuda_available=False) == runtime.INTERPRETER


def test_force_interpreter_even_with_gpu():
    assert runtime.choose_mode(cuda_available=True, force="interpreter") == runtime.INTERPRETER


def test_force_gpu_without_gpu_is_refused():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        runtime.choose_mode(cuda_available=False, force="gpu")


def test_force_must_be_known():
    with pytest.raises(ValueError, match="force must be"):
        runtime.choose_mode(cuda_available=False, force="tpu")


def _run_fresh(code: str, env_extra: dict) -> str:
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(runtime.current().on_gpu, reason="checks the CPU branch; this machine has a GPU")
def test_cpu_branch_forces_interpreter_despite_exported_zero():
    # TRITON_INTERPRET=0 exported by the user must not stop kernels running on a CPU-only machine.
    code = """
import json
from course_lib.platform import runtime
rt = runtime.setup()
import os, triton
import course_lib.platform.envcheck as e
err = e.triton_smoke_test(n=300)
print(json.dumps({"mode": rt.mode, "device": rt.device, "env": os.environ["TRITON_INTERPRET"],
                  "knob": bool(triton.knobs.runtime.interpret), "err": err, "sizes": rt.sizes}))
"""
    lines = _run_fresh(code, {"TRITON_INTERPRET": "0"}).strip().splitlines()
    assert lines[0].startswith("CPU mode"), lines[0]  # the one printed line
    info = json.loads(lines[-1])
    assert info["mode"] == "interpreter" and info["device"] == "cpu"
    assert info["env"] == "1" and info["knob"] is True
    assert info["err"] < 1e-5
    assert info["sizes"]["seq_len"] <= 512  # small sizes on CPU


def test_gpu_branch_describes_native_mode(monkeypatch):
    # Simulate the GPU branch's decision and description without a GPU (the real GPU branch is
    # exercised on the GPU machine by the same notebooks).
    rt = runtime.Runtime(mode=runtime.GPU, device="cuda", gpu_name="NVIDIA H100 80GB HBM3",
                         versions={"python": "3.12", "torch": "2.11", "triton": "3.6", "numpy": "2.4"},
                         sizes=runtime._DEFAULT_SIZES[runtime.GPU])
    line = rt.describe()
    assert line.startswith("GPU mode") and "H100" in line and "triton 3.6" in line
    assert rt.on_gpu and not rt.interpreted


def fake_cuda(monkeypatch, name: str, capability: tuple) -> list:
    """torch sees one CUDA GPU ``name`` of ``capability``; setup() starts afresh; returns the
    list that records each interpreter switch setup() makes."""
    import torch

    calls = []
    monkeypatch.setattr(runtime, "_set_interpreter", lambda on: calls.append(on))
    monkeypatch.setattr(runtime, "_RUNTIME", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    return calls


def test_gpu_branch_turns_interpreter_off(monkeypatch):
    calls = fake_cuda(monkeypatch, "Fake GPU", (9, 0))
    rt = runtime.setup(verbose=False)
    assert calls == [False]
    assert rt.mode == "gpu" and rt.device == "cuda" and rt.gpu_name == "Fake GPU"
    assert rt.sizes["seq_len"] >= 1024


def test_switching_mode_after_kernels_is_refused(monkeypatch):
    monkeypatch.setattr(runtime, "_set_interpreter", lambda on: None)
    monkeypatch.setattr(runtime, "_RUNTIME", runtime.Runtime(mode="gpu", device="cuda", gpu_name="x"))
    monkeypatch.setattr(runtime, "_KERNELS_DEFINED", True)
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="restart the kernel"):
        runtime.setup(verbose=False)


def test_setup_prints_exactly_one_line(capsys):
    runtime.setup()
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    assert "torch" in out and "triton" in out and "numpy" in out
    assert len(out.strip()) <= 120  # fits one line of a notebook output without wrapping


def test_a_gpu_below_tritons_floor_gets_the_interpreter():
    """Colab's free T4 (compute capability 7.5) is below Triton's supported 8.0: the course uses
    the interpreter there, and refuses force='gpu' with the reason."""
    assert runtime.choose_mode(True, capability=(7, 5)) == runtime.INTERPRETER
    assert runtime.choose_mode(True, capability=(8, 0)) == runtime.GPU
    assert runtime.choose_mode(True, capability=(9, 0)) == runtime.GPU
    with pytest.raises(ValueError, match="compute capability 7.5"):
        runtime.choose_mode(True, force="gpu", capability=(7, 5))
    below = runtime.Runtime(mode=runtime.INTERPRETER, device="cpu", gpu_name="Tesla T4",
                            versions={"torch": "t", "triton": "tr", "numpy": "n"})
    assert "Tesla T4 is below the compute capability Triton supports (8.0+)" in below.describe()


def test_setup_on_a_gpu_below_the_floor_uses_the_interpreter(monkeypatch):
    calls = fake_cuda(monkeypatch, "Tesla T4", (7, 5))
    rt = runtime.setup(verbose=False)
    assert calls == [True]
    assert rt.mode == "interpreter" and rt.device == "cpu" and rt.gpu_name == "Tesla T4"
    assert "below the compute capability" in rt.describe()


def test_course_lib_mode_forces_cpu_on_a_gpu_and_says_so(monkeypatch):
    calls = fake_cuda(monkeypatch, "NVIDIA A100", (8, 0))
    monkeypatch.setenv(runtime.MODE_ENV, "cpu")
    rt = runtime.setup(verbose=False)
    assert calls == [True] and rt.mode == runtime.INTERPRETER
    assert rt.describe().startswith("CPU mode (COURSE_LIB_MODE=cpu): Triton runs in its interpreter")


def test_course_lib_mode_gpu_below_the_floor_is_refused_by_name(monkeypatch):
    fake_cuda(monkeypatch, "Tesla T4", (7, 5))
    monkeypatch.setenv(runtime.MODE_ENV, "gpu")
    with pytest.raises(ValueError, match=r"COURSE_LIB_MODE=gpu: this GPU's compute capability 7.5"):
        runtime.setup(verbose=False)


def test_course_lib_mode_must_be_known(monkeypatch):
    fake_cuda(monkeypatch, "NVIDIA A100", (8, 0))
    monkeypatch.setenv(runtime.MODE_ENV, "tpu")
    with pytest.raises(ValueError, match="COURSE_LIB_MODE must be 'cpu', 'gpu' or 'auto', got 'tpu'"):
        runtime.setup(verbose=False)
    monkeypatch.setenv(runtime.MODE_ENV, "auto")
    assert runtime.setup(verbose=False).mode == runtime.GPU


def _helper_calling_kernel():
    """A kernel that calls a ``@triton.jit`` helper twice and ``tl.max`` (module level: the
    interpreter looks helpers up in the kernel's globals)."""
    global _twice, _helper_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def _twice(x):
        return x * 2

    @triton.jit
    def _helper_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + offs, _twice(_twice(x)) + tl.max(x, axis=0), mask=offs < n)

    return _helper_kernel


def test_the_interpreter_patches_the_language_once_per_launch(monkeypatch):
    """In CPU mode a launch patches triton.language once; a helper's call inside it does not patch
    again (runtime._patch_language_once_per_launch); the results are the ones Triton's own path
    gives, a helper called outside any launch still runs, and the next launch is patched anew."""
    if runtime.current().on_gpu:
        pytest.skip("the interpreter's path; on a GPU kernels are compiled")
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as interp

    assert runtime._patch_language_once_per_launch()  # installed by setup; asking again changes nothing
    assert getattr(interp._patch_lang, "_course_once_per_launch", False)

    kernel = _helper_calling_kernel()
    patched = []
    triton_patch = interp._patch_lang.original

    def counting(fn):
        patched.append(fn.__name__)
        return triton_patch(fn)

    monkeypatch.setattr(interp._patch_lang, "original", counting)
    before = {name: getattr(tl.core.tensor, name, None) for name in ("__index__", "__bool__", "__mul__")}
    x = torch.randn(13)
    out = torch.empty_like(x)
    for _ in range(2):
        patched.clear()
        kernel[(1,)](x, out, 13, BLOCK=16)
        # the launch's own patch, and tl.max's once (triton.language.standard sees triton.language.core,
        # which the launch's patch of triton.language does not cover); never _twice's
        assert patched == ["_helper_kernel", "max"], patched
        assert torch.equal(out, x * 4 + x.max())
    # Triton's restore after the launch put the language back as it was
    assert {name: getattr(tl.core.tensor, name, None) for name in before} == before
