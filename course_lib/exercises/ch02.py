"""Checks for chapter 02 (the memory wall).

* Exercise 2.1 — ``softmax_intensity(seq_len, head_dim, bytes_per_elem)``: FLOP per HBM byte of
  the softmax kernel (reads S, writes P; 5 FLOPs per element).
* Exercise 2.2 — ``qk_intensity(seq_len, head_dim, bytes_per_elem)``: FLOP per HBM byte of
  ``S = QKᵀ`` (reads Q and K, writes S; 2 FLOPs per multiply-add).
* Exercise 2.3 — ``cost_table(seq_len, head_dim, dtype, copies, gpu, causal, dropout)``: the whole
  table of :func:`course_lib.costmodel.step_costs` (FLOPs, bytes read, bytes written, intensity)
  for every kernel that runs, each classified memory- or compute-bound against the GPU's balance
  point; hint ladder ``TABLE_HINTS``/``TABLE_SKELETON``. Its check names the first wrong step and
  quantity (``check_cost_table``).

The answers are :func:`course_lib.costmodel.softmax_intensity` and
:func:`course_lib.costmodel.qk_intensity`; the cases mix sizes, head dims and dtypes so that a
formula which happens to be right for one of them is still caught. Exercise 2.3's cases also mix
GPUs, batch·heads and which of the mask and dropout kernels run, and include compute-bound
matmuls (d = 256 on an RTX 4090 and an A100 40GB) and a float32 table (whose balance point uses
the FP32 peak).
"""

from __future__ import annotations

import math
import numbers

from course_lib import checks
from course_lib.checks import learner_check
from course_lib import costmodel, hardware
from course_lib.checks import Case, CapturedOutput, ExerciseFailed, check_function

__all__ = ["CASES", "check_softmax_intensity", "check_qk_intensity", "MISTAKES_SOFTMAX",
           "MISTAKES_QK", "TABLE_FIELDS", "TABLE_CASES", "reference_cost_table", "check_cost_table",
           "MISTAKES_TABLE", "TABLE_HINTS", "TABLE_SKELETON"]

BITS_PER_BYTE = 8

# (seq_len, head_dim, bytes per element): fp16 at the reading's N=1024, fp32, irregular sizes.
CASES = [
    Case((1024, 64, 2), label="N=1024, d=64, fp16"),
    Case((4096, 128, 4), label="N=4096, d=128, fp32"),
    Case((1000, 80, 2), label="N=1000, d=80, bf16"),
    Case((333, 48, 8), label="N=333, d=48, fp64"),
]


def _softmax_parts(n, d, b):
    return costmodel.SOFTMAX_FLOPS_PER_ELEMENT * n * n, n * n * b, n * n * b  # flops, read, write


def _qk_parts(n, d, b):
    return costmodel.FLOPS_PER_MULTIPLY_ADD * n * n * d, 2 * n * d * b, n * n * b


MISTAKES_SOFTMAX = {
    "only the read of S is counted; the kernel also writes P (N² more elements)":
        lambda n, d, b: _softmax_parts(n, d, b)[0] / _softmax_parts(n, d, b)[1],
    "bits instead of bytes: an element is bytes_per_elem bytes, not 8× that":
        lambda n, d, b: _softmax_parts(n, d, b)[0] / (BITS_PER_BYTE * sum(_softmax_parts(n, d, b)[1:])),
    "4 FLOPs per element: the running sum is an operation too (max, subtract, exp, sum, divide = 5)":
        lambda n, d, b: 4 * n * n / sum(_softmax_parts(n, d, b)[1:]),
    "intensity is FLOPs ÷ bytes, not bytes ÷ FLOPs":
        lambda n, d, b: sum(_softmax_parts(n, d, b)[1:]) / _softmax_parts(n, d, b)[0],
    "softmax does not multiply by d: it touches each of the N² scores a fixed number of times":
        lambda n, d, b: d * _softmax_parts(n, d, b)[0] / sum(_softmax_parts(n, d, b)[1:]),
}

MISTAKES_QK = {
    "the write of S (N² elements) is not counted — that write is what makes QKᵀ memory-bound":
        lambda n, d, b: _qk_parts(n, d, b)[0] / _qk_parts(n, d, b)[1],
    "bits instead of bytes: an element is bytes_per_elem bytes, not 8× that":
        lambda n, d, b: _qk_parts(n, d, b)[0] / (BITS_PER_BYTE * sum(_qk_parts(n, d, b)[1:])),
    "a multiply-add is 2 FLOPs: QKᵀ costs 2·N²·d, not N²·d":
        lambda n, d, b: n * n * d / sum(_qk_parts(n, d, b)[1:]),
    "only Q is read: K (another N·d elements) has to come from HBM too":
        lambda n, d, b: _qk_parts(n, d, b)[0] / ((n * d + n * n) * b),
    "intensity is FLOPs ÷ bytes, not bytes ÷ FLOPs":
        lambda n, d, b: sum(_qk_parts(n, d, b)[1:]) / _qk_parts(n, d, b)[0],
}


