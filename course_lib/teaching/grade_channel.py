"""The grader's channel to a learner's notebook process: data only, both ways.

``python -m course_lib.teaching.grade`` runs each notebook in a process of its own (sandboxed where the
machine allows, :mod:`course_lib.teaching.sandbox`) and runs the checks in its own process. A check is
handed *proxies* for the learner's answers: calling a :class:`FunctionProxy` (or launching a
:class:`KernelProxy` with ``kernel[grid](...)``) sends the arguments to the notebook's process,
which calls the learner's object there (:func:`serve`, run by the grader through the kernel's
execute channel) and sends the results back. Whatever the learner's process does — patch the
checks, forge a report, print a ✓ — all the grader receives is numbers.

The wire format (:func:`encode`, :func:`decode`) is JSON for the structure plus raw bytes for
arrays and tensors: decoding parses JSON and copies bytes into fresh arrays, and never imports or
calls anything named by the data (no pickle). It carries ``None``, ``bool``, ``int``, ``float``,
``complex``, ``str``, ``bytes``, tuples, lists, dicts, slices, NumPy arrays and scalars of
numeric dtypes (with their strides), torch tensors (their whole storage, so views keep their
strides, offsets and the margins around them; tensors that share a storage still share it),
torch dtypes, devices and sizes, and — from the grader only — a function of the course's library,
by its name (a check hands 11.2's answer the library's ``attend``: the notebook's process looks it
up in its own copy of the library). Anything else the learner's code returns arrives as an
:class:`Opaque` stand-in (a wrong answer, never code).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import io
import json
import keyword
import linecache
import os
import queue
import re
import secrets
import stat
import struct
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

MAGIC = b"CGC1"  # the first bytes of every message: a file that lacks them is not one
HEADER = struct.Struct("<4sQ")  # magic, length of the JSON part
# The largest message either side reads: far above what any check case needs (a few MB), far
# below what would let a learner's answer exhaust the grader's memory.
MAX_MESSAGE_BYTES = 256 * 2**20
MAX_DEPTH = 32  # nesting of tuples/lists/dicts in one value
MAX_ITEMS = 100_000  # values in one message
# What the learner's code printed during one call that is sent back (the check keeps less).
MAX_PRINTED_CHARS = 16_384
# How long the notebook's process has to answer a request that runs no learner code.
SERVICE_TIMEOUT_S = 60.0
# After an interrupt (a check's time limit), how long the process has to stop before it is killed.
INTERRUPT_GRACE_S = 10.0
POLL_S = 0.25  # how often a waiting grader looks whether the notebook's process is still alive
NUMERIC_DTYPE = re.compile(r"^[<>|=][biufc]\d{1,2}$")
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")


class ChannelError(Exception):
    """A message could not be encoded or decoded; the text says what was wrong."""


class NotIsolable(BaseException):
    """The check used an answer in a way the channel cannot carry (an argument that is not
    data, an attribute of a kernel, ...): the exercise cannot be graded outside the notebook. A
    BaseException, so that no check turns it into an ordinary diagnosis."""


class LearnerProcessGone(BaseException):
    """The notebook's process died, was killed or stopped answering while a check ran."""


class Opaque:
    """What the learner's code returned that is not data (a function, a module, ...): it
    compares equal to nothing, and its repr says what it was."""

    def __init__(self, type_name: str, callable_: bool = False):
        self.type_name, self.callable = type_name, callable_

    def __repr__(self) -> str:
        return f"<{self.type_name} object from the notebook (not data)>"


# ----------------------------------------------------------------------------------------------
# Encoding: a value -> (JSON tree, buffers)


def _torch():
    return sys.modules.get("torch")


def _raw_bytes(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n) if n else b""


