"""Checks for chapter 02 (the memory wall).

* Exercise 2.1 — ``softmax_intensity(seq_len, head_dim, bytes_per_elem)``: FLOP per HBM byte of
  the softmax kernel (reads S, writes P; 5 FLOPs per element).
* Exercise 2.2 — ``qk_intensity(seq_len, head_dim, bytes_per_elem)``: FLOP per HBM byte of
  ``S = QKᵀ`` (reads Q and K, writes S; 2 FLOPs per multiply-add).
* Exercise 2.3 — ``cost_table(seq_len, head_dim, dtype, copies, gpu, causal, dropout)``: the whole
  table of :func:`course_lib.attention.costmodel.step_costs` (FLOPs, bytes read, bytes written, intensity)
  for every kernel that runs, each classified memory- or compute-bound against the GPU's balance
  point; hint ladder ``TABLE_HINTS``/``TABLE_SKELETON``. Its check names the first wrong step and
  quantity (``check_cost_table``).

The answers are :func:`course_lib.attention.costmodel.softmax_intensity` and
:func:`course_lib.attention.costmodel.qk_intensity`; the cases mix sizes, head dims and dtypes so that a
formula which happens to be right for one of them is still caught. Exercise 2.3's cases also mix
GPUs, batch·heads and which of the mask and dropout kernels run, and include compute-bound
matmuls (d = 256 on an RTX 4090 and an A100 40GB) and a float32 table (whose balance point uses
the FP32 peak).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from course_lib.teaching import checks
from course_lib.teaching.checks import learner_check
from course_lib.attention import costmodel
from course_lib.platform import hardware
from course_lib.teaching.checks import Case, CapturedOutput, check_function

__all__ = ["CASES", "check_softmax_intensity", "check_qk_intensity", "MISTAKES_SOFTMAX",
           "MISTAKES_QK", "TABLE_FIELDS", "TABLE_CASES", "reference_cost_table", "check_cost_table",
           "MISTAKES_TABLE", "TABLE_HINTS", "TABLE_SKELETON"]

BITS_PER_BYTE = 8

# (seq_len, head_dim, bytes per element): fp16 at the CS 229s notes' N=1024, fp32, irregular
# sizes, a sequence shorter than the head dim (the N·d terms outweigh N²) and a single query.
CASES = [
    Case((1024, 64, 2), label="N=1024, d=64, fp16"),
    Case((4096, 128, 4), label="N=4096, d=128, fp32"),
    Case((1000, 80, 2), label="N=1000, d=80, bf16"),
    Case((333, 48, 8), label="N=333, d=48, fp64"),
    Case((96, 256, 4), label="N=96 < d=256, fp32"),
    Case((1, 40, 1), label="N=1, d=40, 1 byte (fp8)"),
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
    "bytes_per_elem is not used: the traffic was counted in elements; multiply by the bytes per "
    "element": lambda n, d, b: _softmax_parts(n, d, b)[0] / (2 * n * n),
    "integer division (//) rounds the intensity down: use / for FLOP per byte":
        lambda n, d, b: _softmax_parts(n, d, b)[0] // sum(_softmax_parts(n, d, b)[1:]),
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
    "bytes_per_elem is not used: the traffic was counted in elements; multiply by the bytes per "
    "element": lambda n, d, b: _qk_parts(n, d, b)[0] / (2 * n * d + n * n),
    "integer division (//) rounds the intensity down: use / for FLOP per byte":
        lambda n, d, b: _qk_parts(n, d, b)[0] // sum(_qk_parts(n, d, b)[1:]),
    "Q, K and S are each counted as N² elements (as for a square N×N×N matmul): Q and K are "
    "N×d, so the traffic is 2·N·d + N² elements":
        lambda n, d, b: _qk_parts(n, d, b)[0] / (3 * n * n * b),
}


@learner_check
def check_softmax_intensity(fn, **kwargs):
    """Check Exercise 2.1 against :func:`course_lib.attention.costmodel.softmax_intensity`."""
    return check_function("Exercise 2.1", fn, costmodel.softmax_intensity, CASES,
                          mistakes=MISTAKES_SOFTMAX, **kwargs)


@learner_check
def check_qk_intensity(fn, **kwargs):
    """Check Exercise 2.2 against :func:`course_lib.attention.costmodel.qk_intensity`."""
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
    """Exercise 2.3 from the library: :func:`course_lib.attention.costmodel.step_costs` for the kernels
    that run, each with its bound against :func:`course_lib.platform.hardware.balance_point`.

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
           flip=False, causal_half=False, read_only_intensity=False, copies_flops_only=False):
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
        flops = c * flops
        if not copies_flops_only:
            read, written = c * read, c * written
        read, written = read * b, written * b
        moved = read if read_only_intensity else read + written
        intensity = moved / flops if invert else flops / moved
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
    "the balance point is FLOP/s ÷ GB/s (10⁹× too large, so every step looks memory-bound): use "
    "gpu.bandwidth_bytes_per_s": _table_mistake(units=1e9),
    "the intensity counts only the bytes read: a kernel's traffic is what it reads plus what it "
    "writes": _table_mistake(read_only_intensity=True),
    "`copies` multiplies the FLOPs but not the bytes: every head moves its own bytes too":
        _table_mistake(copies_flops_only=True),
}