@learner_check
def check_softmax_intensity(fn, **kwargs):
    """Check Exercise 2.1 against :func:`course_lib.costmodel.softmax_intensity`."""
    return check_function("Exercise 2.1", fn, costmodel.softmax_intensity, CASES,
                          mistakes=MISTAKES_SOFTMAX, **kwargs)


@learner_check
def check_qk_intensity(fn, **kwargs):
    """Check Exercise 2.2 against :func:`course_lib.costmodel.qk_intensity`."""
    return check_function("Exercise 2.2", fn, costmodel.qk_intensity, CASES,
                          mistakes=MISTAKES_QK, **kwargs)


# ---------------------------------------------------------------------------------------------
# Exercise 2.3: cost_table(seq_len, head_dim, dtype, copies, gpu, causal, dropout) -> rows
# ---------------------------------------------------------------------------------------------

# One row per kernel that runs, in costmodel.STEPS order. bound is "memory" or "compute".
TABLE_FIELDS = ("step", "flops", "bytes_read", "bytes_written", "intensity", "bound")
MEMORY, COMPUTE = "memory", "compute"
# The table's numbers are exact counts (and one division): anything beyond rounding is wrong.
TABLE_RTOL = 1e-9


def _kernels(causal, dropout):
    """The steps standard attention runs: the mask kernel only when causal, dropout only when
    training with dropout."""
    return [s for s in costmodel.STEPS
            if (s != "mask" or causal) and (s != "dropout" or dropout)]


def _bound(intensity, balance):
    return MEMORY if intensity < balance else COMPUTE


def reference_cost_table(seq_len, head_dim, dtype, copies, gpu, causal=True, dropout=True):
    """Exercise 2.3 from the library: :func:`course_lib.costmodel.step_costs` for the kernels
    that run, each with its bound against :func:`course_lib.hardware.balance_point`.

    Returns:
        ``[(step, flops, bytes_read, bytes_written, intensity, bound), ...]`` in
        ``costmodel.STEPS`` order; ``bound`` is ``"memory"`` (intensity below the balance point)
        or ``"compute"``.
    """
    costs = costmodel.step_costs(seq_len, head_dim, dtype, heads=copies)
    balance = hardware.balance_point(gpu, dtype)
    return [(step, c.flops, c.bytes_read, c.bytes_written, c.intensity,
             _bound(c.intensity, balance))
            for step, c in ((step, costs[step]) for step in _kernels(causal, dropout))]


def _table(seq_len, head_dim, dtype, copies, gpu, causal=True, dropout=True, *, mac_flops=2,
           softmax_flops=costmodel.SOFTMAX_FLOPS_PER_ELEMENT, write_s=True, pv_reads_v=True,
           bytes_per_elem=None, per_head=False, invert=False, peak="dtype", units=1.0,
           flip=False, causal_half=False):
    """The table with one thing counted the wrong way (the knobs); defaults give the right one."""
    n, d, c = seq_len, head_dim, 1 if per_head else copies
    b = costmodel.bytes_per_element(dtype) if bytes_per_elem is None else bytes_per_elem
    spec = hardware.get_gpu(gpu)
    peak_flops = spec.peak_flops(dtype if peak == "dtype" else peak)
    balance = peak_flops / spec.bandwidth_bytes_per_s * units
    matmul = mac_flops * n * n * d * (0.5 if causal and causal_half else 1)
    per_step = {  # FLOPs, elements read, elements written, per head
        "qk": (matmul, 2 * n * d, n * n if write_s else 0),
        "mask": (costmodel.MASK_FLOPS_PER_ELEMENT * n * n, n * n, n * n),
        "softmax": (softmax_flops * n * n, n * n, n * n),
        "dropout": (costmodel.DROPOUT_FLOPS_PER_ELEMENT * n * n, n * n, n * n),
        "pv": (matmul, n * n + (n * d if pv_reads_v else 0), n * d),
    }
    rows = []
    for step in _kernels(causal, dropout):
        flops, read, written = per_step[step]
        flops, read, written = c * flops, c * read * b, c * written * b
        intensity = (read + written) / flops if invert else flops / (read + written)
        bound = _bound(intensity, balance)
        if flip:
            bound = COMPUTE if bound == MEMORY else MEMORY
        rows.append((step, flops, read, written, intensity, bound))
    return rows


def _table_mistake(**knobs):
    return lambda *args, **kwargs: _table(*args, **kwargs, **knobs)


