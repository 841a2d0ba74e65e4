"""Triton primer kernels (chapter 05): vector add, a fused row softmax and a tiled matmul.

Three small kernels that show Triton's model before the attention kernel of chapter 06:

- :func:`add_kernel` — each program adds one ``BLOCK_SIZE`` block of two vectors; the last block
  is masked because ``n`` is rarely a multiple of the block size.
- :func:`softmax_kernel` — each program owns one row, reads it once into registers, computes the
  safe softmax there (max, exp, sum, divide) and writes it once. ``BLOCK_SIZE`` is the row width
  rounded up to a power of two (``tl.arange`` needs one); the extra lanes are masked and read as
  ``-inf`` so that they add ``exp(-inf) = 0`` to the sum.
- :func:`matmul_kernel` — a 2-D grid: program ``(pid_m, pid_n)`` owns one ``(BLOCK_M, BLOCK_N)``
  tile of ``C = A @ B``, loops over ``K`` in ``BLOCK_K`` steps with ``tl.dot``, accumulates in
  fp32 and masks all three edges (M, N and the last K tile). Chapter 06's attention kernel is
  this loop with a softmax between two ``tl.dot``s.

Each kernel has a host-side launcher that takes the kernel as an argument (``launch_add``,
``launch_row_softmax``, ``launch_matmul``), so the chapter's exercise checks can run the learner's kernel exactly
as the library runs its own; the public wrappers (:func:`vector_add`, :func:`row_softmax`,
:func:`matmul`) validate their inputs and launch the library's kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib.platform import runtime

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

# Elements per program for vector add. Any power of two works; 1024 is the Triton tutorial's
# choice: enough work per program to hide memory latency on a GPU, and few programs for the
# interpreter (which runs programs one after another).
ADD_BLOCK_SIZE = 1024

# One softmax row lives in one program's registers. Wider rows need a loop over column blocks
# (the online softmax of chapter 03); we refuse them rather than spill registers silently.
MAX_ROW_WIDTH = 16384

# The dtypes the primer kernels accept. The interpreter computes bf16 wrongly (FACTS.md,
# triton issue 11584), so bf16 is accepted on the GPU only.
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Vector add


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    """out[i] = x[i] + y[i] for the block of ``BLOCK_SIZE`` indices owned by this program."""
    pid = tl.program_id(axis=0)  # which block: 0 .. cdiv(n_elements, BLOCK_SIZE) - 1
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # (BLOCK_SIZE,) element indices
    mask = offsets < n_elements  # the last block sticks out past the end
    x = tl.load(x_ptr + offsets, mask=mask)  # read BLOCK_SIZE elements of x
    y = tl.load(y_ptr + offsets, mask=mask)  # ... and of y
    tl.store(out_ptr + offsets, x + y, mask=mask)  # write BLOCK_SIZE elements


def _check_float_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dtype == torch.bfloat16 and _rt.interpreted:
        raise TypeError(f"{name} is bfloat16, which Triton's CPU interpreter computes wrongly; "
                        f"use float32 or float16 on CPU (bfloat16 works on a GPU)")
    if x.device.type != _rt.device:
        raise ValueError(f"{name} is on {x.device}, but kernels run on {_rt.device!r} in this "
                         f"mode; create it with device=rt.device")


def validate_add_inputs(x, y) -> None:
    """Check :func:`vector_add` inputs; raise TypeError/ValueError naming the bad argument."""
    _check_float_tensor("x", x)
    _check_float_tensor("y", y)
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"x and y must be 1-D, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same length, got {x.shape[0]} and {y.shape[0]}")
    if x.dtype != y.dtype:
        raise TypeError(f"x and y must have the same dtype, got {x.dtype} and {y.dtype}")
    if x.stride(0) != 1 or y.stride(0) != 1:
        raise ValueError("x and y must be contiguous (the kernel indexes them as flat arrays)")


def add_grid(n_elements: int, block_size: int) -> tuple[int]:
    """The launch grid: one program per block, the last one partly masked."""
    return (triton.cdiv(n_elements, block_size),)


def launch_add(kernel, x, y, out, block_size: int = ADD_BLOCK_SIZE) -> None:
    """Launch ``kernel`` (with :func:`add_kernel`'s signature) on 1-D tensors; no validation."""
    n = x.shape[0]
    kernel[add_grid(n, block_size)](x, y, out, n, BLOCK_SIZE=block_size)


def vector_add(x, y, block_size: int = ADD_BLOCK_SIZE):
    """``x + y`` computed by :func:`add_kernel`.

    Args:
        x, y: ``(n,)`` contiguous float tensors on the runtime's device, same dtype.
        block_size: elements per program, a power of two.

    Returns:
        ``(n,)`` tensor of x's dtype.
    """
    validate_add_inputs(x, y)
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    out = torch.empty_like(x)
    launch_add(add_kernel, x, y, out, block_size)
    return out


def vector_add_reference(x, y):
    """``x + y`` in float64, rounded to x's dtype: the oracle for :func:`vector_add`."""
    return (x.double() + y.double()).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Fused row softmax


@triton.jit
def softmax_kernel(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols,
                   BLOCK_SIZE: tl.constexpr):
    """Softmax of one row per program: read the row once, write it once."""
    row = tl.program_id(axis=0)
    cols = tl.arange(0, BLOCK_SIZE)  # (BLOCK_SIZE,) BLOCK_SIZE >= n_cols, a power of two
    mask = cols < n_cols
    # read n_cols elements; the masked lanes get -inf so that they vanish in exp()
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=-float("inf"))
    x = x.to(tl.float32)  # fp16/bf16 rows are reduced in fp32
    x = x - tl.max(x, axis=0)  # safe softmax: the largest exponent is exp(0) = 1
    numerator = tl.exp(x)
    y = numerator / tl.sum(numerator, axis=0)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def validate_softmax_input(x) -> None:
    """Check :func:`row_softmax` input; raise TypeError/ValueError naming what is wrong."""
    _check_float_tensor("x", x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (n_rows, n_cols), got shape {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x must have at least one row and one column, got {tuple(x.shape)}")
    if x.shape[1] > MAX_ROW_WIDTH:
        raise ValueError(f"rows wider than {MAX_ROW_WIDTH} do not fit one program; "
                         f"got {x.shape[1]} columns")
    if x.stride(1) != 1:
        raise ValueError("x's rows must be contiguous (stride 1 along the last dim); "
                         "call .contiguous() first")


def softmax_block_size(n_cols: int) -> int:
    """The smallest power of two >= ``n_cols``: ``tl.arange`` only makes power-of-two ranges."""
    return triton.next_power_of_2(n_cols)


def launch_row_softmax(kernel, x, out) -> None:
    """Launch ``kernel`` (with :func:`softmax_kernel`'s signature): one program per row."""
    n_rows, n_cols = x.shape
    kernel[(n_rows,)](out, x, x.stride(0), out.stride(0), n_cols,
                      BLOCK_SIZE=softmax_block_size(n_cols))


def row_softmax(x):
    """Softmax of each row of ``x`` by :func:`softmax_kernel`.

    Args:
        x: ``(n_rows, n_cols)`` float tensor on the runtime's device; rows may be strided.

    Returns:
        ``(n_rows, n_cols)`` contiguous tensor of x's dtype.
    """
    validate_softmax_input(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch_row_softmax(softmax_kernel, x, out)
    return out


def row_softmax_reference(x):
    """Row softmax in float64, rounded to x's dtype: the oracle for :func:`row_softmax`."""
    return torch.softmax(x.double(), dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Tiled matmul

# Tile sizes of the library's matmul: the Triton tutorial's smallest configuration. Large enough
# that tl.dot maps onto tensor cores, small enough for registers (an fp32 64×64 accumulator is
# 16 KiB per program), and few programs for the interpreter.
MATMUL_BLOCK_M, MATMUL_BLOCK_N, MATMUL_BLOCK_K = 64, 64, 32
# tl.dot needs every tile dimension >= 16 on a GPU: the tensor-core instructions multiply 16×16
# (fp16/bf16) fragments; smaller tiles fail to compile.
MIN_DOT_BLOCK = 16


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A @ B for the (BLOCK_M, BLOCK_N) tile of C owned by program (pid_m, pid_n)."""
    pid_m = tl.program_id(axis=0)  # which tile along M: 0 .. cdiv(M, BLOCK_M) - 1
    pid_n = tl.program_id(axis=1)  # which tile along N: 0 .. cdiv(N, BLOCK_N) - 1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of A and C
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) columns of B and C
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,) the K slice of the current step
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # fp32 whatever the inputs' dtype
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K  # the last K tile sticks out: lanes >= k_left read 0
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)  # acc += a @ b, (BLOCK_M, BLOCK_N)
        a_ptrs += BLOCK_K * stride_ak  # next K tile: BLOCK_K columns of A ...
        b_ptrs += BLOCK_K * stride_bk  # ... and BLOCK_K rows of B
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)  # write one tile of C


def validate_matmul_inputs(a, b) -> None:
    """Check :func:`matmul` inputs; raise TypeError/ValueError naming the bad argument."""
    _check_float_tensor("a", a)
    _check_float_tensor("b", b)
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a and b must be 2-D, (M, K) and (K, N), got shapes {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is "
                         f"{tuple(b.shape)} (a's columns must equal b's rows)")
    if 0 in a.shape or 0 in b.shape:
        raise ValueError(f"a and b must not be empty, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")


def matmul_grid(M: int, N: int, block_m: int, block_n: int) -> tuple[int, int]:
    """The launch grid: one program per (BLOCK_M, BLOCK_N) tile of C, edge tiles masked."""
    return (triton.cdiv(M, block_m), triton.cdiv(N, block_n))


def launch_matmul(kernel, a, b, c, block_m: int = MATMUL_BLOCK_M, block_n: int = MATMUL_BLOCK_N,
                  block_k: int = MATMUL_BLOCK_K) -> None:
    """Launch ``kernel`` (with :func:`matmul_kernel`'s signature) on 2-D tensors; no validation."""
    (M, K), N = a.shape, b.shape[1]
    kernel[matmul_grid(M, N, block_m, block_n)](
        a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        c.stride(0), c.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def matmul(a, b, kernel=matmul_kernel, block_m: int = MATMUL_BLOCK_M,
           block_n: int = MATMUL_BLOCK_N, block_k: int = MATMUL_BLOCK_K):
    """``a @ b`` computed by ``kernel`` (default :func:`matmul_kernel`), accumulated in fp32.

    On a GPU, ``tl.dot`` multiplies fp32 tiles in TF32 (10 mantissa bits) by default; the
    interpreter multiplies them exactly.

    Args:
        a: ``(M, K)`` float tensor on the runtime's device; any strides (a transposed view works).
        b: ``(K, N)`` tensor of a's dtype; any strides.
        kernel: a kernel with :func:`matmul_kernel`'s signature (your exercise 5.3, say).
        block_m, block_n, block_k: tile sizes, powers of two >= ``MIN_DOT_BLOCK``.

    Returns:
        ``(M, N)`` contiguous tensor of a's dtype.
    """
    validate_matmul_inputs(a, b)
    for name, block in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if block < MIN_DOT_BLOCK or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= {MIN_DOT_BLOCK} (tl.dot's "
                             f"smallest tile), got {block}")
    c = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    launch_matmul(kernel, a, b, c, block_m, block_n, block_k)
    return c


def matmul_reference(a, b):
    """``a @ b`` in float64, rounded to a's dtype: the oracle for :func:`matmul`."""
    return (a.double() @ b.double()).to(a.dtype)
