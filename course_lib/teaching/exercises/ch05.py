"""Checks for chapter 05 (Triton primer): exercises 5.1 (vector add), 5.2 (fused row softmax)
and 5.3 (tiled matmul, with a hint ladder and a skeleton).

The learner's answers are ``@triton.jit`` kernels. Each case places every tensor in its own
guarded buffer and layout (:class:`LayoutRun`; chapter 06 uses it too), the memory guard of
:mod:`course_lib.teaching.kernel_checks` checks every access in the interpreter, and
:func:`course_lib.teaching.checks.check_function` names a likely cause only when exactly one mistake model
reproduces the kernel's output on every case. This module holds the cases, the mistake models
and one check per exercise.
"""

from __future__ import annotations

import warnings

import torch

from course_lib.kernels import primer
from course_lib.platform import runtime
from course_lib.teaching.checks import Case, learner_check
# the layout harness is check machinery (kernel_checks); chapter 06 uses it too
from course_lib.teaching.kernel_checks import Layout, LayoutCase, LayoutRun, Out, check_layout_kernel

# ----------------------------------------------------------------------------------------------
# Exercise 5.1: add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE)

# (length, BLOCK_SIZE): lengths that are not multiples of the block, one shorter than a block,
# one of exactly a block (no tail); several block sizes, so that a kernel with a block size
# written into it shows.
ADD_CASES = ((1823, 256), (97, 128), (1024, 256), (4099, 512), (300, 64))
ADD_BLOCK = 256  # the block size of the notebook's own launch


def _add_layout(n: int, block: int) -> Layout:
    return Layout((0,), (block,))  # a block's worth of margin past the end


