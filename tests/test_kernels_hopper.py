"""The descriptor (TMA) forward kernel and the FP8 kernel of chapter 09 against float64.

On CPU both run in Triton's interpreter (which supports tensor descriptors and fp8 dots) at
small, ragged sizes; on a Hopper GPU the same tests run natively and the ``gpu``-marked ones add
larger sizes and bf16.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.kernels import hopper, tuning
from course_lib.attention.reference import naive_attention_torch

pytestmark = [pytest.mark.ch09]

REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# FP8 (e4m3: 3 mantissa bits, relative rounding up to 2^-4) of q, k, v and P: several percent of
# ‖o‖. Measured on normal inputs: 4.7-5.4% on an H100 (tools/fa3_ablation.py's check), 5% in the
# CPU emulation (course_lib.attention.fp8), 7% in Triton's interpreter, whose fp32 -> e4m3 casts of P lose
# more than the GPU's.
FP8_REL_TOL = 0.12


def rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _inputs(b, h, n_q, n_k, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen).to(device=device, dtype=dtype)
                 for n in (n_q, n_k, n_k))


def _skip_unless_tma(device):
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need a Hopper GPU; this one is older")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b, h, n_q, n_k, d, causal, two_stage", [
    (1, 2, 77, 77, 64, True, True),
    (2, 1, 100, 37, 40, False, True),   # N_q != N_k, head dim padded 40 -> 64 (zero-filled columns)
    (1, 1, 130, 200, 32, True, False),  # one masked loop over every tile
    (1, 1, 1, 90, 16, True, True),      # one query row
])
def test_tma_forward_matches_reference(b, h, n_q, n_k, d, causal, two_stage, dtype, device):
    _skip_unless_tma(device)
    q, k, v = _inputs(b, h, n_q, n_k, d, dtype, device)
    o, lse = hopper.attention_forward_tma(q, k, v, causal, d ** -0.5, blocks=tuning.Blocks(32, 32),
                                          two_stage=two_stage)
    ref_o, ref_lse = naive_attention_torch(q.double(), k.double(), v.double(), causal=causal)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == q.shape[:-1]
    assert rel_err(o, ref_o) < REL_TOL[dtype]
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


def test_tma_forward_same_as_pointer_kernel(device):
    """The descriptor kernel is chapter 06's kernel with other loads: same numbers."""
    from course_lib.kernels.forward import attention_forward

    _skip_unless_tma(device)
    q, k, v = _inputs(2, 2, 90, 70, 32, torch.float32, device, seed=3)
    blocks = tuning.Blocks(32, 32)
    o1, lse1 = hopper.attention_forward_tma(q, k, v, True, 0.2, blocks=blocks)
    o2, lse2 = attention_forward(q, k, v, True, 0.2, blocks=blocks)
    assert torch.allclose(o1, o2, atol=1e-6) and torch.allclose(lse1, lse2, atol=1e-6)


def test_tma_rejects_what_descriptors_cannot_read(device):
    _skip_unless_tma(device)
    q, k, v = _inputs(1, 1, 20, 20, 64, torch.float32, device)
    with pytest.raises(ValueError, match=r"k cannot be read by a tensor descriptor: the head dim must be contiguous"):
        hopper.attention_forward_tma(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, False, 0.1)
    odd = torch.randn(1, 1, 20, 6, device=device, dtype=torch.float16)  # rows of 12 bytes
    with pytest.raises(ValueError, match=r"q cannot be read .* multiples of 16 bytes"):
        hopper.attention_forward_tma(odd, odd, odd, False, 0.1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotate", [False, True])
def test_fp8_forward_close_to_reference(causal, rotate, device):
    _skip_unless_tma(device)
    q, k, v = _inputs(1, 2, 70, 50, 32, torch.float16, device, seed=5)
    o, lse = hopper.fp8_attention_forward(q, k, v, causal, rotate=rotate, blocks=tuning.Blocks(32, 32))
    ref_o, _ = naive_attention_torch(q.double(), k.double(), v.double(), causal=causal)
    assert o.dtype == q.dtype and o.shape == q.shape
    err = rel_err(o, ref_o)
    assert 0 < err < FP8_REL_TOL, f"fp8 relative error {err:.3f}"  # > 0: it really ran in fp8


def test_fp8_rejects_head_dim_not_multiple_of_16(device):
    q = torch.randn(1, 1, 8, 24, device=device)
    with pytest.raises(ValueError, match=r"head dim d must be a multiple of 16"):
        hopper.fp8_attention_forward(q, q, q)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d, n, causal", [(64, 4096, True), (128, 3000, False), (128, 1023, True), (256, 777, False)])
def test_tma_forward_gpu_large(dtype, d, n, causal):
    _skip_unless_tma("cuda")
    q, k, v = _inputs(2, 3, n, n, d, dtype, "cuda")
    o, _ = hopper.attention_forward_tma(q, k, v, causal, d ** -0.5)
    ref_o, _ = naive_attention_torch(q.double(), k.double(), v.double(), causal=causal)
    assert rel_err(o, ref_o) < REL_TOL[dtype]


def test_library_path_choice(monkeypatch):
    """The library takes the descriptor kernel only on a Hopper GPU at padded head dim 128, in
    fp16/bf16, unless COURSE_LIB_TMA=0 or autotuning; never in the interpreter."""
    from course_lib.platform import runtime

    q = torch.randn(1, 1, 8, 128)
    if runtime.current().interpreted:
        assert not hopper.library_uses_tma(q, q, q)
    monkeypatch.setenv(tuning.TMA_ENV, "0")
    assert not tuning.tma_enabled()
    monkeypatch.setenv(tuning.TMA_ENV, "1")
    assert tuning.tma_enabled()
    assert tuning.hopper_forward(1024, True) == tuning.Blocks(64, 64, 4, 3)
    assert tuning.hopper_forward(1024, False) == tuning.Blocks(128, 64, 4, 2)
    assert tuning.hopper_forward(4096, True) == tuning.Blocks(128, 64, 4, 2)
    assert tuning.hopper_forward(4096, False) == tuning.Blocks(128, 64, 4, 2)
    assert tuning.hopper_forward(16384, True) == tuning.Blocks(128, 128, 8, 3)


@pytest.mark.gpu
def test_library_uses_tma_on_hopper_at_d128():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the descriptor path is for Hopper (compute capability 9.x)")
    q = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.float16)
    assert hopper.library_uses_tma(q, q, q)
    assert not hopper.library_uses_tma(q[..., :64].contiguous(), q[..., :64].contiguous(), q[..., :64].contiguous())
    assert not hopper.library_uses_tma(q.float(), q.float(), q.float())
