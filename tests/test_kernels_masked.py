"""The masked Triton kernels (chapter 10) against a float64 reference with the equivalent explicit
boolean mask: every mask kind with and without ``causal``, GQA/MQA, padded and packed variable
lengths, rows that see no key, forward and gradients; and every named error of the new arguments.

On CPU these run in Triton's interpreter at small ragged sizes (tiles of 16x32 so that one call
has full, partial and skipped tiles); the ``gpu``-marked tests add fp16/bf16 at larger N.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from course_lib.attention import blockmask as bm

pytestmark = pytest.mark.ch10

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 query rows x 32 keys for the masked kernels (the interpreter's default is 64x64)."""
    from course_lib.kernels import masked

    monkeypatch.setattr(masked, "tile_sizes", lambda head_dim, dtype: (16, 32))


@pytest.fixture
def sub_steps(monkeypatch):
    """Kernel tiles of 16x16 under block masks of 32x32 tiles (the API's) or of the test's own 16x32:
    each program owns part of a block-mask tile and walks each listed tile in several steps."""
    from course_lib.kernels import masked, tuning

    small = tuning.Blocks(16, 16)
    monkeypatch.setattr(masked, "launch_blocks", lambda head_dim, dtype: dict.fromkeys(("forward", "dq", "dkdv"), small))
    monkeypatch.setattr(masked, "tile_sizes", lambda head_dim, dtype: (32, 32))


