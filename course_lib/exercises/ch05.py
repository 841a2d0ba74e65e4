"""Checks for chapter 05 (Triton primer): exercises 5.1 (vector add), 5.2 (fused row softmax)
and 5.3 (tiled matmul, with a hint ladder and a skeleton).

The learner's answer is a ``@triton.jit`` kernel, which raises two problems a plain function
check does not have, solved here once for chapters 05–07:

1. **Not done yet looks different on each machine.** The learner notebook's stub is
   ``raise NotImplementedError("Exercise 5.1: ...")`` inside the kernel. Triton's interpreter
   raises it at launch wrapped in an ``InterpreterError``; on a GPU, Triton's compiler refuses
   the ``raise`` statement with a ``CompilationError`` whose message quotes the line.
   :func:`is_not_done` recognises both.
2. **A wrong kernel can corrupt memory.** An unmasked store past the end of a tensor writes into
   whatever lies there (in the interpreter that can crash Python). So the checks never hand the
   learner's kernel bare tensors: :func:`guarded_run` embeds every tensor in a larger buffer —
   inputs surrounded by NaN, outputs by a sentinel — and afterwards reports a store outside the
   output, an output element never written, or a result that depends on memory outside the
   inputs (a load past the end). The diagnosis names the mask or offset to look at.

Any other error becomes one short line (:func:`summarize_kernel_error`): the first meaningful
line of Triton's message, where in the kernel it happened, and a hint when the message is one
of the classic ones (operands of ``tl.dot`` in different dtypes, a block size that is not a
power of two, ...).
"""

from __future__ import annotations

import inspect
import re
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from course_lib import checks, primer, runtime
from course_lib.checks import Case, ExerciseFailed

# Inputs are surrounded by NaN: a NaN in the output then means the kernel read outside its
# input (a missing mask on tl.load, or a wrong offset). Outputs are pre-filled with a sentinel,
# a value no exercise produces (|softmax| <= 1, |attention| <= max|v|, |x + y| of randn is small)
# and exactly representable in fp16/bf16/fp32, so "never written" and "written outside" show.
INPUT_MARGIN_FILL = float("nan")
OUTPUT_SENTINEL = -4096.0
# The second fill for inputs' margins: when a NaN output turns finite with it, the NaN came
# from outside the inputs, not from the arithmetic.
INPUT_MARGIN_REFILL = 0.0

# Per-case time limit for kernels (seconds). The interpreter runs the checks' cases in well
# under a second each; a kernel that takes this long is looping forever.
KERNEL_TIME_LIMIT_S = 30.0


class KernelProblem(RuntimeError):
    """A learner's kernel failed in a way the guarded run diagnosed; the message says how."""


# ----------------------------------------------------------------------------------------------
# Reading a kernel's errors


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or during, outermost first."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        chain.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return chain


def is_not_done(exc: BaseException) -> bool:
    """True when ``exc`` comes from an exercise stub ``raise NotImplementedError(...)``.

    Interpreter: a ``NotImplementedError`` is in the chain. GPU: the compiler rejects the
    ``raise`` statement and quotes its source line, so the text names ``NotImplementedError``.
    """
    for e in exception_chain(exc):
        if isinstance(e, NotImplementedError) or "NotImplementedError" in str(e):
            return True
    return False


# (pattern in the error text, what it usually means)
ERROR_HINTS = (
    ("must be same dtype",
     "tl.dot needs both operands in the same dtype: convert the fp32 probabilities first, "
     "tl.dot(p.to(v.dtype), v) — a missing .to(dtype) before a dot"),
    ("power of 2",
     "tl.arange (and so every block size) must be a power of two: round the width up with "
     "triton.next_power_of_2 and mask the extra lanes"),
    ("equal ranks >= 2",
     "tl.dot multiplies 2-D tiles: check the shapes (BLOCK_M, d) @ (d, BLOCK_N)"),
    ("incompatible dimensions",
     "shapes do not line up: tl.dot(a, b) needs a's last dim == b's first dim (tl.trans(k)?)"),
    ("Cannot broadcast", "shapes do not broadcast: a row index needs [:, None], a column index [None, :]"),
    ("is not defined", "a name is not defined inside the kernel: kernels see only their "
                       "arguments, triton.language (tl) and constexpr globals"),
    ("unsupported AST node", "that Python statement is not supported inside a @triton.jit kernel"),
)


