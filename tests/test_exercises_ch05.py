"""Chapter 05's exercise checks against a corpus of realistic wrong kernels.

Every wrong kernel must be rejected with a short diagnosis that names the cause; the stub must
read as "not done yet"; nothing a learner writes may crash the check, hang it, or corrupt memory
(the guarded runs give every tensor a margin).
"""

import re
import sys

import pytest

from course_lib.platform import runtime

runtime.ensure_configured()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from course_lib.kernels import primer  # noqa: E402
from course_lib.teaching.checks import ExerciseFailed  # noqa: E402
from course_lib.teaching import kernel_checks  # noqa: E402
from course_lib.teaching.exercises import ch05  # noqa: E402

pytestmark = pytest.mark.ch05

ON_GPU = runtime.current().on_gpu


def expect(cpu, gpu):
    """What a diagnosis must contain in this mode. In the interpreter (CPU) the memory guard
    stops an access outside the tensors before it happens and names tensor, index and program
    id; on a GPU the guard is off and the guarded buffers diagnose it after the launch (values
    written outside an output's sentinel-filled buffer, NaN that came from an input's margin)."""
    return gpu if ON_GPU else cpu


def _rejected(check, kernel, *fragments):
    with pytest.raises(ExerciseFailed) as info:
        check(kernel)
    message = str(info.value)
    assert message.startswith("✗ Exercise 5."), message
    for fragment in fragments:
        assert fragment in message, message
    # the check's own NaN margins are never where a NaN "came from"
    assert "came from torch's full" not in message, message
    assert len(message.splitlines()) <= 9, message  # a diagnosis, not a wall
    assert "Traceback" not in message, message
    return message


def _rejected_naming_no_other_cause(check, kernel, *fragments):
    """Rejected with ``fragments``; a cause is named only where a fragment expects it."""
    message = _rejected(check, kernel, *fragments)
    for named in re.findall(r"likely cause: .*", message):
        assert any(f.startswith("likely cause: ") and named.startswith(f) for f in fragments), message
    return message


# ----------------------------------------------------------------------------------------------
# Exercise 5.1: vector add


@triton.jit
def add_stub(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    raise NotImplementedError("Exercise 5.1: vector add")


@triton.jit
def add_no_mask(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + tl.load(y_ptr + offsets))


@triton.jit
def add_store_unmasked(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y)


@triton.jit
def add_mask_off_by_one(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets <= n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


@triton.jit
def add_pid_not_scaled(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) + tl.arange(0, BLOCK_SIZE)  # forgot * BLOCK_SIZE
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


@triton.jit
def add_wrong_axis(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # the grid is 1-D
    mask = offsets < n_elements
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask)
             + tl.load(y_ptr + offsets, mask=mask), mask=mask)


@triton.jit
def add_x_twice(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask)
             + tl.load(x_ptr + offsets, mask=mask), mask=mask)


