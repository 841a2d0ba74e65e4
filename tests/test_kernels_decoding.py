"""``course_lib.kernels.decoding``: split-KV decoding in Triton, with GQA/MQA (chapter 08).

Against SDPA (``enable_gqa``) and the NumPy oracle :func:`course_lib.attention.decoding.decode_attention_reference`,
on sizes that are not multiples of the tile or of the number of splits; every error promised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from course_lib.attention import decoding
from course_lib.teaching.checks import TOLERANCES
from course_lib.kernels import decoding as kdec
from course_lib.kernels.decoding import flash_decode_triton

pytestmark = pytest.mark.ch08

# Small tiles in the interpreter: the short caches below span several tiles per split.
TEST_BLOCK_N = 16


def _sdpa(q, k, v, scale=None):
    """SDPA with grouped K/V heads: ``enable_gqa`` where torch has it (>= 2.5), else repeated."""
    q4 = q if q.dim() == 4 else q[:, :, None]
    group = q4.shape[1] // k.shape[1]
    try:
        o = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5
        o = F.scaled_dot_product_attention(q4, k.repeat_interleave(group, 1),
                                           v.repeat_interleave(group, 1), scale=scale)
    return o.reshape(q.shape)


def _qkv(b, h, h_kv, n_q, n, d, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_shape = (b, h, d) if n_q is None else (b, h, n_q, d)
    q = torch.randn(q_shape, generator=gen)
    k, v = (torch.randn(b, h_kv, n, d, generator=gen) for _ in range(2))
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


# (B, H, H_kv, n_q, N, d, splits): N not a multiple of BLOCK_N (16) nor of splits; splits > tiles;
# splits = 1; MHA, GQA (H_kv = H/2) and MQA; d 16 and 64; one query (no n_q axis) and three.
SHAPES = [
    (2, 4, 4, None, 37, 16, 3),
    (1, 4, 2, 3, 100, 64, 5),
    (2, 4, 1, 1, 53, 16, 2),
    (1, 4, 2, None, 23, 64, 9),   # 9 splits of 3 keys: more splits than the 2 tiles
    (1, 2, 1, 3, 150, 16, 1),     # no split
    (1, 4, 4, 3, 5, 16, 7),       # 7 splits for 5 keys: two chunks are empty
]


@pytest.mark.parametrize("grouped", [False, True], ids=["per-head", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}nq{}N{}d{}S{}".format(*s))
def test_matches_sdpa(shape, dtype, grouped, device):
    b, h, h_kv, n_q, n, d, splits = shape
    q, k, v = _qkv(b, h, h_kv, n_q, n, d, dtype, device)
    o, lse = flash_decode_triton(q, k, v, splits=splits, block_n=TEST_BLOCK_N, grouped=grouped)
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    want = _sdpa(q.double(), k.double(), v.double())
    atol, rtol = TOLERANCES[str(dtype).replace("torch.", "")]
    torch.testing.assert_close(o.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "B{}H{}Hkv{}nq{}N{}d{}S{}".format(*s))
def test_matches_numpy_oracle_with_lse(shape, device):
    b, h, h_kv, n_q, n, d, splits = shape
    q, k, v = _qkv(b, h, h_kv, n_q, n, d, torch.float32, device, seed=1)
    scale = 0.3
    o, lse = flash_decode_triton(q, k, v, splits=splits, scale=scale, block_n=TEST_BLOCK_N)
    q_np, k_np, v_np = (x.cpu().double().numpy() for x in (q, k, v))
    rows = [q_np] if q.dim() == 3 else [q_np[:, :, j] for j in range(q.shape[2])]  # (B, H, d) each
    answers = [decoding.decode_attention_reference(r, k_np, v_np, scale) for r in rows]
    want_o = np.stack([a[0] for a in answers], axis=2).reshape(q.shape)
    want_lse = np.stack([a[1] for a in answers], axis=2).reshape(q.shape[:-1])
    atol, rtol = TOLERANCES["float32"]
    np.testing.assert_allclose(o.cpu().double().numpy(), want_o, atol=atol, rtol=rtol)
    np.testing.assert_allclose(lse.cpu().double().numpy(), want_lse, atol=atol, rtol=rtol)


def test_grouped_is_the_default_when_a_group_fits_one_tile(device):
    q, k, v = _qkv(1, 8, 1, 16, 40, 16, device=device, seed=5)  # 8 heads · 16 rows > 64: per head
    o, _ = flash_decode_triton(q, k, v, splits=2, block_n=TEST_BLOCK_N)
    torch.testing.assert_close(o, _sdpa(q, k, v), atol=2e-5, rtol=2e-4)
    assert 8 * 16 > kdec.MAX_GROUPED_ROWS >= 4 * 3


def test_default_splits_and_non_contiguous_cache(device):
    q, k, v = _qkv(1, 4, 2, None, 70, 16, device=device, seed=2)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H_kv, N, d) view of (B, N, H_kv, d)
    o, _ = flash_decode_triton(q, k_t, v)
    assert kdec.choose_splits(1, 4, 70) >= 1
    torch.testing.assert_close(o, _sdpa(q, k, v), atol=2e-5, rtol=2e-4)


def test_splits_do_not_change_the_answer(device):
    q, k, v = _qkv(1, 2, 1, None, 45, 16, device=device, seed=3)
    outs = [flash_decode_triton(q, k, v, splits=s, block_n=TEST_BLOCK_N) for s in (1, 4, 50)]
    for o, lse in outs[1:]:
        torch.testing.assert_close(o, outs[0][0], atol=2e-6, rtol=2e-5)
        torch.testing.assert_close(lse, outs[0][1], atol=2e-6, rtol=2e-5)


# ----------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("call, error, pattern", [
    (lambda q, k, v: flash_decode_triton(np.zeros((1, 4, 16)), k, v), TypeError,
     r"q must be a torch.Tensor, got ndarray"),
    (lambda q, k, v: flash_decode_triton(q[0, 0], k, v), ValueError,
     r"q must have shape \(B, H, d\) or \(B, H, n_q, d\)"),
    (lambda q, k, v: flash_decode_triton(q, k[0], v), ValueError, r"k must have shape \(B, H_kv, N, d\)"),
    (lambda q, k, v: flash_decode_triton(q, k, v.half()), TypeError, r"same dtype"),
    (lambda q, k, v: flash_decode_triton(q.double(), k.double(), v.double()), TypeError,
     r"dtype torch.float64; supported"),
    (lambda q, k, v: flash_decode_triton(q, k, v[:, :, :5]), ValueError, r"k and v must have the same shape"),
    (lambda q, k, v: flash_decode_triton(q[:1], k, v), ValueError, r"same batch size"),
    (lambda q, k, v: flash_decode_triton(q[..., :8], k[..., :8], v[..., :8]), ValueError,
     r"head dim d = 8 is not supported"),
    (lambda q, k, v: flash_decode_triton(q[:, :3], k, v), ValueError,
     r"H must be a multiple of the number of K/V heads H_kv, got H = 3"),
    (lambda q, k, v: flash_decode_triton(q[:, :, None].expand(2, 4, 17, 16), k, v), ValueError,
     r"n_q = 17 query rows; decoding takes 1 to 16"),
    (lambda q, k, v: flash_decode_triton(q, k[:, :, :0], v[:, :, :0]), ValueError, r"empty input"),
    (lambda q, k, v: flash_decode_triton(q, k, v, splits=2.0), TypeError, r"splits must be a positive int"),
    (lambda q, k, v: flash_decode_triton(q, k, v, splits=0), ValueError, r"splits must be between 1 and"),
    (lambda q, k, v: flash_decode_triton(q, k, v, block_n=24), ValueError,
     r"block_n must be a power of two >= 16, got 24"),
    (lambda q, k, v: flash_decode_triton(q, k, v, scale="x"), TypeError, r"scale must be a real number"),
    (lambda q, k, v: flash_decode_triton(q, k, v, scale=float("nan")), ValueError, r"scale must be finite"),
])
def test_bad_input_is_refused(call, error, pattern, device):
    q, k, v = _qkv(2, 4, 2, None, 9, 16, device=device)
    with pytest.raises(error, match=pattern):
        call(q, k, v)


def test_wrong_device_is_refused(device):
    if device != "cpu":
        pytest.skip("on a GPU, CPU tensors are the wrong device; covered by the message test")
    q, k, v = _qkv(1, 2, 1, None, 9, 16)
    with pytest.raises(ValueError, match=r"same device|are on"):
        flash_decode_triton(q.to("meta"), k.to("meta"), v.to("meta"))


# ----------------------------------------------------------------------------------------------
# GPU only: bf16 and long caches


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b, h, h_kv, n", [(1, 32, 8, 131072), (4, 32, 32, 16411), (16, 8, 1, 4099)])
def test_long_cache_on_gpu(b, h, h_kv, n, dtype):
    q, k, v = _qkv(b, h, h_kv, None, n, 128, dtype, "cuda", seed=4)
    o, lse = flash_decode_triton(q, k, v)
    want = _sdpa(q.float(), k.float(), v.float())
    atol, rtol = TOLERANCES[str(dtype).replace("torch.", "")]
    torch.testing.assert_close(o.float(), want, atol=atol, rtol=rtol)
    assert torch.isfinite(lse).all()


@pytest.mark.gpu
def test_default_splits_fill_the_gpu():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = kdec.choose_splits(1, 8, 131072)
    assert 8 * splits >= sms


# ----------------------------------------------------------------------------------------------
# The benchmark script imports and explains itself without a GPU


def test_bench_script_help():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "bench_decoding.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HBM" in done.stdout and "--out" in done.stdout