class _Encoder:
    def __init__(self, strict: bool):
        self.strict = strict  # True: a value that is not data raises (the grader's inputs)
        self.buffers: list[bytes] = []
        self.storages: dict[tuple, int] = {}
        self.items = 0

    def buffer(self, data: bytes) -> int:
        self.buffers.append(data)
        return len(self.buffers) - 1

    def value(self, x: Any, depth: int = 0) -> Any:
        self.items += 1
        if self.items > MAX_ITEMS or depth > MAX_DEPTH:
            raise ChannelError(f"the value is too large or nested too deeply (over {MAX_ITEMS} "
                               f"items or {MAX_DEPTH} levels)")
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return {"t": "int", "v": str(int(x))} if abs(x) >= 2**53 else int(x)
        if isinstance(x, float):
            return {"t": "float", "v": repr(float(x))}
        if isinstance(x, complex):
            return {"t": "complex", "re": repr(x.real), "im": repr(x.imag)}
        if isinstance(x, bytes):
            return {"t": "bytes", "buf": self.buffer(bytes(x))}
        torch = _torch()
        if torch is not None:
            if isinstance(x, torch.Tensor):
                return self.tensor(x)
            if isinstance(x, torch.dtype):
                return {"t": "tdtype", "name": str(x).replace("torch.", "")}
            if isinstance(x, torch.device):
                return {"t": "tdevice", "name": str(x)}
            if isinstance(x, torch.Size):
                return {"t": "tsize", "items": [int(n) for n in x]}
        if isinstance(x, np.ndarray):
            return self.array(x)
        if isinstance(x, np.generic) and NUMERIC_DTYPE.match(x.dtype.str):
            return {"t": "npscalar", "dtype": x.dtype.str, "buf": self.buffer(x.tobytes())}
        if isinstance(x, tuple):
            return {"t": "tuple", "items": [self.value(e, depth + 1) for e in x]}
        if isinstance(x, list):
            return {"t": "list", "items": [self.value(e, depth + 1) for e in x]}
        if isinstance(x, dict):
            return {"t": "dict", "items": [[self.value(k, depth + 1), self.value(v, depth + 1)]
                                           for k, v in x.items()]}
        if isinstance(x, slice):
            return {"t": "slice", "items": [self.value(e, depth + 1)
                                            for e in (x.start, x.stop, x.step)]}
        named = library_function_name(x) if self.strict else None  # the grader's side only
        if named is not None:
            return {"t": "libfn", "module": named[0], "name": named[1]}
        if self.strict:
            raise ChannelError(f"a {type(x).__module__}.{type(x).__qualname__} is not data")
        return {"t": "opaque", "type": f"{type(x).__module__}.{type(x).__qualname__}"[:200],
                "callable": callable(x)}

    def array(self, x: np.ndarray) -> Any:
        if not NUMERIC_DTYPE.match(x.dtype.str):
            if self.strict:
                raise ChannelError(f"a NumPy array of dtype {x.dtype} is not numeric data")
            return {"t": "opaque", "type": f"numpy.ndarray of {x.dtype}"[:200], "callable": False}
        shape, strides = list(x.shape), list(x.strides)
        if x.size == 0:
            return {"t": "nd", "dtype": x.dtype.str, "shape": shape,
                    "strides": [0] * len(shape), "offset": 0, "buf": self.buffer(b"")}
        # the bytes the view spans, from its lowest to its highest element (strides kept)
        low = sum((n - 1) * st for n, st in zip(shape, strides) if st < 0)
        high = sum((n - 1) * st for n, st in zip(shape, strides) if st > 0) + x.itemsize
        start = x.__array_interface__["data"][0] + low
        return {"t": "nd", "dtype": x.dtype.str, "shape": shape, "strides": strides,
                "offset": -low, "buf": self.buffer(_raw_bytes(start, high - low))}

    def tensor(self, x) -> Any:
        torch = _torch()
        if x.layout != torch.strided or x.is_quantized or x.device.type == "meta":
            if self.strict:
                raise ChannelError(f"a {x.layout} tensor is not plain data")
            return {"t": "opaque", "type": f"torch.Tensor ({x.layout})", "callable": False}
        x = x.detach()
        if x.is_conj() or x.is_neg():
            x = x.resolve_conj().resolve_neg()
        storage = x.untyped_storage()
        key = (str(x.device), storage.data_ptr(), storage.nbytes())
        if key not in self.storages or not storage.nbytes():
            raw = torch.empty(0, dtype=torch.uint8, device=x.device).set_(storage)
            self.storages[key] = self.buffer(raw.cpu().numpy().tobytes())
        return {"t": "tensor", "dtype": str(x.dtype).replace("torch.", ""),
                "shape": list(x.shape), "stride": list(x.stride()),
                "offset": x.storage_offset(), "storage": self.storages[key],
                "device": str(x.device), "grad": bool(x.requires_grad)}


def encode(value: Any, *, strict: bool = True) -> bytes:
    """One message holding ``value``.

    Args:
        value: data (see the module docstring).
        strict: raise :class:`ChannelError` on anything that is not data (the grader's side);
            False: encode it as an :class:`Opaque` stand-in (the notebook's side).

    Returns:
        The bytes: magic, JSON length, JSON, buffers.
    """
    enc = _Encoder(strict)
    tree = enc.value(value)
    offsets, at = [], 0
    for b in enc.buffers:
        offsets.append([at, len(b)])
        at += len(b)
    head = json.dumps({"value": tree, "buffers": offsets}, allow_nan=False).encode()
    data = b"".join([HEADER.pack(MAGIC, len(head)), head, *enc.buffers])
    if len(data) > MAX_MESSAGE_BYTES:
        raise ChannelError(f"the message is {len(data)} bytes, over the limit of "
                           f"{MAX_MESSAGE_BYTES}")
    return data


# ----------------------------------------------------------------------------------------------
# Decoding: bytes -> value, building only arrays, tensors and plain Python values