def _is_library_frame(filename: str) -> bool:
    return any(part in filename for part in ("site-packages", "dist-packages", "/triton/",
                                             "/course_lib/", "<frozen", "/lib/python"))


def _user_location(chain: list[BaseException]) -> str:
    """' (line N: `code`)' for the innermost traceback frame in the learner's code, if any."""
    for exc in reversed(chain):  # innermost exception first
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if not _is_library_frame(f.filename)]
        if frames:
            f = frames[-1]
            return f" (line {f.lineno}: `{(f.line or '').strip()}`)"
    return ""


def _compilation_detail(exc: BaseException) -> str | None:
    """For a Triton CompilationError (GPU): 'line N: `code` — message', else None."""
    node, src, message = (getattr(exc, a, None) for a in ("node", "src", "error_message"))
    if node is None or not hasattr(node, "lineno"):
        return None
    line = ""
    if src:
        lines = src.split("\n")
        if 0 < node.lineno <= len(lines):
            line = lines[node.lineno - 1].strip()
    text = (message or type(exc).__name__).strip().splitlines()
    return f"line {node.lineno} of the kernel: `{line}` — {text[0] if text else ''}"


def summarize_kernel_error(exc: BaseException) -> str:
    """One or two lines that say what went wrong in a kernel launch, and where.

    Walks the exception chain to the innermost error (Triton wraps the real one), keeps its
    first line, adds the learner's source line and a hint for the classic mistakes.
    """
    chain = exception_chain(exc)
    detail = None
    for e in reversed(chain):  # the innermost compilation error points at the offending line
        detail = _compilation_detail(e)
        if detail:
            break
    innermost = chain[-1]
    if detail is None:
        first = (str(innermost).strip().splitlines() or [""])[0]
        detail = f"{type(innermost).__name__}: {first}{_user_location(chain)}"
    text = " ".join(f"{e} {getattr(e, 'error_message', '') or ''}" for e in chain)
    for pattern, hint in ERROR_HINTS:
        if pattern in text:
            return f"{detail}\n  hint: {hint}"
    return detail


# ----------------------------------------------------------------------------------------------
# Guarded runs: tensors with margins


def embed(x: torch.Tensor, margin: Sequence[int], fill: float):
    """A copy of ``x`` living inside a larger buffer filled with ``fill``.

    Args:
        x: ``(n_0, ..., n_k)``.
        margin: extra size along each dim, appended after the data. A margin along the last
            dim makes rows strided (gaps between rows); along the first dim it adds room past
            the end of the tensor.

    Returns:
        ``(view, buffer)``: ``view`` has x's shape and values and the buffer's strides.
    """
    if len(margin) != x.ndim:
        raise ValueError(f"margin needs one entry per dim of x ({x.ndim}), got {tuple(margin)}")
    buffer = torch.full([n + m for n, m in zip(x.shape, margin)], fill, dtype=x.dtype,
                        device=x.device)
    view = buffer[tuple(slice(0, n) for n in x.shape)]
    view.copy_(x)
    return view, buffer


def _outside(buffer: torch.Tensor, shape) -> torch.Tensor:
    """Boolean mask of the buffer's margin (True outside the embedded view)."""
    inside = torch.zeros(buffer.shape, dtype=torch.bool, device=buffer.device)
    inside[tuple(slice(0, n) for n in shape)] = True
    return ~inside


def _like_first_input(*inputs):
    return tuple(inputs[0].shape), inputs[0].dtype


@dataclass
class Output:
    """An output a kernel writes: its name in messages, its margin per dim, and
    ``shape_dtype(*inputs) -> (shape, dtype)`` (default: those of the first input)."""

    name: str
    margin: tuple
    shape_dtype: Callable = _like_first_input