def reference(q, k, v, mask, scale=None):
    """float64 ``(o, lse)`` with a boolean ``mask`` broadcast to ``(B, H, N_q, N_k)``; K/V heads are
    repeated for GQA; rows with no visible key give ``o = 0``, ``lse = -inf``."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    k = k.double().repeat_interleave(heads // kv_heads, dim=-3)
    v = v.double().repeat_interleave(heads // kv_heads, dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * (q.double() @ k.transpose(-1, -2))
    mask = mask.to(s.device).expand_as(s)
    seen = mask.any(-1, keepdim=True)
    s = torch.where(mask, s, float("-inf"))
    s = torch.where(seen, s, 0.0)  # empty rows: finite scores, zeroed below (no NaN anywhere)
    p = torch.softmax(s, dim=-1) * seen
    lse = torch.where(seen[..., 0], torch.logsumexp(s, dim=-1), float("-inf"))
    return p @ v, lse


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1.0)).item()


def leaves(shapes, dtype=torch.float32, seed=0):
    from course_lib.platform import runtime

    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(device=runtime.current().device, dtype=dtype).requires_grad_()
            for s in shapes]


def check(run, q, k, v, mask, scale=None):
    """Forward, lse and the three gradients of ``run(q, k, v)`` against :func:`reference`."""
    o = run(q, k, v)
    ref_o, ref_lse = reference(q, k, v, mask.to(q.device), scale)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert torch.isfinite(o).all()
    assert rel_err(o, ref_o) < TOL[q.dtype], rel_err(o, ref_o)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_grads = torch.autograd.grad(reference(q64, k64, v64, mask.to(q.device), scale)[0], (q64, k64, v64),
                                    do.double())
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape and torch.isfinite(g).all()
        assert rel_err(g, r) < TOL[q.dtype], f"d{name}: {rel_err(g, r):.2e}"
    return ref_lse


def element_mask(n_q, n_k, causal=False, window=None, len_q=None, len_k=None, batch=1):
    """``(B, 1, n_q, n_k)``: FlashAttention-2's window (bottom-right, per sample), top-left causal,
    lengths — written from the definitions, independently of the library."""
    out = torch.zeros(batch, 1, n_q, n_k, dtype=torch.bool)
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    for b in range(batch):
        lq = n_q if len_q is None else int(len_q[b])
        lk = n_k if len_k is None else int(len_k[b])
        m = (i < lq) & (j < lk)
        if window is not None:
            if window[0] >= 0:
                m &= j >= i + lk - lq - window[0]
            if window[1] >= 0:
                m &= j <= i + lk - lq + window[1]
        if causal:
            m &= j <= i
        out[b, 0] = m
    return out


# ----------------------------------------------------------------------------------------------
# every mask kind, with and without causal


WINDOWS = [(8, 0), (5, 12), (-1, 3)]  # (0, 0) and one-sided windows: test_rows_with_no_visible_key, the property test


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_sliding_window(window, causal, small_tiles):
    from course_lib import flash_attention

    n_q, n_k = 45, 70  # ragged, N_q != N_k: the window is bottom-right aligned
    q, k, v = leaves([(1, 2, n_q, 16), (1, 2, n_k, 16), (1, 2, n_k, 16)], seed=len(str(window)))
    check(lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window), q, k, v,
          element_mask(n_q, n_k, causal, window))


@pytest.mark.parametrize("causal", [False, True])
def test_seq_lens(causal, small_tiles):
    from course_lib import flash_attention

    lens = torch.tensor([70, 33, 0, 17])
    q, k, v = leaves([(4, 1, 70, 16)] * 3, seed=1)
    ref_lse = check(lambda q, k, v: flash_attention(q, k, v, causal=causal, seq_lens=lens.to(q.device)),
                    q, k, v, element_mask(70, 70, causal, None, lens, lens, batch=4))
    assert torch.isinf(ref_lse[2]).all()


def test_seq_lens_pair_with_window(small_tiles):
    """Different query and key lengths per sample; the window is aligned per sample."""
    from course_lib import flash_attention

    len_q, len_k = torch.tensor([20, 45]), torch.tensor([60, 9])
    q, k, v = leaves([(2, 2, 45, 16), (2, 2, 60, 16), (2, 2, 60, 16)], seed=2)
    check(lambda q, k, v: flash_attention(q, k, v, window=(6, 2), seq_lens=(len_q, len_k)),
          q, k, v, element_mask(45, 60, False, (6, 2), len_q, len_k, batch=2))


@pytest.mark.parametrize("causal", [False, True])
def test_document_mask(causal):
    from course_lib import flash_attention

    docs = torch.tensor([[0] * 10 + [1] * 30 + [2] * 3 + [3] * 27, [0] * 40 + [5] * 30])
    mask = bm.document_block_mask(docs, 16, 32, causal=causal)
    q, k, v = leaves([(2, 1, 70, 16)] * 3, seed=3)
    dense = (docs[:, :, None] == docs[:, None, :])[:, None] & element_mask(70, 70, causal)
    check(lambda q, k, v: flash_attention(q, k, v, causal=causal, block_mask=mask), q, k, v, dense)


@pytest.mark.parametrize("causal", [False, True])
def test_mask_mod_block_mask(causal):
    """Any predicate (FlexAttention's mask_mod): exact tile classes, the dense mask on partial tiles;
    per-head masks, one head with an empty row."""
    from course_lib import flash_attention

    def mask_mod(b, h, q_idx, kv_idx):
        return (((q_idx - kv_idx) % 5 == 0) & (q_idx != 3)) | ((h == 1) & (kv_idx >= 50))

    n_q, n_k = 45, 70
    mask = bm.BlockMask.from_mask_mod(mask_mod, None, 2, n_q, n_k, 16, 32)
    q, k, v = leaves([(2, 2, n_q, 16), (2, 2, n_k, 16), (2, 2, n_k, 16)], seed=4)
    check(lambda q, k, v: flash_attention(q, k, v, causal=causal, block_mask=mask), q, k, v,
          mask.mask & element_mask(n_q, n_k, causal))


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_layout(causal):
    from course_lib import flash_attention

    gen = torch.Generator().manual_seed(5)
    layout = torch.rand(2, 1, 3, 3, generator=gen) < 0.5
    layout[:, :, 0, 0] = True
    mask = bm.BlockMask.from_layout(layout, 45, 70, 16, 32)
    dense = layout.repeat_interleave(16, 2).repeat_interleave(32, 3)[..., :45, :70]
    q, k, v = leaves([(2, 2, 45, 16), (2, 2, 70, 16), (2, 2, 70, 16)], seed=5)
    check(lambda q, k, v: flash_attention(q, k, v, causal=causal, block_mask=mask), q, k, v,
          dense & element_mask(45, 70, causal))


def test_block_mask_with_window_and_seq_lens():
    """A block mask, a window and lengths together: the tile classes are intersected."""
    from course_lib import flash_attention

    mask = bm.BlockMask.from_mask_mod(lambda b, h, qi, kj: (qi + kj) % 3 != 0, None, None, 64, 64, 16, 16)
    lens = torch.tensor([64, 40])
    q, k, v = leaves([(2, 1, 64, 16)] * 3, seed=6)
    check(lambda q, k, v: flash_attention(q, k, v, causal=True, window=(9, 0), seq_lens=lens,
                                          block_mask=mask), q, k, v,
          mask.mask & element_mask(64, 64, True, (9, 0), lens, lens, batch=2))


def test_builder_block_masks_carry_their_element_rules():
    """causal_block_mask & co. store their rule: the kernel applies it on partial tiles without the
    caller repeating ``causal=`` / ``window=`` / ``seq_lens=``."""
    from course_lib import flash_attention

    lens = torch.tensor([50, 21])
    q, k, v = leaves([(2, 1, 50, 16)] * 3, seed=12)
    for block, mask in ((bm.causal_block_mask(50, 50, 16, 32), element_mask(50, 50, True)),
                        (bm.sliding_window_block_mask(50, 50, (6, 3), 16, 32, causal=True),
                         element_mask(50, 50, True, (6, 3))),
                        (bm.length_block_mask(lens, lens, 50, 50, 16, 32),
                         element_mask(50, 50, False, None, lens, lens, 2))):
        o = flash_attention(q, k, v, block_mask=block)
        assert rel_err(o, reference(q, k, v, mask)[0]) < 1e-5
    with pytest.raises(ValueError, match="window is given twice"):
        flash_attention(q, k, v, window=(1, 1), block_mask=bm.sliding_window_block_mask(50, 50, (6, 3), 16, 32))
    with pytest.raises(ValueError, match="seq_lens is given twice"):
        flash_attention(q, k, v, seq_lens=lens, block_mask=bm.length_block_mask(lens, lens, 50, 50, 16, 32))


@pytest.mark.parametrize("case", ["window", "seq_lens", "documents", "mask_mod", "layout", "varlen"])
def test_kernel_tiles_smaller_than_the_block_mask(case, sub_steps):
    """The same cases with 16x16 kernel tiles under larger block-mask tiles (the GPU's case: 128x128
    masks, 128x64 forward and 64x128 dK/dV tiles); the fixture passed on is unused by the bodies."""
    cases = {"window": lambda: test_sliding_window((5, 12), True, None),
             "seq_lens": lambda: test_seq_lens_pair_with_window(None),
             "documents": lambda: test_document_mask(True),
             "mask_mod": lambda: test_mask_mod_block_mask(False),
             "layout": lambda: test_block_sparse_layout(True),
             "varlen": lambda: test_varlen(True, (6, -1), 2, None)}
    cases[case]()


# ----------------------------------------------------------------------------------------------
# GQA / MQA, empty rows, lse, the dense path untouched


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["group1", "group2", "MQA"])
def test_gqa(kv_heads, small_tiles):
    from course_lib import flash_attention

    q, k, v = leaves([(1, 4, 45, 16), (1, kv_heads, 50, 16), (1, kv_heads, 50, 16)], seed=kv_heads)
    check(lambda q, k, v: flash_attention(q, k, v, window=(7, 7), causal=True), q, k, v,
          element_mask(45, 50, True, (7, 7)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision(dtype, small_tiles):
    """fp16 and bf16 inputs (bf16 is computed in fp32 by the interpreter, rounded back)."""
    from course_lib import flash_attention

    q, k, v = leaves([(1, 2, 40, 16), (1, 1, 40, 16), (1, 1, 40, 16)], dtype=dtype, seed=14)
    check(lambda q, k, v: flash_attention(q, k, v, causal=True, window=(9, 0)), q, k, v,
          element_mask(40, 40, True, (9, 0)))


def test_gqa_without_mask_matches_sdpa():
    """GQA alone routes to the masked kernels (dense tiles); SDPA's enable_gqa is the reference."""
    from course_lib import flash_attention

    from course_lib.platform import runtime

    dtype = torch.float64 if runtime.current().interpreted else torch.float32  # float64: interpreter only
    q, k, v = leaves([(1, 4, 40, 16), (1, 2, 40, 16), (1, 2, 40, 16)], dtype=dtype, seed=8)
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), is_causal=True,
                                                           enable_gqa=True)
    assert rel_err(flash_attention(q, k, v, causal=True), ref) < TOL[dtype]


