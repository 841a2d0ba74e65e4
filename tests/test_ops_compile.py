"""The public entry points inside ``torch.compile`` (issue 33): torch.library ops, one graph, eager's numbers.

Each case calls a public function as a user would (dense, causal, window, seq_lens, block masks,
GQA, varlen, ``flash_attention_with_lse``, flash-decoding). For each:

- ``torch.compile(fullgraph=True)`` makes exactly one graph with no break, and the compiled
  forward (and backward) gives eager's numbers, for the "eager" and "aot_eager" backends (and
  "inductor", whose C++ compiles are slow on a CPU, for four of the calls);
- lengths that change between calls do not crash, and with ``dynamic=True`` do not recompile;
- the op path, forced eagerly, calls only ``torch.ops.course.*``, and every op it calls passes
  ``torch.library.opcheck`` with the arguments it was called with (schema, autograd registration,
  fake implementation against the real one, AOT dispatch with dynamic shapes).

CPU: the Triton interpreter, float32 (its bf16 is wrong), tiny shapes. The ``gpu`` tests at the end
run the same checks in fp16 and bf16 with the inductor backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

import course_lib
from course_lib.attention import blockmask as bm
from course_lib.teaching import checks
from course_lib.platform import runtime
from course_lib.kernels import decoding, ops

N, D = 40, 16  # CPU: N = 40 leaves a ragged last tile for every tile size (the interpreter's 64, TILE)
TILE = 32  # the block masks' tiles in the CPU cases: N = 40 is one full and one ragged tile
LENGTHS = (24, 40, 56)  # sequence lengths of the "varying N" tests
CPU_BACKENDS = ("eager", "aot_eager")
# The CPU tests run the interpreter's kernels in fp32; a GPU session runs the gpu tests at the end.
cpu_only = pytest.mark.skipif(runtime.current().on_gpu, reason="CPU (interpreter, fp32) version; on a GPU "
                              "the gpu-marked tests of this file run the same checks in fp16/bf16")


def _leaves(device, dtype, *shapes, grad=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_(grad) for s in shapes)


def _documents(n):
    """Two documents (a third, then the rest) of ``n`` tokens: ids ``(n,)``."""
    return torch.tensor([0] * (n // 3) + [1] * (n - n // 3))


@dataclass(frozen=True)
class Case:
    """A public call: ``make(device, dtype, n, d)`` gives its arguments, ``fn(*args)`` calls it."""

    name: str
    make: Callable
    fn: Callable
    backward: bool = True  # differentiable w.r.t. its floating-point arguments
    same_graph_for_every_length: bool = True  # False: an argument is built for one length


def _qkv(heads_q=2, heads_kv=2, extra_keys=0):
    return lambda dev, dt, n, d: _leaves(dev, dt, (2, heads_q, n, d), *[(2, heads_kv, n + extra_keys, d)] * 2)


def _with(make_qkv, *extra):
    """Arguments ``(q, k, v, *extra(dev, dt, n, d))``."""
    return lambda dev, dt, n, d: (*make_qkv(dev, dt, n, d), *(e(dev, dt, n, d) for e in extra))


def _tiles(dev, dt, d):
    """Block-mask tiles: small on the CPU (full, partial and skipped tiles at N = 40), the API's own
    (:func:`course_lib.kernels.masked.tile_sizes`) on a GPU."""
    if dev == "cpu":
        return TILE, TILE
    from course_lib.kernels import masked

    return masked.tile_sizes(d, dt)


def _packed(dev, dt, n, d):
    """A packed batch of two sequences: q ``(n, 4, d)``, k, v ``(n, 2, d)`` (GQA), offsets, max length."""
    cu = torch.tensor([0, n // 3, n], device=dev)
    return (*_leaves(dev, dt, (n, 4, d), (n, 2, d), (n, 2, d)), cu, n - n // 3)


def _cache(dev, dt, n, d):
    """Decoding: one new token per sequence, q ``(2, 4, d)``; a cache of ``n`` tokens, 2 K/V heads."""
    return _leaves(dev, dt, (2, 4, d), (2, 2, n, d), (2, 2, n, d), grad=False)


CASES = [
    Case("dense", _qkv(), lambda q, k, v: course_lib.flash_attention(q, k, v)),
    Case("causal", _qkv(extra_keys=8), lambda q, k, v: course_lib.flash_attention(q, k, v, causal=True)),
    Case("window", _qkv(), lambda q, k, v: course_lib.flash_attention(q, k, v, window=(8, 0))),
    Case("seq_lens", _with(_qkv(), lambda dev, dt, n, d: torch.tensor([n - 7, n], device=dev)),
         lambda q, k, v, lens: course_lib.flash_attention(q, k, v, causal=True, seq_lens=lens)),
    Case("seq_lens_pair_window", _with(_qkv(), lambda dev, dt, n, d: torch.tensor([n - 7, n], device=dev),
                                       lambda dev, dt, n, d: torch.tensor([n, n - 3], device=dev)),
         lambda q, k, v, lq, lk: course_lib.flash_attention(q, k, v, window=(6, 2), seq_lens=(lq, lk))),
    Case("block_mask", _with(_qkv(), lambda dev, dt, n, d: bm.document_block_mask(_documents(n), *_tiles(dev, dt, d),
                                                                                   causal=True)),
         lambda q, k, v, block: course_lib.flash_attention(q, k, v, block_mask=block),
         same_graph_for_every_length=False),
    Case("mask_mod", _with(_qkv(), lambda dev, dt, n, d: bm.BlockMask.from_mask_mod(
             lambda b, h, i, j: (i - j).abs() % 5 != 1, None, None, n, n, *_tiles(dev, dt, d))),
         lambda q, k, v, block: course_lib.flash_attention(q, k, v, block_mask=block),
         same_graph_for_every_length=False),
    Case("gqa", _qkv(heads_q=4), lambda q, k, v: course_lib.flash_attention(q, k, v, causal=True)),
    Case("with_lse", _qkv(), lambda q, k, v: course_lib.flash_attention_with_lse(q, k, v, causal=True),
         backward=False),
    Case("with_lse_window", _qkv(), lambda q, k, v: course_lib.flash_attention_with_lse(q, k, v, window=(4, 4)),
         backward=False),
    Case("varlen", _packed, lambda q, k, v, cu, m: course_lib.flash_attention_varlen(q, k, v, cu, cu, m, m,
                                                                                     causal=True)),
    Case("varlen_lse", _packed, lambda q, k, v, cu, m: course_lib.flash_attention_varlen(
        q, k, v, cu, cu, m, m, window=(4, 0), return_lse=True), backward=False),
    Case("decode", _cache, lambda q, k, v: decoding.flash_decode_triton(q, k, v), backward=False),
]
CASE_IDS = [c.name for c in CASES]


def _cases(*names):
    """Parametrize ``case`` over the named cases, for a test that needs a few (each compile costs
    seconds on CPU)."""
    chosen = [c for c in CASES if c.name in names]
    return pytest.mark.parametrize("case", chosen, ids=[c.name for c in chosen])


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _run(fn, case, args, seed=1):
    """``fn(*args)``'s outputs, and the gradients of a random projection of the first w.r.t. the
    floating-point leaves (``()`` for a forward-only case)."""
    outs = _outputs(fn(*args))
    if not case.backward:
        assert not any(o.requires_grad for o in outs), f"{case.name} is forward only, as in eager"
        return outs, ()
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(outs[0].shape, generator=gen).to(outs[0])
    return outs, torch.autograd.grad(outs[0], leaves, weight)


def _tolerance(dtype) -> dict:
    """The course's tolerance for ``dtype`` (:data:`course_lib.teaching.checks.TOLERANCES`)."""
    atol, rtol = checks.TOLERANCES[str(dtype).removeprefix("torch.")]
    return dict(atol=atol, rtol=rtol)