class _Decoder:
    def __init__(self, data: bytes, body: int, buffers: list, library_functions: bool = False):
        self.data, self.body, self.library_functions = data, body, library_functions
        if not isinstance(buffers, list):
            raise ChannelError("malformed message: no buffer table")
        self.spans = []
        for span in buffers:
            if not (isinstance(span, list) and len(span) == 2 and all(_is_int(v) and v >= 0
                                                                       for v in span)):
                raise ChannelError("malformed message: a bad buffer entry")
            if body + span[0] + span[1] > len(data):
                raise ChannelError("malformed message: a buffer runs past the end")
            self.spans.append(span)
        self.storages: dict[tuple, Any] = {}
        self.items = 0

    def buffer(self, index: Any) -> memoryview:
        if not _is_int(index) or not 0 <= index < len(self.spans):
            raise ChannelError("malformed message: a bad buffer index")
        start, n = self.spans[index]
        return memoryview(self.data)[self.body + start:self.body + start + n]

    def value(self, node: Any, depth: int = 0) -> Any:
        self.items += 1
        if self.items > MAX_ITEMS or depth > MAX_DEPTH:
            raise ChannelError("malformed message: too many items or levels")
        if node is None or isinstance(node, (bool, str)):
            return node
        if _is_int(node):
            return node
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise ChannelError("malformed message: an unknown node")
        kind = node["t"]
        if kind == "int":
            return int(_text(node.get("v"), 400))
        if kind == "float":
            return float(_text(node.get("v"), 40))
        if kind == "complex":
            return complex(float(_text(node.get("re"), 40)), float(_text(node.get("im"), 40)))
        if kind == "bytes":
            return bytes(self.buffer(node.get("buf")))
        if kind in ("tuple", "list", "tsize", "slice"):
            items = node.get("items")
            if not isinstance(items, list):
                raise ChannelError("malformed message: a sequence without items")
            values = [self.value(e, depth + 1) for e in items]
            if kind == "tuple":
                return tuple(values)
            if kind == "list":
                return values
            if kind == "slice":
                if len(values) != 3 or not all(v is None or _is_int(v) for v in values):
                    raise ChannelError("malformed message: a bad slice")
                return slice(*values)
            if not all(_is_int(v) for v in values):
                raise ChannelError("malformed message: a bad torch.Size")
            return self.torch().Size(values)
        if kind == "dict":
            items = node.get("items")
            if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2
                                                      for p in items):
                raise ChannelError("malformed message: a bad dict")
            out = {}
            for k, v in items:
                key = self.value(k, depth + 1)
                try:
                    hash(key)
                except TypeError:
                    raise ChannelError("malformed message: a dict key that is not hashable") \
                        from None
                out[key] = self.value(v, depth + 1)
            return out
        if kind == "nd":
            return self.array(node)
        if kind == "npscalar":
            dtype = _numeric_dtype(node.get("dtype"))
            raw = self.buffer(node.get("buf"))
            if len(raw) != dtype.itemsize:
                raise ChannelError("malformed message: a bad NumPy scalar")
            return np.frombuffer(bytes(raw), dtype=dtype)[0]
        if kind == "tensor":
            return self.tensor(node)
        if kind == "tdtype":
            return self.dtype(node.get("name"))
        if kind == "tdevice":
            return self.torch().device(_text(node.get("name"), 40))
        if kind == "opaque":
            return Opaque(_text(node.get("type"), 200), bool(node.get("callable")))
        if kind == "libfn" and self.library_functions:
            return resolve_library_function(node.get("module"), node.get("name"))
        raise ChannelError(f"malformed message: an unknown kind of node {kind[:40]!r}")

    def torch(self):
        torch = _torch()
        if torch is None:
            import torch  # noqa: F811 - a tensor arrived: torch is needed to build it
        return torch

    def dtype(self, name: Any):
        torch = self.torch()
        value = getattr(torch, _text(name, 40), None) if IDENTIFIER.match(str(name)) else None
        if not isinstance(value, torch.dtype):
            raise ChannelError("malformed message: an unknown torch dtype")
        return value

    def array(self, node: dict) -> np.ndarray:
        dtype = _numeric_dtype(node.get("dtype"))
        shape, strides, offset = node.get("shape"), node.get("strides"), node.get("offset")
        if not (_int_list(shape) and _int_list(strides) and len(shape) == len(strides)
                and _is_int(offset) and all(n >= 0 for n in shape)):
            raise ChannelError("malformed message: a bad array header")
        raw = bytearray(self.buffer(node.get("buf")))
        if 0 in shape:
            return np.zeros(shape, dtype=dtype)
        low = offset + sum((n - 1) * st for n, st in zip(shape, strides) if st < 0)
        high = offset + sum((n - 1) * st for n, st in zip(shape, strides) if st > 0) + dtype.itemsize
        if low < 0 or high > len(raw):
            raise ChannelError("malformed message: an array runs outside its buffer")
        return np.ndarray(tuple(shape), dtype=dtype, buffer=raw, offset=offset,
                          strides=tuple(strides))

    def tensor(self, node: dict):
        torch = self.torch()
        dtype = self.dtype(node.get("dtype"))
        shape, stride, offset = node.get("shape"), node.get("stride"), node.get("offset")
        if not (_int_list(shape) and _int_list(stride) and len(shape) == len(stride)
                and _is_int(offset) and offset >= 0 and all(n >= 0 for n in shape)
                and all(s >= 0 for s in stride)):
            raise ChannelError("malformed message: a bad tensor header")
        device = torch.device(_text(node.get("device"), 40))
        key = (node.get("storage"), str(device))
        if key not in self.storages:
            raw = bytearray(self.buffer(node.get("storage")))
            base = torch.frombuffer(raw, dtype=torch.uint8) if raw else \
                torch.empty(0, dtype=torch.uint8)
            self.storages[key] = base.to(device).untyped_storage()
        storage = self.storages[key]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if 0 not in shape:
            last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
            if (last + 1) * itemsize > storage.nbytes():
                raise ChannelError("malformed message: a tensor runs outside its storage")
        out = torch.empty(0, dtype=dtype, device=device)
        out.set_(storage, offset if 0 not in shape else 0, tuple(shape), tuple(stride))
        if node.get("grad") is True and (out.is_floating_point() or out.is_complex()):
            out.requires_grad_(True)
        return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_DEPTH and all(_is_int(e) for e in v)


def _text(v: Any, limit: int) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise ChannelError("malformed message: a bad text field")
    return v


def _numeric_dtype(text: Any) -> np.dtype:
    if not isinstance(text, str) or not NUMERIC_DTYPE.match(text):
        raise ChannelError("malformed message: not a numeric dtype")
    return np.dtype(text)


def decode(data: bytes, *, library_functions: bool = False) -> Any:
    """The value in a message made by :func:`encode`; raises :class:`ChannelError` when the
    bytes are not one (nothing named by the data is imported or called).

    ``library_functions``: True only in the notebook's process, decoding the grader's requests: a
    function of the course's library the check passes (11.2's ``attend``) arrives by name and is
    looked up there (:func:`resolve_library_function`). The grader decodes the learner's answers
    with False: a name of a function is then malformed data, never looked up."""
    if len(data) < HEADER.size or len(data) > MAX_MESSAGE_BYTES:
        raise ChannelError("not a message: too short or too long")
    magic, n = HEADER.unpack_from(data)
    if magic != MAGIC or HEADER.size + n > len(data):
        raise ChannelError("not a message: a bad header")
    try:
        head = json.loads(data[HEADER.size:HEADER.size + n].decode("utf-8"))
    except (ValueError, RecursionError):
        raise ChannelError("not a message: its structure is not valid JSON") from None
    if not isinstance(head, dict) or "value" not in head:
        raise ChannelError("not a message: no value")
    try:
        return _Decoder(data, HEADER.size + n, head.get("buffers"), library_functions).value(head["value"])
    except RecursionError:
        raise ChannelError("malformed message: nested too deeply") from None
    except (ValueError, TypeError, OverflowError, RuntimeError) as exc:
        raise ChannelError(f"malformed message: {type(exc).__name__}") from None


