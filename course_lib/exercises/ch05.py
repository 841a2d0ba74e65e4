"""Checks for chapter 05 (Triton primer): exercises 5.1 (vector add), 5.2 (fused row softmax)
and 5.3 (tiled matmul, with a hint ladder and a skeleton).

The learner's answers are ``@triton.jit`` kernels; :mod:`course_lib.kernel_checks` runs them on
guarded buffers and turns their errors into one diagnosis. This module holds the cases, the known
mistakes and one check per exercise.
"""

from __future__ import annotations

from typing import Callable

import torch

from course_lib.checks import learner_check
from course_lib import checks, primer, runtime
from course_lib.checks import Case
from course_lib.kernel_checks import INPUT_MARGIN_REFILL, GuardedRun, Output, check_kernel, embed

# ----------------------------------------------------------------------------------------------
# Exercise 5.1: add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE)

# Vector lengths: not multiples of any block size, one shorter than a block, one of exactly a
# block (no tail), so every way of getting the tail wrong shows.
ADD_LENGTHS = (1823, 97, 1024, 4099)
ADD_BLOCK = 256  # small blocks in the checks: several programs even for short vectors


def _add_cases(device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(5_1)
    cases = []
    for n in ADD_LENGTHS:
        x, y = (torch.randn(n, generator=gen).to(device) for _ in range(2))
        cases.append(Case((x, y), label=f"n={n}, BLOCK_SIZE={ADD_BLOCK}"))
    half = [c.to(torch.float16) for c in cases[0].args]
    cases.append(Case(tuple(half), label=f"float16, n={ADD_LENGTHS[0]}"))
    return cases


def add_runner(kernel, block_size: int = ADD_BLOCK) -> GuardedRun:
    """Run an add kernel on guarded 1-D tensors (a block's worth of margin past each end)."""
    margin = (block_size,)
    return GuardedRun(
        launch=lambda x, y, out: primer.launch_add(kernel, x, y, out, block_size),
        margins=(margin, margin),
        outputs=(Output("out", margin),),
        store_hint="the last block sticks out past n_elements: mask the tl.store with "
                   "offsets < n_elements (and the loads too)")


def _x_plus_x(x, y):
    return (2 * x.double()).to(x.dtype)


ADD_MISTAKES = {
    "x is loaded twice (the second load should read y_ptr)": _x_plus_x,
}


@learner_check
def check_add_kernel(kernel):
    """Check exercise 5.1; return the learner's kernel or, if not done, the library's."""
    return check_kernel("Exercise 5.1", kernel, add_runner(kernel), primer.vector_add_reference,
                        _add_cases(runtime.current().device), fallback=primer.add_kernel,
                        mistakes=ADD_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 5.2: softmax_kernel(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK_SIZE)

# (rows, cols): widths that are not powers of two (781 -> BLOCK_SIZE 1024), a single row, a
# width of exactly a power of two, and a width below the smallest interesting block.
SOFTMAX_SHAPES = ((37, 781), (1, 100), (16, 128), (9, 5))
# Scores this large overflow exp() in fp32 (exp(89) > 3.4e38) unless the max is subtracted.
LARGE_LOGIT = 200.0
# Gaps between rows (input and output strides differ, so a kernel that mixes them up shows).
IN_ROW_GAP, OUT_ROW_GAP = 7, 3


def _softmax_cases(device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(5_2)
    cases = [Case((torch.randn(r, c, generator=gen).to(device),), label=f"{r}×{c}")
             for r, c in SOFTMAX_SHAPES]
    big = LARGE_LOGIT * torch.randn(*SOFTMAX_SHAPES[0], generator=gen).to(device)
    cases.append(Case((big,), label=f"{SOFTMAX_SHAPES[0][0]}×{SOFTMAX_SHAPES[0][1]}, "
                                    f"scores ~ {LARGE_LOGIT:g}"))
    cases.append(Case((cases[0].args[0].to(torch.float16),), label="float16"))
    return cases


def softmax_runner(kernel) -> GuardedRun:
    """Run a row-softmax kernel on guarded 2-D tensors with gaps between rows."""
    return GuardedRun(
        launch=lambda x, out: primer.launch_row_softmax(kernel, x, out),
        margins=((1, IN_ROW_GAP),),
        outputs=(Output("out", (1, OUT_ROW_GAP)),),
        store_hint="BLOCK_SIZE is n_cols rounded up to a power of two: mask the tl.store with "
                   "cols < n_cols, and address rows with out_row_stride",
        coverage_hint="each program writes one row: row = tl.program_id(0), at "
                      "out_ptr + row * out_row_stride + cols",
        load_hint="a tl.load reads outside the row — mask it with cols < n_cols and "
                  "other=-float('inf'), and address rows with in_row_stride (rows are not "
                  "contiguous with each other)")


def _softmax_zero_padded(x):
    # masked lanes read as 0 instead of -inf: each adds exp(0 - max) to the denominator
    block = primer.softmax_block_size(x.shape[-1])
    padded = torch.nn.functional.pad(x.double(), (0, block - x.shape[-1]))
    return torch.softmax(padded, dim=-1)[..., : x.shape[-1]].to(x.dtype)


def _softmax_unnormalised(x):
    x64 = x.double()
    return torch.exp(x64 - x64.max(dim=-1, keepdim=True).values).to(x.dtype)


SOFTMAX_MISTAKES = {
    "the masked lanes were loaded as 0 (the default), so each adds exp(0 - max) to the sum — "
    "load with other=-float('inf')": _softmax_zero_padded,
    "the row is not divided by its sum: y = exp(x - max) / sum(exp(x - max))": _softmax_unnormalised,
}


@learner_check
def check_softmax_kernel(kernel):
    """Check exercise 5.2; return the learner's kernel or, if not done, the library's."""
    return check_kernel("Exercise 5.2", kernel, softmax_runner(kernel), primer.row_softmax_reference,
                        _softmax_cases(runtime.current().device), fallback=primer.softmax_kernel,
                        mistakes=SOFTMAX_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 5.3: matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
#               stride_bn, stride_cm, stride_cn, BLOCK_M, BLOCK_N, BLOCK_K)

# Tiles of the check: the smallest tl.dot allows, so that a 77×61 output spans several tiles in
# each direction; BLOCK_M != BLOCK_N, so that a kernel mixing them up shows.
MATMUL_CHECK_BLOCKS = dict(block_m=32, block_n=16, block_k=16)
# (M, K, N): ragged on all three edges, exact multiples of the tiles (no edge at all; M < N so
# that a column mask compared with M shows), smaller than one tile in every direction.
MATMUL_SHAPES = ((77, 45, 61), (32, 64, 48), (5, 7, 3))
# Inputs are small integers in [-MATMUL_INT_RANGE, MATMUL_INT_RANGE]: every product and partial
# sum is then exact in fp32, fp16, bf16 and TF32 (the GPU's default for fp32 tl.dot), so a
# correct kernel matches the float64 reference on any machine, in any summation order, and the
# mistake models below reproduce a wrong kernel's output exactly.
MATMUL_INT_RANGE = 3
# The overflow case: partial sums of about 16 · 150² per K tile pass fp16's largest value, 65504,
# although the result (the two halves of K cancel) fits easily. Only an fp32 accumulator gets it.
FP16_MAX = 65504.0
OVERFLOW_SHAPE = (20, 32, 24)  # (M, K/2, N)
OVERFLOW_VALUES = (100, 200)  # the range of the large entries


def _ints(shape, gen, low=-MATMUL_INT_RANGE, high=MATMUL_INT_RANGE):
    return torch.randint(low, high + 1, shape, generator=gen).float()


def _overflow_case(gen) -> tuple:
    """A = [X, X], B = [Y; -Y + E]: A @ B = X @ E is small, but X @ Y overflows fp16."""
    m, half, n = OVERFLOW_SHAPE
    x, y = (_ints(s, gen, *OVERFLOW_VALUES) for s in ((m, half), (half, n)))
    e = _ints((half, n), gen, -1, 1)
    return torch.cat([x, x], dim=1), torch.cat([y, -y + e], dim=0)


def _matmul_cases(device: str, on_gpu: bool) -> list[Case]:
    gen = torch.Generator().manual_seed(5_3)
    cases = []
    for m, k, n in MATMUL_SHAPES:
        a, b = _ints((m, k), gen).to(device), _ints((k, n), gen).to(device)
        cases.append(Case((a, b), label=f"{m}×{k} @ {k}×{n}"))
    first = cases[0].args
    cases.append(Case(tuple(x.half() for x in first), label="float16"))
    a, b = _overflow_case(gen)
    m, half, n = OVERFLOW_SHAPE
    cases.append(Case((a.half().to(device), b.half().to(device)),
                      label=f"float16, {m}×{2 * half} @ {2 * half}×{n}, partial sums past "
                            f"fp16's max {FP16_MAX:g} (the result is small)"))
    if on_gpu:  # the interpreter computes bf16 wrongly (FACTS.md)
        cases.append(Case(tuple(x.bfloat16() for x in first), label="bfloat16"))
    return cases


def _matmul_margins(a_shape, b_shape, blocks) -> tuple[tuple, tuple, tuple]:
    """Margins (rows, columns) of A, B and C, wide enough that even a kernel with its strides
    swapped or its masks missing stays inside the guarded buffers."""
    (m, k), n = a_shape, b_shape[1]
    bm, bn, bk = blocks["block_m"], blocks["block_n"], blocks["block_k"]
    return ((bm + k + bk, bk), (bk + n + bn, bn), (bm + n + bn, bn))


def _swapped_read(x, margin):
    """What a kernel with x's two strides swapped reads from x's zero-margined buffer."""
    rows, cols = x.shape
    row_stride = cols + margin[1]
    flat = embed(x, margin, INPUT_MARGIN_REFILL)[1].reshape(-1)
    i = torch.arange(rows, device=x.device)[:, None]
    j = torch.arange(cols, device=x.device)[None, :]
    return flat[i + j * row_stride]  # element (i, j) read at i * stride 1 + j * row_stride


def _explain_matmul_outside(a, b, outputs, blocks):
    """The likely cause of a matmul whose output read the inputs' margins, from a rerun with
    zero margins: right then -> the K edge is unmasked; else a stride mix-up it reproduces."""
    (got,) = outputs
    atol, rtol = checks.TOLERANCES.get(str(got.dtype).replace("torch.", ""),
                                       checks.TOLERANCES["float32"])
    if checks.compare(got, primer.matmul_reference(a, b), atol, rtol) is None:
        return ("the last K tile sticks out past K: mask both loads along K "
                "(offs_k < K - k * BLOCK_K) with other=0.0, so the extra lanes add 0 to the dot")
    margin_a, margin_b, _ = _matmul_margins(a.shape, b.shape, blocks)
    swapped_a, swapped_b = _swapped_read(a, margin_a), _swapped_read(b, margin_b)
    for which, (x, y) in (("A's", (swapped_a, b)), ("B's", (a, swapped_b)),
                          ("both A's and B's", (swapped_a, swapped_b))):
        if checks.compare(got, primer.matmul_reference(x, y), atol, rtol) is None:
            return (f"{which} row and column strides are swapped: a row offset goes with the "
                    f"row stride (offs_m * stride_am, offs_k * stride_bk), a column offset with "
                    f"the column stride (offs_k * stride_ak, offs_n * stride_bn)")
    return None


def matmul_runner(kernel, blocks: dict | None = None) -> Callable:
    """Run a matmul kernel on guarded 2-D tensors (margins past every edge, gaps between rows)."""
    blocks = dict(MATMUL_CHECK_BLOCKS if blocks is None else blocks)

    def run(a, b):
        margin_a, margin_b, margin_c = _matmul_margins(a.shape, b.shape, blocks)
        guarded = GuardedRun(
            launch=lambda a, b, c: primer.launch_matmul(kernel, a, b, c, **blocks),
            margins=(margin_a, margin_b),
            outputs=(Output("c", margin_c,
                            lambda a, b: ((a.shape[0], b.shape[1]), a.dtype)),),
            store_hint="the edge tiles stick out past M and N: mask the tl.store with "
                       "(offs_m[:, None] < M) & (offs_n[None, :] < N)",
            coverage_hint="program (pid_m, pid_n) = (tl.program_id(0), tl.program_id(1)) — "
                          "the grid's axis 0 runs along M, axis 1 along N — writes rows pid_m * BLOCK_M + tl.arange(0, BLOCK_M) and columns "
                          "pid_n * BLOCK_N + tl.arange(0, BLOCK_N) of c, masked with offs_m < M "
                          "and offs_n < N",
            load_hint="a tl.load reads outside A or B — a missing mask, or a wrong offset or "
                      "stride",
            nonfinite_hint="the accumulator overflowed: keep acc in fp32 (tl.zeros(..., "
                           f"dtype=tl.float32)) and convert to c's dtype only at the tl.store — "
                           f"fp16 stops at {FP16_MAX:g}",
            explain_outside=lambda inputs, outs: _explain_matmul_outside(*inputs, outs, blocks))
        return guarded(a, b)

    return run


def matmul_tile(index, blocks: dict | None = None) -> str:
    """Which program's output tile holds element ``index = (row, col)`` of C."""
    blocks = MATMUL_CHECK_BLOCKS if blocks is None else blocks
    bm, bn = blocks["block_m"], blocks["block_n"]
    row, col = index
    pid_m, pid_n = row // bm, col // bn
    return (f"element {tuple(index)} lies in the output tile of program (pid_m={pid_m}, "
            f"pid_n={pid_n}): rows {pid_m * bm}–{(pid_m + 1) * bm - 1}, columns "
            f"{pid_n * bn}–{(pid_n + 1) * bn - 1} (BLOCK_M={bm}, BLOCK_N={bn})")


def _k_tiles(k: int):
    bk = MATMUL_CHECK_BLOCKS["block_k"]
    return [(start, min(start + bk, k)) for start in range(0, k, bk)]


def _matmul_k_not_advanced(a, b):
    # every step reloads the first K tile, under the mask of the step's own tile
    a64, b64 = a.double(), b.double()
    out = sum(a64[:, : stop - start] @ b64[: stop - start] for start, stop in _k_tiles(a.shape[1]))
    return out.to(a.dtype)


def _matmul_last_tile_only(a, b):
    start, stop = _k_tiles(a.shape[1])[-1]
    return (a.double()[:, start:stop] @ b.double()[start:stop]).to(a.dtype)


def _matmul_masks_m_n_mixed(a, b):
    # A's rows masked with offs_m < N, B's columns with offs_n < M: those rows/columns read 0
    (m, _), n = a.shape, b.shape[1]
    a64, b64 = a.double().clone(), b.double().clone()
    a64[n:] = 0
    b64[:, m:] = 0
    return (a64 @ b64).to(a.dtype)


MATMUL_MISTAKES = {
    "the K pointers never move: after each tl.dot advance them, a_ptrs += BLOCK_K * stride_ak "
    "and b_ptrs += BLOCK_K * stride_bk": _matmul_k_not_advanced,
    "acc = tl.dot(a, b) replaces the sum at every step: accumulate, acc = tl.dot(a, b, acc) "
    "(or acc += tl.dot(a, b))": _matmul_last_tile_only,
    "a load mask compares rows with N or columns with M: rows go with M (offs_m < M), columns "
    "with N (offs_n < N)": _matmul_masks_m_n_mixed,
}


@learner_check
def check_matmul_kernel(kernel):
    """Check exercise 5.3; return the learner's kernel or, if not done, the library's."""
    rt = runtime.current()
    return check_kernel("Exercise 5.3", kernel, matmul_runner(kernel), primer.matmul_reference,
                        _matmul_cases(rt.device, rt.on_gpu), fallback=primer.matmul_kernel,
                        mistakes=MATMUL_MISTAKES, locate=matmul_tile)


MATMUL_HINTS = (
    "Start with who owns what: <code>pid_m = tl.program_id(0)</code>, "
    "<code>pid_n = tl.program_id(1)</code>; this program computes rows "
    "<code>offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)</code> and columns "
    "<code>offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)</code> of C.",
    "A tile of A is a 2-D block of pointers: <code>a_ptr + offs_m[:, None] * stride_am + "
    "offs_k[None, :] * stride_ak</code> with <code>offs_k = tl.arange(0, BLOCK_K)</code>, shape "
    "(BLOCK_M, BLOCK_K). B's tile is the same with (offs_k, offs_n) and B's strides.",
    "Before the loop: <code>acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)</code>. Loop "
    "<code>for k in range(0, tl.cdiv(K, BLOCK_K))</code>: load both tiles, "
    "<code>acc = tl.dot(a, b, acc)</code>, then move both pointer blocks on by BLOCK_K along K.",
    "Masks: A's tile needs <code>(offs_m[:, None] < M) & (offs_k[None, :] < K - k * BLOCK_K)"
    "</code>, B's <code>(offs_k[:, None] < K - k * BLOCK_K) & (offs_n[None, :] < N)</code>, both "
    "with <code>other=0.0</code> so that masked lanes add nothing to the dot.",
    "Store once, after the loop, in C's dtype: <code>tl.store(c_ptr + offs_m[:, None] * "
    "stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, "
    "None] < M) & (offs_n[None, :] < N))</code>.",
)

MATMUL_SKELETON = '''\
pid_m = tl.program_id(axis=0)
pid_n = tl.program_id(axis=1)
offs_m = ...                      # (BLOCK_M,) rows of A and C
offs_n = ...                      # (BLOCK_N,) columns of B and C
offs_k = tl.arange(0, BLOCK_K)    # (BLOCK_K,)
a_ptrs = ...                      # (BLOCK_M, BLOCK_K) pointers into A
b_ptrs = ...                      # (BLOCK_K, BLOCK_N) pointers into B
acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
for k in range(0, tl.cdiv(K, BLOCK_K)):
    k_left = K - k * BLOCK_K
    a = tl.load(a_ptrs, mask=..., other=0.0)
    b = tl.load(b_ptrs, mask=..., other=0.0)
    acc = ...
    a_ptrs += ...
    b_ptrs += ...
c_ptrs = ...
tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=...)
'''