def _assert_same(got, want, exact=True, what=""):
    """Equal shapes and dtypes, and values equal bit for bit (``exact``: the same kernels on the same
    inputs) or within the dtype's tolerance (a GPU backward that adds dQ atomically, in any order)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        tol = dict(atol=0, rtol=0) if exact else _tolerance(w.dtype)
        torch.testing.assert_close(g, w, **tol, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# one graph, eager's numbers


@cpu_only
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_one_graph_no_break(case):
    """``torch._dynamo.explain``: one graph, no graph break (fullgraph would fail otherwise)."""
    args = case.make("cpu", torch.float32, N, D)
    explained = torch._dynamo.explain(case.fn)(*args)
    reasons = [str(b.reason)[:300] for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


def _check_compiled_matches_eager(case, backend):
    """fullgraph: one frame, compiled once; forward and gradients equal eager's bit for bit."""
    args = case.make("cpu", torch.float32, N, D)
    want = _run(case.fn, case, args)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(case.fn, fullgraph=True, backend=counter)
    for _ in range(2):  # the second call reuses the graph
        got = _run(compiled, case, args)
        _assert_same(got[0], want[0], what=f"{case.name} forward")
        _assert_same(got[1], want[1], what=f"{case.name} gradients")
    assert counter.frame_count == 1