@triton.jit
def add_typo(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    tl.store(out_ptr + offsets, tl.load(x_ptr + offset, mask=mask), mask=mask)  # noqa: F821


@triton.jit
def add_forever(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    start = 0
    while start < n_elements:
        start = start * 2  # never advances
    tl.store(out_ptr + tl.arange(0, BLOCK_SIZE), tl.zeros([BLOCK_SIZE], tl.float32))


@triton.jit
def add_into_x(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    total = tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask)
    tl.store(x_ptr + offsets, total, mask=mask)  # x_ptr where out_ptr was meant
    tl.store(out_ptr + offsets, total, mask=mask)


def test_library_add_kernel_passes(capsys):
    assert ch05.check_add_kernel(primer.add_kernel) is primer.add_kernel
    assert "✓ Exercise 5.1: passed" in capsys.readouterr().out


def test_add_stub_is_not_done_and_falls_back(capsys):
    assert ch05.check_add_kernel(add_stub) is primer.add_kernel
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("kernel, fragments", [
    (add_no_mask, expect(cpu=("tl.load in program id (7, 0, 0)", "`x` (1823,) at index (1823,)",
                              "this tl.load needs mask=offsets < n_elements"),
                         gpu=("case 1 of 6", "wrote 225 value(s) outside out (1823,)",
                              "a tl.store without a mask"))),
    (add_store_unmasked, expect(cpu=("tl.store in program id (7, 0, 0)", "`out` (1823,) at index (1823,)",
                                     "the tl.store needs mask=offsets < n_elements"),
                                gpu=("case 1 of 6", "wrote 225 value(s) outside out (1823,)",
                                     "a tl.store without a mask"))),
    (add_mask_off_by_one, expect(cpu=("1 of its 32 active lane(s)", "<= where < is meant"),
                                 gpu=("case 1 of 6", "wrote 1 value(s) outside out (1823,)"))),
    (add_pid_not_scaled, ("were never written; the first at index (263,)",
                          "program pid = 263 // BLOCK_SIZE = 1")),
    (add_wrong_axis, ("never written", "program pid = 256 // BLOCK_SIZE = 1")),
    (add_x_twice, ("likely cause: x is loaded twice",)),
    (add_typo, ("NameError", "offset", "is not defined")),
    (add_into_x, expect(cpu=("`x` is an input (read-only)", "case 1 of 6"),
                        gpu=("wrote into its input `x`", "case 1 of 6"))),
], ids=lambda v: getattr(v, "__name__", "")[:30])
def test_add_mistakes_are_rejected_with_their_cause(kernel, fragments):
    _rejected_naming_no_other_cause(ch05.check_add_kernel, kernel, *fragments)


ON_GPU_REASON = ("a kernel that never ends cannot be interrupted on a GPU (the time limit stops it in "
                 "the interpreter, which is where CI checks it)")


@pytest.mark.skipif(runtime.current().on_gpu, reason=ON_GPU_REASON)
def test_add_kernel_that_loops_forever_is_stopped():
    with pytest.raises(ExerciseFailed, match="stopped after 1 s"):
        kernel_checks.check_kernel("Exercise 5.1", add_forever, ch05.add_runner(add_forever),
                          ch05._add_reference, ch05._add_cases("cpu"),
                          fallback=primer.add_kernel, time_limit=1)


# Kernels that exit, interrupt or print a flood (Python statements run as such only in the
# interpreter; on a GPU the compiler rejects them, which the mistakes above already cover)

ONLY_INTERPRETED_REASON = "sys.exit, raise and print run as Python only in Triton's interpreter"
FLOOD_CHARS = 300_000  # per program: 2.4 MB from the 8 programs of case 1, which is wrong
MAX_MESSAGE_CHARS = 5_000


@triton.jit
def add_exits(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    sys.exit(0)


@triton.jit
def add_interrupts(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    raise KeyboardInterrupt


@triton.jit
def add_floods(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    print("x" * FLOOD_CHARS)  # a debugging print left in
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask)
             + tl.load(x_ptr + offsets, mask=mask), mask=mask)  # and x loaded twice


def _assert_library_kernel_passes_next(capsys):
    capsys.readouterr()
    assert ch05.check_add_kernel(primer.add_kernel) is primer.add_kernel
    assert capsys.readouterr().out.splitlines() == ["✓ Exercise 5.1: passed (6 cases)."]


@pytest.mark.skipif(runtime.current().on_gpu, reason=ONLY_INTERPRETED_REASON)
@pytest.mark.parametrize("kernel, fragments", [
    (add_exits, ("your kernel called sys.exit() on case 1", "SystemExit: 0", "sys.exit(0)")),
    (add_interrupts, ("your kernel raised KeyboardInterrupt on case 1", "raise KeyboardInterrupt",
                      "raise an ordinary exception")),
], ids=["sys.exit", "KeyboardInterrupt"])
def test_kernel_that_exits_or_interrupts_is_a_diagnosis(kernel, fragments, capsys):
    _rejected(ch05.check_add_kernel, kernel, *fragments)
    _assert_library_kernel_passes_next(capsys)


@pytest.mark.skipif(runtime.current().on_gpu, reason=ONLY_INTERPRETED_REASON)
def test_kernel_that_prints_a_flood_shows_an_excerpt(capsys):
    with pytest.raises(ExerciseFailed) as info:
        ch05.check_add_kernel(add_floods)
    message = str(info.value)
    assert len(message) < MAX_MESSAGE_CHARS
    assert "likely cause: x is loaded twice" in message
    assert "your kernel printed" in message and "MB more output hidden" in message
    captured = capsys.readouterr()
    assert "xxxx" not in captured.out + captured.err
    _assert_library_kernel_passes_next(capsys)


# ----------------------------------------------------------------------------------------------
# Exercise 5.2: fused row softmax


@triton.jit
def softmax_stub(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    raise NotImplementedError("Exercise 5.2: fused softmax")


@triton.jit
def softmax_other_zero(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols,
                       BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def softmax_load_unmasked(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols,
                          BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    x = tl.load(in_ptr + row * in_row_stride + cols).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@triton.jit
def softmax_store_unmasked(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols,
                           BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=cols < n_cols,
                other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0))


@triton.jit
def softmax_rows_by_n_cols(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols,
                           BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(in_ptr + row * n_cols + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def softmax_no_max(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols,
                   BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x)
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def softmax_unnormalised(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols,
                         BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, tl.exp(x - tl.max(x, axis=0)), mask=mask)


@triton.jit
def softmax_out_stride_mixed_up(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols,
                                BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * in_row_stride + cols, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def softmax_arange_n_cols(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols,
                          BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, n_cols)  # not a constexpr power of two
    x = tl.load(in_ptr + row * in_row_stride + cols).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0))


def test_library_softmax_kernel_passes(capsys):
    assert ch05.check_softmax_kernel(primer.softmax_kernel) is primer.softmax_kernel
    assert "✓ Exercise 5.2: passed" in capsys.readouterr().out


def test_softmax_stub_is_not_done_and_falls_back(capsys):
    assert ch05.check_softmax_kernel(softmax_stub) is primer.softmax_kernel
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("kernel, fragments", [
    (softmax_other_zero, ("likely cause: the masked lanes were loaded as 0",)),
    (softmax_load_unmasked, expect(cpu=("`x` (37, 781) at index (0, 781)",
                                        "the tl.load needs mask=cols < n_cols, other=-float('inf')"),
                                   gpu=("case 1 of 7", "the output depends on memory outside the inputs",
                                        "a tl.load without a mask"))),
    (softmax_store_unmasked, expect(cpu=("`out` (37, 781) at index (0, 781)",
                                         "the tl.store needs mask=cols < n_cols"),
                                    gpu=("case 1 of 7", "wrote 351 value(s) outside out (37, 781)"))),
    (softmax_rows_by_n_cols, expect(cpu=("tl.load in program id (1, 0, 0)", "wrong when only `x` (strides (788, 1))"),
                                    gpu=("the output depends on memory outside the inputs",
                                         "wrong when only `x` (strides (788, 1))"))),
    # NumPy traces the overflow to its line only in the interpreter; the cause is named in both
    (softmax_no_max, expect(cpu=("wrong answer on case 5", "overflow encountered in exp at line",
                                 "likely cause: the max is not subtracted"),
                            gpu=("wrong answer on case 5", "NaN/inf where the answer is finite",
                                 "likely cause: the max is not subtracted"))),
    (softmax_unnormalised, ("likely cause: the row is not divided by its sum",)),
    # only x's layout changed, and out's store went out of bounds: out's offsets use x's strides
    (softmax_out_stride_mixed_up, expect(cpu=("tl.store in program id (1, 0, 0)",
                                              "`out`'s offsets use `x`'s strides"),
                                         gpu=("value(s) outside out (37, 781)",
                                              "`out` has this case's layout"))),
    (softmax_arange_n_cols, ("failed on case 1",)),
], ids=lambda v: getattr(v, "__name__", "")[:30])
def test_softmax_mistakes_are_rejected_with_their_cause(kernel, fragments):
    _rejected_naming_no_other_cause(ch05.check_softmax_kernel, kernel, *fragments)


# ----------------------------------------------------------------------------------------------
# Reading errors


def test_is_not_done_recognises_interpreter_and_compiler_forms():
    wrapped = RuntimeError("InterpreterError")
    wrapped.__cause__ = NotImplementedError("Exercise 6.1: update")
    assert kernel_checks.is_not_done(wrapped)
    # on a GPU the compiler quotes the stub's source line in its message
    assert kernel_checks.is_not_done(RuntimeError('at 3:4:\n    raise NotImplementedError("Exercise 5.1")\n'
                                         "unsupported AST node type: Raise"))
    assert not kernel_checks.is_not_done(ValueError("shapes do not match"))


def test_summary_of_a_compilation_error_quotes_the_line_and_hint():
    class FakeCompilationError(Exception):  # the attributes triton's CompilationError has
        def __init__(self):
            super().__init__("at 2:10: ... a wall of text ...")
            self.src = "def k(p, v):\n    acc = tl.dot(p, v)\n"
            self.node = type("Node", (), {"lineno": 2, "col_offset": 10})()
            self.error_message = "Both operands must be same dtype. Got fp32 and fp16"
    summary = kernel_checks.summarize_kernel_error(FakeCompilationError())
    assert summary.splitlines()[0] == ("line 2 of the kernel: `acc = tl.dot(p, v)` — Both operands "
                                       "must be same dtype. Got fp32 and fp16")
    assert "p.to(v.dtype)" in summary


def test_embed_keeps_values_and_fills_the_margin():
    x = torch.arange(6.0).reshape(2, 3)
    view, buffer = kernel_checks.embed(x, (1, 2), fill=-1.0)
    assert torch.equal(view, x) and view.stride() == (5, 1)
    assert buffer.shape == (3, 5) and int((buffer == -1.0).sum()) == 15 - 6
    with pytest.raises(ValueError, match="one entry per dim"):
        kernel_checks.embed(x, (1,), fill=0.0)


# ----------------------------------------------------------------------------------------------
# Exercise 5.3: tiled matmul. Each wrong kernel below is the library's kernel with one mistake.


@triton.jit
def matmul_stub(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    raise NotImplementedError("Exercise 5.3: tiled matmul")


@triton.jit
def matmul_no_k_mask(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                     stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)  # the K edge is not masked
        b = tl.load(b_ptrs, mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def matmul_a_strides_swapped(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                             stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_ak + offs_k[None, :] * stride_am  # swapped
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_am  # (consistently)
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def matmul_acc_in_input_dtype(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                              stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=a_ptr.dtype.element_ty)  # fp16 for fp16 inputs
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc += tl.dot(a, b).to(a_ptr.dtype.element_ty)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def matmul_k_not_advanced(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                          stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)  # and the pointers stay where they are
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def matmul_b_not_advanced(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                          stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak  # only A's pointers move
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def matmul_k_floored(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                     stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K // BLOCK_K):  # the last, shorter K tile is never reached
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def matmul_acc_overwritten(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                           stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b)  # replaces instead of accumulating
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def matmul_m_masked_with_n(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                           stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < N) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def matmul_store_unmasked(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                          stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty))  # no mask: the edge tiles write past M and N


@triton.jit
def matmul_program_ids_swapped(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                               stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # axis 1 runs along N
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def test_library_matmul_kernel_passes(capsys):
    assert ch05.check_matmul_kernel(primer.matmul_kernel) is primer.matmul_kernel
    assert "✓ Exercise 5.3: passed" in capsys.readouterr().out


def test_matmul_stub_is_not_done_and_falls_back(capsys):
    assert ch05.check_matmul_kernel(matmul_stub) is primer.matmul_kernel
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("kernel, fragments", [
    (matmul_no_k_mask, expect(cpu=("case 1 of", "`a` (77, 45) at index (0, 45)", "sticks out past K",
                                   "other=0.0"),
                              gpu=("case 1 of", "the output depends on memory outside the inputs",
                                   "a tl.load without a mask"))),
    (matmul_a_strides_swapped, expect(cpu=("tl.load in program id (1, 0, 0)", "`a` (77, 45)"),
                                      gpu=("case 1 of", "the output depends on memory outside the inputs"))),
    # on a GPU the fp16 sums overflow to inf and then NaN, which no model reproduces: no cause
    (matmul_acc_in_input_dtype, expect(cpu=("partial sums past fp16's max", "NaN/inf", "overflow encountered",
                                            "likely cause: the accumulator is in the inputs' dtype"),
                                       gpu=("wrong answer on case 6", "partial sums past fp16's max",
                                            "NaN/inf where the answer is finite"))),
    (matmul_k_not_advanced, ("wrong answer on case 1", "output tile of program",
                             "likely cause: the K pointers never move")),
    (matmul_acc_overwritten, ("wrong answer on case 1", "likely cause: acc = tl.dot(a, b) "
                              "replaces the sum")),
    (matmul_b_not_advanced, ("wrong answer on case 1", "likely cause: B's pointers never move "
                             "along K (A's do)")),
    (matmul_k_floored, ("wrong answer on case 1", "likely cause: the K loop runs K // BLOCK_K "
                        "times")),
    (matmul_m_masked_with_n, ("wrong answer on case 1", "index (61, 0)",
                              "(pid_m=1, pid_n=0): rows 32–63",
                              "likely cause: A's load masks its rows with N")),
    (matmul_store_unmasked, expect(cpu=("`c` (77, 61) at index (0, 61)",
                                        "the tl.store needs mask=(offs_n[None, :] < N)"),
                                   gpu=("case 1 of 7", "wrote 280 value(s) outside c (77, 61)"))),
    (matmul_program_ids_swapped, ("never written; the first at index (0, 48)",
                                  "output tile of program (pid_m=0, pid_n=3)")),
], ids=lambda v: getattr(v, "__name__", "")[:30])
def test_matmul_mistakes_are_rejected_with_their_cause(kernel, fragments):
    _rejected_naming_no_other_cause(ch05.check_matmul_kernel, kernel, *fragments)


def test_matmul_tile_names_the_program_that_owns_an_element():
    blocks = dict(block_m=32, block_n=16, block_k=16)
    assert ch05.matmul_tile((64, 17), blocks) == (
        "element (64, 17) lies in the output tile of program (pid_m=2, pid_n=1): rows 64–95, "
        "columns 16–31 (BLOCK_M=32, BLOCK_N=16)")


def test_matmul_cases_are_exact_in_every_precision():
    # small integers: a correct kernel in any dtype and summation order equals the reference
    for case in ch05._matmul_cases("cpu", on_gpu=True):
        a, b = case.args
        exact = a.double() @ b.double()
        assert torch.equal(a.double().round(), a.double()), case.label
        if "partial sums" in case.label:
            assert exact.abs().max() < ch05.FP16_MAX < (a[:, :16].double() @ b[:16].double()).max()
        assert exact.abs().max() < 2 ** 24  # exact in fp32


def test_matmul_hints_and_skeleton_fit_the_hint_ladder():
    import ast

    from course_lib.teaching.widgets.hints import HintLadder

    ladder = HintLadder("Exercise 5.3", ch05.MATMUL_HINTS, skeleton=ch05.MATMUL_SKELETON)
    shown = [ladder.next_hint() for _ in ch05.MATMUL_HINTS]
    assert shown == list(ch05.MATMUL_HINTS) and ladder.next_hint() is None
    assert ladder.show_skeleton() == ch05.MATMUL_SKELETON
    ast.parse(ch05.MATMUL_SKELETON)  # valid Python, with `...` where the learner writes
    assert "tl.float32" in ch05.MATMUL_SKELETON and "tl.cdiv(K, BLOCK_K)" in ch05.MATMUL_SKELETON


# ----------------------------------------------------------------------------------------------
# Corpora written from the solution notebook's own answers, one realistic change each (a line
# dropped, an operator, a stride or a bound wrong), loaded as modules: the kernel under test is
# what a learner would have typed. Each must be rejected, and the cause named must be the right
# one, or none at all. Valid alternatives in other styles must pass.

import importlib.util  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

SOLUTION_NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions" / "05_triton_primer.ipynb"
HEADER = "import torch\nimport triton\nimport triton.language as tl\n\n"


def _solution(prefix: str) -> str:
    for cell in json.loads(SOLUTION_NOTEBOOK.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith(prefix):
            return source
    raise AssertionError(f"no cell starting with {prefix!r} in {SOLUTION_NOTEBOOK}")


def _kernel(tmp_path, prefix, name, changes=(), source=None):
    """The notebook's exercise cell (or ``source``) with ``changes`` applied, as a module's kernel."""
    source = source if source is not None else _solution(prefix)
    for old, new in changes:
        assert old in source, f"the solution no longer contains {old!r}: update the corpus"
        source = source.replace(old, new)
    module_name = re.sub(r"\W", "_", f"{prefix}_{name}")[-60:]
    path = tmp_path / f"{module_name}.py"
    path.write_text(HEADER + source)  # @triton.jit reads the source from a file
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = re.search(r"def (\w+_kernel)\(", source).group(1)
    return getattr(module, kernel)


def _judge(check, kernel, cause: str | None, *fragments):
    """Rejected; the right cause named (``cause``), or — when ``cause`` is None — none at all."""
    message = _rejected(check, kernel, *fragments)
    named = re.findall(r"likely cause: (.*)", message)
    if cause is None:
        assert not named and "two known mistakes" not in message, message
    else:
        assert named and named[0].startswith(cause), message
    return message


ADD = "# Exercise 5.1"
ADD_CORPUS = {  # name -> (changes, the cause to name or None, fragments)
    "no-mask-anywhere": ([("mask = offsets < n_elements", "mask = None")], None,
                         expect(cpu=("needs mask=offsets < n_elements",),
                                gpu=("value(s) outside out (1823,)", "a tl.store without a mask"))),
    "mask-le": ([("offsets < n_elements", "offsets <= n_elements")], None,
                expect(cpu=("<= where < is meant",), gpu=("wrote 1 value(s) outside out (1823,)",))),
    "mask-against-block": ([("offsets < n_elements", "offsets < BLOCK_SIZE")], None,
                           ("were never written; the first at index (256,)",)),
    "y-from-x": ([("tl.load(y_ptr + offsets", "tl.load(x_ptr + offsets")],
                 "x is loaded twice", ()),
    "x-from-y": ([("tl.load(x_ptr + offsets", "tl.load(y_ptr + offsets")],
                 "y is loaded twice", ()),
    "minus": ([("x + y, mask", "x - y, mask")], "the kernel subtracts", ()),
    "stores-x": ([("x + y, mask", "x, mask")], "the kernel stores x alone", ()),
    "block-written-in": ([("pid * BLOCK_SIZE", "pid * 256")], None, ("never written",)),
    "no-pid": ([("pid * BLOCK_SIZE + ", "")], None, ("never written",)),
    "store-into-y": ([("tl.store(out_ptr", "tl.store(y_ptr")], None,
                     expect(cpu=("`y` is an input",), gpu=("wrote into its input `y`",))),
    "pid-plus": ([("pid * BLOCK_SIZE", "pid + BLOCK_SIZE")], None, ()),
}
ADD_VALID = {
    "other-zero": [("tl.load(x_ptr + offsets, mask=mask)", "tl.load(x_ptr + offsets, mask=mask, other=0.0)")],
    "fp32-sum": [("x + y, mask", "(x.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask")],
    "block-start": [("offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)",
                     "block_start = pid * BLOCK_SIZE\n    offsets = block_start + tl.arange(0, BLOCK_SIZE)")],
    "pointer-blocks": [("x = tl.load(x_ptr + offsets, mask=mask)", "x_ptrs = x_ptr + offsets\n    x = tl.load(x_ptrs, mask=mask)")],
}


@pytest.mark.parametrize("name", list(ADD_CORPUS))
def test_add_corpus_is_rejected_with_the_right_cause_or_none(tmp_path, name):
    changes, cause, fragments = ADD_CORPUS[name]
    _judge(ch05.check_add_kernel, _kernel(tmp_path, ADD, name, changes), cause, *fragments)


@pytest.mark.parametrize("name", list(ADD_VALID))
def test_add_valid_alternatives_pass(tmp_path, name, capsys):
    kernel = _kernel(tmp_path, ADD, name, ADD_VALID[name])
    assert ch05.check_add_kernel(kernel) is kernel
    assert "✓ Exercise 5.1: passed" in capsys.readouterr().out


SOFTMAX = "# Exercise 5.2"
SOFTMAX_CORPUS = {
    "other-zero": ([('other=-float("inf")', "other=0.0")], "the masked lanes were loaded as 0", ()),
    "no-other": ([(', other=-float("inf")', "")], "the masked lanes were loaded as 0", ()),
    "no-max": ([("x = x - tl.max(x, axis=0)", "")], "the max is not subtracted before exp", ()),
    "no-division": ([("y = numerator / tl.sum(numerator, axis=0)", "y = numerator")],
                    "the row is not divided by its sum", ()),
    "out-stride-for-input": ([("in_ptr + row * in_row_stride", "in_ptr + row * out_row_stride")],
                             None, expect(cpu=("`x`'s offsets use `out`'s strides",),
                                          gpu=("`x` (strides",))),
    "in-stride-for-output": ([("out_ptr + row * out_row_stride", "out_ptr + row * in_row_stride")],
                             None, expect(cpu=("`out`'s offsets use `x`'s strides",),
                                          gpu=("`out` has this case's layout",))),
    "dense-rows": ([("row * in_row_stride", "row * n_cols"), ("row * out_row_stride", "row * n_cols")],
                   None, ()),
    "load-unmasked": ([(', mask=mask, other=-float("inf"))', ")")], None,
                      expect(cpu=("the tl.load needs mask=cols < n_cols",),
                             gpu=("the output depends on memory outside the inputs", "a tl.load without a mask"))),
    "store-unmasked": ([(", y.to(out_ptr.dtype.element_ty), mask=mask)", ", y.to(out_ptr.dtype.element_ty))")],
                       None, expect(cpu=("the tl.store needs mask=cols < n_cols",),
                                    gpu=("value(s) outside out (37, 781)", "a tl.store without a mask"))),
    "max-in-numerator-only": ([("x = x - tl.max(x, axis=0)", "x_max = tl.max(x, axis=0)"),
                                ("numerator = tl.exp(x)", "numerator = tl.exp(x - x_max)"),
                                ("y = numerator / tl.sum(numerator, axis=0)",
                                 "y = numerator / tl.sum(tl.exp(x), axis=0)")],
                               "the max is subtracted in the numerator only", ()),
}
SOFTMAX_VALID = {
    "exp2": [("numerator = tl.exp(x)", "numerator = tl.exp2(x * 1.4426950408889634)")],
    "mask-with-where": [('x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=-float("inf"))',
                         "x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=0.0)\n"
                         '    x = tl.where(mask, x.to(tl.float32), -float("inf"))')],
    "reciprocal": [("y = numerator / tl.sum(numerator, axis=0)",
                    "y = numerator * (1.0 / tl.sum(numerator, axis=0))")],
    "pointers-first": [("row = tl.program_id(axis=0)",
                        "row = tl.program_id(axis=0)\n    in_ptr = in_ptr + row * in_row_stride\n"
                        "    out_ptr = out_ptr + row * out_row_stride"),
                       ("in_ptr + row * in_row_stride + cols", "in_ptr + cols"),
                       ("out_ptr + row * out_row_stride + cols", "out_ptr + cols")],
}


@pytest.mark.parametrize("name", list(SOFTMAX_CORPUS))
def test_softmax_corpus_is_rejected_with_the_right_cause_or_none(tmp_path, name):
    changes, cause, fragments = SOFTMAX_CORPUS[name]
    _judge(ch05.check_softmax_kernel, _kernel(tmp_path, SOFTMAX, name, changes), cause, *fragments)


@pytest.mark.parametrize("name", list(SOFTMAX_VALID))
def test_softmax_valid_alternatives_pass(tmp_path, name, capsys):
    kernel = _kernel(tmp_path, SOFTMAX, name, SOFTMAX_VALID[name])
    assert ch05.check_softmax_kernel(kernel) is kernel
    assert "✓ Exercise 5.2: passed" in capsys.readouterr().out


MATMUL = "# Exercise 5.3"
MATMUL_CORPUS = {
    "k-mask-missing": ([(" & (offs_k[None, :] < k_left)", ""), ("(offs_k[:, None] < k_left) & ", "")],
                       None, expect(cpu=("sticks out past K",),
                                    gpu=("the output depends on memory outside the inputs",))),
    "a-strides-swapped": ([("offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak",
                            "offs_m[:, None] * stride_ak + offs_k[None, :] * stride_am")], None, ()),
    "b-row-stride-both": ([("offs_n[None, :] * stride_bn", "offs_n[None, :] * stride_bk")], None, ()),
    "c-strides-of-a": ([("offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn",
                         "offs_m[:, None] * stride_am + offs_n[None, :] * stride_ak")], None, ()),
    "no-advance": ([("        a_ptrs += BLOCK_K * stride_ak", ""), ("        b_ptrs += BLOCK_K * stride_bk", "")],
                   "the K pointers never move", ()),
    "advance-by-one": ([("a_ptrs += BLOCK_K * stride_ak", "a_ptrs += stride_ak"),
                        ("b_ptrs += BLOCK_K * stride_bk", "b_ptrs += stride_bk")], None, ()),
    "acc-replaced": ([("acc = tl.dot(a, b, acc)", "acc = tl.dot(a, b)")], "acc = tl.dot(a, b) replaces", ()),
    "fp16-acc": ([("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
                   "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=a_ptr.dtype.element_ty)"),
                  ("acc = tl.dot(a, b, acc)", "acc += tl.dot(a, b).to(a_ptr.dtype.element_ty)")],
                 # on a GPU the fp16 sums reach inf, then NaN, which no model reproduces: no cause
                 expect(cpu="the accumulator is in the inputs' dtype", gpu=None),
                 expect(cpu=(), gpu=("partial sums past fp16's max", "NaN/inf where the answer is finite"))),
    "rows-masked-with-n": ([("a = tl.load(a_ptrs, mask=(offs_m[:, None] < M)", "a = tl.load(a_ptrs, mask=(offs_m[:, None] < N)")],
                           "A's load masks its rows with N", ()),
    # in the interpreter the guard stops case 1's read past B's columns (M > N); on a GPU that read
    # lands in B's margin and only feeds C's masked columns, and case 2 (M < N) singles out the cause
    "cols-masked-with-m": ([("b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N)",
                             "b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < M)")],
                           expect(cpu=None, gpu="B's load masks its columns with M"), ()),
    "pids-swapped": ([("pid_m = tl.program_id(axis=0)", "pid_m = tl.program_id(axis=1)"),
                      ("pid_n = tl.program_id(axis=1)", "pid_n = tl.program_id(axis=0)")], None, ("never written",)),
    "block-m-for-n": ([("offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
                        "offs_n = pid_n * BLOCK_M + tl.arange(0, BLOCK_N)")], None, ()),
    "store-unmasked": ([(", acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))",
                         ", acc.to(c_ptr.dtype.element_ty))")], None,
                       expect(cpu=("`c`",), gpu=("value(s) outside c (77, 61)",))),
    "k-left-from-block": ([("k_left = K - k * BLOCK_K", "k_left = BLOCK_K")], None, ()),
}
MATMUL_VALID = {
    "acc-plus-equals": [("acc = tl.dot(a, b, acc)", "acc += tl.dot(a, b)")],
    "k-offsets-in-loop": [("    for k in range(0, tl.cdiv(K, BLOCK_K)):\n        k_left = K - k * BLOCK_K",
                           "    for k in range(0, tl.cdiv(K, BLOCK_K)):\n        k_left = K - k * BLOCK_K\n"
                           "        a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k * BLOCK_K + offs_k[None, :]) * stride_ak\n"
                           "        b_ptrs = b_ptr + (k * BLOCK_K + offs_k[:, None]) * stride_bk + offs_n[None, :] * stride_bn"),
                          ("        a_ptrs += BLOCK_K * stride_ak", ""), ("        b_ptrs += BLOCK_K * stride_bk", "")],
    "k-start-loop": [("for k in range(0, tl.cdiv(K, BLOCK_K)):\n        k_left = K - k * BLOCK_K",
                      "for k0 in range(0, K, BLOCK_K):\n        k_left = K - k0")],
    "masks-named": [("    c_ptrs = c_ptr", "    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)\n    c_ptrs = c_ptr"),
                    ("mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))\n", "mask=c_mask)\n")],
}


@pytest.mark.parametrize("name", list(MATMUL_CORPUS))
def test_matmul_corpus_is_rejected_with_the_right_cause_or_none(tmp_path, name):
    changes, cause, fragments = MATMUL_CORPUS[name]
    _judge(ch05.check_matmul_kernel, _kernel(tmp_path, MATMUL, name, changes), cause, *fragments)


@pytest.mark.parametrize("name", list(MATMUL_VALID))
def test_matmul_valid_alternatives_pass(tmp_path, name, capsys):
    kernel = _kernel(tmp_path, MATMUL, name, MATMUL_VALID[name])
    assert ch05.check_matmul_kernel(kernel) is kernel
    assert "✓ Exercise 5.3: passed" in capsys.readouterr().out