def test_rows_with_no_visible_key():
    """N_q > N_k with a bottom-right window (0, 0): the first N_q - N_k rows see nothing."""
    from course_lib.kernels.api import flash_attention, flash_attention_with_lse

    q, k, v = leaves([(1, 2, 50, 16), (1, 2, 20, 16), (1, 2, 20, 16)], seed=9)
    o, lse = flash_attention_with_lse(q, k, v, window=(0, 0))
    assert torch.equal(o[..., :30, :], torch.zeros_like(o[..., :30, :]))
    assert torch.isneginf(lse[..., :30]).all() and torch.isfinite(lse[..., 30:]).all()
    ref_lse = check(lambda q, k, v: flash_attention(q, k, v, window=(0, 0)), q, k, v,
                    element_mask(50, 20, False, (0, 0)))
    assert torch.allclose(lse[..., 30:].double(), ref_lse[..., 30:], atol=1e-5)
    o = flash_attention(q, k, v, window=(0, 0))
    (gq,) = torch.autograd.grad(o.sum(), (q,))
    assert torch.equal(gq[..., :30, :], torch.zeros_like(gq[..., :30, :]))


def test_lse_matches_reference(small_tiles):
    from course_lib.kernels.api import flash_attention_with_lse

    q, k, v = leaves([(2, 2, 45, 16), (2, 1, 70, 16), (2, 1, 70, 16)], seed=10)
    lens = (torch.tensor([45, 20]), torch.tensor([70, 31]))
    o, lse = flash_attention_with_lse(q, k, v, window=(10, 0), seq_lens=lens)
    ref_o, ref_lse = reference(q, k, v, element_mask(45, 70, False, (10, 0), *lens, batch=2))
    assert lse.shape == (2, 2, 45) and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max() < 1e-5
    assert rel_err(o, ref_o) < 1e-5