def _add_cases(device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(5_1)
    cases = []
    for n, block in ADD_CASES:
        x, y = (torch.randn(n, generator=gen).to(device) for _ in range(2))
        cases.append(LayoutCase((x, y), {"block_size": block, "layouts": (_add_layout(n, block),) * 3},
                          label=f"n={n}, BLOCK_SIZE={block}"))
    x, y = (c.to(torch.float16) for c in cases[0].args)
    cases.append(LayoutCase((x, y), dict(cases[0].kwargs), label=f"float16, n={ADD_CASES[0][0]}, "
                                                         f"BLOCK_SIZE={ADD_CASES[0][1]}"))
    return cases


def _add_block_of(index, block_size=ADD_BLOCK, **_) -> str:
    (i,), bs = index, block_size
    return (f"element {i} belongs to the block of program pid = {i} // BLOCK_SIZE = {i // bs} "
            f"(elements {i // bs * bs}–{i // bs * bs + bs - 1}, BLOCK_SIZE={bs})")


def _add_guard_hint(e: dict | None, params: dict) -> str | None:
    """A line on the guard's diagnosis from what it saw: lanes just past the end of a vector."""
    if not e or len(e["index"]) != 1 or e["index"][0] < e["shape"][0]:
        return None
    n, block = e["shape"][0], params.get("block_size", ADD_BLOCK)
    if e["bad"] == 1 and e["index"][0] == n and e["lanes"] == n % block + 1:
        return (f"hint: exactly one lane, at index n_elements = {n}, is past the end: the mask "
                f"lets offsets == n_elements through (<= where < is meant?)")
    if e["lanes"] == block and e["index"][0] == n:
        return (f"hint: all {block} lanes of the last block are active, {e['bad']} of them past "
                f"the end: {'the tl.store' if e['op'] == 'write' else 'this tl.load'} needs "
                f"mask=offsets < n_elements")
    return None


def add_runner(kernel) -> LayoutRun:
    """Run an add kernel on guarded 1-D tensors: ``run(x, y, block_size=..., layouts=...)``."""
    return LayoutRun(
        launch=lambda x, y, out, block_size=ADD_BLOCK: primer.launch_add(kernel, x, y, out,
                                                                         block_size),
        names=("x", "y"),
        outputs=(Out("out", lambda x, y, **_: (tuple(x.shape), x.dtype), _add_block_of),),
        guard_hint=_add_guard_hint)


def _add_reference(x, y, **_):
    return primer.vector_add_reference(x, y)


def _rounded(fn):
    """A mistake model computed in float64 and rounded to x's dtype, taking the case's kwargs."""
    return lambda x, y, **_: fn(x.double(), y.double()).to(x.dtype)


ADD_MISTAKES = {
    "x is loaded twice: the second tl.load should read y_ptr": _rounded(lambda x, y: x + x),
    "y is loaded twice: the first tl.load should read x_ptr": _rounded(lambda x, y: y + y),
    "the kernel stores x alone: out = x + y": _rounded(lambda x, y: x),
    "the kernel stores y alone: out = x + y": _rounded(lambda x, y: y),
    "the kernel subtracts: out = x + y, not x - y": _rounded(lambda x, y: x - y),
    "the kernel multiplies: out = x + y, not x * y": _rounded(lambda x, y: x * y),
}


@learner_check
def check_add_kernel(kernel):
    """Check exercise 5.1; return the learner's kernel or, if not done, the library's."""
    return check_layout_kernel("Exercise 5.1", kernel, add_runner(kernel), _add_reference,
                               _add_cases(runtime.current().device), fallback=primer.add_kernel,
                               mistakes=ADD_MISTAKES, names=("x", "y", "out"))


# ----------------------------------------------------------------------------------------------
# Exercise 5.2: softmax_kernel(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK_SIZE)

# (rows, cols, gap between x's rows, gap between out's rows): widths that are not powers of two
# (781 -> BLOCK_SIZE 1024), a single row, a width of exactly a power of two, one below the
# smallest interesting block; x's and out's row strides differ in every case but one (and which
# is larger changes), so a kernel that mixes them up or assumes dense rows shows.
SOFTMAX_SHAPES = ((37, 781, 7, 3), (1, 100, 0, 5), (16, 128, 3, 0), (9, 5, 2, 9))
# Scores this large overflow exp() in fp32 (exp(89) > 3.4e38) unless the max is subtracted.
LARGE_LOGIT = 200.0
# Rows shifted from -ROW_SHIFT to +ROW_SHIFT: exp() of a row far below 0 underflows to 0 (0/0
# without the max), of a row far above overflows.
ROW_SHIFT = 450.0


def _softmax_layouts(in_gap: int, out_gap: int) -> tuple:
    return (Layout((0, 1), (1, in_gap)), Layout((0, 1), (1, out_gap)))


def _softmax_cases(device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(5_2)
    cases = []
    for r, c, gi, go in SOFTMAX_SHAPES:
        cases.append(LayoutCase((torch.randn(r, c, generator=gen).to(device),),
                          {"layouts": _softmax_layouts(gi, go)},
                          label=f"{r}×{c}, row gaps x {gi}, out {go}"))
    r, c, gi, go = SOFTMAX_SHAPES[0]
    big = LARGE_LOGIT * torch.randn(r, c, generator=gen)
    cases.append(LayoutCase((big.to(device),), {"layouts": _softmax_layouts(gi, go)},
                      label=f"{r}×{c}, scores ~ ±{LARGE_LOGIT:g}"))
    shifted = torch.randn(12, 50, generator=gen) + torch.linspace(-ROW_SHIFT, ROW_SHIFT, 12)[:, None]
    cases.append(LayoutCase((shifted.to(device),), {"layouts": _softmax_layouts(5, 1)},
                      label=f"12×50, rows shifted from {-ROW_SHIFT:g} to +{ROW_SHIFT:g}"))
    cases.append(LayoutCase((cases[0].args[0].to(torch.float16),), {"layouts": _softmax_layouts(1, 6)},
                      label=f"float16, {r}×{c}, row gaps x 1, out 6"))
    return cases


def _softmax_row_of(index, **_) -> str:
    return f"row {index[0]} is written by program {index[0]} (one program per row)"


def _softmax_guard_hint(e: dict | None, params: dict) -> str | None:
    """A line on the guard's diagnosis: lanes past the end of a row."""
    if not e or len(e["index"]) != 2 or e["index"][1] < e["shape"][1]:
        return None
    n_cols = e["shape"][1]
    block = primer.softmax_block_size(n_cols)
    what = "the tl.store" if e["op"] == "write" else "the tl.load"
    if e["lanes"] == block:
        return (f"hint: all {block} lanes of BLOCK_SIZE = next_power_of_2(n_cols) are active, "
                f"{block - n_cols} of them past n_cols = {n_cols}: {what} needs mask=cols < n_cols"
                + (", other=-float('inf')" if e["op"] == "read" else ""))
    if e["lanes"] == n_cols:
        return (f"hint: {what} is masked (n_cols = {n_cols} lanes active) but lands outside the "
                f"row: the row offset is off — x's rows are in_row_stride apart, out's rows "
                f"out_row_stride apart")
    return None


def softmax_runner(kernel) -> LayoutRun:
    """Run a row-softmax kernel on guarded 2-D tensors: ``run(x, layouts=(x's, out's))``."""
    return LayoutRun(
        launch=lambda x, out: primer.launch_row_softmax(kernel, x, out),
        names=("x",),
        outputs=(Out("out", lambda x, **_: (tuple(x.shape), x.dtype), _softmax_row_of),),
        guard_hint=_softmax_guard_hint)


def _softmax_reference(x, **_):
    return primer.row_softmax_reference(x)


def _softmax_zero_padded(x, **_):
    # masked lanes read as 0 instead of -inf: each adds exp(0 - max) to the denominator (and 0
    # takes part in the max)
    block = primer.softmax_block_size(x.shape[-1])
    padded = torch.nn.functional.pad(x.float(), (0, block - x.shape[-1]))
    return torch.softmax(padded.double(), dim=-1)[..., : x.shape[-1]].to(x.dtype)


def _softmax_unnormalised(x, **_):
    x32 = x.float()
    return torch.exp(x32 - x32.max(dim=-1, keepdim=True).values).to(x.dtype)


def _softmax_without_max(x, **_):
    # in fp32 as the kernel computes it: exp overflows to inf (inf/inf = NaN) or underflows to 0
    # (0/0 = NaN) where a row is far from 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = torch.exp(x.float())
        return (e / e.sum(dim=-1, keepdim=True)).to(x.dtype)


def _softmax_max_only_in_numerator(x, **_):
    x32 = x.float()
    e = torch.exp(x32 - x32.max(dim=-1, keepdim=True).values)
    return (e / torch.exp(x32).sum(dim=-1, keepdim=True)).to(x.dtype)


SOFTMAX_MISTAKES = {
    "the masked lanes were loaded as 0 (the default), so each adds exp(0 - max) to the sum — "
    "load with other=-float('inf')": _softmax_zero_padded,
    "the row is not divided by its sum: y = exp(x - max) / sum(exp(x - max))": _softmax_unnormalised,
    "the max is not subtracted before exp: exp() of scores ~100 overflows to inf, of scores "
    "~-100 underflows to 0 — use exp(x - max)": _softmax_without_max,
    "the max is subtracted in the numerator only: the sum must be of the same exp(x - max)":
        _softmax_max_only_in_numerator,
}


@learner_check
def check_softmax_kernel(kernel):
    """Check exercise 5.2; return the learner's kernel or, if not done, the library's."""
    return check_layout_kernel("Exercise 5.2", kernel, softmax_runner(kernel), _softmax_reference,
                               _softmax_cases(runtime.current().device),
                               fallback=primer.softmax_kernel, mistakes=SOFTMAX_MISTAKES,
                               names=("x", "out"))


# ----------------------------------------------------------------------------------------------
# Exercise 5.3: matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
#               stride_bn, stride_cm, stride_cn, BLOCK_M, BLOCK_N, BLOCK_K)

# Tiles of the check: the smallest tl.dot allows, so that a 77×61 output spans several tiles in
# each direction; BLOCK_M != BLOCK_N, so that a kernel mixing them up shows.
MATMUL_CHECK_BLOCKS = dict(block_m=32, block_n=16, block_k=16)
# The other way round, and a K tile wider than the others.
MATMUL_OTHER_BLOCKS = dict(block_m=16, block_n=32, block_k=32)
ROW_MAJOR_GAP, COL_MAJOR = (lambda gap: Layout((0, 1), (2, gap))), (lambda gap: Layout((1, 0), (2, gap)))
# (M, K, N, blocks, layouts of A, B, C): ragged on all three edges, exact multiples of the tiles
# (no edge at all; M < N so that a column mask compared with M shows), smaller than one tile in
# every direction, K ragged against a wider K tile; A and B column-major in turn (a column
# stride != 1), rows with gaps of different widths.
MATMUL_SHAPES = (
    (77, 45, 61, MATMUL_CHECK_BLOCKS, (ROW_MAJOR_GAP(3), COL_MAJOR(5), ROW_MAJOR_GAP(2))),
    (32, 64, 48, MATMUL_CHECK_BLOCKS, (COL_MAJOR(1), ROW_MAJOR_GAP(7), COL_MAJOR(4))),
    (5, 7, 3, MATMUL_CHECK_BLOCKS, (ROW_MAJOR_GAP(1), ROW_MAJOR_GAP(0), ROW_MAJOR_GAP(3))),
    (40, 50, 24, MATMUL_OTHER_BLOCKS, (ROW_MAJOR_GAP(0), COL_MAJOR(3), ROW_MAJOR_GAP(5))),
)
# Inputs are small integers in [-MATMUL_INT_RANGE, MATMUL_INT_RANGE]: every product and partial
# sum is then exact in fp32, fp16, bf16 and TF32 (the GPU's default for fp32 tl.dot), so a
# correct kernel matches the float64 reference on any machine, in any summation order, and the
# mistake models below reproduce a wrong kernel's output exactly. One more case (interpreter
# only, where fp32 products are exact) has non-integer inputs.
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


def _blocks_label(blocks: dict) -> str:
    return f"BLOCK_M={blocks['block_m']}, BLOCK_N={blocks['block_n']}, BLOCK_K={blocks['block_k']}"


def _layouts_label(layouts) -> str:
    return ", ".join(f"{name} {'column' if lay.order == (1, 0) else 'row'}-major"
                     for name, lay in zip("ABC", layouts))


def _matmul_cases(device: str, on_gpu: bool) -> list[Case]:
    gen = torch.Generator().manual_seed(5_3)
    cases = []
    for m, k, n, blocks, layouts in MATMUL_SHAPES:
        a, b = _ints((m, k), gen).to(device), _ints((k, n), gen).to(device)
        cases.append(LayoutCase((a, b), {**blocks, "layouts": layouts},
                          label=f"{m}×{k} @ {k}×{n}, {_blocks_label(blocks)}, "
                                f"{_layouts_label(layouts)}"))
    first = cases[0]
    if not on_gpu:  # fp32 products are exact in the interpreter, not in TF32
        a, b = torch.randn(33, 29, generator=gen), torch.randn(29, 20, generator=gen)
        layouts = (COL_MAJOR(2), ROW_MAJOR_GAP(1), ROW_MAJOR_GAP(0))
        cases.append(LayoutCase((a.to(device), b.to(device)), {**MATMUL_CHECK_BLOCKS, "layouts": layouts},
                          label=f"non-integer, 33×29 @ 29×20, {_layouts_label(layouts)}"))
    cases.append(LayoutCase(tuple(x.half() for x in first.args), dict(first.kwargs),
                      label="float16, " + first.label))
    a, b = _overflow_case(gen)
    m, half, n = OVERFLOW_SHAPE
    cases.append(LayoutCase((a.half().to(device), b.half().to(device)),
                      {**MATMUL_CHECK_BLOCKS, "layouts": (ROW_MAJOR_GAP(1),) * 3},
                      label=f"float16, {m}×{2 * half} @ {2 * half}×{n}, partial sums past "
                            f"fp16's max {FP16_MAX:g} (the result is small)"))
    if on_gpu:  # the interpreter computes bf16 wrongly (FACTS.md)
        cases.append(LayoutCase(tuple(x.bfloat16() for x in first.args), dict(first.kwargs),
                          label="bfloat16, " + first.label))
    return cases


def matmul_tile(index, blocks: dict | None = None, **kwargs) -> str:
    """Which program's output tile holds element ``index = (row, col)`` of C."""
    blocks = dict(blocks or MATMUL_CHECK_BLOCKS, **{k: v for k, v in kwargs.items()
                                                   if k in MATMUL_CHECK_BLOCKS})
    bm, bn = blocks["block_m"], blocks["block_n"]
    row, col = index
    pid_m, pid_n = row // bm, col // bn
    return (f"element {tuple(index)} lies in the output tile of program (pid_m={pid_m}, "
            f"pid_n={pid_n}): rows {pid_m * bm}–{(pid_m + 1) * bm - 1}, columns "
            f"{pid_n * bn}–{(pid_n + 1) * bn - 1} (BLOCK_M={bm}, BLOCK_N={bn})")


def _matmul_guard_hint(e: dict | None, params: dict) -> str | None:
    """A line on the guard's diagnosis: which edge of which operand the lanes stick out of."""
    if not e or len(e["index"]) != 2:
        return None
    (i, j), (rows, cols) = e["index"], e["shape"]
    edges = {  # tensor -> (name of its row edge, of its column edge, the mask for each)
        "a": (("M", "offs_m[:, None] < M"), ("K", "offs_k[None, :] < K - k * BLOCK_K")),
        "b": (("K", "offs_k[:, None] < K - k * BLOCK_K"), ("N", "offs_n[None, :] < N")),
        "c": (("M", "offs_m[:, None] < M"), ("N", "offs_n[None, :] < N")),
    }.get(e["tensor"])
    if edges is None:
        return None
    past = [edge for edge, over in zip(edges, (i >= rows, j >= cols)) if over]
    if not past:
        return None
    what = "the tl.store" if e["op"] == "write" else f"the tl.load of {e['tensor'].upper()}"
    masks = " & ".join(f"({mask})" for _, mask in past)
    return (f"hint: if the offsets are right, the tile sticks out past "
            f"{' and '.join(name for name, _ in past)}: {what} needs mask={masks}"
            + (", other=0.0" if e["op"] == "read" else ""))


def matmul_runner(kernel) -> LayoutRun:
    """Run a matmul kernel on guarded 2-D tensors: ``run(a, b, block_m=..., block_n=...,
    block_k=..., layouts=(A's, B's, C's))``."""
    return LayoutRun(
        launch=lambda a, b, c, **blocks: primer.launch_matmul(kernel, a, b, c, **blocks),
        names=("a", "b"),
        outputs=(Out("c", lambda a, b, **_: ((a.shape[0], b.shape[1]), a.dtype), matmul_tile),),
        guard_hint=_matmul_guard_hint)


def _matmul_reference(a, b, **_):
    return primer.matmul_reference(a, b)


def _k_tiles(k: int, block_k: int):
    return [(start, min(start + block_k, k)) for start in range(0, k, block_k)]


def _matmul_k_not_advanced(a, b, block_k=16, **_):
    # every step reloads the first K tile, under the mask of the step's own tile
    a64, b64 = a.double(), b.double()
    out = sum(a64[:, : stop - start] @ b64[: stop - start] for start, stop in _k_tiles(a.shape[1], block_k))
    return out.to(a.dtype)


def _matmul_b_not_advanced(a, b, block_k=16, **_):
    # A's pointers move along K, B's stay on B's first K tile (each step under its own mask)
    a64, b64 = a.double(), b.double()
    out = sum(a64[:, start:stop] @ b64[: stop - start] for start, stop in _k_tiles(a.shape[1], block_k))
    return out.to(a.dtype)


def _matmul_a_not_advanced(a, b, block_k=16, **_):
    # B's pointers move along K, A's stay on A's first K tile
    a64, b64 = a.double(), b.double()
    out = sum(a64[:, : stop - start] @ b64[start:stop] for start, stop in _k_tiles(a.shape[1], block_k))
    return out.to(a.dtype)


def _matmul_k_floored(a, b, block_k=16, **_):
    # K // BLOCK_K steps: the last, shorter K tile is never added
    whole = a.shape[1] - a.shape[1] % block_k
    return (a.double()[:, :whole] @ b.double()[:whole]).to(a.dtype)


def _matmul_last_tile_only(a, b, block_k=16, **_):
    start, stop = _k_tiles(a.shape[1], block_k)[-1]
    return (a.double()[:, start:stop] @ b.double()[start:stop]).to(a.dtype)


def _matmul_a_rows_masked_with_n(a, b, **_):
    # A's rows masked with offs_m < N: rows >= N read as 0 (when M > N)
    a64 = a.double().clone()
    a64[b.shape[1]:] = 0
    return (a64 @ b.double()).to(a.dtype)


def _matmul_b_cols_masked_with_m(a, b, **_):
    # B's columns masked with offs_n < M: columns >= M read as 0 (when N > M)
    b64 = b.double().clone()
    b64[:, a.shape[0]:] = 0
    return (a.double() @ b64).to(a.dtype)


def _matmul_acc_in_input_dtype(a, b, block_k=16, **_):
    # acc in a's dtype: each K tile's fp32 dot is rounded to it and added in it
    acc = torch.zeros((a.shape[0], b.shape[1]), dtype=a.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for start, stop in _k_tiles(a.shape[1], block_k):
            acc = acc + (a[:, start:stop].double() @ b[start:stop].double()).to(a.dtype)
    return acc


MATMUL_MISTAKES = {
    "the K pointers never move: after each tl.dot advance them, a_ptrs += BLOCK_K * stride_ak "
    "and b_ptrs += BLOCK_K * stride_bk": _matmul_k_not_advanced,
    "B's pointers never move along K (A's do): every step multiplies A's next K tile by B's "
    "first one — advance both, b_ptrs += BLOCK_K * stride_bk after each tl.dot":
        _matmul_b_not_advanced,
    "A's pointers never move along K (B's do): every step multiplies A's first K tile by B's "
    "next one — advance both, a_ptrs += BLOCK_K * stride_ak after each tl.dot":
        _matmul_a_not_advanced,
    "the K loop runs K // BLOCK_K times, so the last, shorter K tile is never added: loop "
    "tl.cdiv(K, BLOCK_K) times (its mask keeps the tile inside K)": _matmul_k_floored,
    "acc = tl.dot(a, b) replaces the sum at every step: accumulate, acc = tl.dot(a, b, acc) "
    "(or acc += tl.dot(a, b))": _matmul_last_tile_only,
    "A's load masks its rows with N: rows go with M (offs_m[:, None] < M)":
        _matmul_a_rows_masked_with_n,
    "B's load masks its columns with M: columns go with N (offs_n[None, :] < N)":
        _matmul_b_cols_masked_with_m,
    "the accumulator is in the inputs' dtype: keep acc in fp32 (tl.zeros(..., dtype=tl.float32)) "
    f"and convert to c's dtype only at the tl.store — fp16 stops at {FP16_MAX:g}":
        _matmul_acc_in_input_dtype,
}


@learner_check
def check_matmul_kernel(kernel):
    """Check exercise 5.3; return the learner's kernel or, if not done, the library's."""
    rt = runtime.current()
    return check_layout_kernel("Exercise 5.3", kernel, matmul_runner(kernel), _matmul_reference,
                               _matmul_cases(rt.device, rt.on_gpu), fallback=primer.matmul_kernel,
                               mistakes=MATMUL_MISTAKES, names=("a", "b", "c"), locate=matmul_tile)


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
