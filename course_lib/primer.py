"""Triton primer kernels (chapter 05): vector add and a fused row softmax.

Two small kernels that show Triton's model before the attention kernel of chapter 06:

- :func:`add_kernel` — each program adds one ``BLOCK_SIZE`` block of two vectors; the last block
  is masked because ``n`` is rarely a multiple of the block size.
- :func:`softmax_kernel` — each program owns one row, reads it once into registers, computes the
  safe softmax there (max, exp, sum, divide) and writes it once. ``BLOCK_SIZE`` is the row width
  rounded up to a power of two (``tl.arange`` needs one); the extra lanes are masked and read as
  ``-inf`` so that they add ``exp(-inf) = 0`` to the sum.

Each kernel has a host-side launcher that takes the kernel as an argument (``launch_add``,
``launch_row_softmax``), so the chapter's exercise checks can run the learner's kernel exactly
as the library runs its own; the public wrappers (:func:`vector_add`, :func:`row_softmax`)
validate their inputs and launch the library's kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib import runtime

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