def test_dense_and_causal_paths_do_not_use_the_masked_kernels(monkeypatch):
    from course_lib import flash_attention
    from course_lib.kernels import masked

    def refuse(*args, **kwargs):
        raise AssertionError("the masked kernel ran")

    monkeypatch.setattr(masked, "masked_forward", refuse)
    q, k, v = leaves([(1, 2, 20, 16)] * 3)
    for causal in (False, True):
        flash_attention(q, k, v, causal=causal)
    with pytest.raises(AssertionError, match="the masked kernel ran"):
        flash_attention(q, k, v, window=(3, 3))


# ----------------------------------------------------------------------------------------------
# packed variable lengths (FlashAttention-2's varlen layout)


def varlen_reference_mask(lens_q, lens_k, causal, window):
    """Block-diagonal ``(1, 1, total_q, total_k)``: each sequence bottom-right aligned (FA2)."""
    cq = [0] + torch.tensor(lens_q).cumsum(0).tolist()
    ck = [0] + torch.tensor(lens_k).cumsum(0).tolist()
    out = torch.zeros(1, 1, cq[-1], ck[-1], dtype=torch.bool)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        m = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            m &= j <= i + lk - lq
        if window is not None:
            if window[0] >= 0:
                m &= j >= i + lk - lq - window[0]
            if window[1] >= 0:
                m &= j <= i + lk - lq + window[1]
        out[0, 0, cq[b]:cq[b + 1], ck[b]:ck[b + 1]] = m
    return out, torch.tensor(cq), torch.tensor(ck)


@pytest.mark.parametrize("causal, window, kv_heads", [(False, None, 2), (True, None, 1), (True, (6, -1), 2),
                                                      (False, (3, 2), 2)])
