"""The Triton forward kernel against the float64 reference (chapter 06).

On CPU these run in Triton's interpreter at small, irregular sizes; on a GPU (``device`` fixture)
the same tests run natively, and the ``gpu``-marked ones add bf16-heavy, large-N cases.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from course_lib.attention.reference import naive_attention_torch

pytestmark = [pytest.mark.ch06]

# ‖out − ref‖ / ‖ref‖ budgets, from the rounding of each input dtype (fp32 with IEEE dots ~1e-7,
# fp16 ~5e-4, bf16 ~4e-3 measured; a factor of ~5-10 of headroom).
REL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
LSE_ABS_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # bf16 is computed in fp32 there


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _inputs(lead, n_q, n_k, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, n_q, d, generator=gen)
    k = torch.randn(*lead, n_k, d, generator=gen)
    v = torch.randn(*lead, n_k, d, generator=gen)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def check_forward(q, k, v, causal, scale=None):
    from course_lib.kernels.api import flash_attention_with_lse

    o, lse = flash_attention_with_lse(q, k, v, causal=causal, scale=scale)
    ref_o, ref_lse = naive_attention_torch(q.double(), k.double(), v.double(), causal=causal, scale=scale)
    assert o.shape == ref_o.shape and o.dtype == q.dtype and lse.shape == q.shape[:-1]
    assert torch.isfinite(o).all(), "non-finite values in o"
    err = rel_err(o, ref_o)
    assert err < REL_TOL[q.dtype], f"o: relative error {err:.2e} for {tuple(q.shape)} {q.dtype} causal={causal}"
    lse_err = (lse.double() - ref_lse).abs().max().item()
    assert lse_err < LSE_ABS_TOL[q.dtype], f"lse: max error {lse_err:.2e}"


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("lead, n_q, n_k, d, causal", [
    ((2, 3), 37, 53, 16, False),
    ((2, 3), 53, 37, 32, True),
    ((), 100, 100, 64, True),
    ((3,), 1, 70, 48, True),  # one query row, head dim not a power of two
    ((1, 2), 70, 1, 24, False),  # one key
])
def test_forward_matches_reference(lead, n_q, n_k, d, causal, dtype, device):
    check_forward(*_inputs(lead, n_q, n_k, d, dtype, device), causal=causal)


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16), (16, 16)])
@pytest.mark.parametrize("n_q, n_k", [(53, 37), (37, 100)])
def test_forward_many_tiles(block_m, block_n, n_q, n_k, device):
    """Small tiles: several unmasked tiles, a diagonal band that BLOCK_M and BLOCK_N cut
    differently, and ragged ends on both sides."""
    from course_lib.kernels.forward import attention_forward
    from course_lib.kernels.tuning import Blocks

    q, k, v = _inputs((1, 2), n_q, n_k, 32, torch.float32, device, seed=block_m + n_q)
    for causal in (False, True):
        o, lse = attention_forward(q, k, v, causal, 0.3, Blocks(block_m, block_n))
        ref_o, ref_lse = naive_attention_torch(q.double(), k.double(), v.double(), causal=causal, scale=0.3)
        assert rel_err(o, ref_o) < REL_TOL[torch.float32]
        assert (lse.double() - ref_lse).abs().max() < LSE_ABS_TOL[torch.float32]


@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.generate])  # no shrinking: too slow here
@given(lead=st.sampled_from([(), (2,), (1, 2)]), n_q=st.integers(1, 80), n_k=st.integers(1, 80),
       d=st.sampled_from([16, 20, 32, 40, 64]), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**16))
def test_forward_random_shapes(lead, n_q, n_k, d, causal, dtype, seed):
    from course_lib.platform import runtime

    check_forward(*_inputs(lead, n_q, n_k, d, dtype, runtime.current().device, seed), causal=causal)


def test_forward_float64_is_exact_in_interpreter():
    from course_lib.platform import runtime

    if not runtime.current().interpreted:
        pytest.skip("float64 runs only in the interpreter")
    check_forward(*_inputs((2,), 45, 61, 32, torch.float64, "cpu"), causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_sdpa_alignment(causal, device):
    """Top-left causal alignment, N_q < N_k and N_q > N_k, exactly as SDPA's is_causal."""
    for n_q, n_k in ((20, 45), (45, 20)):
        q, k, v = _inputs((2,), n_q, n_k, 16, torch.float32, device)
        from course_lib import flash_attention

        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                               is_causal=causal)
        assert rel_err(flash_attention(q, k, v, causal=causal), ref) < REL_TOL[torch.float32]


