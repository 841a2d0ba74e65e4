"""``course_lib.flash_attention`` refuses bad input with a clear message (chapter 06).

Every error the design doc promises, each with its message checked: never a wrong answer, never a
Triton stack trace.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib import flash_attention

pytestmark = [pytest.mark.ch06]


def _qkv(device, shape=(2, 17, 16), dtype=torch.float32):
    return tuple(torch.randn(shape).to(device=device, dtype=dtype) for _ in range(3))


def test_not_a_tensor(device):
    q, k, v = _qkv(device)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got ndarray"):
        flash_attention(np.zeros((4, 16)), k, v)
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor, got list"):
        flash_attention(q, k, [[1.0] * 16])


def test_wrong_rank(device):
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match=r"k must have shape \(\.\.\., N, d\) with at least 2 dims, got shape \(16,\)"):
        flash_attention(q, k[0, 0], v)


def test_integer_and_bool_tensors(device):
    q, k, v = _qkv(device)
    with pytest.raises(TypeError, match=r"q must be a floating-point tensor .*got torch.int64"):
        flash_attention(torch.ones(2, 17, 16, dtype=torch.int64, device=device), k, v)
    with pytest.raises(TypeError, match=r"v must be a floating-point tensor .*got torch.bool"):
        flash_attention(q, k, torch.ones(2, 17, 16, dtype=torch.bool, device=device))


def test_mismatched_dtypes(device):
    q, k, v = _qkv(device)
    with pytest.raises(TypeError, match=r"same dtype, got q torch.float32, k torch.float16, v torch.float32"):
        flash_attention(q, k.half(), v)


def test_unsupported_dtype(device):
    from course_lib.platform import runtime

    q, k, v = _qkv(device, dtype=torch.float64)
    if runtime.current().interpreted:
        assert flash_attention(q, k, v).dtype == torch.float64  # allowed for gradcheck
    else:
        with pytest.raises(TypeError, match=r"float64 only runs in the interpreter"):
            flash_attention(q, k, v)


def test_complex_dtype(device):
    q = torch.randn(2, 17, 16, dtype=torch.complex64, device=device)
    with pytest.raises(TypeError, match=r"q must be a floating-point tensor"):
        flash_attention(q, q, q)


def test_device_mismatch_with_runtime(device):
    from course_lib.platform import runtime

    rt = runtime.current()
    if rt.interpreted:
        meta = torch.randn(2, 17, 16, device="meta")
        with pytest.raises(ValueError, match=r"q, k and v are on meta, but this session has no GPU"):
            flash_attention(meta, meta, meta)
    else:
        q, k, v = _qkv("cpu")
        with pytest.raises(ValueError, match=r"are on cpu, but this session runs kernels natively on the GPU"):
            flash_attention(q, k, v)
        with pytest.raises(ValueError, match=r"same device, got q on cpu, k on cuda"):
            flash_attention(q, k.cuda(), v)


def test_mismatched_shapes(device):
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match=r"same leading dims"):
        flash_attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"k and v must have the same number of keys N_k"):
        flash_attention(q, k, v[:, :5])
    with pytest.raises(ValueError, match=r"same head dim d"):
        flash_attention(q, k, torch.randn(2, 17, 32, device=device))


@pytest.mark.parametrize("d", [8, 15, 257, 512])
def test_unsupported_head_dim(d, device):
    x = torch.randn(1, 4, d, device=device)
    with pytest.raises(ValueError, match=rf"head dim d = {d} is not supported: the kernels take 16 <= d <= 256"):
        flash_attention(x, x, x)


def test_empty_sequence(device):
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match=r"empty sequence: N_q = 0, N_k = 17"):
        flash_attention(q[:, :0], k, v)
    with pytest.raises(ValueError, match=r"empty sequence: N_q = 17, N_k = 0"):
        flash_attention(q, k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match=r"empty leading dim"):
        flash_attention(q[:0], k[:0], v[:0])


@pytest.mark.parametrize("scale, exc, msg", [
    (float("nan"), ValueError, r"scale must be finite, got nan"),
    (float("inf"), ValueError, r"scale must be finite, got inf"),
    ("0.1", TypeError, r"scale must be a real number or None, got str"),
    (True, TypeError, r"scale must be a real number or None, got bool"),
])
def test_bad_scale(scale, exc, msg, device):
    q, k, v = _qkv(device)
    with pytest.raises(exc, match=msg):
        flash_attention(q, k, v, scale=scale)


def test_bad_causal(device):
    q, k, v = _qkv(device)
    with pytest.raises(TypeError, match=r"causal must be True or False, got 1"):
        flash_attention(q, k, v, causal=1)


def test_causal_any_lengths_is_served(device):
    """Top-left alignment leaves every query row at least key 0, so no (N_q, N_k) is refused:
    rows i >= N_k see every key."""
    q = torch.randn(1, 30, 16, device=device)
    kv = torch.randn(1, 3, 16, device=device)
    o = flash_attention(q, kv, kv, causal=True)
    full = flash_attention(q[:, 5:], kv, kv, causal=False)  # rows i >= 3 see all 3 keys
    assert torch.allclose(o[:, 5:], full, atol=1e-5)


def test_scale_is_used(device):
    q, k, v = _qkv(device)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.05)
    assert torch.allclose(flash_attention(q, k, v, scale=0.05), ref, atol=1e-5)
    # an integer scale is a real number too
    ref2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)
    assert torch.allclose(flash_attention(q, k, v, scale=1), ref2, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# What the autograd function saves: peer harnesses look for the log-sum-exp among saved tensors.


@pytest.mark.parametrize("shape", [(37, 16), (2, 37, 16), (2, 3, 37, 16), (2, 2, 3, 37, 16)],
                         ids=["2-dim", "3-dim", "4-dim", "5-dim"])
def test_saved_tensors_have_the_inputs_leading_shape(shape, device):
    import math

    q, k, v = (torch.randn(shape, device=device, requires_grad=True) for _ in range(3))
    o = flash_attention(q, k, v, causal=True)
    saved = o.grad_fn.saved_tensors
    shapes = [tuple(t.shape) for t in saved]
    assert shapes == [shape, shape, shape, shape, shape[:-1]], shapes  # q, k, v, o, lse
    lse = saved[-1]
    scores = (q @ k.transpose(-1, -2)).detach() / math.sqrt(shape[-1])
    mask = torch.ones(shape[-2], shape[-2], dtype=torch.bool, device=device).tril()
    ref = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(lse, ref, atol=1e-4, rtol=1e-4)  # natural log, per query row
    torch.testing.assert_close(saved[3], o.detach())
    o.sum().backward()  # the backward reads them back in that shape
    assert q.grad.shape == shape and k.grad.shape == shape and v.grad.shape == shape


def test_with_lse_returns_the_leading_shape(device):
    from course_lib import flash_attention_with_lse

    q = torch.randn(2, 3, 29, 16, device=device)
    o, lse = flash_attention_with_lse(q, q, q)
    assert o.shape == (2, 3, 29, 16) and lse.shape == (2, 3, 29)


# ----------------------------------------------------------------------------------------------
# Bad input: non-finite values behave as in SDPA; wrong types get a TypeError naming the argument.


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_inputs_propagate_like_sdpa(bad, which, causal, device):
    import warnings

    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=gen).to(device) for _ in range(3))
    dict(q=q, k=k, v=v)[which][0, 1, 5, 3] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's "invalid value" in the interpreter
        o = flash_attention(q, k, v, causal=causal)
    # The yardstick is SDPA's default CPU backend, a FlashAttention-style kernel: it skips masked
    # keys (the MATH backend adds a -inf bias to a masked key's NaN score: NaN), and an input of
    # -inf in k gives a score of -inf, weight 0, not NaN (CUDA's fp32 SDPA backend returns NaN
    # for those rows; exact attention does not).
    o, q, k, v = (x.cpu() for x in (o, q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.equal(o.isnan(), ref.isnan()), "NaN where SDPA has none, or the other way round"
    assert torch.equal(o.isinf(), ref.isinf())
    finite = torch.isfinite(ref)
    assert finite.any()  # the other head is untouched
    torch.testing.assert_close(o[finite], ref[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arg", ["q", "k", "v"])
@pytest.mark.parametrize("bad, got", [
    (lambda t: t.numpy(), "ndarray"),
    (lambda t: t.tolist(), "list"),
    (lambda t: 1.5, "float"),
    (lambda t: None, "NoneType"),
], ids=["numpy", "list", "float", "None"])
def test_non_tensors_are_refused_naming_the_argument(arg, bad, got, device):
    q, k, v = _qkv("cpu")
    args = dict(q=q, k=k, v=v)
    args[arg] = bad(args[arg])
    args = {name: (x.to(device) if isinstance(x, torch.Tensor) else x) for name, x in args.items()}
    with pytest.raises(TypeError, match=rf"^{arg} must be a torch.Tensor, got {got}$"):
        flash_attention(**args)


@pytest.mark.parametrize("arg", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.int32, torch.uint8])
def test_non_float_tensors_are_refused_naming_the_argument(arg, dtype, device):
    q, k, v = _qkv(device)
    args = dict(q=q, k=k, v=v)
    args[arg] = torch.ones(args[arg].shape, dtype=dtype, device=device)
    with pytest.raises(TypeError, match=rf"^{arg} must be a floating-point tensor .*got {dtype}$"):
        flash_attention(**args)