# The "eager" backend (Dynamo alone) on a few cases: "aot_eager" runs the same Dynamo graph and then
# traces the forward and backward graphs (AOTAutograd), so it goes through everything "eager" does.
EAGER_BACKEND_CASES = ("dense", "causal", "varlen")


@cpu_only
@pytest.mark.parametrize("case, backend", [(c, b) for c in CASES for b in CPU_BACKENDS
                                           if b == "aot_eager" or c.name in EAGER_BACKEND_CASES],
                         ids=[f"{c.name}-{b}" for c in CASES for b in CPU_BACKENDS
                              if b == "aot_eager" or c.name in EAGER_BACKEND_CASES])
def test_compiled_matches_eager(case, backend):
    """The "aot_eager" backend (Dynamo, then AOTAutograd's forward and backward graphs) on every
    case, "eager" (Dynamo alone) on :data:`EAGER_BACKEND_CASES`."""
    _check_compiled_matches_eager(case, backend)


@cpu_only
@pytest.mark.slow
@_cases("causal", "block_mask", "varlen", "decode")
def test_compiled_with_inductor(case):
    """The same with inductor, which generates code around the ops (C++ on CPU: slow to compile, so
    a dense, a masked, a packed and a decoding call)."""
    _check_compiled_matches_eager(case, "inductor")


# Every kind of call over lengths with dynamic=True; the default (automatic dynamic shapes, a
# recompile at the second length) on a dense and a packed call.
VARYING = ("causal", "window", "seq_lens", "gqa", "varlen", "decode")
AUTOMATIC_TOO = ("causal", "varlen")