def read_message(path: Path, *, library_functions: bool = False) -> Any:
    """Decode the message in the file ``path``: a regular file (not a link, a pipe or a device)
    of at most :data:`MAX_MESSAGE_BYTES` (``library_functions``: as :func:`decode`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ChannelError(f"no answer file ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ChannelError("the answer file is not a regular file")
        if info.st_size > MAX_MESSAGE_BYTES:
            raise ChannelError(f"the answer is {info.st_size} bytes, over the limit of "
                               f"{MAX_MESSAGE_BYTES}")
        chunks, left = [], MAX_MESSAGE_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    return decode(b"".join(chunks), library_functions=library_functions)


MODULE_NAME = re.compile(r"^course_lib(\.[a-z_][a-z0-9_]{0,60}){0,4}$")


def library_function_name(x: Any) -> tuple[str, str] | None:
    """``(module, name)`` when ``x`` is a plain function defined at the top level of a module of
    the course's library (found again by that name), else None: what the grader may send by name."""
    if not inspect.isfunction(x):
        return None
    module, name = getattr(x, "__module__", None) or "", getattr(x, "__qualname__", "")
    if not (MODULE_NAME.match(module) and IDENTIFIER.match(name)):
        return None
    return (module, name) if getattr(sys.modules.get(module), name, None) is x else None


def resolve_library_function(module: Any, name: Any):
    """The library function ``module.name`` (:func:`library_function_name`), in this process."""
    import importlib

    if not (isinstance(module, str) and MODULE_NAME.match(module) and isinstance(name, str)
            and IDENTIFIER.match(name)):
        raise ChannelError("malformed message: a bad library function name")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        raise ChannelError(f"malformed message: no library module {module}") from None
    if not inspect.isfunction(found):
        raise ChannelError(f"malformed message: {module}.{name} is not a library function")
    return found


def write_message(path: Path, value: Any, *, strict: bool = True) -> None:
    """Write ``value`` as a message to a new file ``path`` (written aside, then renamed)."""
    data = encode(value, strict=strict)
    tmp = Path(f"{path}.part")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Exceptions: described on the notebook's side, rebuilt on the grader's


def describe_exception(exc: BaseException) -> list[dict]:
    """``exc`` and its causes (outermost first) as data: type, message, the innermost frame in
    the learner's code, for a Triton compilation error the line it points at and, for an
    exception of the course's checks, its evidence fields (a MemoryViolation's tensor, kind, ...:
    the diagnoses read them)."""
    from course_lib.teaching import checks

    chain, seen = [], set()
    while exc is not None and id(exc) not in seen and len(chain) < 8:
        seen.add(id(exc))
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if not checks.is_library_frame(f.filename)]
        entry = {"type": type(exc).__name__[:100], "module": type(exc).__module__[:200],
                 "message": str(exc)[:4000],
                 "builtin": type(exc).__module__ == "builtins",
                 "frame": ([frames[-1].filename[:400], frames[-1].lineno or 0,
                            (frames[-1].line or "")[:400]] if frames else None)}
        node, src = getattr(exc, "node", None), getattr(exc, "src", None)
        if node is not None and hasattr(node, "lineno") and isinstance(src, str):
            entry["compilation"] = {"lineno": int(node.lineno), "src": src[:100_000],
                                    "error_message": str(getattr(exc, "error_message", "")
                                                         or "")[:4000]}
        if (type(exc).__module__, type(exc).__name__) in _COURSE_EXCEPTIONS:
            entry["fields"] = {k: v for k, v in vars(exc).items() if _is_field(k, v)}
        chain.append(entry)
        exc = exc.__cause__ or exc.__context__
    return chain


# Exceptions of the course whose type a check tests (isinstance), rebuilt as themselves.
_COURSE_EXCEPTIONS = {("course_lib.teaching.kernel_checks", "MemoryViolation"),
                      ("course_lib.teaching.kernel_checks", "KernelProblem"),
                      ("course_lib.teaching.checks", "Diagnosed")}  # 7.6's named glue mistakes
_learner_types: dict[str, type] = {}


def _exception_type(entry: dict) -> type:
    import builtins

    name, module = str(entry.get("type")), str(entry.get("module"))
    if (module, name) in _COURSE_EXCEPTIONS:
        import importlib
        return getattr(importlib.import_module(module), name)
    found = getattr(builtins, name, None) if entry.get("builtin") else None
    if isinstance(found, type) and issubclass(found, BaseException) and \
            found not in (GeneratorExit, StopIteration, StopAsyncIteration):
        return found
    if not IDENTIFIER.match(name) or keyword.iskeyword(name):
        name = "LearnerError"
    if name not in _learner_types:  # named as in the notebook, raised as data
        _learner_types[name] = type(name, (Exception,), {"__module__": "learner"})
    return _learner_types[name]


def _is_field(name: Any, value: Any) -> bool:
    """Whether ``name = value`` is an evidence field that crosses with a course exception: a
    public name, and a number, a short text, a truth value, None or a short tuple of numbers."""
    if not (isinstance(name, str) and IDENTIFIER.match(name) and not name.startswith("_")):
        return False
    if isinstance(value, tuple):
        return len(value) <= MAX_DEPTH and all(_is_int(v) for v in value)
    return value is None or isinstance(value, (bool, int, float)) or (
        isinstance(value, str) and len(value) <= 400)


