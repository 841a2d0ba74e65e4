"""Which Triton gets which Gluon spelling, and the fall-back to the Triton kernels
(course_lib/kernels/compat.py).

Without a GPU: the spelling table against the installed Triton (the same tests run with 3.6.0 in
``make test-oldest``, 3.7.1 in ``make test`` and 3.9.0 in ``make test-newest``); the fall-back
through each Gluon launcher, with its kernel replaced by one that fails to compile, on CPU tensors
in Triton's interpreter (the Triton kernel it falls back to really runs and is checked against a
reference). On a Hopper GPU (``-m gpu``): ``flash_attention`` with a Gluon forward that does not
compile warns once and returns SDPA's answer.
"""

from __future__ import annotations

import ast
import warnings

import pytest
import torch
import triton
from triton.compiler.errors import CompilationError

from course_lib.kernels import compat

pytestmark = pytest.mark.ch09

NEWEST = {"tma_load": "nvidia.hopper.tma.async_load", "tma_store": "nvidia.hopper.tma.async_store",
          "cp_async_load": "nvidia.ampere.async_copy.async_load", "sync_warps": "barrier"}


@pytest.mark.parametrize("text,expected", [("3.6.0", (3, 6)), ("3.9.0", (3, 9)), ("3.10.1+git4a5b", (3, 10)),
                                           (" 4.0", (4, 0))])
def test_triton_version_reads_major_and_minor(text, expected):
    assert compat.triton_version(text) == expected


def test_triton_version_refuses_text_without_one():
    with pytest.raises(ValueError, match="text must be a version like '3.9.0', got 'nightly'"):
        compat.triton_version("nightly")


@pytest.mark.parametrize("version,name,expected", [
    ((3, 6), "tma_load", "nvidia.hopper.tma.async_copy_global_to_shared"),
    ((3, 7), "tma_load", "nvidia.hopper.tma.async_copy_global_to_shared"),
    ((3, 8), "tma_load", "nvidia.hopper.tma.async_load"),
    ((3, 9), "tma_store", "nvidia.hopper.tma.async_store"),
    ((3, 6), "sync_warps", "thread_barrier"),
    ((3, 7), "sync_warps", "barrier"),
    ((3, 5), "cp_async_load", "nvidia.ampere.async_copy.async_copy_global_to_shared"),  # older: the oldest
])
def test_each_triton_gets_its_spelling(version, name, expected):
    assert compat.spelling(name, version) == expected


@pytest.mark.parametrize("name", sorted(NEWEST))
def test_a_triton_the_course_has_not_seen_gets_the_newest_spelling(name):
    assert compat.spelling(name, (3, 12)) == compat.spelling(name, (4, 0)) == NEWEST[name]


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="name must be one of .*'tma_load'.*got 'tma_copy'"):
        compat.spelling("tma_copy")


def test_the_installed_triton_has_every_name():
    """Each name resolves to one of Gluon's builtins (what a Gluon kernel may call), of the
    installed Triton's own spelling."""
    assert compat.API_ERROR is None, compat.API_ERROR
    for name in compat.SPELLINGS:
        obj = compat.resolve(name)
        assert getattr(obj, "__triton_builtin__", False), (name, obj)
        assert obj.__name__ == compat.spelling(name).rsplit(".", 1)[-1]
    assert compat.tma_load is compat.resolve("tma_load") and compat.sync_warps is compat.resolve("sync_warps")


def test_the_installed_triton_was_tested():
    """Every Triton a `make test*` environment installs is in TESTED_TRITON (the README's table)."""
    assert triton.__version__.split("+")[0] in compat.TESTED_TRITON


# ----------------------------------------------------------------------------------------------
# Telling compile errors from others


def _compilation_error(message: str = "async_copy_global_to_shared has been removed; call async_load instead"):
    return CompilationError("tma.async_copy_global_to_shared(desc, [0], bar, buf)", ast.parse("x").body[0], message)


def test_compile_errors_are_told_from_others():
    assert compat.is_compile_error(_compilation_error())
    from triton.backends.compiler import GPUTarget

    try:  # any error raised inside Triton's compile counts, not only CompilationError
        triton.compile(None, target=GPUTarget("cuda", 90, 32))
    except Exception as err:  # noqa: BLE001 - whatever this Triton raises for a missing source
        inside_compile = err
    assert compat.is_compile_error(inside_compile), repr(inside_compile)
    try:
        raise ValueError("attention_forward_gluon: q, k, v: the head dim must be one of (64, 128)")
    except ValueError as err:
        assert not compat.is_compile_error(err)


@pytest.fixture
def fresh_state(monkeypatch):
    """No Gluon failure recorded yet in this process (and none left behind by the test)."""
    monkeypatch.setitem(compat._STATE, "failure", None)