def _compiles_over_lengths(case, dynamic, lengths=LENGTHS):
    """Compile once, call at each length: eager's numbers each time; returns the compile count."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(case.fn, fullgraph=True, backend=counter, dynamic=dynamic)
    for n in lengths:
        args = case.make("cpu", torch.float32, n, D)
        want = _run(case.fn, case, args)
        got = _run(compiled, case, args)
        _assert_same(got[0], want[0], what=f"{case.name} N={n} forward")
        _assert_same(got[1], want[1], what=f"{case.name} N={n} gradients")
    return counter.frame_count


@cpu_only
@pytest.mark.parametrize("case, dynamic", [(c, d) for c in CASES for d in (None, True) if c.name in VARYING
                                           and (d or c.name in AUTOMATIC_TOO)],
                         ids=[f"{c.name}-{'dynamic' if d else 'automatic'}" for c in CASES for d in (None, True)
                              if c.name in VARYING and (d or c.name in AUTOMATIC_TOO)])
def test_varying_lengths(case, dynamic):
    """New lengths never crash and give eager's numbers. ``dynamic=True`` compiles once for every
    length; by default (automatic dynamic shapes) the second length recompiles once, as a dynamic
    graph, and the third reuses it."""
    assert _compiles_over_lengths(case, dynamic) == (1 if dynamic else 2)


@cpu_only
@pytest.mark.slow
def test_block_mask_new_length_new_graph():
    """A block mask is built for one length (its sizes are Python ints the graph is specialised
    on), so each length is a new mask and a new graph, even with ``dynamic=True``: no crash."""
    case = CASES[CASE_IDS.index("block_mask")]
    assert _compiles_over_lengths(case, True, LENGTHS[:2]) == 2


# ----------------------------------------------------------------------------------------------
# the ops themselves


class _RecordOps(TorchDispatchMode):
    """Records every call of a ``course`` op (below autograd: the tensors carry no grad)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ops.ALL_OPS:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _op_path_calls(case, monkeypatch, device="cpu", dtype=torch.float32, n=N, d=D):
    """Run ``case`` eagerly through the ops (the branch the entry points take under torch.compile):
    ``(outputs and gradients, the direct path's, [(op, args, kwargs)])``."""
    args = case.make(device, dtype, n, d)
    direct = _run(case.fn, case, args)
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        with _RecordOps() as recorder:
            through_ops = _run(case.fn, case, args)
    return through_ops, direct, recorder.calls


@cpu_only
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_op_path_is_the_direct_path(case, monkeypatch):
    """The ops run the same implementation as the eager path: equal outputs and gradients; the
    forward op and (for a differentiable call) its backward op are what runs."""
    through_ops, direct, calls = _op_path_calls(case, monkeypatch)
    _assert_same(through_ops[0], direct[0], what=f"{case.name} forward")
    _assert_same(through_ops[1], direct[1], what=f"{case.name} gradients")
    names = [func.name().split("::")[1] for func, _, _ in calls]
    assert len(names) == (2 if case.backward else 1) and names[0].endswith(("_forward", "flash_decode")), names
    if case.backward:
        assert names[1] == names[0].replace("_forward", "_backward")


def _opcheck_args(func, args):
    """The recorded arguments, with q, k, v leaves that require grad for a forward op (so that
    opcheck checks its autograd registration and backward too)."""
    args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
    if func.name().endswith("_forward"):
        args = (*(a.requires_grad_() for a in args[:3]), *args[3:])
    return args


# A few calls that, together, pass every op each of its kinds of arguments (optional tensors given
# and absent, GQA, lengths, a block mask with and without an element mask); the other cases call
# the same ops (test_op_path_is_the_direct_path checks which).
# (mask_mod calls the masked ops exactly as block_mask does, with the block mask it builds: opcheck
# on one of them; test_op_path_is_the_direct_path checks mask_mod's calls)
OPCHECK_CASES = _cases("causal", "gqa", "seq_lens_pair_window", "block_mask", "varlen", "decode")


@cpu_only
@pytest.mark.slow
@OPCHECK_CASES
def test_opcheck(case, monkeypatch):
    """``torch.library.opcheck`` on every op a public call uses, with the arguments it passes."""
    _, _, calls = _op_path_calls(case, monkeypatch)
    assert calls
    for func, args, kwargs in calls:
        results = torch.library.opcheck(func, _opcheck_args(func, args), kwargs)
        assert set(results.values()) == {"SUCCESS"}, (func, results)


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("shape, dtype", [((N, D), torch.float64), ((2, N, D), torch.float32),
                                          ((2, 1, 2, N, D), torch.float32)], ids=["2d-fp64", "3d", "5d"])