def test_varlen(causal, window, kv_heads, small_tiles):
    from course_lib import flash_attention_varlen

    lens_q, lens_k = [5, 40, 0, 37], [9, 40, 3, 30]  # an empty sequence, N_q != N_k per sequence
    mask, cq, ck = varlen_reference_mask(lens_q, lens_k, causal, window)
    q, k, v = leaves([(sum(lens_q), 2, 16), (sum(lens_k), kv_heads, 16), (sum(lens_k), kv_heads, 16)], seed=11)

    def run(q, k, v):
        o = flash_attention_varlen(q, k, v, cq.to(q.device), ck.to(q.device), max(lens_q), max(lens_k),
                                   causal=causal, window=window)
        return o

    def as_bhnd(x):
        return x.transpose(0, 1)[None]

    check(lambda q4, k4, v4: as_bhnd(run(q4[0].transpose(0, 1), k4[0].transpose(0, 1), v4[0].transpose(0, 1))),
          *(as_bhnd(x.detach()).requires_grad_() for x in (q, k, v)), mask)
    o, lse = flash_attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal, window=window,
                                    return_lse=True)
    assert o.shape == q.shape and lse.shape == (2, sum(lens_q))


# ----------------------------------------------------------------------------------------------
# the property test of chapters 06/07, over the mask kinds


@settings(max_examples=5, deadline=None, phases=[Phase.explicit, Phase.generate])  # no shrinking: too slow here
@given(kind=st.sampled_from(["window", "seq_lens", "documents", "layout", "gqa"]), causal=st.booleans(),
       n_q=st.integers(1, 70), n_k=st.integers(1, 70), left=st.integers(-1, 30), right=st.integers(-1, 30),
       seed=st.integers(0, 2**16))