def test_fall_back_swallows_a_compile_error_and_warns_once(fresh_state):
    with pytest.warns(compat.GluonFallbackWarning, match=rf"the Gluon forward does not compile with triton "
                                                        rf"{triton.__version__} \(CompilationError: async_copy"):
        with compat.FallBack("the Gluon forward") as launch:
            raise _compilation_error()
    assert launch.failed
    assert compat.gluon_failure().startswith(f"the Gluon forward did not compile with triton {triton.__version__}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second failure: no second warning
        with compat.FallBack("the Gluon backward") as again:
            raise _compilation_error()
    assert again.failed and compat.gluon_failure().startswith("the Gluon forward")


def test_fall_back_lets_other_errors_and_strict_compiles_through(fresh_state):
    with pytest.raises(ValueError, match="not a compile error"):
        with compat.FallBack("the Gluon forward"):
            raise ValueError("not a compile error")
    with pytest.raises(CompilationError):
        with compat.FallBack("the Gluon forward", strict=True):  # cross-compiling: a test must see it
            raise _compilation_error()
    with compat.FallBack("the Gluon forward") as fine:
        pass
    assert not fine.failed and compat.gluon_failure() is None


# ----------------------------------------------------------------------------------------------
# Each launcher falls back to the library's Triton kernel (CPU tensors, Triton's interpreter)


class _DoesNotCompile:
    """Stands in for a Gluon kernel that this Triton cannot compile: ``kernel[grid](...)`` raises."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise _compilation_error()

        return launch


def _inputs(shape=(1, 2, 160, 64)):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for _ in range(4)]  # q, k, v, do


def _reference(q, k, v, do, causal, mask=None):
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, attn_mask=mask)
    return (o, *torch.autograd.grad(o, (q64, k64, v64), do.double()))


@pytest.fixture
def gluon_modules():
    from course_lib.kernels import gluon_backward as gb
    from course_lib.kernels import gluon_hopper as gh
    from course_lib.kernels import gluon_masked as gm

    if not gh.available():  # pragma: no cover - depends on the installed Triton
        pytest.skip(f"gluon not importable: {gh.GLUON_IMPORT_ERROR}")
    return gh, gb, gm


@pytest.fixture
def interpreter():
    """The fall-back's Triton kernels run on CPU tensors, in Triton's interpreter."""
    from course_lib.platform import runtime

    if not runtime.current().interpreted:
        pytest.skip("the fall-back runs here on CPU tensors in Triton's interpreter; on a GPU "
                    "test_flash_attention_on_hopper_falls_back_with_one_warning covers it")


def test_the_forward_and_backward_launchers_fall_back(gluon_modules, interpreter, fresh_state, monkeypatch):
    gh, gb, _ = gluon_modules
    monkeypatch.setattr(gh, "attention_forward_gluon_kernel", _DoesNotCompile())
    monkeypatch.setattr(gb, "attention_backward_gluon_kernel", _DoesNotCompile())
    monkeypatch.setattr(gh, "gluon_unsupported_reason", lambda *tensors: None)  # past the "needs Hopper" check
    q, k, v, do = _inputs()
    ref_o, *ref_grads = _reference(q, k, v, do, causal=True)
    with pytest.warns(compat.GluonFallbackWarning, match=f"triton {triton.__version__}"):
        o, lse = gh.attention_forward_gluon(q, k, v, True, variant="pingpong")
    assert (o.double() - ref_o).abs().max().item() < 1e-4
    monkeypatch.setattr(gb, "gluon_backward_unsupported_reason", lambda *tensors: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already
        grads = gb.attention_backward_gluon(do, q, k, v, o, lse, True, 64 ** -0.5)
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max().item() < 1e-4


def test_the_masked_launchers_fall_back(gluon_modules, interpreter, fresh_state, monkeypatch):
    _, gb, gm = gluon_modules
    monkeypatch.setattr(gm, "masked_forward_gluon_kernel", _DoesNotCompile())
    monkeypatch.setattr(gb, "masked_backward_gluon_kernel", _DoesNotCompile())
    monkeypatch.setattr(gm, "masked_gluon_unsupported_reason", lambda *args: None)
    monkeypatch.setattr(gb, "masked_backward_unsupported_reason", lambda *args: None)
    q, k, plan = gm._cross_inputs((1, 1, 256, 64), 1, torch.float32, True, (100, 0), 0, False)  # causal window
    q, k, v, do = _inputs(q.shape)
    i, j = torch.arange(256)[:, None], torch.arange(256)[None, :]
    ref_o, *ref_grads = _reference(q, k, v, do, causal=False, mask=(j <= i) & (j >= i - 100))
    with pytest.warns(compat.GluonFallbackWarning, match="the Gluon masked forward does not compile"):
        o, lse = gm.masked_forward_gluon(q, k, v, 64 ** -0.5, plan)
    assert (o.double() - ref_o).abs().max().item() < 1e-4
    grads = gb.masked_backward_gluon(do, q, k, v, o, lse, 64 ** -0.5, plan)
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max().item() < 1e-4


def test_after_a_failure_the_library_no_longer_chooses_gluon(gluon_modules, fresh_state):
    gh, gb, _ = gluon_modules
    with pytest.warns(compat.GluonFallbackWarning):
        compat.record_failure("the Gluon forward", _compilation_error())
    q = torch.zeros(1, 1, 64, 128, dtype=torch.float16)
    why = gh.gluon_unsupported_reason(q, q, q)
    assert why == compat.gluon_failure() and "did not compile with triton" in why
    assert "did not compile" in gb.gluon_backward_unsupported_reason(q, q, q, q, q)


@pytest.mark.gpu
def test_flash_attention_on_hopper_falls_back_with_one_warning(fresh_state, monkeypatch):
    """On an H100: a Gluon forward that does not compile gives one warning and SDPA's answer, and
    the next call takes the Triton kernels without a word."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on Hopper only (compute capability 9.x); this GPU is not")
    from course_lib import flash_attention
    from course_lib.kernels import gluon_hopper as gh

    monkeypatch.setattr(gh, "attention_forward_gluon_kernel", _DoesNotCompile())
    gen = torch.Generator(device="cuda").manual_seed(0)
    # 4·8 heads of 9 query tiles, more than an H100's SMs (a smaller problem takes chapter 06's kernel)
    q, k, v = (torch.randn(4, 8, 1111, 128, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    with pytest.warns(compat.GluonFallbackWarning, match=f"triton {triton.__version__}"):
        o = flash_attention(q, k, v, causal=True)
    assert (o.double() - ref).abs().max().item() < 4e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o2 = flash_attention(q, k, v, causal=True)
    assert torch.equal(o, o2)