def test_opcheck_dense_layouts(shape, dtype):
    """The dense ops for any leading dims, non-contiguous inputs, and float64 (its lse is float64)."""
    q, k, v = (x.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
               for x in _leaves("cpu", dtype, shape, shape, shape))
    assert not q.is_contiguous()
    o, lse = ops.attention_forward(q, k, v, True, 0.3, False)
    assert lse.dtype == ops.lse_dtype(dtype) and lse.shape == q.shape[:-1]
    results = torch.library.opcheck(ops.attention_forward, (q, k, v, True, 0.3, False))
    assert set(results.values()) == {"SUCCESS"}, results
    do = torch.randn_like(o).transpose(-1, -2).contiguous().transpose(-1, -2)
    args = (do, *(x.detach() for x in (q, k, v, o, lse)), True, 0.3, True)
    results = torch.library.opcheck(ops.attention_backward, args)
    assert set(results.values()) == {"SUCCESS"}, results


def test_block_mask_round_trip():
    """A BlockMask taken apart at the op boundary comes back with the same tiles, element mask and
    document ids; the same tensors (or new objects over the same memory, as autograd's saved
    tensors are) give the same cached object, new tensors a new one."""
    block = bm.document_block_mask(_documents(N), TILE, TILE)
    lens = torch.tensor([N, N - 3])
    args = ops.mask_args((3, -1), lens, block)
    window, seq_lens, again = ops.mask_from_args(*args)
    assert window == (3, -1) and seq_lens is lens
    for name in ("classes", "full_kv_num_blocks", "full_kv_indices", "kv_num_blocks", "kv_indices",
                 "full_q_num_blocks", "full_q_indices", "q_num_blocks", "q_indices"):
        assert torch.equal(getattr(again, name), getattr(block, name)), name
    assert all(torch.equal(a, b) for a, b in zip(again.document_ids, block.document_ids))
    assert (again.n_q, again.n_k, again.block_size) == (block.n_q, block.n_k, block.block_size)
    assert ops.mask_from_args(*args)[2] is again
    same_memory = (args[3][:],) + tuple(x.view_as(x) for x in block.document_ids)
    assert ops.mask_from_args(*args[:3], same_memory[0], None, *same_memory[1:], args[-1])[2] is again
    other = bm.document_block_mask(_documents(N), TILE, TILE)
    assert ops.mask_from_args(*ops.mask_args(None, None, other))[2] is not again
    pair = ops.mask_from_args(*ops.mask_args(None, (lens, lens + 1), None))[1]
    assert pair[0] is lens and torch.equal(pair[1], lens + 1)


@cpu_only
def test_compiled_block_mask_is_rebuilt_once(monkeypatch):
    """Under compile, the ops rebuild the block mask and its launch plan on the first call only:
    later calls, forward and backward, find both in the caches."""
    case = CASES[CASE_IDS.index("block_mask")]
    args = case.make("cpu", torch.float32, N, D)
    built = []
    real_init = bm.BlockMask.__init__
    monkeypatch.setattr(bm.BlockMask, "__init__", lambda self, *a, **kw: built.append(1) or real_init(self, *a, **kw))
    compiled = torch.compile(case.fn, fullgraph=True, backend="aot_eager")
    _run(compiled, case, args)
    assert built  # the first call rebuilds the mask and plans its launch
    built.clear()
    for _ in range(2):
        _run(compiled, case, args)
    assert not built


# ----------------------------------------------------------------------------------------------
# errors under torch.compile