@dataclass
class GuardedRun:
    """How to run one kernel on guarded tensors.

    ``launch(*inputs, *outputs)`` launches the kernel on views (inputs first, then outputs);
    ``margins`` gives each input's margin per dim; ``outputs`` describes what it writes.
    """

    launch: Callable
    margins: Sequence[tuple]
    outputs: Sequence[Output]
    store_hint: str = "mask every tl.store so that lanes past the end write nothing"
    coverage_hint: str = ("each program must start at its own block: offsets = pid * BLOCK_SIZE + "
                          "tl.arange(0, BLOCK_SIZE), and the grid must cover every block")
    load_hint: str = ("a tl.load reads outside the input — a missing mask (or other=) on a load, "
                      "or a wrong offset or stride")
    nonfinite_hint: str = ("an exp() of a large positive number (subtract the running max first; "
                           "the correction is exp(m_old - m_new), never the reverse) or a "
                           "division by zero")
    # explain_nonfinite(inputs, outputs) -> a likely cause, or None (e.g. by replaying mistakes)
    explain_nonfinite: Callable | None = None
    # explain_outside(inputs, outputs) -> a likely cause, or None: called when NaN came from the
    # inputs' margins, with the outputs of a second run whose margins held INPUT_MARGIN_REFILL
    explain_outside: Callable | None = None

    def _input_names(self, n: int) -> list[str]:
        """The launcher's names for its first ``n`` parameters (the inputs), e.g. ``x, y``."""
        try:
            names = list(inspect.signature(self.launch).parameters)
        except (TypeError, ValueError):
            names = []
        return names[:n] if len(names) >= n else [f"#{i}" for i in range(1, n + 1)]

    def _launch(self, inputs, fill):
        embedded = [embed(x, m, fill) for x, m in zip(inputs, self.margins)]
        views = [view for view, _ in embedded]
        pristine = [buffer.clone() for _, buffer in embedded]  # to see a store into an input
        device = inputs[0].device
        outs = []
        for o in self.outputs:
            shape, dtype = o.shape_dtype(*inputs)
            view, buffer = embed(torch.empty(shape, dtype=dtype, device=device), o.margin,
                                 OUTPUT_SENTINEL)
            view.fill_(OUTPUT_SENTINEL)
            outs.append((view, buffer))
        with warnings.catch_warnings():  # the interpreter's NumPy overflow warnings: we diagnose
            warnings.simplefilter("ignore", RuntimeWarning)
            self.launch(*views, *(v for v, _ in outs))
        if device.type == "cuda":
            torch.cuda.synchronize()
        for name, (_, buffer), before in zip(self._input_names(len(inputs)), embedded, pristine):
            if not checks.same_value(before, buffer):
                raise KernelProblem(f"your kernel wrote into its input `{name}` — inputs are "
                                    f"read-only: tl.store only to the output pointer(s) (two "
                                    f"pointer arguments swapped?)")
        return outs

    def __call__(self, *inputs):
        """Run on guarded copies of ``inputs``; return the outputs (one tensor or a tuple)."""
        outs = self._launch(inputs, INPUT_MARGIN_FILL)
        results = []
        for spec, (view, buffer) in zip(self.outputs, outs):
            sentinel = torch.tensor(OUTPUT_SENTINEL, dtype=buffer.dtype, device=buffer.device)
            outside = _outside(buffer, view.shape)
            written_outside = int((outside & (buffer != sentinel)).sum())
            if written_outside:
                raise KernelProblem(f"your kernel wrote {written_outside} value(s) outside "
                                    f"{spec.name} {tuple(view.shape)} — {self.store_hint}")
            unwritten = torch.nonzero(view == sentinel)
            if len(unwritten):
                first = tuple(int(i) for i in unwritten[0])
                raise KernelProblem(f"{len(unwritten)} element(s) of {spec.name} "
                                    f"{tuple(view.shape)} were never written (first at index "
                                    f"{first}) — {self.coverage_hint}")
            results.append(view.clone())
        if any(not torch.isfinite(r).all() for r in results) and all(
                torch.isfinite(x).all() for x in inputs):
            again = [v.clone() for v, _ in self._launch(inputs, INPUT_MARGIN_REFILL)]
            if all(torch.isfinite(r).all() for r in again):
                cause = self.explain_outside(inputs, again) if self.explain_outside else None
                raise KernelProblem(f"the output depends on memory outside the inputs (their "
                                    f"margins hold NaN, and NaN came out) — "
                                    f"{cause or self.load_hint}")
            cause = self.explain_nonfinite(inputs, results) if self.explain_nonfinite else None
            raise KernelProblem("your kernel returns NaN or inf although every input is finite — "
                                + (f"likely cause: {cause}" if cause else self.nonfinite_hint))
        return results[0] if len(results) == 1 else tuple(results)