# The first case has no mask, so a matmul FLOP count wrong there is not a causal halving (on a
# causal case N²·d is both "1 FLOP per multiply-add" and "halved"); its matmuls are compute-bound
# and its softmax memory-bound, so swapped bounds and a 1000× too small balance point differ.
TABLE_CASES = [
    Case((3001, 256, "float16", 3, "RTX 4090"), {"causal": False, "dropout": False},
         label="N=3001, d=256, fp16, batch·heads=3, RTX 4090, no mask, no dropout"),
    Case((1024, 64, "float16", 1, "A100 80GB"), {"causal": True, "dropout": True},
         label="the CS 229s notes' N=1024, d=64, fp16, 1 head, A100 80GB, causal, dropout"),
    Case((4096, 128, "bfloat16", 32, "H100 SXM"), {"causal": True, "dropout": False},
         label="N=4096, d=128, bf16, batch·heads=32, H100 SXM, causal, no dropout"),
    Case((1000, 80, "float32", 12, "A100 80GB PCIe"), {"causal": False, "dropout": True},
         label="N=1000, d=80, fp32, batch·heads=12, A100 80GB PCIe, no mask, dropout"),
    Case((8192, 256, "float16", 2, "A100 40GB"), {"causal": True, "dropout": True},
         label="N=8192, d=256, fp16, batch·heads=2, A100 40GB, causal, dropout"),
    Case((96, 256, "float32", 5, "H200"), {"causal": True, "dropout": False},
         label="N=96 < d=256, fp32, batch·heads=5, H200, causal, no dropout"),
    Case((2048, 96, "bfloat16", 40, "RTX 4090"), {"causal": False, "dropout": True},
         label="N=2048, d=96, bf16, batch·heads=40, RTX 4090, no mask, dropout"),
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


_BOUND_CODES = {MEMORY: 0.0, COMPUTE: 1.0}
_CRASHED = object()  # a case the learner's function raised on, after a wrong table: no evidence


def _encode(table):
    """A table as numbers (step index, flops, read, written, intensity, bound code) per row, so
    that checks.compare and the mistake models' agreement work on it; None when it is not a list of
    rows of the right form."""
    try:
        rows = []
        for row in table:
            step, *numbers, bound = row
            rows.append([costmodel.STEPS.index(step), *(float(x) for x in numbers),
                         _BOUND_CODES.get(bound, -1.0) if isinstance(bound, str) else -1.0])
        encoded = np.array(rows, dtype=np.float64)
        return encoded if encoded.ndim == 2 and encoded.shape[1] == len(TABLE_FIELDS) else None
    except Exception:  # noqa: BLE001 - not a table of rows
        return None


def _encoded(model):
    return lambda *args, **kwargs: _encode(model(*args, **kwargs))


@learner_check
def check_cost_table(fn, **kwargs):
    """Check Exercise 2.3 against :func:`reference_cost_table`; return ``fn`` (pass) or the
    reference (not done yet).

    ``check_function`` runs ``fn`` on every case (not done yet, crashes, time limit, printing);
    the tables are compared here, so that the diagnosis names the first wrong step and quantity.
    A likely cause is named only when exactly one of ``MISTAKES_TABLE`` gives the learner's
    table on every case (``checks.cause_lines``).
    """
    exercise = "Exercise 2.3"
    output = kwargs.pop("output", None) or CapturedOutput()
    quiet = kwargs.pop("quiet", False)
    tables: list = []  # check_function calls once per case, in order: (case, table or None)

    def compared(*args, **kw):
        case = TABLE_CASES[len(tables)]
        seen_wrong = any(t is not _CRASHED and _table_problem(t, reference_cost_table(
            *c.args, **c.kwargs)) for c, t in tables)
        try:
            got = fn(*args, **kw)
        except Exception:  # noqa: BLE001 - after a wrong table, a later crash is no evidence
            if not seen_wrong:
                raise
            tables.append((case, _CRASHED))
            return 0.0
        tables.append((case, got))
        return 0.0  # check_function compares this with the reference's 0.0: tables are judged below

    result = check_function(exercise, compared, lambda *a, **kw: 0.0, TABLE_CASES,
                            fallback=reference_cost_table, quiet=True, output=output, **kwargs)
    if result is not compared:  # not done yet
        return result if quiet else checks.not_done(exercise, result)
    runs = []
    for n, (case, got) in enumerate(tables, 1):
        if got is _CRASHED:
            continue
        want = reference_cost_table(*case.args, **case.kwargs)
        problem = _table_problem(got, want)
        runs.append(checks.CaseRun(n, case, _encode(want), _encode(got),
                                "\n".join(problem) if problem else None, (0.0, TABLE_RTOL)))
    first = next((r for r in runs if r.problem), None)
    if first is None:
        if not quiet:
            checks.passed(exercise, "\n".join([f"✓ {exercise}: passed ({len(TABLE_CASES)} "
                                               f"cases).", *output.excerpt()]))
        return fn
    lines = [f"✗ {exercise}: wrong answer on case {first.n} of {len(TABLE_CASES)}",
             f"  inputs: {first.case.describe()}", first.problem,
             *checks.cause_lines(runs, {cause: _encoded(model)
                                        for cause, model in MISTAKES_TABLE.items()})]
    other = [r.n for r in runs if r.problem and r is not first]
    if other:
        lines.append(f"  (also wrong on case{'s' if len(other) > 1 else ''} "
                     f"{', '.join(map(str, other))}; right on "
                     f"{len([r for r in runs if not r.problem])} of {len(TABLE_CASES)})")
    raise checks.failed_with(exercise, "\n".join([*lines, *output.excerpt()]))