def rebuild_exception(chain: list) -> BaseException:
    """The exception :func:`describe_exception` described, raised here once so that its
    traceback holds the learner's line (the diagnoses quote it)."""
    if not isinstance(chain, list) or not chain or not all(isinstance(e, dict) for e in chain):
        return ChannelError("the notebook's process described an error badly")
    built = None
    for entry in reversed(chain):  # innermost first: each is the cause of the one outside it
        cls = _exception_type(entry)
        message = str(entry.get("message", ""))[:4000]
        try:
            exc = cls(message)
        except Exception:  # noqa: BLE001 - a builtin that wants other arguments
            exc = _exception_type({"type": entry.get("type")})(message)
        if isinstance(exc, SystemExit):
            exc.code = message or None
        fields = entry.get("fields")
        if (entry.get("module"), entry.get("type")) in _COURSE_EXCEPTIONS and isinstance(fields, dict):
            for name, value in fields.items():
                if _is_field(name, value):
                    setattr(exc, name, value)
        comp = entry.get("compilation")
        if isinstance(comp, dict) and _is_int(comp.get("lineno")):
            exc.node = type("Node", (), {"lineno": comp["lineno"]})()
            exc.src = str(comp.get("src", ""))
            exc.error_message = str(comp.get("error_message", ""))
        exc = _with_frame(exc, entry.get("frame"))
        exc.__cause__ = built
        built = exc
    return built


def _with_frame(exc: BaseException, frame: Any) -> BaseException:
    """``exc`` with a traceback whose innermost frame is the learner's line (file name, line
    number and text as the notebook's process saw them)."""
    if not (isinstance(frame, list) and len(frame) == 3 and isinstance(frame[0], str)
            and _is_int(frame[1]) and 0 < frame[1] < 1_000_000 and isinstance(frame[2], str)):
        return exc
    filename, lineno, line = frame
    # a name no real file has (the diagnoses quote only the line): the notebook cannot put
    # lines of its own into the grader's view of one of the grader's files
    filename = f"<notebook> {filename}"
    lines = [""] * (lineno - 1) + [line + "\n"]
    linecache.cache[filename] = (len(line), None, lines, filename)  # mtime None: kept
    code = compile("\n" * (lineno - 1) + "raise __exc", filename, "exec")
    try:
        exec(code, {"__exc": exc})  # noqa: S102 - fixed code; only the file name is the learner's
    except BaseException as raised:  # noqa: BLE001 - the exception itself, now with the frame
        return raised
    return exc


# ----------------------------------------------------------------------------------------------
# The notebook's side: answering the grader's requests (run in the learner's process)

_SNAPSHOT: dict[str, dict[str, Any]] = {}  # key (exercise) -> name -> the object as it was


class _Bounded(io.TextIOBase):
    """A text stream that keeps the first :data:`MAX_PRINTED_CHARS` characters written."""

    def __init__(self):
        self.parts, self.kept = [], 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        text = str(text)
        if self.kept < MAX_PRINTED_CHARS:
            self.parts.append(text[:MAX_PRINTED_CHARS - self.kept])
            self.kept += len(self.parts[-1])
        return len(text)

    def text(self) -> str:
        return "".join(self.parts)


def describe_object(obj: Any) -> dict:
    """What kind of answer ``obj`` is: "data", "function" (a callable), "kernel" (launched as
    ``kernel[grid](...)``) or "other" (a class, a module, ...), with its parameter names and
    whether it is the library's own code."""
    from course_lib.teaching import checks

    kind_module = type(obj).__module__.split(".")[0]
    library = bool(checks.is_library_object(obj)) if not _is_plain_data(obj) else False
    if _is_plain_data(obj):
        return {"kind": "data", "library": False}
    if inspect.isclass(obj) or inspect.ismodule(obj):
        return {"kind": "other", "type": type(obj).__name__, "library": library}
    if kind_module == "triton" or (hasattr(type(obj), "__getitem__") and not callable(obj)):
        return {"kind": "kernel", "library": library, "name": _name(obj)}
    if callable(obj):
        params = []
        try:
            for p in inspect.signature(obj).parameters.values():
                params.append([p.name, int(p.kind), p.default is not inspect.Parameter.empty])
        except (TypeError, ValueError):
            params = None
        return {"kind": "function", "library": library, "params": params, "name": _name(obj)}
    return {"kind": "other", "type": type(obj).__name__, "library": library}


def _name(obj: Any) -> str:
    name = getattr(obj, "__name__", None) or getattr(getattr(obj, "fn", None), "__name__", "")
    return name if isinstance(name, str) and IDENTIFIER.match(name) else "answer"


def _is_plain_data(obj: Any) -> bool:
    torch = _torch()
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, np.ndarray,
                                       np.generic)):
        return True
    if torch is not None and isinstance(obj, (torch.Tensor, torch.dtype, torch.device)):
        return True
    if isinstance(obj, (tuple, list)):
        return all(_is_plain_data(e) for e in obj)
    if isinstance(obj, dict):
        return all(_is_plain_data(v) for v in obj.values())
    return False


def serve(request_path: str) -> None:
    """Answer one request of the grader (run in the notebook's process, by the grader): read the
    request, do it, write the answer where the request says."""
    request = json.loads(Path(request_path).read_text(encoding="utf-8"))
    op, key, reply = request["op"], request["key"], Path(request["reply"])
    if op == "describe":
        namespace = _user_namespace()
        found = {name: namespace[name] for name in request["names"] if name in namespace}
        _SNAPSHOT[key] = found
        answer = {"objects": {name: describe_object(obj) for name, obj in found.items()},
                  "values": {name: obj for name, obj in found.items() if _is_plain_data(obj)}}
        write_message(reply, answer, strict=False)
        return
    name = request["name"]
    # several answers (6.1's update and finish) go to a library function together, as a tuple
    target = tuple(_SNAPSHOT[key][n] for n in name) if isinstance(name, list) else \
        _SNAPSHOT[key][name]
    grid, args, kwargs, allow, errstate, quiet = read_message(Path(request["input"]),
                                                              library_functions=True)
    printed = _Bounded()
    result, error = None, None
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed), \
                np.errstate(**errstate), warnings.catch_warnings():
            if quiet:  # as in the check's process (NumPy's overflow warnings in a kernel)
                warnings.simplefilter("ignore", RuntimeWarning)
            if op == "call":
                result = target(*args, **kwargs)
            elif op == "with":  # a library function of the check's, run here on the answer
                result = _run_with(target, args, kwargs, allow)
            else:
                result = _launch(target, grid, args, kwargs, allow)
    except BaseException as exc:  # noqa: BLE001 - the learner's error goes back as data
        error = describe_exception(exc)
    answer = {"result": result, "error": error, "args": args, "kwargs": kwargs,
              "printed": printed.text()}
    write_message(reply, answer, strict=False)