def test_random_masks(kind, causal, n_q, n_k, left, right, seed):
    from course_lib import flash_attention

    gen = torch.Generator().manual_seed(seed)
    kv_heads = 1 if kind == "gqa" else 2
    if kind == "documents":
        n_k = n_q
    q, k, v = leaves([(2, 2, n_q, 16), (2, kv_heads, n_k, 16), (2, kv_heads, n_k, 16)], seed=seed)
    kwargs, mask = {}, element_mask(n_q, n_k, causal)
    if kind == "window":
        kwargs["window"] = (left, right)
        mask = element_mask(n_q, n_k, causal, (left, right))
    elif kind == "seq_lens":
        lens = (torch.randint(0, n_q + 1, (2,), generator=gen), torch.randint(0, n_k + 1, (2,), generator=gen))
        kwargs["seq_lens"] = lens
        mask = element_mask(n_q, n_k, causal, None, *lens, batch=2)
    elif kind == "documents":
        docs = torch.sort(torch.randint(0, 4, (2, n_q), generator=gen), dim=-1).values
        kwargs["block_mask"] = bm.document_block_mask(docs, 16, 32)
        mask = mask & (docs[:, :, None] == docs[:, None, :])[:, None]
    elif kind == "layout":
        t_q, t_k = -(-n_q // 16), -(-n_k // 32)
        layout = torch.rand(1, 2, t_q, t_k, generator=gen) < 0.6
        kwargs["block_mask"] = bm.BlockMask.from_layout(layout, n_q, n_k, 16, 32)
        mask = mask & layout.repeat_interleave(16, 2).repeat_interleave(32, 3)[..., :n_q, :n_k]
    check(lambda q, k, v: flash_attention(q, k, v, causal=causal, **kwargs), q, k, v, mask)


# ----------------------------------------------------------------------------------------------
# named errors


def test_named_errors():
    from course_lib.kernels.api import flash_attention, flash_attention_varlen

    q, k, v = leaves([(2, 4, 32, 16)] * 3)
    with pytest.raises(ValueError, match="window sizes must be >= -1"):
        flash_attention(q, k, v, window=(-2, 0))
    with pytest.raises(TypeError, match="window must be a pair"):
        flash_attention(q, k, v, window=5)
    with pytest.raises(ValueError, match=r"H = 4 must be a multiple of the key/value heads H_kv = 3"):
        flash_attention(q, *leaves([(2, 3, 32, 16)] * 2))
    with pytest.raises(ValueError, match="k and v must have the same leading dims"):
        flash_attention(q, *leaves([(2, 2, 32, 16), (2, 1, 32, 16)]))
    with pytest.raises(ValueError, match="same leading dims before the heads"):
        flash_attention(q, *leaves([(1, 2, 32, 16)] * 2), window=(1, 1))
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(B,\) = \(2,\)"):
        flash_attention(q, k, v, seq_lens=torch.tensor([3, 4, 5]))
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, 32\]"):
        flash_attention(q, k, v, seq_lens=torch.tensor([3, 40]))
    with pytest.raises(ValueError, match=r"seq_lens_k must lie in \[0, 32\]"):
        flash_attention(q, k, v, seq_lens=(torch.tensor([3, 4]), torch.tensor([-1, 4])))
    with pytest.raises(TypeError, match="seq_lens must be an integer tensor"):
        flash_attention(q, k, v, seq_lens=torch.tensor([3.0, 4.0]))
    with pytest.raises(ValueError, match=r"seq_lens needs q, k, v of shape \(B, H, N, d\)"):
        flash_attention(q[0], k[0], v[0], seq_lens=torch.tensor([3, 4]))
    with pytest.raises(TypeError, match="block_mask must be a course_lib.attention.blockmask.BlockMask"):
        flash_attention(q, k, v, block_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="block_mask was built for n_q=48, n_k=32"):
        flash_attention(q, k, v, block_mask=bm.causal_block_mask(48, 32, 16, 16))
    with pytest.raises(ValueError, match=r"block_mask has leading dims \(3, 1\)"):
        flash_attention(q, k, v, block_mask=bm.BlockMask(torch.zeros(3, 1, 2, 2, dtype=torch.int8), 32, 32, 16, 16))
    with pytest.raises(TypeError, match="causal must be True or False"):
        flash_attention(q, k, v, causal=1, window=(1, 1))

    lens = [5, 11]
    cu = torch.tensor([0, 5, 16])
    pq, pk, pv = leaves([(16, 4, 16), (16, 2, 16), (16, 2, 16)])
    with pytest.raises(ValueError, match=r"q must be packed as \(total, heads, d\)"):
        flash_attention_varlen(pq[None], pk, pv, cu, cu, 11, 11)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        flash_attention_varlen(pq, pk, pv, torch.tensor([1, 5, 16]), cu, 11, 11)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        flash_attention_varlen(pq, pk, pv, cu, torch.tensor([0, 12, 5, 16]), 11, 11)
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the packed length 16"):
        flash_attention_varlen(pq, pk, pv, torch.tensor([0, 5, 15]), cu, 11, 11)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must have shape \(B \+ 1,\)"):
        flash_attention_varlen(pq, pk, pv, torch.tensor([0]), cu, 11, 11)
    with pytest.raises(TypeError, match="cu_seqlens_k must be an integer tensor"):
        flash_attention_varlen(pq, pk, pv, cu, cu.float(), 11, 11)
    with pytest.raises(ValueError, match=r"max_seqlen_q = 10 is smaller than the longest sequence \(11\)"):
        flash_attention_varlen(pq, pk, pv, cu, cu, 10, 11)
    with pytest.raises(ValueError, match="max_seqlen_k must be a positive int"):
        flash_attention_varlen(pq, pk, pv, cu, cu, 11, 0)
    with pytest.raises(ValueError, match="describe the same number of sequences"):
        flash_attention_varlen(pq, pk, pv, cu, torch.tensor([0, 16]), 11, 16)
    with pytest.raises(ValueError, match="window sizes must be >= -1"):
        flash_attention_varlen(pq, pk, pv, cu, cu, max(lens), max(lens), window=(0, -5))
    with pytest.raises(ValueError, match="GQA: the query heads H = 4"):
        flash_attention_varlen(pq, *leaves([(16, 3, 16)] * 2), cu, cu, 11, 11)