@cpu_only
def test_errors_under_compile():
    """The checks run inside the compiled function: without fullgraph the same exception and
    message as eager; with fullgraph Dynamo wraps it (``Unsupported: Observed exception``) and
    keeps the message. Checks that read tensor values (lengths, offsets) run in the op."""
    q, k, v = _leaves("cpu", torch.float32, (2, 2, N, 8), (2, 2, N, 8), (2, 2, N, 8))
    message = r"head dim d = 8 is not supported"
    with pytest.raises(ValueError, match=message):
        torch.compile(course_lib.flash_attention, backend="eager")(q, k, v)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=message):
        torch.compile(course_lib.flash_attention, backend="eager", fullgraph=True)(q, k, v)
    q, k, v = _leaves("cpu", torch.float32, *[(2, 2, N, D)] * 3)
    attend = torch.compile(lambda q, k, v, lens: course_lib.flash_attention(q, k, v, seq_lens=lens),
                           backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=rf"seq_lens must lie in \[0, {N}\]"):
        attend(q, k, v, torch.tensor([N + 1, 3]))
    pq, pk, pv, cu, m = _packed("cpu", torch.float32, N, D)
    packed = torch.compile(lambda *a: course_lib.flash_attention_varlen(*a), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        packed(pq, pk, pv, cu + 1, cu, m, m)
    with pytest.raises(ValueError, match=r"max_seqlen_k = 3 is smaller than the longest sequence"):
        packed(pq, pk, pv, cu, cu, m, 3)


# ----------------------------------------------------------------------------------------------
# GPU: the same checks in fp16 and bf16, inductor (run on the H100: pytest -m gpu tests/test_ops_compile.py)

GPU_N = 300  # ragged against every tile size the GPU kernels use
GPU_DTYPES = [torch.float16, torch.bfloat16]
# both dtypes and both head dims the Gluon kernels serve, in two configurations (each inductor compile
# and opcheck costs seconds of the GPU session)
GPU_CONFIGS = pytest.mark.parametrize("dtype, d", [(torch.float16, 64), (torch.bfloat16, 128)],
                                      ids=["fp16-d64", "bf16-d128"])
SAME_GRAPH_CASES = [c for c in CASES if c.same_graph_for_every_length]


@pytest.mark.gpu
@GPU_CONFIGS
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gpu_compiled_matches_eager(case, dtype, d):
    """Inductor, fullgraph: one graph; forward equal to eager's; gradients equal up to the order of
    the one-pass backward's atomic dQ adds (within the dtype's tolerance)."""
    args = case.make("cuda", dtype, GPU_N, d)
    want = _run(case.fn, case, args)
    counter = CompileCounterWithBackend("inductor")
    got = _run(torch.compile(case.fn, fullgraph=True, backend=counter), case, args)
    _assert_same(got[0], want[0], what=f"{case.name} forward")
    _assert_same(got[1], want[1], exact=False, what=f"{case.name} gradients")
    assert counter.frame_count == 1


@pytest.mark.gpu
@GPU_CONFIGS
@OPCHECK_CASES
def test_gpu_opcheck(case, dtype, d, monkeypatch):
    """opcheck on the GPU paths (Gluon, tensor descriptors, fitted configs): the fakes' strides
    and dtypes match what those kernels return."""
    _, _, calls = _op_path_calls(case, monkeypatch, device="cuda", dtype=dtype, n=GPU_N, d=d)
    assert calls
    for func, args, kwargs in calls:
        results = torch.library.opcheck(func, _opcheck_args(func, args), kwargs, **_tolerance(dtype))
        assert set(results.values()) == {"SUCCESS"}, (func, results)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SAME_GRAPH_CASES, ids=[c.name for c in SAME_GRAPH_CASES])
def test_gpu_varying_lengths(case):
    """dynamic=True with inductor: one graph for three lengths, each with eager's numbers."""
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(case.fn, fullgraph=True, backend=counter, dynamic=True)
    for n in (GPU_N, 2 * GPU_N + 5, 1024):
        args = case.make("cuda", GPU_DTYPES[-1], n, 64)
        got, want = _run(compiled, case, args), _run(case.fn, case, args)
        _assert_same(got[0], want[0], what=f"{case.name} N={n} forward")
        _assert_same(got[1], want[1], exact=False, what=f"{case.name} N={n} gradients")
    assert counter.frame_count == 1

