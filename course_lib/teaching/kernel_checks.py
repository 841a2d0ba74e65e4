"""Checking a learner's Triton kernel: "not done yet" on any machine, guarded buffers, one diagnosis.

The learner's answer to a kernel exercise (chapters 05–08) is a ``@triton.jit`` kernel, which
raises two problems a plain function check (:mod:`course_lib.teaching.checks`) does not have:

1. **Not done yet looks different on each machine.** The learner notebook's stub is
   ``raise NotImplementedError("Exercise 5.1: ...")`` inside the kernel. Triton's interpreter
   raises it at launch wrapped in an ``InterpreterError``; on a GPU, Triton's compiler refuses
   the ``raise`` statement with a ``CompilationError`` whose message quotes the line.
   :func:`is_not_done` recognises both.
2. **A wrong kernel can corrupt memory.** An unmasked store past the end of a tensor writes into
   whatever lies there (in the interpreter that can crash Python). So the checks never hand the
   learner's kernel bare tensors: :class:`GuardedRun` embeds every tensor in a larger buffer —
   inputs surrounded by NaN, outputs by a sentinel — and afterwards reports a store outside the
   output, an output element never written, or a result that depends on memory outside the
   inputs (a load past the end). The diagnosis names the mask or offset to look at.

Any other error becomes one short line (:func:`summarize_kernel_error`): the first meaningful
line of Triton's message, where in the kernel it happened, and a hint when the message is one
of the classic ones (operands of ``tl.dot`` in different dtypes, a block size that is not a
power of two, ...). :func:`check_kernel` puts it together for one exercise.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from course_lib.teaching import checks
from course_lib.teaching.checks import Case, ExerciseFailed


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


# (pattern in the error text, what it usually means) — or (pattern, hint, test of the learner's
# source line): the same message comes from different statements (Triton reports a mask that
# does not broadcast with the same words as a tl.dot of mismatched shapes)
_AXIS_RULE = ("in a 2-D tile a row index needs [:, None] and a column index [None, :] — in a mask or "
              "a tl.where condition too (a (BLOCK_M,) mask lines up with the columns of a "
              "(BLOCK_M, HEAD_DIM) block, not its rows)")
_BROADCAST_HINT = f"shapes do not broadcast: {_AXIS_RULE}"
ERROR_HINTS = (
    ("must be same dtype",
     "tl.dot needs both operands in the same dtype: convert the fp32 probabilities first, "
     "tl.dot(p.to(v.dtype), v) — a missing .to(dtype) before a dot"),
    ("power of 2",
     "tl.arange (and so every block size) must be a power of two: round the width up with "
     "triton.next_power_of_2 and mask the extra lanes"),
    ("equal ranks >= 2",
     "tl.dot multiplies 2-D tiles: check the shapes (BLOCK_M, d) @ (d, BLOCK_N)"),
    ("equal reduction dimensions",
     "tl.dot(a, b) needs a (M, K) @ b (K, N): for scores q (M, d) @ kᵀ (d, N), write tl.dot(q, tl.trans(k))"),
    ("incompatible dimensions",
     "shapes do not line up: tl.dot(a, b) needs a's last dim == b's first dim (tl.trans(k)?)",
     lambda line: "tl.dot" in line),
    ("incompatible dimensions", _BROADCAST_HINT, lambda line: "tl.dot" not in line),
    ("Cannot broadcast", _BROADCAST_HINT),
    ("is not defined", "a name is not defined inside the kernel: kernels see only their "
                       "arguments, triton.language (tl) and constexpr globals"),
    ("unsupported AST node", "that Python statement is not supported inside a @triton.jit kernel"),
)


def _user_location(chain: list[BaseException]) -> str:
    """' (line N: `code`)' for the innermost traceback frame in the learner's code, if any."""
    for exc in reversed(chain):  # innermost exception first
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if not checks.is_library_frame(f.filename)]
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
    found = re.search(r"`([^`]*)`", detail)
    line = found.group(1) if found else ""
    sizes = re.search(r"incompatible dimensions at index \d+: (\d+) and (\d+)", text)
    if sizes and "tl.dot" not in line and sizes.group(1) != sizes.group(2):
        return f"{detail}\n  hint: {_lengths_hint(*sizes.groups())}"
    for pattern, hint, *fits in ERROR_HINTS:
        if pattern in text and (not fits or fits[0](line)):
            return f"{detail}\n  hint: {hint}"
    return detail


def _lengths_hint(a: str, b: str) -> str:
    """The hint for two tiles of different lengths on one axis (Triton's "incompatible dimensions
    ... a and b"): the ways such lengths meet, none singled out (the error alone cannot tell)."""
    return (f"shapes do not broadcast: a tile {a} long meets one {b} long on the same axis. Either a "
            f"1-D vector sits on the wrong axis ({_AXIS_RULE}), or it was made along the wrong axis (on a "
            f"(BLOCK_M, BLOCK_N) score tile tl.max/tl.sum with axis=1 give one value per row, axis=0 one "
            f"per key column), or a tile loaded in the other shape (block sizes given in the other "
            f"order: a pointer grid or a descriptor's block_shape of BLOCK_N rows where BLOCK_M belong)")


def _runtime():
    from course_lib.platform import runtime  # not at import time: kernel_checks is imported by runtime's users

    return runtime.current()


# ----------------------------------------------------------------------------------------------
# Memory-safe runs in the interpreter: every access checked before it happens


class MemoryViolation(KernelProblem):
    """A learner's kernel tried to load or store outside the tensors it was handed (checked in
    Triton's interpreter before the access, so nothing was read or corrupted).

    Besides the message, the evidence as fields: ``op`` ("tl.load", ...), ``write``,
    ``program`` (the program id), ``n_bad``/``n_lanes`` (bad and active lanes), ``tensor`` (the
    name of the tensor the first bad lane is nearest to, or None), ``index`` (its index there,
    or None) and ``kind``: "input written", "past the end", "strides of another tensor",
    "own strides swapped", "past the end or strides of another tensor", or "outside"."""

    def __init__(self, message: str, **evidence):
        super().__init__(message)
        self.op = evidence.get("op")
        self.write = evidence.get("write")
        self.program = evidence.get("program")
        self.n_bad = evidence.get("n_bad")
        self.n_lanes = evidence.get("n_lanes")
        self.tensor = evidence.get("tensor")
        self.index = evidence.get("index")
        self.kind = evidence.get("kind")

    def extended(self, line: str | None) -> "MemoryViolation":
        """The same violation with one more line of explanation (a chapter's hint), its
        evidence kept."""
        return MemoryViolation(str(self) + (f"\n  {line}" if line else ""), **{
            k: getattr(self, k) for k in ("op", "write", "program", "n_bad", "n_lanes", "tensor",
                                          "index", "kind")})