# ----------------------------------------------------------------------------------------------
# GPU: fp16/bf16 at larger N


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_masks_half_precision(dtype, d):
    from course_lib import flash_attention, flash_attention_varlen
    from course_lib.kernels import masked

    n = 1000  # ragged against every tile size
    q, k, v = leaves([(2, 8, n, d), (2, 2, n, d), (2, 2, n, d)], dtype=dtype, seed=d)
    lens = torch.tensor([1000, 613], device=q.device)
    for kwargs, mask in (
            (dict(causal=True, window=(256, 0)), element_mask(n, n, True, (256, 0))),
            (dict(seq_lens=lens), element_mask(n, n, False, None, lens.cpu(), lens.cpu(), batch=2))):
        check(lambda q, k, v: flash_attention(q, k, v, **kwargs), q, k, v, mask)
    docs = torch.sort(torch.randint(0, 6, (2, n), generator=torch.Generator().manual_seed(0)), dim=-1).values
    block = bm.document_block_mask(docs, *masked.tile_sizes(d, dtype))
    check(lambda q, k, v: flash_attention(q, k, v, causal=True, block_mask=block.to(q.device)), q, k, v,
          (docs[:, :, None] == docs[:, None, :])[:, None] & element_mask(n, n, True))
    lens_q = [300, 1000, 1, 555]
    mask, cq, ck = varlen_reference_mask(lens_q, lens_q, True, None)
    pq, pk, pv = leaves([(sum(lens_q), 8, d), (sum(lens_q), 2, d), (sum(lens_q), 2, d)], dtype=dtype)
    o = flash_attention_varlen(pq, pk, pv, cq.cuda(), ck.cuda(), 1000, 1000, causal=True)
    ref, _ = reference(pq.transpose(0, 1)[None], pk.transpose(0, 1)[None], pv.transpose(0, 1)[None], mask.cuda())
    assert rel_err(o, ref[0].transpose(0, 1)) < TOL[dtype]


def test_varlen_plans_are_built_once_per_packing(monkeypatch):
    """flash_attention_varlen keeps its plan per packing (the offsets' values): a repeated call builds
    no tile lists, a new packing does."""
    from course_lib import flash_attention_varlen
    from course_lib.kernels import api

    built = []
    real = bm.band_tile_classes
    monkeypatch.setattr(bm, "band_tile_classes", lambda *a, **kw: built.append(1) or real(*a, **kw))
    q, k, v = leaves([(30, 2, 16), (30, 1, 16), (30, 1, 16)], seed=14)
    cu = torch.tensor([0, 12, 30])
    first = flash_attention_varlen(q, k, v, cu, cu, 18, 18, causal=True)
    assert torch.equal(flash_attention_varlen(q, k, v, cu, cu, 18, 18, causal=True), first)
    assert len(built) == 1
    flash_attention_varlen(q, k, v, torch.tensor([0, 13, 30]), cu, 18, 18, causal=True)
    assert len(built) == 2
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        flash_attention_varlen(q, k, v, cu, cu, 18, 18, deterministic="yes")
    api._VARLEN_CACHE.clear()


def test_plans_are_built_once_per_shape(monkeypatch):
    """Repeated calls with the same shapes and arguments reuse their tile lists (no host work)."""
    from course_lib.kernels import api, masked

    built = []
    real = masked.mask_plan
    monkeypatch.setattr(masked, "mask_plan", lambda *a: built.append(a) or real(*a))
    q, k, v = leaves([(1, 2, 33, 16), (1, 1, 33, 16), (1, 1, 33, 16)], seed=13)
    block = bm.document_block_mask(torch.tensor([0] * 10 + [1] * 23), 16, 16)
    for _ in range(2):
        api.flash_attention(q, k, v, window=(4, 4))
        api.flash_attention(q, k, v, block_mask=block)
    assert len(built) == 2
    api.flash_attention(q, k, v, window=(4, 5))
    api.flash_attention(q, k, v, seq_lens=torch.tensor([20]))  # lengths: planned on every call
    api.flash_attention(q, k, v, seq_lens=torch.tensor([20]))
    assert len(built) == 5