def _run_with(target, args: list, kwargs: dict, allow: list):
    """``args[0](target, *args[1:], **kwargs)``, where ``args[0]`` is a function of the course's
    library (it arrived by name, :func:`resolve_library_function`): what :func:`run_with` asks for.
    When the grader's check ran it under its memory guard (chapter 06's pieces launch the teaching
    kernel), it runs here under a guard allowing the same elements."""
    if not args or library_function_name(args[0]) is None:
        raise TypeError("the grader asked to run something that is not a library function")
    with _guarded(args, allow) if allow else contextlib.nullcontext():
        return args[0](target, *args[1:], **kwargs)


def _launch(kernel, grid, args, kwargs, allow):
    """``kernel[grid](*args, **kwargs)`` under the memory guard, allowing here the elements the
    grader's guard allowed (see :func:`_guard_allowances`)."""
    with _guarded(args, allow):
        return kernel[tuple(grid)](*args, **kwargs)


@contextlib.contextmanager
def _guarded(args: list, allow: list):
    """The memory guard (course_lib.teaching.kernel_checks), allowing the elements ``allow`` locates in the
    storages of ``args`` (:func:`_guard_allowances`)."""
    import torch

    from course_lib.teaching import kernel_checks

    with kernel_checks.memory_guard() as guard:
        for name, position, write, offset, shape, strides in allow:
            arg = args[position]
            view = torch.empty(0, dtype=arg.dtype, device=arg.device).set_(
                arg.untyped_storage(), offset, tuple(shape), tuple(strides))
            guard.allow(name, view, write=write)
        yield guard


def _user_namespace() -> dict:
    shell = sys.modules.get("IPython") and getattr(sys.modules["IPython"], "get_ipython", None)
    shell = shell() if shell else None
    return shell.user_ns if shell is not None else vars(sys.modules["__main__"])


# ----------------------------------------------------------------------------------------------
# The grader's side: one notebook process, its answers as proxies


class Session:
    """The grader's line to one notebook process.

    Args:
        client: a started blocking kernel client of the notebook's kernel.
        inbox: where the grader writes requests and inputs (read-only for the notebook).
        outbox: where the notebook's process writes its answers.
        alive: ``alive() -> bool``, whether the notebook's process still runs.
        kill: ``kill(reason)``, stop the notebook's process for good.
        time_limit: seconds any one request may take (the check's own limits are shorter).
    """

    def __init__(self, client, inbox: Path, outbox: Path, alive: Callable[[], bool],
                 kill: Callable[[str], None], time_limit: float):
        self.client, self.alive, self.kill = client, alive, kill
        self.inbox, self.outbox = Path(inbox), Path(outbox)
        self.time_limit = time_limit
        self.gone: str | None = None  # why the process is gone, once it is
        self.misuse: str | None = None  # how a check used an answer the channel cannot carry
        self.overtime: float | None = None  # the grader's limit per call, when a call ran into it

    def describe(self, key: str, names: list[str]) -> tuple[dict, dict]:
        """({name: description}, {name: value of a data answer}) of the names in the notebook's
        namespace now; names that are not defined are left out."""
        answer = self._request({"op": "describe", "key": key, "names": list(names)}, None,
                               SERVICE_TIMEOUT_S)
        if not isinstance(answer, dict) or not isinstance(answer.get("objects"), dict):
            raise ChannelError("the notebook's process answered the description badly")
        objects = {n: d for n, d in answer["objects"].items()
                   if n in names and isinstance(d, dict)}
        values = answer.get("values") if isinstance(answer.get("values"), dict) else {}
        return objects, values

    def call(self, op: str, key: str, name: str | list[str], grid, args: tuple, kwargs: dict,
             allow=()) -> dict:
        """Run the learner's ``name`` (call or launch; for "with", a list of names is the tuple of
        those answers) on ``args``; return the answer dict."""
        try:
            payload = encode((grid, list(args), dict(kwargs), list(allow),
                              {k: v for k, v in np.geterr().items()},
                              _runtime_warnings_ignored()))
        except ChannelError as exc:
            self.misuse = self.misuse or f"an argument the check passes cannot be sent ({exc})"
            raise NotIsolable(self.misuse) from None
        answer = self._request({"op": op, "key": key, "name": name}, payload, self.time_limit)
        if not isinstance(answer, dict) or "printed" not in answer:
            raise ChannelError("the notebook's process answered the call badly")
        return answer

    def _request(self, fields: dict, payload: bytes | None, time_limit: float) -> Any:
        if self.gone:
            raise LearnerProcessGone(self.gone)
        nonce = secrets.token_hex(8)
        request, reply = self.inbox / f"req-{nonce}.json", self.outbox / f"reply-{nonce}.bin"
        if payload is not None:
            fields["input"] = str(self.inbox / f"input-{nonce}.bin")
            Path(fields["input"]).write_bytes(payload)
        request.write_text(json.dumps({**fields, "reply": str(reply)}), encoding="utf-8")
        code = f"__import__('course_lib.teaching.grade_channel', fromlist=['serve']).serve({str(request)!r})"
        try:
            reply_msg = self._execute(code, time_limit)
            if reply_msg["content"].get("status") != "ok":
                content = reply_msg["content"]
                raise ChannelError(f"the notebook's process could not answer ("
                                   f"{str(content.get('ename', 'error'))[:100]}: "
                                   f"{str(content.get('evalue', ''))[:300]})")
            return read_message(reply)
        finally:
            for path in (request, reply, Path(fields.get("input", request))):
                with contextlib.suppress(OSError):
                    path.unlink()

    def _execute(self, code: str, time_limit: float) -> dict:
        msg_id = self.client.execute(code, silent=True, store_history=False, allow_stdin=False)
        try:
            return self._wait(msg_id, time.monotonic() + time_limit)
        except TimeoutError:  # the grader's own limit (shorter than the check's): as the check's
            self._stop(msg_id)
            if self.gone:
                raise LearnerProcessGone(self.gone) from None
            from course_lib.teaching import checks

            self.overtime = time_limit
            raise checks.TimeLimitExceeded() from None
        except LearnerProcessGone:
            raise
        except BaseException:  # a check's time limit (or Ctrl-C): stop the learner's code too
            self._stop(msg_id)
            raise

    def _wait(self, msg_id: str, deadline: float) -> dict:
        while True:
            try:
                msg = self.client.get_shell_msg(timeout=POLL_S)
            except queue.Empty:
                if not self.alive():
                    self.gone = "the Python process running the notebook died"
                    raise LearnerProcessGone(self.gone) from None
                if time.monotonic() > deadline:
                    raise TimeoutError from None
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return msg

    def _stop(self, msg_id: str) -> None:
        """Interrupt the learner's code; kill the process when it does not stop in time."""
        if self.gone:
            return
        try:
            self.client.control_channel.send(self.client.session.msg("interrupt_request", {}))
            self._wait(msg_id, time.monotonic() + INTERRUPT_GRACE_S)
        except (TimeoutError, LearnerProcessGone):
            self.gone = self.gone or (f"the notebook's process did not stop within "
                                      f"{INTERRUPT_GRACE_S:g} s of an interrupt and was killed")
            self.kill(self.gone)


