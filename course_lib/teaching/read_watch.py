"""The read watcher: which elements of its NumPy inputs a learner's function loads, in order, and from
which of the learner's lines.

A check hands the learner's function :class:`Watched` arrays (:func:`watch`) instead of its inputs.
Each looks like an ``ndarray`` and records every load into a :class:`LoadLog`: an operation that
copies or computes with values loads what it touches; a slice is a view that loads nothing until its
values are used, and then holds them, like a tile in SRAM; shapes and dtypes load nothing. Chapter 04
states the rules for the learner (``ch04.LOAD_RULES``) and judges the log against the FlashAttention
loop orders; chapter 07 uses the same log to see which tiles a backward computes. The grader runs the
learner's function in the notebook's process and judges in its own: :func:`watched_call` (sent by
name) returns the log as data, :meth:`LoadLog.from_data` reads it back and :func:`missing_loads`
tells a record that cannot be the function's own.
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import warnings
from dataclasses import dataclass

import numpy as np

from course_lib.teaching import checks


@dataclass
class Touch:
    """One operation's use of an input: which rows, how many elements it loaded (the rest were
    already held by the slice, or came from the learner's own copy), and the learner's line."""

    name: str
    rows: np.ndarray  # sorted row numbers (along N) that the operation used
    loaded: int  # elements loaded from the input by this operation
    kind: str  # "load", "reuse" (a slice used again) or "copy" (the learner's copy of it)
    whole: bool  # the operation used every element of the input
    where: tuple | None  # (filename, line number) in the learner's code
    op: int = 0  # the NumPy operation it was part of (touches of one product share it)


class LoadLog:
    """The loads one call of the learner's function makes from its inputs, in order."""

    def __init__(self, inputs: dict):
        self.shapes = {name: x.shape for name, x in inputs.items()}
        self.counts = {name: np.zeros(x.size, dtype=np.int64) for name, x in inputs.items()}
        self.touches: list[Touch] = []
        self.op = 0  # counts operations on watched arrays (the touches of one product share it)
        self.grouping = False  # True while one NumPy operation touches its inputs

    @contextlib.contextmanager
    def operation(self):
        """The touches made inside the block belong to one operation (e.g. both sides of a
        product); any touch outside such a block is an operation of its own."""
        self.op += 1
        self.grouping = True
        try:
            yield
        finally:
            self.grouping = False

    def record(self, name: str, ids: np.ndarray, new: np.ndarray, kind: str) -> None:
        n, d = self.shapes[name][-2:]
        self.counts[name][new] += 1
        if not self.grouping:
            self.op += 1
        self.touches.append(Touch(name, np.unique((ids // d) % n), int(new.size), kind,
                                   ids.size == self.counts[name].size, learner_line(), self.op))

    def loads_per_row(self, name: str) -> np.ndarray:
        """(N,) the most times any element of each row was loaded."""
        n, d = self.shapes[name][-2:]
        return self.counts[name].reshape(-1, n, d).max(axis=(0, 2))

    def as_data(self) -> dict:
        """The record as plain data (names, numbers, arrays; each touch's line with its text): what
        the learner's process hands the check (:func:`watched_call`)."""
        def where(w):
            return None if w is None else (w[0], w[1], linecache.getline(w[0], w[1]))
        return {"shapes": {name: tuple(shape) for name, shape in self.shapes.items()},
                "counts": dict(self.counts),
                "touches": [(t.name, t.rows, t.loaded, t.kind, t.whole, where(t.where), t.op)
                            for t in self.touches]}

    @classmethod
    def from_data(cls, data, shapes: dict) -> "LoadLog":
        """The record :meth:`as_data` made, for inputs of ``shapes`` ({name: shape}, as the check
        made them); ValueError when it is not one (the grader reads it from the learner's
        process, which could send anything)."""
        def bad(what):
            return ValueError(f"the record of your function's loads is malformed: {what}")

        if not (isinstance(data, dict) and isinstance(data.get("counts"), dict)
                and isinstance(data.get("touches"), list)):
            raise bad("not a record")
        if data.get("shapes") != {name: tuple(shape) for name, shape in shapes.items()}:
            raise bad("the inputs' shapes differ")
        log = cls({name: np.empty(shape, dtype=np.int8) for name, shape in shapes.items()})
        for name, counts in log.counts.items():
            got = data["counts"].get(name)
            if not (isinstance(got, np.ndarray) and got.shape == counts.shape
                    and got.dtype.kind in "iu" and (got >= 0).all()):
                raise bad(f"the counts of {name}")
            log.counts[name] = got.astype(np.int64)
        kinds = ("load", "reuse", "copy")
        for touch in data["touches"]:
            if not (isinstance(touch, tuple) and len(touch) == 7):
                raise bad("a touch")
            name, rows, loaded, kind, whole, where, op = touch
            if not (name in shapes and isinstance(rows, np.ndarray) and rows.ndim == 1
                    and rows.dtype.kind in "iu" and ((rows >= 0) & (rows < shapes[name][-2])).all()
                    and isinstance(loaded, int) and loaded >= 0 and kind in kinds
                    and isinstance(whole, bool) and isinstance(op, int)
                    and (where is None or (isinstance(where, tuple) and len(where) == 3
                                           and isinstance(where[0], str) and isinstance(where[1], int)
                                           and isinstance(where[2], str)))):
                raise bad("a touch")
            log.touches.append(Touch(name, rows, loaded, kind, whole, where, op))
        for name in shapes:  # every load a touch made is in the counts, and no other
            if sum(t.loaded for t in log.touches if t.name == name) != int(log.counts[name].sum()):
                raise bad(f"the loads of {name} do not add up")
        return log


def learner_line():
    """(filename, line number) of the innermost frame of the learner's code on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if not checks.is_library_frame(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


def line_text(where) -> str:
    if where is None:
        return "a line outside your code"
    text = (where[2] if len(where) > 2 else linecache.getline(where[0], where[1])).strip()
    return f"line {where[1]}: `{text}`" if text else f"line {where[1]}"


# NumPy functions that return a view (the result stays watched, nothing is loaded), that only
# read the metadata (nothing is loaded), or that copy (loads; the result is the learner's copy)
VIEW_FUNCTIONS = {np.swapaxes, np.transpose, np.moveaxis, np.reshape, np.expand_dims,
                   np.squeeze, np.ravel, np.broadcast_to, np.rollaxis,
                   *(getattr(np, f) for f in ("matrix_transpose", "permute_dims")
                     if hasattr(np, f))}
METADATA_FUNCTIONS = {np.shape, np.ndim, np.size, np.result_type, np.empty_like, np.zeros_like,
                       np.ones_like, np.full_like, np.iscomplexobj, np.isrealobj}
COPY_FUNCTIONS = {np.copy}


def numpy_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, with any warning NumPy gives (overflow, invalid value) told at
    the learner's line, not inside the watched array that passed the call on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    where = learner_line()
    for w in caught:
        if where is None:
            warnings.warn(w.message, w.category, stacklevel=3)
        else:
            warnings.warn_explicit(w.message, w.category, where[0], where[1])
    return result


def is_basic_index(key) -> bool:
    items = key if isinstance(key, tuple) else (key,)
    return all(i is None or i is Ellipsis or isinstance(i, slice)
               or (isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)))
               for i in items)


def plain(x, touch: bool = True):
    """``x`` with every Watched inside (through tuples, lists and dicts) replaced by its values;
    ``touch``: as a use of all of them (a load, unless they are held or the learner's copy)."""
    if isinstance(x, Watched):
        if touch:
            x._touch(x._ids)
        return x._data
    if isinstance(x, tuple):
        return tuple(plain(e, touch) for e in x)
    if isinstance(x, list):
        return [plain(e, touch) for e in x]
    if isinstance(x, dict):
        return {key: plain(e, touch) for key, e in x.items()}
    return x


class Watched(np.lib.mixins.NDArrayOperatorsMixin):
    """An input of the learner's forward (or a view of it, or the learner's copy of it) that
    records which of its elements are loaded (chapter 04 states the rules: ``ch04.LOAD_RULES``).

    It is not an ndarray, so that every way of reading its values goes through it (NumPy calls
    ``__array__`` to copy it into another array, ``__array_ufunc__`` for arithmetic,
    ``__array_function__`` for its functions); ``isinstance(x, np.ndarray)`` still holds, as for
    the array the learner expects. ``_ids`` holds, for each element, its flat position in the
    input; ``_memory`` (a slice's) which of them the slice already holds (None: a whole input,
    which holds nothing); ``_copy``: the learner's copy (using it loads nothing).
    """

    def __init__(self, data, ids, log: LoadLog, name: str, memory=None, copy=False):
        self._data, self._ids, self._log, self._name = data, ids, log, name
        self._memory, self._copy = memory, copy

    @property
    def __class__(self):  # isinstance(x, np.ndarray) is True, as for a plain input
        return np.ndarray

    # ---- what loads nothing
    shape = property(lambda self: self._data.shape)
    dtype = property(lambda self: self._data.dtype)
    ndim = property(lambda self: self._data.ndim)
    size = property(lambda self: self._data.size)
    itemsize = property(lambda self: self._data.itemsize)
    nbytes = property(lambda self: self._data.nbytes)
    strides = property(lambda self: self._data.strides)
    flags = property(lambda self: self._data.flags)

    def __len__(self):
        return len(self._data)

    def __repr__(self):  # printing is not a load
        return repr(self._data)

    def __str__(self):
        return str(self._data)

    def __format__(self, spec):
        return format(self._data, spec)

    # ---- views: watched, nothing loaded
    def _view(self, data, ids, indexed: bool = False) -> "Watched":
        memory = self._memory
        if indexed and not self._copy and memory is None \
                and np.unique(ids).size < self._log.counts[self._name].size:
            memory = np.zeros(self._log.counts[self._name].size, dtype=bool)  # a new slice
        return Watched(data, ids, self._log, self._name, memory, self._copy)

    T = property(lambda self: self._view(self._data.T, self._ids.T))
    mT = property(lambda self: self._view(np.swapaxes(self._data, -1, -2),
                                          np.swapaxes(self._ids, -1, -2)))
    real = property(lambda self: self)

    def swapaxes(self, *axes):
        return self._view(self._data.swapaxes(*axes), self._ids.swapaxes(*axes))

    def transpose(self, *axes):
        return self._view(self._data.transpose(*axes), self._ids.transpose(*axes))

    def reshape(self, *shape, **kwargs):
        return self._view(self._data.reshape(*shape, **kwargs),
                          self._ids.reshape(*shape, **kwargs))

    def squeeze(self, *args, **kwargs):
        return self._view(self._data.squeeze(*args, **kwargs),
                          self._ids.squeeze(*args, **kwargs))

    def ravel(self, *args, **kwargs):
        return self._view(self._data.ravel(*args, **kwargs), self._ids.ravel(*args, **kwargs))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, key):
        key = plain(key)
        if is_basic_index(key):
            data = self._data[key]
            if not isinstance(data, np.ndarray):  # one element: keep it a (0-d) view
                items = key if isinstance(key, tuple) else (key,)
                if any(i is Ellipsis for i in items):
                    self._touch(np.asarray(self._ids[key]).reshape(-1))
                    return data
                key = items + (Ellipsis,)
                data = self._data[key]
            return self._view(data, self._ids[key], indexed=True)
        ids = self._ids[key]  # fancy indexing copies: a load, and the learner's copy
        self._touch(ids)
        return Watched(self._data[key], ids, self._log, self._name, copy=True)

    # ---- what loads
    def _touch(self, ids) -> None:
        ids = np.unique(np.asarray(ids).reshape(-1))
        if self._copy:
            new, kind = ids[:0], "copy"
        elif self._memory is None:
            new, kind = ids, "load"
        else:
            new = ids[~self._memory[ids]]
            self._memory[new] = True
            kind = "load" if new.size else "reuse"
        self._log.record(self._name, ids, new, kind)

    def __setitem__(self, key, value):  # writes into the input: the check reports it
        self._data[plain(key)] = plain(value)

    def __array__(self, dtype=None, copy=None):
        self._touch(self._ids)
        data = self._data if dtype is None else self._data.astype(dtype, copy=False)
        return data.copy() if copy else data

    def _learner_copy(self, data) -> "Watched":
        self._touch(self._ids)
        return Watched(data, self._ids.copy(), self._log, self._name, copy=True)

    def astype(self, dtype, *args, **kwargs):
        return self._learner_copy(self._data.astype(dtype, *args, **kwargs))

    def copy(self, *args, **kwargs):
        return self._learner_copy(self._data.copy(*args, **kwargs))

    def flatten(self, *args, **kwargs):
        self._touch(self._ids)
        return Watched(self._data.flatten(*args, **kwargs), self._ids.flatten(*args, **kwargs),
                        self._log, self._name, copy=True)

    def __float__(self):
        self._touch(self._ids)
        return float(self._data)

    def __int__(self):
        self._touch(self._ids)
        return int(self._data)

    def __bool__(self):
        self._touch(self._ids)
        return bool(self._data)

    def __getattr__(self, name):  # any other ndarray method (max, sum, dot, ...) uses all of it
        if name.startswith("__") or name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self._data, name)
        if not callable(attr):
            return attr

        def method(*args, **kwargs):
            with self._log.operation():
                self._touch(self._ids)
                args, kwargs = plain(args), plain(kwargs)
            return numpy_call(attr, *args, **kwargs)
        return method

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        watched = [x for x in inputs if isinstance(x, Watched)]
        out = kwargs.get("out")
        out_watched = out[0] if out and isinstance(out[0], Watched) else None
        if out is not None:
            kwargs["out"] = tuple(plain(o, touch=False) for o in out)
        with self._log.operation():
            inputs, kwargs = plain(inputs), plain(kwargs)
        result = numpy_call(getattr(ufunc, method), *inputs, **kwargs)
        if out_watched is not None:
            return out_watched
        # an element-wise operation on one watched array (q * scale): the learner's copy of it
        if method == "__call__" and ufunc.signature is None and ufunc.nout == 1 \
                and len(watched) == 1 and out is None and isinstance(result, np.ndarray) \
                and result.shape == watched[0].shape:
            w = watched[0]
            return Watched(result, np.array(w._ids), w._log, w._name, copy=True)
        return result

    def __array_function__(self, func, types, args, kwargs):
        if func in METADATA_FUNCTIONS:
            return func(*plain(args, touch=False), **plain(kwargs, touch=False))
        if func in VIEW_FUNCTIONS and args and isinstance(args[0], Watched):
            w = args[0]
            rest, kw = plain(args[1:], touch=False), plain(kwargs, touch=False)
            return w._view(func(w._data, *rest, **kw), func(w._ids, *rest, **kw))
        if func in COPY_FUNCTIONS and args and isinstance(args[0], Watched):
            return args[0]._learner_copy(func(args[0]._data, *args[1:], **kwargs))
        with self._log.operation():
            args, kwargs = plain(args), plain(kwargs)
        return numpy_call(func, *args, **kwargs)


def watch(inputs: dict) -> tuple[LoadLog, list[Watched]]:
    """Watched versions of the named arrays, and the log they record into."""
    log = LoadLog(inputs)
    return log, [Watched(x, np.arange(x.size).reshape(x.shape), log, name)
                 for name, x in inputs.items()]


def watched_call(fn, names: tuple, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its first ``len(names)`` arguments watched (named ``names``):
    ``(what fn returned, with plain arrays where it returned watched ones, the record of its
    loads as data)`` (:meth:`LoadLog.as_data`). A check reads the record back with
    :meth:`LoadLog.from_data`; the grader runs this in the notebook's process, by name
    (``grade_channel.run_with``), and judges the record in its own."""
    log, watched = watch(dict(zip(names, args)))
    out = fn(*watched, *args[len(names):], **kwargs)
    out = type(out)(plain(e, touch=False) for e in out) if isinstance(out, (tuple, list)) \
        else plain(out, touch=False)
    return out, log.as_data()


def missing_loads(log: LoadLog, n_q: int, causal: bool) -> list[str]:
    """Lines naming the first input whose record shows no load of an element the outputs need
    (every query row; every key row when not causal, keys 0 .. N_q - 1 when causal), or [] when
    none. A function that returns the right numbers loads them all, so only a record that was not
    the function's own (one sent back from the notebook's process in its place) leaves one out."""
    for name, shape in log.shapes.items():
        needed = shape[-2] if name == "q" or not causal else min(shape[-2], n_q)
        per_row = log.counts[name].reshape(-1, *shape[-2:]).min(axis=(0, 2))  # (N,)
        unread = np.flatnonzero(per_row[:needed] == 0)
        if unread.size:
            return [f"  no load of row {int(unread[0])} of {name} in the record of your "
                    f"function's loads, though the right numbers it returned need it: the record "
                    f"is not the one your function made"]
    return []