def test_forward_non_contiguous_and_leading_dims(device):
    from course_lib import flash_attention

    gen = torch.Generator().manual_seed(1)
    # (B, N, H, d) memory viewed as (B, H, N, d); k with a non-unit last stride
    q = torch.randn(2, 41, 3, 32, generator=gen).to(device).transpose(1, 2)
    k = torch.randn(2, 3, 32, 29, generator=gen).to(device).transpose(-1, -2)  # (2, 3, 29, 32), stride_d = 29
    v = torch.randn(2, 3, 29, 64, generator=gen).to(device)[..., ::2]  # stride_d = 2
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    ref, _ = naive_attention_torch(q.double(), k.double(), v.double(), causal=True)
    assert rel_err(flash_attention(q, k, v, causal=True), ref) < REL_TOL[torch.float32]
    # (N, d), (B, N, d) and 5-D inputs give the same rows
    x2 = q[0, 0].contiguous()
    ref2, _ = naive_attention_torch(x2.double(), x2.double(), x2.double())
    assert flash_attention(x2, x2, x2).shape == x2.shape
    assert rel_err(flash_attention(x2, x2, x2), ref2) < REL_TOL[torch.float32]
    x5 = torch.randn(2, 1, 2, 17, 16, generator=gen).to(device)
    ref5, _ = naive_attention_torch(x5.double(), x5.double(), x5.double(), causal=True)
    assert rel_err(flash_attention(x5, x5, x5, causal=True), ref5) < REL_TOL[torch.float32]


def test_interpreter_uses_one_config_gpu_several():
    from course_lib.kernels import tuning

    assert len(tuning.forward_configs()) > 1
    assert tuning.INTERPRETER_FORWARD.block_m >= 16 and tuning.INTERPRETER_FORWARD.block_n >= 16


# ------------------------------------------------------------------------------------------------
# GPU: the same checks natively, bf16 included, head dims 64 and 128, N up to 16k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, n", [(dt, n) for dt in (torch.float16, torch.bfloat16) for n in (1000, 4096, 16384)]
                         + [(torch.float32, 1000), (torch.float32, 4096)],  # IEEE fp32 dots are slow
                         ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_gpu_large(dtype, d, n, causal):
    heads = 2 if n <= 4096 else 1
    check_forward(*_inputs((1, heads), n, n, d, dtype, "cuda", seed=n + d), causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_forward_gpu_ragged_and_odd_head_dims(dtype):
    for lead, n_q, n_k, d, causal in [((2, 3), 1000, 777, 80, True), ((3,), 333, 2049, 96, True),
                                      ((2, 2), 129, 129, 256, False), ((1, 4), 517, 517, 16, True)]:
        check_forward(*_inputs(lead, n_q, n_k, d, dtype, "cuda"), causal=causal)


@pytest.mark.parametrize("order", [0, 1, 2])
def test_every_program_order_gives_the_same_causal_forward(order, device, monkeypatch):
    """tiles.program_tile_ordered only renumbers the programs: each order covers every (head, tile)
    once, on ragged N, several heads and batches, pointer and descriptor kernels alike."""
    from course_lib.kernels import hopper, tuning
    from course_lib.kernels.forward import attention_forward
    from course_lib.attention.reference import naive_attention_torch

    monkeypatch.setattr(tuning, "CAUSAL_ORDER", order)
    dtype, tol = (torch.float64, 1e-12) if device == "cpu" else (torch.float32, 1e-5)
    gen = torch.Generator().manual_seed(order)
    q, k, v = (torch.randn(2, 3, 77, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    ref, ref_lse = naive_attention_torch(q, k, v, causal=True, scale=0.3)
    qd, kd, vd = (x.to(device=device, dtype=dtype) for x in (q, k, v))
    o, lse = attention_forward(qd, kd, vd, True, 0.3, tuning.Blocks(16, 32))
    assert (o.double().cpu() - ref).abs().max() < tol and (lse.double().cpu() - ref_lse).abs().max() < tol
    q32, k32, v32 = (x.to(device=device, dtype=torch.float32) for x in (q, k, v))
    if hopper.tma_unsupported_reason(q32, k32, v32) is None:  # the interpreter or a Hopper GPU
        o_tma, _ = hopper.attention_forward_tma(q32, k32, v32, True, 0.3, blocks=tuning.Blocks(16, 32))
        assert (o_tma.double().cpu() - ref).abs().max() < 1e-5