MISTAKES_TABLE = {
    # before the factor 2: on a causal case both give N²·d; the first case (no mask) tells them
    # apart, so an answer that reaches a causal case with N²·d halved for causal
    "the matmul FLOPs were halved for causal: standard attention computes all N² scores and "
    "only then masks them (halving is what FlashAttention's tile skipping earns)":
        _table_mistake(causal_half=True),
    "a multiply-add is 2 FLOPs: each matmul (QKᵀ and PV) costs 2·N²·d, not N²·d":
        _table_mistake(mac_flops=1),
    "the write of S (N² elements) is not counted: QKᵀ writes its whole N×N result to HBM":
        _table_mistake(write_s=False),
    "PV reads V as well as P: N² + N·d elements": _table_mistake(pv_reads_v=False),
    "bytes per element ignored: elements were counted as bytes — multiply by "
    "costmodel.bytes_per_element(dtype)": _table_mistake(bytes_per_elem=1),
    "batch·heads ignored: the FLOPs and bytes are per head — multiply both by `copies`":
        _table_mistake(per_head=True),
    "intensity is FLOPs ÷ bytes, not bytes ÷ FLOPs": _table_mistake(invert=True),
    "softmax costs 5 FLOPs per element (max, subtract, exp, sum, divide), not 4":
        _table_mistake(softmax_flops=4),
    "the balance point is TFLOP/s ÷ GB/s without converting units (1000× too small, so every "
    "step looks compute-bound): use peak_flops(dtype) ÷ bandwidth_bytes_per_s":
        _table_mistake(units=1e-3),
    "the balance point uses the fp16 tensor-core peak for a float32 table: take the peak of the "
    "table's dtype, gpu.peak_flops(dtype)": _table_mistake(peak="float16"),
    "memory- and compute-bound are swapped: below the balance point (few FLOPs per byte) a "
    "kernel waits for memory, so softmax is memory-bound": _table_mistake(flip=True),
}

# The first case has no mask, so a matmul FLOP count wrong there is not a causal halving (on a
# causal case N²·d is both "1 FLOP per multiply-add" and "halved"); its matmuls are compute-bound
# and its softmax memory-bound, so swapped bounds and a 1000× too small balance point differ.
TABLE_CASES = [
    Case((3001, 256, "float16", 3, "RTX 4090"), {"causal": False, "dropout": False},
         label="N=3001, d=256, fp16, batch·heads=3, RTX 4090, no mask, no dropout"),
    Case((1024, 64, "float16", 1, "A100 80GB"), {"causal": True, "dropout": True},
         label="the reading's N=1024, d=64, fp16, 1 head, A100 80GB, causal, dropout"),
    Case((4096, 128, "bfloat16", 32, "H100 SXM"), {"causal": True, "dropout": False},
         label="N=4096, d=128, bf16, batch·heads=32, H100 SXM, causal, no dropout"),
    Case((1000, 80, "float32", 12, "A100 80GB PCIe"), {"causal": False, "dropout": True},
         label="N=1000, d=80, fp32, batch·heads=12, A100 80GB PCIe, no mask, dropout"),
    Case((8192, 256, "float16", 2, "A100 40GB"), {"causal": True, "dropout": True},
         label="N=8192, d=256, fp16, batch·heads=2, A100 40GB, causal, dropout"),
]

TABLE_HINTS = [
    "Which kernels run: <code>costmodel.STEPS</code> is <code>('qk', 'mask', 'softmax', "
    "'dropout', 'pv')</code>; leave out <code>'mask'</code> when not <code>causal</code> and "
    "<code>'dropout'</code> when not <code>dropout</code>. The matmuls stay whole with a mask: "
    "standard attention computes every score, then masks it.",
    "Per head, in elements: QKᵀ reads <code>2·N·d</code>, writes <code>N²</code>; mask, "
    "softmax "
    "and dropout each read <code>N²</code> and write <code>N²</code>; PV reads <code>N² + N·d"
    "</code>, writes <code>N·d</code>.",
    "FLOPs per head: <code>costmodel.FLOPS_PER_MULTIPLY_ADD · N²·d</code> for each matmul, and "
    "<code>MASK_/SOFTMAX_/DROPOUT_FLOPS_PER_ELEMENT · N²</code> for the others.",
    "Multiply FLOPs and elements by <code>copies</code>, the elements also by "
    "<code>costmodel.bytes_per_element(dtype)</code>; intensity = FLOPs ÷ (read + written).",
    "Balance point: <code>gpu = hardware.get_gpu(gpu_name)</code>, then "
    "<code>gpu.peak_flops(dtype) / gpu.bandwidth_bytes_per_s</code> (FLOP/s ÷ bytes/s). A step is "
    "<code>\"memory\"</code>-bound when its intensity is below it, else "
    "<code>\"compute\"</code>.",
]