def _write_back(target: Any, value: Any) -> None:
    """Copy what the learner's code left in an argument (changed in place, or a kernel's
    output) into the grader's own argument, where shapes and dtypes agree."""
    torch = _torch()
    if isinstance(target, np.ndarray) and isinstance(value, np.ndarray):
        if target.shape == value.shape and target.dtype == value.dtype and target.flags.writeable:
            np.copyto(target, value)
    elif torch is not None and isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
        src = torch.empty(0, dtype=torch.uint8, device=value.device).set_(value.untyped_storage())
        dst = torch.empty(0, dtype=torch.uint8, device=target.device).set_(target.untyped_storage())
        if src.numel() == dst.numel() and target.dtype == value.dtype:
            with torch.no_grad():
                dst.copy_(src.to(dst.device))
    elif isinstance(target, list) and isinstance(value, list):
        if len(target) == len(value) and all(_same_kind(a, b) for a, b in zip(target, value)):
            for a, b in zip(target, value):
                _write_back(a, b)
        else:
            target[:] = value
    elif isinstance(target, tuple) and isinstance(value, (tuple, list)) and len(target) == len(value):
        for a, b in zip(target, value):
            _write_back(a, b)
    elif isinstance(target, dict) and isinstance(value, dict):
        for k in target:
            if k in value:
                _write_back(target[k], value[k])


def _same_kind(a: Any, b: Any) -> bool:
    return type(a) is type(b) or (hasattr(a, "shape") and hasattr(b, "shape"))


def _answer(session: Session, answer: dict, args: tuple, kwargs: dict) -> Any:
    """Hand on what the learner's call left: prints, changed arguments, then its result or its
    error (rebuilt with the learner's line)."""
    printed = answer.get("printed")
    if isinstance(printed, str) and printed:
        sys.stdout.write(printed)
    if isinstance(answer.get("args"), list) and len(answer["args"]) == len(args):
        for target, value in zip(args, answer["args"]):  # each argument on its own: the first
            _write_back(target, value)                   # of run_with's is a function
    if isinstance(answer.get("kwargs"), dict):
        _write_back(kwargs, answer["kwargs"])
    if answer.get("error") is not None:
        raise rebuild_exception(answer["error"])
    return answer.get("result")


class _Proxy:
    """What every stand-in shares: the library's module (a check judges it only under
    ``checks.library_answers_allowed()``), and any attribute a check reads beyond the few the
    library's own tests of an answer read (``fn``, ``func``, ``kernel``: absent) means the
    exercise cannot be graded outside the notebook."""

    __module__ = __name__
    _what = "the answer"

    def __getattr__(self, attr: str):
        if attr.startswith("_") or attr in ("fn", "func", "kernel"):
            raise AttributeError(attr)
        return self._refuse(f"the check reads the attribute `{attr}` of {self._what}")

    def _refuse(self, why: str):
        self._session.misuse = self._session.misuse or why
        raise NotIsolable(self._session.misuse)


class FunctionProxy(_Proxy):
    """Stands in, in the grader's process, for a function of the learner's: calling it calls the
    learner's function in the notebook's process on copies of the arguments."""

    def __init__(self, session: Session, key: str, name: str, description: dict):
        self._session, self._key, self._name = session, key, name
        self.__name__ = self.__qualname__ = description.get("name") or name
        self.__signature__ = _signature(description.get("params"))

    def __call__(self, *args, **kwargs):
        answer = self._session.call("call", self._key, self._name, None, args, kwargs)
        return _answer(self._session, answer, args, kwargs)

    def __repr__(self) -> str:
        return f"<the learner's {self.__name__} in the notebook's process>"