# ----------------------------------------------------------------------------------------------
# Checking a kernel exercise


def check_kernel(exercise: str, answer, run: Callable, reference: Callable,
                 cases: Sequence[Case], *, fallback, mistakes: dict | None = None,
                 tolerance: tuple[float, float] | None = None,
                 time_limit: float | None = None, locate: Callable | None = None):
    """Check a kernel exercise and return what the notebook should go on with.

    Args:
        exercise: the id shown to the learner, e.g. ``"Exercise 5.1"``.
        answer: the learner's kernel (or kernels); returned when they pass.
        run: ``run(*case.args)`` runs the learner's answer (through a :class:`GuardedRun`).
        reference: the correct outputs for a case's args.
        cases: inputs to try, irregular sizes first-class.
        fallback: returned when the exercise is not done yet (the library's kernel).
        mistakes: ``{"likely cause": fn}`` as in :func:`course_lib.checks.check_function`.
        time_limit: seconds per case; default :data:`KERNEL_TIME_LIMIT_S` (read at call time).
        locate: ``locate(index) -> text`` names what owns an output index (e.g. its tile); the
            diagnosis shows it under the first index it quotes.

    Raises:
        ExerciseFailed: with a short diagnosis when the kernel is wrong, fails to compile or
            run, writes out of bounds, or runs past ``time_limit``.
    """
    problem: list[str] = []
    cases = list(cases)
    current: list[str] = []  # the case in hand, as the diagnosis names it

    def describe(args, kwargs):
        for n, case in enumerate(cases, 1):
            if len(case.args) == len(args) and all(a is b for a, b in zip(case.args, args)):
                return f"case {n} of {len(cases)}, {case.describe()}"
        return Case(args, kwargs).describe()

    def tracked_reference(*args, **kwargs):
        # check_function calls the reference on a case's own tensors just before it runs the
        # learner's answer on copies of them (which identity cannot match to a case)
        current[:] = [describe(args, kwargs)]
        return reference(*args, **kwargs)

    def attempt(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except KernelProblem as exc:
            problem.append(f"{exc}\n  on {current[0]}")
            raise
        except Exception as exc:  # noqa: BLE001 - any learner error becomes a diagnosis
            chain = exception_chain(exc)
            for e in chain:  # a time limit hit inside the interpreter: let checks report it
                if isinstance(e, checks.TimeLimitExceeded):
                    raise e from None
            if is_not_done(exc):
                raise NotImplementedError(exercise) from None
            problem.append(f"your kernel failed on {current[0]}"
                           f"\n  {summarize_kernel_error(exc)}")
            raise KernelProblem(problem[-1]) from None
        # SystemExit and KeyboardInterrupt (BaseException, not Exception: Triton's interpreter
        # does not wrap them) go on to check_function, which diagnoses them

    output = checks.CapturedOutput()
    try:
        result = checks.check_function(exercise, attempt, tracked_reference, cases,
                                       fallback=fallback, tolerance=tolerance, mistakes=mistakes,
                                       time_limit=time_limit or KERNEL_TIME_LIMIT_S,
                                       subject="your kernel", output=output)
    except ExerciseFailed as failed:
        message = str(failed)
        if problem:
            message = "\n".join([f"✗ {exercise}: {problem[-1]}", *output.excerpt("your kernel")])
        raise ExerciseFailed(_with_location(message, locate)) from None
    return answer if result is attempt else result


_INDEX = re.compile(r"index \(([\d, ]+)\)")


def _with_location(message: str, locate: Callable | None) -> str:
    """``message`` with ``locate(index)`` on a line after the first line quoting an index."""
    if locate is None:
        return message
    lines = message.splitlines()
    for i, line in enumerate(lines):
        found = _INDEX.search(line)
        if found:
            index = tuple(int(v) for v in found.group(1).split(",") if v.strip())
            lines.insert(i + 1, f"  {locate(index)}")
            break
    return "\n".join(lines)


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