TABLE_SKELETON = '''\
n, d = seq_len, head_dim
b = ...                                     # bytes per element of dtype
gpu = hardware.get_gpu(gpu_name)
balance = ...                               # FLOP/s ÷ bytes/s, for this dtype
matmul = ...                                # FLOPs of one (N×d)·(d×N) product
per_head = {                                # step: (FLOPs, elements read, elements written)
    "qk": ..., "mask": ..., "softmax": ..., "dropout": ..., "pv": ...,
}
table = []
for step in costmodel.STEPS:
    if ...:                                 # mask only if causal, dropout only if dropout
        continue
    flops, read, written = per_head[step]
    flops, read, written = ...              # all heads, in bytes
    intensity = ...
    table.append((step, flops, read, written, intensity, ...))   # "memory" or "compute"
return table'''


def _table_problem(got, want):
    """None when ``got`` is ``want`` (numbers to TABLE_RTOL); else the lines saying the first
    thing that is wrong: the table's shape, a row's shape, or a step's quantity."""
    steps = [row[0] for row in want]
    if not isinstance(got, (list, tuple)):
        return [f"  expected a list of rows {TABLE_FIELDS}, got {type(got).__name__}"]
    got_steps = [row[0] if isinstance(row, (list, tuple)) and row else row for row in got]
    if got_steps != steps:
        return [f"  the table's steps are {got_steps}; the kernels that run here are {steps} "
                f"(the mask kernel only when causal=True, dropout only when dropout=True, in "
                f"costmodel.STEPS order)"]
    for step, row in zip(steps, got):
        if not isinstance(row, (list, tuple)) or len(row) != len(TABLE_FIELDS):
            what = f"{len(row)} fields" if isinstance(row, (list, tuple)) else type(row).__name__
            return [f"  each row is a tuple {TABLE_FIELDS}; the row of {step!r} is {what}"]
    wrong = []
    for row, right in zip(got, want):
        for field, g, w in zip(TABLE_FIELDS[1:], row[1:], right[1:]):
            if field == "bound":
                ok = isinstance(g, str) and g == w
                shown = (repr(g), repr(w))
            else:
                try:
                    ok = math.isclose(float(g), w, rel_tol=TABLE_RTOL)
                except (TypeError, ValueError):
                    ok = False
                shown = (f"{g:,.6g}" if isinstance(g, numbers.Real) else repr(g), f"{w:,.6g}")
            if not ok:
                wrong.append((row[0], field, *shown))
    if not wrong:
        return None
    step, field, g, w = wrong[0]
    lines = [f"  step {step!r} ({costmodel.STEP_LABELS[step]}), {field}: got {g}, expected {w}"]
    if len(wrong) > 1:
        lines.append(f"  ({len(wrong) - 1} more wrong quantit{'ies' if len(wrong) > 2 else 'y'} "
                     f"after it in the table)")
    return lines


class _WrongTable(Exception):
    """Raised through check_function when the learner's table is wrong (the lines are kept)."""


@learner_check
def check_cost_table(fn, **kwargs):
    """Check Exercise 2.3 against :func:`reference_cost_table`; return ``fn`` (pass) or the
    reference (not done yet).

    ``check_function`` runs ``fn`` (not done yet, crashes, time limit, printing); the table is
    compared here, so that one diagnosis names the first wrong step and quantity and, when one
    of ``MISTAKES_TABLE`` gives the same table, its likely cause.
    """
    exercise = "Exercise 2.3"
    problem: list[str] = []
    output = kwargs.pop("output", None) or CapturedOutput()
    quiet = kwargs.pop("quiet", False)
    calls = []  # check_function calls once per case, in order: len(calls) is the case number

    def compared(*args, **kw):
        calls.append(args)
        got = fn(*args, **kw)
        want = reference_cost_table(*args, **kw)
        lines = _table_problem(got, want)
        if lines:
            n = len(calls)
            problem[:] = [f"✗ {exercise}: wrong answer on case {n} of {len(TABLE_CASES)}",
                          f"  inputs: {TABLE_CASES[n - 1].describe()}", *lines]
            for cause, wrong_fn in MISTAKES_TABLE.items():
                if _table_problem(got, wrong_fn(*args, **kw)) is None:
                    problem.append(f"  likely cause: {cause}")
                    break
            raise _WrongTable()
        return 0.0  # check_function compares this with the reference's 0.0: the table was right

    try:
        result = check_function(exercise, compared, lambda *a, **kw: 0.0, TABLE_CASES,
                                fallback=reference_cost_table, quiet=True, output=output,
                                **kwargs)
    except ExerciseFailed:
        if problem:
            raise checks.failed_with(exercise, "\n".join([*problem, *output.excerpt()])) from None
        raise
    if result is compared:
        if not quiet:
            checks.passed(exercise, "\n".join([f"✓ {exercise}: passed ({len(TABLE_CASES)} "
                                               f"cases).", *output.excerpt()]))
        return fn
    if not quiet:
        return checks.not_done(exercise, result)
    return result