@dataclass
class _Region:
    """The exact elements of one tensor a kernel may touch."""

    name: str
    base: int  # address of element (0, ..., 0)
    itemsize: int
    shape: tuple
    strides: tuple  # in elements
    write: bool
    storage: tuple  # (first, last + 1) address of the whole allocation
    nested: bool = field(init=False)

    def __post_init__(self):
        dims = sorted((st, n) for st, n in zip(self.strides, self.shape) if n > 1 and st > 0)
        extent, self.nested = 1, True
        for st, n in dims:  # each stride must step over everything the smaller ones reach
            self.nested &= st >= extent
            extent = st * n

    @classmethod
    def of(cls, name: str, t: torch.Tensor, write: bool) -> "_Region":
        storage = t.untyped_storage()
        return cls(name, t.data_ptr(), t.element_size(), tuple(t.shape), tuple(t.stride()), write,
                   (storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    def index_of(self, addresses: np.ndarray, strides=None, shape=None):
        """(index per dim, ok) of each address read with ``strides`` (default: the tensor's own),
        ``ok`` False where it is not an element of a view of ``shape`` (default: the tensor's)."""
        strides = self.strides if strides is None else strides
        shape = self.shape if shape is None else shape
        offset = addresses.astype(np.int64) - self.base
        ok = (offset >= 0) & (offset % self.itemsize == 0)
        rem = offset // self.itemsize
        index = [np.zeros_like(rem) for _ in shape]
        for d in sorted(range(len(shape)), key=lambda d: -strides[d]):
            if strides[d] <= 0 or shape[d] <= 1:
                continue
            index[d] = rem // strides[d]
            rem = rem - index[d] * strides[d]
            ok &= index[d] < shape[d]
        ok &= rem == 0
        return index, ok

    def contains(self, addresses: np.ndarray) -> np.ndarray:
        if self.nested:
            return self.index_of(addresses)[1]
        valid = self.base + self.itemsize * sum(  # small views: list every element's address
            np.arange(n, dtype=np.int64).reshape([-1 if i == d else 1 for i in range(len(self.shape))])
            * st for d, (n, st) in enumerate(zip(self.shape, self.strides)))
        return np.isin(addresses.astype(np.int64), np.asarray(valid).ravel())

    def in_storage(self, address: int) -> bool:
        return self.storage[0] <= address < self.storage[1]


def _tiles_by_swapped_ids(first: dict) -> str:
    """The clause saying that the tiles of a 2-D output the programs stored (``{program: its
    first element (row, column)}``) sit at row block = program id 1 and column block = program
    id 0 (each block numbered by its place among the rows, the columns, that were stored), and
    not the other way round; "" when they do not."""
    rows = sorted({r for r, _ in first.values()})
    cols = sorted({c for _, c in first.values()})

    def placed(row_axis: int, col_axis: int) -> bool:
        return all(rows.index(r) == p[row_axis] and cols.index(c) == p[col_axis]
                   for p, (r, c) in first.items())

    if placed(0, 1) or not placed(1, 0):
        return ""
    return (" — each program's tile sits at row block tl.program_id(1) and column block "
            "tl.program_id(0) (by the first element it stored): the two program ids are used "
            "the other way round")


class MemoryGuard:
    """The tensors a kernel launch may touch; see :func:`memory_guard`."""

    def __init__(self):
        self.regions: list[_Region] = []
        # name -> {program: flat element offsets it stored} (outputs only: evidence of coverage)
        self.stores: dict[str, dict[tuple, list]] = {}

    def _record_store(self, lanes: np.ndarray, program) -> None:
        program = tuple(int(i) for i in program)
        for r in self.regions:
            if not r.write:
                continue
            inside = lanes[r.contains(lanes)]
            if inside.size:
                self.stores.setdefault(r.name, {}).setdefault(program, []).append(
                    (inside.astype(np.int64) - r.base) // r.itemsize)

    def coverage(self, name: str, view: torch.Tensor, limit: int = 3) -> str:
        """Which elements of output ``name`` (``view``) each program stored, for a diagnosis of
        elements never written: the first ``limit`` programs' spans (first and last index) and
        how far apart consecutive programs' first elements are when that is one number."""
        found = self.stores.get(name)
        if not found:
            return f"no program stored anything into `{name}`"
        strides, shape = view.stride(), tuple(view.shape)

        def index(offset: int) -> tuple:
            out = []
            for st in strides:
                out.append(offset // st if st else 0)
                offset -= out[-1] * st
            return tuple(out)

        def show(i: tuple):
            return i[0] if len(i) == 1 else i

        programs = sorted(found)
        spans = {p: np.unique(np.concatenate(found[p])) for p in programs}
        used = max((i + 1 for p in programs for i, v in enumerate(p) if v), default=1)

        def pid(p: tuple) -> str:  # the grid's axes that any program has a non-zero id on
            return str(p[0]) if used == 1 else str(p[:used])

        lines = [f"program {pid(p)}: {spans[p].size} element(s), "
                 f"{show(index(int(spans[p][0])))}–{show(index(int(spans[p][-1])))}"
                 for p in programs[:limit]]
        firsts = [int(spans[p][0]) for p in programs]
        said = f"the programs' stores into `{name}` {tuple(shape)}: " + "; ".join(lines)
        if len(programs) > limit:
            said += f"; … ({len(programs)} programs stored)"
        steps = set(np.diff(firsts).tolist())
        if len(programs) > 1 and all(np.array_equal(spans[p], spans[programs[0]]) for p in programs):
            said += (f" — all {len(programs)} programs stored the same elements: the offsets "
                     f"do not change with the program id")
            axes = range(len(programs[0]))
            moving = [a for a in axes if len({p[a] for p in programs}) > 1]
            still = [a for a in axes if a not in moving]
            if moving and still:  # which ids a kernel could have read to get this
                said += (f" (the programs differ only in "
                         f"{' and '.join(f'tl.program_id({a})' for a in moving)}; "
                         + " and ".join(f"tl.program_id({a})" for a in still)
                         + f" {'is' if len(still) == 1 else 'are'} the same in every one: "
                         + ", ".join(str(programs[0][a]) for a in still) + ")")
        elif len(programs) > 1 and len(steps) == 1:
            said += (f" — consecutive programs' first elements are {steps.pop()} element(s) "
                     f"apart")
        elif len(shape) == 2 and len(programs) > 1 and used >= 2:
            said += _tiles_by_swapped_ids({p: index(int(spans[p][0])) for p in programs})
        return said

    def allow(self, name: str, t: torch.Tensor, write: bool = False) -> torch.Tensor:
        """Let the kernel read ``t``'s elements (and write them if ``write``); returns ``t``."""
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            self.regions.append(_Region.of(name, t, write))
        return t

    # -- checking one access

    def check(self, op: str, addresses: np.ndarray, mask: np.ndarray | None, write: bool,
              program: tuple) -> None:
        lanes = np.asarray(addresses).astype(np.int64)
        if mask is not None:
            lanes = lanes[np.broadcast_to(np.asarray(mask, dtype=bool), lanes.shape)]
        else:
            lanes = lanes.ravel()
        if not lanes.size or not self.regions:
            return
        ok = np.zeros(lanes.shape, dtype=bool)
        for r in self.regions:
            if write and not r.write:
                continue
            ok |= r.contains(lanes)
        if ok.all():
            if write:
                self._record_store(lanes, program)
            return
        bad = lanes[~ok]
        program = tuple(int(i) for i in program)
        pid = ", ".join(map(str, program))
        head = (f"your kernel's {op} in program id ({pid}) would {'write' if write else 'read'} "
                f"{bad.size} of its {lanes.size} active lane(s) outside the tensors it may "
                f"{'write' if write else 'read'}; stopped before the access")
        self._op = op
        where, why, evidence = self._locate(bad, lanes, write)
        if op in (DESCRIPTOR_LOAD, DESCRIPTOR_STORE):  # no mask to add: its declared shape is it
            why = re.sub(r"The tl\.(load|store) of a tile needs a mask on its rows \(mask=[^)]*\)",
                         f"A descriptor's {'store' if write else 'load'} takes no mask: it stops at "
                         f"the shape the descriptor was declared with — a declared shape larger "
                         f"than `{evidence.get('tensor')}`'s own reaches past its end",  why)
        why += self._steps_note(np.asarray(addresses), evidence.get("tensor"))
        why += self._grouped_index_note(evidence)
        if bad.size == lanes.size:  # the whole tile is off, not a ragged edge a mask would cover
            why += _swapped_program_ids_note(program, _grid_dims())
        raise MemoryViolation(f"{head}\n  first bad lane: {where}\n  {why}", op=op, write=write,
                              program=program, n_bad=int(bad.size), n_lanes=int(lanes.size),
                              **evidence)

    def _locate(self, bad: np.ndarray, lanes: np.ndarray, write: bool):
        """Where the first bad lane points, what the offsets suggest, and that evidence as
        fields. An explanation is kept only when every lane it is about fits it: "past the end"
        must fit every bad lane; "another tensor's strides" must fit every active lane (the
        good ones too, or it is a coincidence of numbers)."""
        address = int(bad[0])
        a = bad[:1]
        # 1. inside a tensor the kernel may only read: a store into an input
        for r in self.regions:
            if r.contains(a)[0]:
                idx = tuple(int(i[0]) for i in r.index_of(a)[0])
                return (f"element {idx} of `{r.name}`",
                        f"`{r.name}` is an input (read-only): tl.store only to the output "
                        f"pointer(s); two pointer arguments swapped?",
                        dict(tensor=r.name, index=idx, kind="input written"))
        nearest = sorted((r for r in self.regions if r.base <= address), key=lambda r: -r.base)
        # 2a. the rows of one tile running past the last row of their own (batch, head) slice
        # (an unmasked row load or store): its lanes land in the next slice or past the end
        # (kept as the "past the end" reading: step 3 still asks whether another tensor's strides
        # explain the same offsets, and then says both)
        past = self._rows_past(nearest[0], bad, lanes, write) if nearest else None
        # 2. just past the end of the nearest tensor along some dims (within one more extent)
        for r in nearest[:1] if past is None else ():
            index, _ = r.index_of(bad)
            aligned = (bad.astype(np.int64) - r.base) % r.itemsize == 0
            if aligned.all() and all((i < 2 * n).all() for i, n in zip(index, r.shape)):
                idx = tuple(int(i[0]) for i in index)
                over = [(d, i, n) for d, (i, n) in enumerate(zip(idx, r.shape)) if i >= n]
                text = "; ".join(f"dim {d} index {i} ≥ its size {n}" for d, i, n in over)
                leading = len(r.shape) > 2 and all(d < len(r.shape) - 2 for d, _, _ in over)
                dims = " and ".join(str(d) for d, _, _ in over)
                why = (f"past the end of `{r.name}`: a descriptor's "
                       f"{'store' if write else 'load'} takes no mask — it stops at the shape the "
                       f"descriptor was declared with, so a declared shape larger than "
                       f"`{r.name}`'s own reaches past its end: declare its real shape (and "
                       f"strides) when you make the descriptor"
                       if getattr(self, "_op", None) in (DESCRIPTOR_LOAD, DESCRIPTOR_STORE) else
                       f"past the end of `{r.name}` along dim {dims}: the offset along that dim "
                       f"is too large — its index computed with another dim's stride, from the "
                       f"wrong program id, or from a length that runs past the end"
                       if leading else
                       f"past the end of `{r.name}`: lanes past the last row/column need a "
                       f"mask on the {'tl.store' if write else 'tl.load'} (mask=offs < n"
                       f"{'' if write else ', other=0.0'}), or an offset is too large")
                past = (f"`{r.name}` {tuple(r.shape)} at index {idx} ({text})", why,
                        dict(tensor=r.name, index=idx, kind="past the end"))
        # 3. one tensor's base with its own strides in another order, or with another tensor's
        # strides: every active lane must fit
        for r in nearest[:1]:
            own = self._own_strides_swapped(r, lanes)
            for other in self.regions:
                if other is r or other.strides == r.strides or len(other.strides) != len(r.shape):
                    continue
                if not _strides_nest(other.strides, r.shape):
                    continue  # indices read with them are not unique: any offset fits somehow
                if not r.index_of(lanes, strides=other.strides)[1].all():
                    continue
                idx = tuple(int(i[0]) for i in r.index_of(a, strides=other.strides)[0])
                strides = (f"every lane of this access is an element of `{r.name}` indexed with "
                           f"`{other.name}`'s strides {other.strides}: use `{r.name}`'s own "
                           f"strides {r.strides} for `{r.name}`")
                if own is not None:  # both fit: say both, guess neither
                    strides = (f"either {own[1]};\n  or {strides} (both fit these offsets: "
                               f"`{other.name}`'s strides are `{r.name}`'s in another order)")
                if past is None:
                    return (f"element {(address - r.base) // r.itemsize:+d} from the start of "
                            f"`{r.name}` = index {idx} with `{other.name}`'s strides", strides,
                            dict(tensor=r.name, index=idx, kind="strides of another tensor"))
                # both fit the evidence: say both, guess neither
                return past[0], (f"either {past[1]};\n  or {strides} (both fit these "
                                 f"offsets)"), dict(past[2], kind="past the end or strides of "
                                                                  "another tensor")
            if own is not None:
                if past is None:
                    return own
                return past[0], (f"either {past[1]};\n  or {own[1]} (both fit these offsets)"), \
                    dict(past[2], kind="past the end or strides of another tensor")
        if past:
            return past
        # 4. elsewhere: name the nearest tensor that starts before it
        near = nearest[0] if nearest else min(self.regions, key=lambda r: r.base)
        elements = (address - near.base) / near.itemsize
        return (f"{elements:+.0f} elements from the start of `{near.name}` {tuple(near.shape)}, "
                f"outside every tensor the kernel was given",
                "an offset that is too large or negative: a missing batch/head offset, a row "
                "index multiplied by the wrong stride, or a pid used for the wrong axis",
                dict(tensor=near.name, index=None, kind="outside"))


    def _grouped_index_note(self, evidence: dict) -> str:
        """A line of evidence when the first bad lane is past the end of exactly one dim of its
        tensor, and the index it has there fits a larger dim of another tensor whose size is a
        multiple of this one's (4 query heads, 2 K/V heads): an index of the other tensor's
        dim used for this one — with grouped heads, a query head used as a K/V head."""
        r = next((x for x in self.regions if x.name == evidence.get("tensor")), None)
        idx = evidence.get("index")
        if r is None or not idx or evidence.get("kind") not in ("past the end",
                                                                "past the end or strides of another tensor"):
            return ""
        over = [(d, i, n) for d, (i, n) in enumerate(zip(idx, r.shape)) if i >= n]
        if len(over) != 1:
            return ""
        d, i, n = over[0]
        if r.strides[d] == 1:
            return ""  # the innermost dim (columns, the head dim d): not a count of anything
        for x in self.regions:
            if x is r or x.write or len(x.shape) != len(r.shape):
                continue
            for dx, m in enumerate(x.shape):
                if dx != d or x.strides[dx] == 1:  # the same dim of a tensor laid out alike
                    continue
                if m > n > 1 and m % n == 0 and i < m and m not in r.shape:
                    return (f"\n  also: index {i} along dim {d} of `{r.name}` (size {n}) is a valid "
                            f"index of `{x.name}`'s dim {dx} (size {m} = {m // n} × {n}): an index "
                            f"computed for `{x.name}`'s dim used on `{r.name}`'s? (if these are "
                            f"heads: each K/V head serves {m // n} query heads, K/V head = h // "
                            f"{m // n})")
        return ""

    def _steps_note(self, addresses: np.ndarray, name: str | None) -> str:
        """A line of evidence when the tile's offsets step through memory by amounts that are
        not strides of the tensor they are meant for: the steps per tile axis (uniform ones
        only, read from every lane, masked or not) beside the tensor's strides, and what a
        wrong step equals (a size of that tensor, or another tensor's stride). Empty when the
        steps are the tensor's strides (the slip is elsewhere: a base offset, a mask)."""
        r = next((x for x in self.regions if x.name == name), None)
        if r is None or addresses.ndim < 2 or addresses.size < 4:
            return ""
        steps = []
        for axis in range(addresses.ndim):
            if addresses.shape[axis] < 2:
                continue
            diff = np.diff(addresses.astype(np.int64), axis=axis)
            if (diff != diff.flat[0]).any() or diff.flat[0] % r.itemsize:
                return ""  # not one step along this axis: no simple story
            steps.append(int(diff.flat[0]) // r.itemsize)
        wrong = [st for st in steps if st not in r.strides]
        if not wrong or len(steps) < 2:
            return ""
        said = []
        for st in dict.fromkeys(wrong):
            sizes = [d for d, n in enumerate(r.shape) if n == st]
            others = [f"`{x.name}`'s stride({d})" for x in self.regions if x is not r
                      for d, xs in enumerate(x.strides) if xs == st and x.shape[d] > 1]
            if sizes:
                said.append(f"{st} is `{r.name}`'s size along dim {sizes[0]} (a size where a stride "
                            f"belongs)")
            elif others:
                said.append(f"{st} is {others[0]}")
        axes = " and ".join(str(st) for st in steps)
        return (f"\n  the offsets of this tile step {axes} elements along its axes; `{r.name}`'s "
                f"strides are {tuple(r.strides)}" + (f": {'; '.join(said)}" if said else ""))

    @staticmethod
    def _own_strides_swapped(r: "_Region", lanes: np.ndarray):
        """(where, why, evidence) when every lane is an element of ``r`` reached with ``r``'s own
        strides given to the wrong dims (e.g. its row and head strides swapped), else None."""
        for perm in sorted(set(itertools.permutations(r.strides))):
            if perm == tuple(r.strides) or not r.index_of(lanes, strides=perm)[1].all():
                continue
            swapped = [d for d in range(len(perm)) if perm[d] != r.strides[d]]
            dims = " and ".join(f"dim {d}" for d in swapped)
            idx = tuple(int(i[0]) for i in r.index_of(lanes[:1], strides=perm)[0])
            return (f"`{r.name}` {tuple(r.shape)} at index {idx} reached with its strides in "
                    f"another order {perm}",
                    f"every lane of this access is an element of `{r.name}` reached with "
                    f"`{r.name}`'s own strides {tuple(r.strides)} given to the wrong dims ({dims} "
                    f"swapped): each index times the stride of its own dim",
                    dict(tensor=r.name, index=idx, kind="own strides swapped"))
        return None

    @staticmethod
    def _rows_past(r: "_Region", bad: np.ndarray, lanes: np.ndarray, write: bool):
        """(where, why, evidence) when the access is one tile of rows of ``r`` whose last rows run
        past the last row of their own (batch, head) slice: every lane, good and bad, is
        (row, column) of the slice the good lanes lie in, the rows contiguous, the bad ones
        exactly those ≥ N. None otherwise (or when rows are not the outer of the last two
        dims, where rows past the end cannot be told from columns)."""
        nd = len(r.shape)
        if nd < 2 or not r.nested:
            return None
        st_row, st_col = r.strides[-2], r.strides[-1]
        n_rows, n_cols = r.shape[-2], r.shape[-1]
        if st_col < 1 or st_row < st_col * n_cols:
            return None
        inside = r.contains(lanes)
        if not inside.any():
            return None
        anchor = [int(i[0]) for i in r.index_of(lanes[inside][:1])[0]][:nd - 2]
        base = r.base + r.itemsize * sum(i * st for i, st in zip(anchor, r.strides))
        offset = lanes.astype(np.int64) - base
        if (offset < 0).any() or (offset % r.itemsize).any():
            return None
        rem = offset // r.itemsize
        row, within = rem // st_row, rem % st_row
        col = within // st_col
        if (within % st_col).any() or (col >= n_cols).any():
            return None
        rows = np.unique(row)
        bad_rows = np.unique(rem[np.isin(lanes, bad)] // st_row)
        if rows.max() - rows.min() + 1 != rows.size or not (rows.min() < n_rows <= rows.max()) \
                or bad_rows.min() < n_rows:
            return None
        first = int(np.flatnonzero(np.isin(lanes, bad[:1]))[0])
        idx = (*anchor, int(row[first]), int(col[first]))
        slice_name = (f" in head {anchor[0]}" if nd == 3 else
                      f" in (batch {anchor[0]}, head {anchor[1]})" if nd == 4 else
                      f" at leading index {tuple(anchor)}" if anchor else "")
        op = "tl.store" if write else "tl.load"
        where = (f"run past the end of `{r.name}` (its last row is {n_rows - 1})" if nd == 2 else
                 f"run past the last row ({n_rows - 1}) of `{r.name}`{slice_name}: rows "
                 f"{n_rows}–{int(rows.max())} lie in the next slice or past the end of the tensor")
        return (f"`{r.name}` {tuple(r.shape)} at index {idx} (dim {nd - 2} index {idx[-2]} ≥ its "
                f"size {n_rows})",
                f"this tile's rows {int(rows.min())}–{int(rows.max())} {where}. The {op} of a tile "
                f"needs a mask on its rows (mask=offs_m[:, None] < n"
                f"{'' if write else ', other=0.0'})",
                dict(tensor=r.name, index=idx, kind="past the end"))


def _coverage_line(guard, name: str, view: torch.Tensor) -> str:
    """``"\n  evidence: <what each program stored>"`` from the guard of the launch (interpreter
    only; empty on a GPU, where nothing is recorded)."""
    if guard is None or not _runtime().interpreted:
        return ""
    return f"\n  evidence: {guard.coverage(name, view)}"


def _strides_nest(strides: tuple, shape: tuple) -> bool:
    """Whether every offset has at most one index of ``shape`` under ``strides`` (each stride
    steps over everything the smaller ones reach); otherwise "these offsets fit those strides"
    is true of almost any offsets and is no evidence."""
    extent = 1
    for st, n in sorted((st, n) for st, n in zip(strides, shape) if n > 1):
        if st < extent:
            return False
        extent = st * n
    return True


def _grid_dims() -> tuple:
    """The running launch's grid in the interpreter (``()`` when unknown)."""
    from triton.runtime import interpreter as interp

    dims = getattr(interp.interpreter_builder, "grid_dim", None)
    return tuple(int(n) for n in dims) if dims else ()


def _swapped_program_ids_note(program: tuple, grid: tuple) -> str:
    """A line of evidence when the faulting program is the very first whose id along one axis
    reaches the grid's extent along another (every other id 0; programs run in order, so all
    before it ran clean): what a kernel reading one axis's index from the other's program_id
    does first. Empty otherwise. The caller asks only when every active lane of the access is
    out of bounds (a tile whose base is off, as with swapped ids; a missing mask leaves the
    tile's first lanes in bounds)."""
    if len(program) != len(grid):
        return ""
    for i, v in enumerate(program):
        others_zero = all(p == 0 for k, p in enumerate(program) if k != i)
        for j, extent in enumerate(grid):
            if j != i and extent > 1 and grid[i] > 1 and v == extent and others_zero:
                return (f"\n  also: program ({', '.join(map(str, program))}) is the first of the grid "
                        f"{tuple(grid)} whose program_id({i}) = {v} reaches the grid's extent along axis "
                        f"{j} ({extent}): a kernel that takes axis {j}'s index from program_id({i}) (the "
                        f"two program ids swapped) goes out of bounds first exactly here")
    return ""


_ACTIVE_GUARDS: list[MemoryGuard] = []


def active_guard() -> MemoryGuard | None:
    """The innermost :func:`memory_guard` in force (in the interpreter), or None."""
    return _ACTIVE_GUARDS[-1] if _ACTIVE_GUARDS else None


# How the guard names a load or store a tensor descriptor made (the interpreter turns it into a
# masked access whose mask is the descriptor's declared shape, not the tensor's)
DESCRIPTOR_LOAD, DESCRIPTOR_STORE = "descriptor load (desc.load)", "descriptor store (desc.store)"


def _guarded_builder_methods():
    """The interpreter builder's memory operations, wrapped to ask the active guard first."""
    from triton.runtime import interpreter as interp

    builder = interp.interpreter_builder
    original = {name: getattr(builder, name) for name in
                ("create_masked_load", "create_masked_store", "create_atomic_rmw",
                 "create_atomic_cas", "create_descriptor_load", "create_descriptor_store")
                if hasattr(builder, name)}
    through_descriptor = []  # non-empty while a descriptor's load/store runs (it masks by its shape)

    def pid():
        return builder.grid_idx or (0, 0, 0)

    def masked_load(ptrs, mask, other, *rest, **options):
        op = DESCRIPTOR_LOAD if through_descriptor else "tl.load"
        _ACTIVE_GUARDS[-1].check(op, ptrs.data, mask.data, False, pid())
        return original["create_masked_load"](ptrs, mask, other, *rest, **options)

    def masked_store(ptrs, value, mask, *rest, **options):
        op = DESCRIPTOR_STORE if through_descriptor else "tl.store"
        _ACTIVE_GUARDS[-1].check(op, ptrs.data, mask.data, True, pid())
        return original["create_masked_store"](ptrs, value, mask, *rest, **options)

    def by_descriptor(name):
        def run(*args, **options):
            through_descriptor.append(name)
            try:
                return original[name](*args, **options)
            finally:
                through_descriptor.pop()
        return run

    def atomic_rmw(op, ptr, val, mask, *rest, **options):
        _ACTIVE_GUARDS[-1].check("atomic", ptr.data, mask.data, True, pid())
        return original["create_atomic_rmw"](op, ptr, val, mask, *rest, **options)

    def atomic_cas(ptr, cmp, val, *rest, **options):
        _ACTIVE_GUARDS[-1].check("tl.atomic_cas", ptr.data, None, True, pid())
        return original["create_atomic_cas"](ptr, cmp, val, *rest, **options)

    wrapped = {"create_masked_load": masked_load, "create_masked_store": masked_store,
               "create_atomic_rmw": atomic_rmw, "create_atomic_cas": atomic_cas}
    wrapped.update({name: by_descriptor(name) for name in
                    ("create_descriptor_load", "create_descriptor_store") if name in original})
    return builder, original, wrapped


@contextlib.contextmanager
def memory_guard():
    """Check every load, store and atomic of kernels launched inside the block, in Triton's
    interpreter, against the tensors registered with ``guard.allow(name, tensor, write=...)``,
    before the access: a lane outside them raises :class:`MemoryViolation` (which tensor, which
    program, which offset, what the offset suggests) instead of reading stray memory or
    corrupting the process. Reads of stray memory fail even when their values would be
    discarded. On a GPU the block runs unchecked (the guarded buffers' margins catch what they
    can there)."""
    from course_lib.platform import runtime

    guard = MemoryGuard()
    if not runtime.current().interpreted:
        yield guard
        return
    builder, original, wrapped = _guarded_builder_methods()
    outer = not _ACTIVE_GUARDS
    _ACTIVE_GUARDS.append(guard)
    if outer:
        for name, fn in wrapped.items():
            setattr(builder, name, fn)
    try:
        yield guard
    except Exception as exc:  # Triton wraps it in an InterpreterError: hand on the guard's own
        violation = next((e for e in exception_chain(exc) if isinstance(e, MemoryViolation)), None)
        if violation is None or violation is exc:
            raise
        raise violation from None
    finally:
        _ACTIVE_GUARDS.pop()
        if outer:
            for name in wrapped:
                if name in vars(builder):
                    delattr(builder, name)


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
        names = self._input_names(len(inputs))
        with warnings.catch_warnings(), memory_guard() as guard:  # NumPy overflow warnings: we diagnose
            self.last_guard = guard
            warnings.simplefilter("ignore", RuntimeWarning)
            for name, view in zip(names, views):
                guard.allow(name, view)
            for spec, (view, _) in zip(self.outputs, outs):
                guard.allow(spec.name, view, write=True)
            self.launch(*views, *(v for v, _ in outs))
        if device.type == "cuda":
            torch.cuda.synchronize()
        for name, (_, buffer), before in zip(names, embedded, pristine):
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
                                    f"{first}) — {self.coverage_hint}"
                                    + _coverage_line(getattr(self, "last_guard", None),
                                                     spec.name, view))
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
            if cause:
                raise KernelProblem("your kernel returns NaN or inf although every input is "
                                    f"finite — likely cause: {cause}")
            # no cause singled out: hand the outputs on, so that the check compares them and
            # traces the first invalid operation to the kernel's line (checks.trace_nonfinite)
        return results[0] if len(results) == 1 else tuple(results)


# ----------------------------------------------------------------------------------------------
# Checking a kernel exercise


def check_kernel(exercise: str, answer, run: Callable, reference: Callable,
                 cases: Sequence[Case], *, fallback, mistakes: dict | None = None,
                 tolerance: tuple[float, float] | None = None,
                 time_limit: float | None = None, locate: Callable | None = None,
                 output_names: Sequence[str] | None = None, features=None):
    """Check a kernel exercise and return what the notebook should go on with.

    Args:
        exercise: the id shown to the learner, e.g. ``"Exercise 5.1"``.
        answer: the learner's kernel (or kernels); returned when they pass.
        run: ``run(*case.args)`` runs the learner's answer (through a :class:`GuardedRun`).
        reference: the correct outputs for a case's args.
        cases: inputs to try, irregular sizes first-class.
        fallback: returned when the exercise is not done yet (the library's kernel).
        mistakes: ``{"likely cause": fn}`` as in :func:`course_lib.teaching.checks.check_function`.
        time_limit: seconds per case; default :data:`KERNEL_TIME_LIMIT_S` (read at call time).
        locate: ``locate(index) -> text`` names what owns an output index (e.g. its tile); the
            diagnosis shows it under the first index it quotes.
        output_names: the names of the kernel's outputs, for messages (default: those of
            ``run.outputs`` when ``run`` is a :class:`LayoutRun`).
        features: as in :func:`course_lib.teaching.checks.check_function` (the differential diagnosis).

    Raises:
        ExerciseFailed: with a short diagnosis when the kernel is wrong, fails to compile or
            run, writes out of bounds, or runs past ``time_limit``.
    """
    problem: list[str] = []
    cases = list(cases)
    current: list[str] = []  # the case in hand, as the diagnosis names it
    faulted: list[bool] = []  # a kernel error outside the guard on a GPU: later cases unrun
    if output_names is None and getattr(run, "outputs", None):
        output_names = [getattr(o, "name", f"output {i}") for i, o in enumerate(run.outputs)]

    def describe(args, kwargs):
        for n, case in enumerate(cases, 1):
            if len(case.args) == len(args) and all(a is b for a, b in zip(case.args, args)):
                return f"case {n} of {len(cases)}, {case.describe()}"
        return Case(args, kwargs).describe()

    @functools.wraps(reference)  # its argument names name the inputs in the diagnosis
    def tracked_reference(*args, **kwargs):
        # check_function calls the reference on a case's own tensors just before it runs the
        # learner's answer on copies of them (which identity cannot match to a case)
        current[:] = [describe(args, kwargs)]
        return reference(*args, **kwargs)

    def attempt(*args, **kwargs):
        if faulted:  # a GPU that faulted may fail every launch after: no evidence from them
            raise checks.NoEvidence()
        try:
            return run(*args, **kwargs)
        except KernelProblem as exc:
            problem.append(f"{exc}\n  on {current[0]}")
            raise
        except Exception as exc:  # noqa: BLE001 - any learner error becomes a diagnosis
            chain = exception_chain(exc)
            for e in chain:  # a time limit hit inside the interpreter: let checks report it;
                # NumPy's first invalid operation (checks.trace_nonfinite's re-run) goes on to it
                if isinstance(e, (checks.TimeLimitExceeded, FloatingPointError)):
                    raise e from None
            violation = next((e for e in chain if isinstance(e, KernelProblem)), None)
            if violation is not None:  # raised inside the kernel (the memory guard)
                problem.append(f"{violation}\n  on {current[0]}")
                raise KernelProblem(problem[-1]) from None
            if is_not_done(exc):
                raise NotImplementedError(exercise) from None
            problem.append(f"your kernel failed on {current[0]}"
                           f"\n  {summarize_kernel_error(exc)}")
            if not _runtime().interpreted:
                faulted.append(True)
            raise KernelProblem(problem[-1]) from None
        # SystemExit and KeyboardInterrupt (BaseException, not Exception: Triton's interpreter
        # does not wrap them) go on to check_function, which diagnoses them

    output = checks.CapturedOutput()
    try:
        result = checks.check_function(exercise, attempt, tracked_reference, cases,
                                       fallback=fallback, tolerance=tolerance, mistakes=mistakes,
                                       time_limit=time_limit or KERNEL_TIME_LIMIT_S,
                                       subject="your kernel", output=output,
                                       output_names=output_names, features=features)
    except ExerciseFailed as failed:
        message = str(failed)
        if problem and "wrong answer on case" not in message.split("\n")[0]:
            # the kernel crashed or broke a guard: its diagnosis, not check_function's, with
            # what the other cases showed
            message = "\n".join([f"✗ {exercise}: {problem[0]}", *failed.evidence,
                                  *output.excerpt("your kernel")])
        raise _carrying(checks.failed_with(exercise, _with_location(message, locate)),
                        failed) from None
    return answer if result is attempt else result


def _carrying(exc: ExerciseFailed, source: ExerciseFailed) -> ExerciseFailed:
    """``exc`` with the evidence of ``source`` (check_function's), for checks that rewrite it."""
    for name in ("evidence", "outcomes", "output_names", "headline", "experiments"):
        setattr(exc, name, getattr(source, name, None))
    return exc


_INDEX = re.compile(r"first (?:bad element )?at index \(([\d, ]+)\)")


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
# Guarded runs on varied layouts (chapters 05 and 06)
#
# A kernel exercise's contract says "any strides": each tensor of a case is placed in its own
# guarded buffer with its own layout (row-major with gaps between rows, column-major, heads
# interleaved with rows, ...), so that a kernel that uses one tensor's stride for another, or
# assumes a dense layout, is wrong on some case. The memory guard of :mod:`kernel_checks` checks
# every access in the interpreter; what a run observes (an access outside the tensors, elements
# never written, NaN and the operation that made it first) becomes the diagnosis, and after a
# wrong answer :func:`layout_experiments` reruns the case with one tensor's layout at a time to
# find whose strides the kernel gets wrong.


@dataclass(frozen=True)
class Layout:
    """Where a tensor lies in its guarded buffer.

    ``order`` lists the tensor's dims from the outermost in memory to the innermost (``(1, 0)``
    is a column-major matrix); ``pad`` is the extra size of each buffer dim, in that order (a pad
    on the innermost dim leaves gaps between rows, on the outermost one room past the end).
    """

    order: tuple
    pad: tuple

    @classmethod
    def dense(cls, ndim: int) -> "Layout":
        return cls(tuple(range(ndim)), (0,) * ndim)

    def strides(self, shape) -> tuple:
        """The element strides a tensor of ``shape`` gets in this layout."""
        return tuple(place(torch.empty(shape), self, 0.0)[0].stride())


def place(x: torch.Tensor, layout: "Layout | None", fill: float):
    """``(view, buffer)``: a copy of ``x`` laid out as ``layout`` in a buffer filled with ``fill``
    (default layout: dense row-major)."""
    if layout is None:  # dense row-major, with as much room again past the end (strides are
        # unchanged): a store or load past the end lands in the margin, where it shows on a GPU
        layout = Layout(tuple(range(x.ndim)), (max(1, x.shape[0]),) + (0,) * (x.ndim - 1)) \
            if x.ndim else Layout.dense(0)
    view, buffer = embed(x.permute(layout.order), layout.pad, fill)
    inverse = sorted(range(x.ndim), key=lambda d: layout.order[d])
    return view.permute(inverse), buffer


class LayoutCase(Case):
    """A :class:`Case` whose ``layouts`` kwarg the diagnosis leaves out (its label says them)."""

    def describe(self) -> str:
        hidden = Case(self.args, {k: v for k, v in (self.kwargs or {}).items() if k != "layouts"},
                      self.label)
        return hidden.describe()


@dataclass
class Out:
    """An output the check allocates: its name, ``shape_dtype(*inputs, **params)`` and
    ``locate(index) -> text`` (which program owns an element), used when elements stay unwritten."""

    name: str
    shape_dtype: Callable
    locate: Callable | None = None


_GUARD_LINE = re.compile(r"would (read|write) (\d+) of its (\d+) active lane")
_GUARD_PROGRAM = re.compile(r"in program id \(([\d, ]*)\)")
_GUARD_LANE = re.compile(r"first bad lane: `([^`]+)` \(([\d, ]*)\) at index \(([\d, ]*)\)")


def guard_evidence(message: str) -> dict | None:
    """What a :class:`MemoryViolation` message says, as fields: ``op`` (read or
    write), ``bad`` and ``lanes`` (counts), ``tensor``, ``shape``, ``index``, ``program`` (the
    program id, a tuple); None when the message has none of them (e.g. a store into an input)."""
    line, lane = _GUARD_LINE.search(message), _GUARD_LANE.search(message)
    if not (line and lane):
        return None
    ints = lambda text: tuple(int(v) for v in text.split(",") if v.strip())  # noqa: E731
    program = _GUARD_PROGRAM.search(message)
    return {"op": line.group(1), "bad": int(line.group(2)), "lanes": int(line.group(3)),
            "tensor": lane.group(1), "shape": ints(lane.group(2)), "index": ints(lane.group(3)),
            "program": ints(program.group(1)) if program else ()}


def _first_fp_error(exc: BaseException) -> str | None:
    """'overflow encountered in exp at line 12: `e = tl.exp(x)`' from the FloatingPointError in
    ``exc``'s chain (NumPy raising inside Triton's interpreter), or None."""
    for e in exception_chain(exc):
        if isinstance(e, FloatingPointError):
            frame = checks.learner_frame(e)
            where = f" at line {frame.lineno}: `{(frame.line or '').strip()}`" if frame else ""
            return f"{e}{where}"
    return None


@dataclass
class LayoutRun:
    """Run a kernel on guarded copies of a case's inputs, each in the layout the case gives it.

    ``launch(*input_views, *output_views, **params)`` launches the learner's kernel. Called as
    ``run(*inputs, layouts=(...), **params)``: ``layouts`` has one :class:`Layout` (or None) per
    input and then per output. Returns the outputs as they are, NaN included: check_function
    compares them and the mistake models explain them. Raises :class:`KernelProblem` for what
    only the run can see: an access outside the tensors (the guard, with ``guard_hint``'s line),
    a store into an input, elements never written, a NaN that came from outside the inputs (GPU).
    """

    launch: Callable
    names: Sequence[str]
    outputs: Sequence[Out]
    # guard_hint(evidence dict, params) -> extra line or None; params hold the launch's keyword
    # parameters and, under "inputs", the inputs as the check made them
    guard_hint: Callable | None = None
    nonfinite: dict = field(default_factory=dict)  # call number -> the first FP error seen
    calls: int = 0

    def launch_guarded(self, inputs, layouts, fill, params, trace=False):
        layouts = tuple(layouts or ()) + (None,) * (len(inputs) + len(self.outputs))
        placed = [place(x, lay, fill) for x, lay in zip(inputs, layouts)]
        pristine = [buffer.clone() for _, buffer in placed]
        outs = []
        for spec, lay in zip(self.outputs, layouts[len(inputs):]):
            shape, dtype = spec.shape_dtype(*inputs, **params)
            view, buffer = place(torch.empty(shape, dtype=dtype, device=inputs[0].device), lay,
                                 OUTPUT_SENTINEL)
            view.fill_(OUTPUT_SENTINEL)
            outs.append((view, buffer))
        errstate = (np.errstate(over="raise", divide="raise", invalid="raise", under="ignore")
                    if trace else contextlib.nullcontext())
        with warnings.catch_warnings(), errstate, memory_guard() as guard:
            self.last_guard = guard
            warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's overflow warnings
            for name, (view, _) in zip(self.names, placed):
                guard.allow(name, view)
            for spec, (view, _) in zip(self.outputs, outs):
                guard.allow(spec.name, view, write=True)
            try:
                self.launch(*(v for v, _ in placed), *(v for v, _ in outs), **params)
            except Exception as exc:  # noqa: BLE001 - the guard's diagnosis, with this chapter's hint
                violation = next((e for e in exception_chain(exc)
                                  if isinstance(e, MemoryViolation)), None)
                if violation is None:
                    raise
                hint = self.guard_hint and self.guard_hint(guard_evidence(str(violation)),
                                                           {**params, "inputs": inputs})
                raise violation.extended(hint) from None
        if inputs[0].device.type == "cuda":
            torch.cuda.synchronize()
        for name, (_, buffer), before in zip(self.names, placed, pristine):
            if not checks.same_value(before, buffer):
                raise KernelProblem(f"your kernel wrote into its input `{name}` — inputs are "
                                    f"read-only: tl.store only to the output pointer(s) (two "
                                    f"pointer arguments swapped?)")
        return outs

    def __call__(self, *inputs, layouts=None, **params):
        self.calls += 1
        outs = self.launch_guarded(inputs, layouts, INPUT_MARGIN_FILL, params)
        results = []
        for spec, (view, buffer) in zip(self.outputs, outs):
            sentinel = torch.tensor(OUTPUT_SENTINEL, dtype=buffer.dtype, device=buffer.device)
            outside = int((buffer != sentinel).sum()) - int((view != sentinel).sum())
            if outside:  # (on a GPU; in the interpreter the guard stops such a store first)
                raise KernelProblem(f"your kernel wrote {outside} value(s) outside {spec.name} "
                                    f"{tuple(view.shape)}: a tl.store without a mask, or with a "
                                    f"wrong offset or stride")
            unwritten = view == sentinel
            if unwritten.any():
                first = tuple(int(i) for i in torch.nonzero(unwritten)[0])
                where = f"\n  {spec.locate(first, **params)}" if spec.locate else ""
                raise KernelProblem(f"{int(unwritten.sum())} of the {view.numel()} elements of "
                                    f"{spec.name} {tuple(view.shape)} were never written; the "
                                    f"first at index {first}{where}"
                                    + _coverage_line(getattr(self, "last_guard", None), spec.name,
                                                     view))
            results.append(view.clone())
        if any(not torch.isfinite(r).all() for r in results) and all(
                torch.isfinite(x).all() for x in inputs):
            again = [v for v, _ in self.launch_guarded(inputs, layouts, INPUT_MARGIN_REFILL, params)]
            if all(torch.isfinite(r).all() for r in again):  # (on a GPU: the guard is off there)
                raise KernelProblem("the output depends on memory outside the inputs (their "
                                    "margins hold NaN, and NaN came out): a tl.load without a "
                                    "mask, or with a wrong offset or stride")
            if _runtime().interpreted:
                try:
                    self.launch_guarded(inputs, layouts, INPUT_MARGIN_REFILL, params, trace=True)
                except Exception as exc:  # noqa: BLE001 - evidence only
                    error = _first_fp_error(exc)
                    if error:
                        self.nonfinite[self.calls] = error
        return results[0] if len(results) == 1 else tuple(results)


def with_evidence(message: str, run: LayoutRun) -> str:
    """``message`` with the first floating-point error the run saw on the case it shows."""
    found = re.search(r"wrong answer on case (\d+)", message)
    error = found and run.nonfinite.get(int(found.group(1)))
    if not error or "the first invalid operation NumPy saw" in message:  # said once is enough
        return message
    lines = message.splitlines()
    at = next((i for i, line in enumerate(lines) if "NaN/inf" in line), 2)
    lines.insert(at + 1, f"  the first invalid operation NumPy saw in your kernel on that case: "
                         f"{error}")
    return "\n".join(lines)


def dense_case(case: Case) -> Case | None:
    """``case`` with every tensor dense and row-major, or None when it has no layouts."""
    kwargs = dict(case.kwargs or {})
    layouts = tuple(kwargs.get("layouts") or ())
    if not any(layouts):
        return None
    return LayoutCase(case.args, {**kwargs, "layouts": tuple(None for _ in layouts)})


def layout_experiments(correct: Callable, case: Case, names: Sequence[str],
                       dense_right: bool | None = None) -> str | None:
    """Which tensors' layouts a wrong answer depends on, found by rerunning ``case``.

    ``correct(case) -> bool`` runs the learner's kernel (False when it fails in any way). The
    case is rerun with every tensor dense and row-major, then with one tensor at a time in the
    case's own layout. Returns a line naming the tensors whose own layout alone makes the
    answer wrong, or None when the answer is wrong on dense tensors too (not a layout problem).
    ``dense_right``: the dense run's outcome when the caller already knows it.
    """
    kwargs = dict(case.kwargs or {})
    layouts = tuple(kwargs.get("layouts") or ())
    dense = dense_case(case)
    if dense is None:
        return None
    if not (correct(dense) if dense_right is None else dense_right):
        return None
    culprits = []
    for i, lay in enumerate(layouts):
        if lay is None:
            continue
        alone = tuple(lay if j == i else None for j in range(len(layouts)))
        if not correct(LayoutCase(case.args, {**kwargs, "layouts": alone})):
            shape = case.args[i].shape if i < len(case.args) else None
            strides = lay.strides(shape) if shape is not None else None
            culprits.append(f"`{names[i]}`" + (f" (strides {strides})" if strides else ""))
            faulted = getattr(correct, "faulted", None)
            if faulted and faulted != names[i] and len(layouts) > 1:
                # another tensor goes out of bounds when only this one's layout changes
                return (f"your kernel is right when every tensor is dense and row-major; with "
                        f"only {culprits[-1]} in this case's layout it goes out of bounds on "
                        f"`{faulted}`, whose layout did not change: `{faulted}`'s offsets use "
                        f"`{names[i]}`'s strides (at least one of them) — use `{faulted}`'s own")
    if not culprits:
        return ("your kernel is right when every tensor is dense and row-major, and when any one "
                "of them has this case's layout, but not with all of them: a stride of one "
                "tensor is used for another")
    return (f"your kernel is right when every tensor is dense and row-major, and wrong when only "
            f"{' or '.join(culprits)} has this case's layout: look at how the kernel steps "
            f"through {'that tensor' if len(culprits) == 1 else 'those tensors'} — each offset "
            f"times that tensor's own stride for that dim")


def _quietly(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its prints swallowed and a time limit."""
    import io

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        return checks.call_with_time_limit(fn, args, kwargs, KERNEL_TIME_LIMIT_S)


def _insert_before_tail(lines: list[str], line: str) -> list[str]:
    """``lines`` with ``line`` before the "(also wrong on ...)" and printed-output lines."""
    at = next((i for i, text in enumerate(lines) if i and (text.startswith("  (also wrong")
                                                            or text.startswith("  your kernel printed"))),
              len(lines))
    return lines[:at] + [line] + lines[at:]


def layout_features(case: Case, names: Sequence[str]) -> dict:
    """The features of a case's layouts (its ``layouts`` kwarg, one per tensor of ``names``)
    for the differential diagnosis: which tensors have their dims permuted in memory, gaps
    inside them, or a column stride other than 1."""
    feats = {}
    for name, lay in zip(names, (case.kwargs or {}).get("layouts") or ()):
        if lay is None:
            continue
        ndim = len(lay.order)
        inner = lay.order[1:]  # the pad of the outermost dim in memory only adds room past the end
        feats[f"the dims of `{name}` permuted in memory"] = tuple(lay.order) != tuple(range(ndim))
        feats[f"gaps between the rows or heads of `{name}`"] = any(
            p for d, p in zip(lay.order, lay.pad) if d in inner)
        feats[f"a column stride of `{name}` other than 1"] = ndim >= 2 and lay.order[-1] != ndim - 1
    return feats


LAYOUT_FEATURE = re.compile(r"(permuted in memory|gaps between the rows or heads|a column stride "
                            r"of `[^`]+` other than 1)")


def _with_layout_features(cases: Sequence[Case], names: Sequence[str]) -> list[Case]:
    out = []
    for case in cases:
        found = {**layout_features(case, names), **(case.features or {})}
        copy = type(case)(case.args, case.kwargs, case.label) if isinstance(case, LayoutCase) \
            else Case(case.args, case.kwargs, case.label)
        copy.features = found
        out.append(copy)
    return out


def check_layout_kernel(exercise: str, answer, run: LayoutRun, reference: Callable,
                        cases: Sequence[Case], *, fallback, mistakes: dict, names: Sequence[str],
                        tolerance=None, locate: Callable | None = None,
                        output_names: Sequence[str] | None = None, features=None):
    """:func:`check_kernel` on cases whose kwargs give layouts and launch
    parameters; adds the evidence of the run (the first invalid floating-point operation) and
    of :func:`layout_experiments` to a failure's diagnosis, and the layouts to the features of
    the differential diagnosis (:func:`layout_features`). ``reference`` and the mistake
    models take the case's kwargs (``layouts=`` included; they may ignore it)."""
    cases = _with_layout_features(cases, names)
    try:
        return check_kernel(exercise, answer, run, reference, cases, fallback=fallback,
                            mistakes=mistakes, tolerance=tolerance, output_names=output_names,
                            features=features)
    except ExerciseFailed as failed:
        message = with_evidence(str(failed), run)
        lines = message.splitlines()
        if locate is not None:  # which program owns the first bad element of the output
            for i, line in enumerate(lines):
                found = re.search(r"first bad element at index \(([\d, ]+)\)", line)
                if found:
                    index = tuple(int(v) for v in found.group(1).split(",") if v.strip())
                    case = cases[int(re.search(r"case (\d+)", lines[0]).group(1)) - 1]
                    lines.insert(i + 1, f"  {locate(index, **(case.kwargs or {}))}")
                    break
        found = re.search(r"on case (\d+) of", message)
        skip = ("stopped after", "sys.exit", "KeyboardInterrupt", "likely cause", "two known mistakes")
        if found:
            case = cases[int(found.group(1)) - 1]

            def correct(c: Case) -> bool:
                correct.faulted = None  # the tensor a memory violation of this run names
                try:
                    kwargs = dict(c.kwargs or {})
                    got = _quietly(run, *checks._copy_value(tuple(c.args)), **kwargs)
                    atol, rtol = tolerance or checks._default_tolerance(
                        want := reference(*c.args, **kwargs))
                    return checks.compare(got, want, atol, rtol) is None
                except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure is "not right"
                    violation = next((e for e in exception_chain(exc)
                                      if isinstance(e, MemoryViolation)), None)
                    correct.faulted = violation and violation.tensor
                    return False

            dense_right = None
            if failed.outcomes and dense_case(case) is not None and any(
                    LAYOUT_FEATURE.search(x) for x in lines if x.startswith("  evidence: ")):
                # a contrast that names a layout is evidence only if the layout matters: the
                # same case on dense tensors says whether it does
                dense_right = correct(dense_case(case))
                if not dense_right:
                    lines = _without_layout_evidence(lines, failed)
            if not any(x in message for x in skip):
                line = layout_experiments(correct, case, names, dense_right)
                if line:  # the layout explains it: drop the guess about masks
                    lines = _insert_before_tail([x for x in lines if not x.startswith("  hint: ")],
                                                f"  {line}")
        raise checks.failed_with(exercise, "\n".join(lines)) from None


def _without_layout_evidence(lines: list[str], failed: ExerciseFailed) -> list[str]:
    """``lines`` with the evidence lines recomputed from features that leave the layouts out."""
    from course_lib.teaching import diagnosis

    outcomes = [diagnosis.Outcome(o.n, {k: v for k, v in o.features.items()
                                        if not LAYOUT_FEATURE.search(k)},
                                  o.status, o.got, o.want, o.tolerance, o.inputs)
                for o in failed.outcomes]
    fresh = diagnosis.diagnose(outcomes, failed.output_names, failed.headline, failed.experiments)
    at = next((i for i, x in enumerate(lines) if x.startswith("  evidence: ")), None)
    kept = [x for x in lines if not x.startswith("  evidence: ")]
    return kept if at is None else kept[:at] + fresh + kept[at:]


def _params(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k != "layouts"}