class KernelProxy(_Proxy):
    """Stands in for a Triton kernel of the learner's: ``proxy[grid](*args, **kwargs)`` launches
    the learner's kernel in the notebook's process, under the memory guard with the tensors the
    check's guard allows, and copies every tensor argument's storage back (the outputs, and any
    store into an input or a margin the check looks for)."""

    _what = "the kernel"

    def __init__(self, session: Session, key: str, name: str, description: dict):
        self._session, self._key, self._name = session, key, name
        self.__name__ = self.__qualname__ = description.get("name") or name

    def __getitem__(self, grid):
        if callable(grid):
            self._refuse("the check launches the kernel with a grid function")

        def launch(*args, **kwargs):
            allow = _guard_allowances(args)
            answer = self._session.call("launch", self._key, self._name, list(grid), args,
                                        kwargs, allow)
            return _answer(self._session, answer, args, kwargs)
        return launch

    def __repr__(self) -> str:
        return f"<the learner's kernel {self.__name__} in the notebook's process>"


class OtherProxy(_Proxy):
    """Stands in for an answer that is neither data, a function nor a kernel (a class, ...):
    using it means the exercise cannot be graded outside the notebook, except through
    :func:`run_with` (a library function run on it in the notebook's process)."""

    def __init__(self, session: Session, type_name: str, key: str = "", name: str = ""):
        self._session, self._what = session, f"the answer (a {type_name})"
        self._key, self._name = key, name

    def __call__(self, *args, **kwargs):
        return self._refuse(f"{self._what} cannot cross to the grader")


def run_with(answer: Any, fn: Callable, *args, **kwargs) -> Any:
    """``fn(answer, *args, **kwargs)``, where ``fn`` is a top-level function of the course's library
    (:func:`library_function_name`). In the learner's own process (a check cell) that is the call
    itself; in the grader's, where ``answer`` is a proxy, ``fn`` is sent by name and run on the
    learner's object in the notebook's process, and only its result (data) comes back: how a check
    uses an answer that is not data (7.6's ``autograd.Function`` class, run through autograd).

    ``answer`` may be a tuple of answers (6.1's two ``@triton.jit`` helpers, which ``fn`` puts into
    one kernel): ``fn`` gets the tuple. Run under the check's memory guard, ``fn`` runs under one
    allowing the same elements there, and the tensors it is handed come back as it left them
    (a kernel's outputs, and any store into an input or a margin the check looks for)."""
    parts = answer if isinstance(answer, tuple) else (answer,)
    proxies = [a for a in parts if isinstance(a, _Proxy)]
    if not proxies:
        return fn(answer, *args, **kwargs)
    first = proxies[0]
    if len(proxies) != len(parts) or any(p._session is not first._session or p._key != first._key
                                         for p in proxies):
        return first._refuse("the check runs a library function on answers of which some are "
                             "not the notebook's")
    if library_function_name(fn) is None:
        return first._refuse(f"the check runs {getattr(fn, '__qualname__', fn)!r} on "
                             f"{first._what}, which is not a library function the grader can send")
    session = first._session
    names = [p._name for p in proxies] if isinstance(answer, tuple) else first._name
    sent = (fn, *args)
    answer_ = session.call("with", first._key, names, None, sent, kwargs, _guard_allowances(sent))
    return _answer(session, answer_, (None, *args), kwargs)


def _runtime_warnings_ignored() -> bool:
    """Whether a RuntimeWarning given now would be ignored: the checks ignore NumPy's overflow
    warnings around a kernel launch (they diagnose the NaN), and the notebook's process is told
    to do the same, or the warnings would show in the diagnosis as printed by the learner's code."""
    for action, message, category, module, _ in warnings.filters:
        if issubclass(RuntimeWarning, category) and message is None and module is None:
            return action == "ignore"
    return False


def _guard_allowances(args: tuple) -> list:
    """[(name, argument position, write, storage offset, shape, strides)]: each tensor the
    check's active memory guard (course_lib.teaching.kernel_checks) allows, located in the storage of a
    launch argument (the kernel may be handed another view of it, e.g. with its dims permuted),
    so that the notebook's side can allow exactly the same elements."""
    guards = getattr(sys.modules.get("course_lib.teaching.kernel_checks"), "_ACTIVE_GUARDS", None)
    if not guards:
        return []
    torch = _torch()
    allow = []
    for region in guards[-1].regions:
        for position, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor) or arg.element_size() != region.itemsize:
                continue
            start = arg.untyped_storage().data_ptr()
            if region.storage == (start, start + arg.untyped_storage().nbytes()):
                offset, rest = divmod(region.base - start, region.itemsize)
                if rest == 0:
                    allow.append((region.name, position, bool(region.write), offset,
                                  list(region.shape), list(region.strides)))
                    break
    return allow


def _signature(params: Any) -> inspect.Signature | None:
    """The learner's parameter names, for messages that name an argument; None if unreadable."""
    if not isinstance(params, list):
        return None
    try:
        out = []
        for entry in params[:64]:
            name, kind, has_default = entry
            if not (isinstance(name, str) and IDENTIFIER.match(name) and not keyword.iskeyword(name)):
                return None
            default = None if has_default else inspect.Parameter.empty
            out.append(inspect.Parameter(name, inspect._ParameterKind(int(kind)), default=default))
        return inspect.Signature(out)
    except (ValueError, TypeError):
        return None


def proxy_for(session: Session, key: str, name: str, description: dict, values: dict) -> Any:
    """What the check is handed for the learner's ``name``: its value (data), or a proxy."""
    kind = description.get("kind")
    if kind == "data" and name in values:
        return values[name]
    if kind == "function":
        return FunctionProxy(session, key, name, description)
    if kind == "kernel":
        return KernelProxy(session, key, name, description)
    return OtherProxy(session, str(description.get("type", "object"))[:100], key, name)
