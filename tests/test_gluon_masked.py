"""The Gluon masked forward for Hopper (course_lib/kernels/gluon_masked.py).

Without a GPU: the kernel is cross-compiled for sm_90 (in a child process: the stand-in driver
cannot compile once Triton's interpreter has run a kernel in the process) and the tests read from
the compiled kernel that it fits and keeps the ping-pong design; the dispatch rules say, by name,
why an input goes to the Triton kernel. On a Hopper GPU (``-m gpu``): its output against the
Triton masked kernel and a float64 reference, and ``course_lib``'s masked calls taking it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_lib.attention import blockmask as bm
from course_lib.kernels import gluon_hopper as gh
from course_lib.kernels import gluon_masked as gm

if not gh.available():  # pragma: no cover - depends on the installed Triton
    pytest.skip(f"gluon not importable: {gh.GLUON_IMPORT_ERROR}", allow_module_level=True)

H100_BLOCK_SHARED_BYTES = 227 * 1024
O_TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}  # max |o - o_ref| (tools/gluon_forward.py's)
ROOT = Path(__file__).resolve().parent.parent
# name -> keyword arguments of gm.cross_compile: every element rule, both head dims and dtypes, GQA
COMPILE_CASES = {
    "causal+window d128 fp16 GQA": dict(q_shape=(1, 4, 1000, 128), kv_heads=2, dtype="float16", causal=True,
                                        window=(300, 0)),
    "documents d128 bf16": dict(q_shape=(2, 2, 1000, 128), kv_heads=2, dtype="bfloat16", causal=False, documents=4),
    "dense mask d64 fp16": dict(q_shape=(1, 2, 1008, 64), kv_heads=1, dtype="float16", causal=False,
                                dense_mask=True),
}
CHILD = """
import json, sys, torch
from course_lib.kernels import gluon_masked as gm
out = {}
for name, kw in json.loads(sys.argv[1]).items():
    kw = dict(kw, dtype=getattr(torch, kw["dtype"]), q_shape=tuple(kw["q_shape"]))
    out[name] = gm.cross_compile(**kw)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def facts():
    """kernel_facts of each COMPILE_CASES entry, compiled in a fresh Python process."""
    if torch.cuda.is_available():  # the masked API refuses CPU tensors in a GPU session
        pytest.skip("cross-compiling from CPU tensors runs where there is no GPU (CI); here the gpu tests run "
                    "the kernel itself")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(COMPILE_CASES)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", COMPILE_CASES)
def test_compiles_without_spills_within_shared_memory(facts, case):
    f = facts[case]
    assert f["spill_bytes"] == 0, f
    assert 0 < f["shared_bytes"] <= H100_BLOCK_SHARED_BYTES, f
    assert f["wgmma"] > 0, f


@pytest.mark.parametrize("case", COMPILE_CASES)
def test_keeps_the_ping_pong_design(facts, case):
    """Producer warp with LOADER_REGS registers, consumers with CONSUMER_REGS (setmaxnreg), and in
    each of the two consumer partitions a product left running across the softmax."""
    cfg = gh.config(gm.VARIANT, COMPILE_CASES[case]["q_shape"][-1])
    f = facts[case]
    assert f"dec {cfg['LOADER_REGS']}" in f["setmaxnreg"], f
    assert f"inc {cfg['CONSUMER_REGS']}" in f["setmaxnreg"], f
    assert f["wait_group_1"] == 2, f


def test_dense_mask_costs_at_most_its_layout_change_in_shared_memory(facts):
    """The dense mask's tile goes through shared memory to reach the scores' layout: 64 rows x 128
    bytes per consumer, on top of Q, the K/V rings and the barriers."""
    f = facts["dense mask d64 fp16"]
    rings = (128 + 2 * 3 * 128) * 64 * 2  # Q + 3 slots of K and V tiles, fp16, d=64
    assert rings <= f["shared_bytes"] <= rings + 2 * 64 * 128 + 1024, f


# ----------------------------------------------------------------------------------------------
# Which inputs the library sends to the kernel


def _plan(q, k, **kwargs):
    from course_lib.platform import runtime
    from course_lib.kernels import api

    if runtime.current().on_gpu:
        pytest.skip("builds plans from CPU tensors through the API, which a GPU session refuses (CI runs it); "
                    "the GPU tests below cover this machine")

    return api._masked_call(q, k, k, kwargs.get("causal", False), None, kwargs.get("window"),
                            kwargs.get("seq_lens"), kwargs.get("block_mask"))[-1]


def _cpu(*shape, dtype=torch.float16):
    return torch.zeros(shape, dtype=dtype)


N = 1000
CAUSAL_128 = dict(block_mask=bm.causal_block_mask(N, N, 128, 128))


@pytest.mark.parametrize("make,match", [
    (lambda: (_cpu(1, 4, N, 128), _cpu(1, 2, N, 128), dict(CAUSAL_128, seq_lens=torch.tensor([900]))),
     "per-sample lengths"),
    (lambda: (_cpu(1, 4, N, 128), _cpu(1, 2, N, 128), dict(causal=True)), "tiles must be 128x128"),  # CPU: 64x64
    (lambda: (_cpu(1, 2, N, 96), _cpu(1, 2, N, 96), CAUSAL_128), "head dim must be one of"),
    (lambda: (_cpu(1, 2, N, 64, dtype=torch.float32), _cpu(1, 2, N, 64, dtype=torch.float32), CAUSAL_128),
     "float16 or bfloat16"),
    (lambda: (_cpu(1, 2, N, 64), _cpu(1, 2, N, 64),
              dict(block_mask=bm.BlockMask.from_mask_mod(bm.causal_mask_mod, None, None, N, N, 128, 128))),
     "multiple of 16 bytes"),
])
def test_unsupported_inputs_are_named(make, match):
    q, k, kwargs = make()
    plan = _plan(q, k, **kwargs)
    with gh.stand_in_sm90():  # past the "needs a Hopper GPU" check, to the input checks
        assert match in gm.masked_gluon_unsupported_reason(q, k, k, plan)
        with pytest.raises(ValueError, match=f"masked_forward_gluon: q, k, v, plan: .*{match}"):
            gm.masked_forward_gluon(q, k, k, 1.0, plan)


def test_covered_inputs_have_no_reason():
    q, k = _cpu(1, 4, N, 128), _cpu(1, 2, N, 128)
    ids = torch.arange(N) * 3 // N
    for kwargs in (CAUSAL_128, dict(block_mask=bm.document_block_mask(ids, 128, 128)),
                   dict(block_mask=bm.sliding_window_block_mask(N, N, (200, 0), 128, 128, causal=True))):
        plan = _plan(q, k, **kwargs)
        with gh.stand_in_sm90():
            assert gm.masked_gluon_unsupported_reason(q, k, k, plan) is None
        assert "CPU tensors are only accepted" in gm.masked_gluon_unsupported_reason(q, k, k, plan)
        assert not gm.library_uses_gluon_masked(q, k, k, plan)  # the interpreter keeps the Triton kernel


def test_tile_order_takes_the_heaviest_q_tiles_first():
    causal = bm.causal_block_mask(N, N, 128, 128)
    assert gm.tile_order(causal).tolist() == [[list(range(7, -1, -1))]]  # the diagonal's rows grow
    ids = torch.arange(N) * 3 // N  # three documents: the Q tiles on a boundary visit more K/V tiles
    docs = bm.document_block_mask(ids, 128, 128)
    order = gm.tile_order(docs)[0, 0].long()
    counts = (docs.full_kv_num_blocks + docs.kv_num_blocks)[0, 0]
    assert sorted(order.tolist()) == list(range(8))
    assert (counts[order].diff() <= 0).all() and counts.unique().numel() > 1
    assert gm.tile_order(docs, heaviest_first=False).tolist() == [[list(range(7, -1, -1))]]
    assert gm.tile_order(docs) is gm.tile_order(docs)  # computed once per block mask
    # the backward's order, over the K/V tiles (the transposed lists): causal, the first ones first
    assert gm.tile_order(causal, transposed=True).tolist() == [[list(range(8))]]
    order_t = gm.tile_order(docs, transposed=True)[0, 0].long()
    counts_t = (docs.full_q_num_blocks + docs.q_num_blocks)[0, 0]
    assert sorted(order_t.tolist()) == list(range(8)) and (counts_t[order_t].diff() <= 0).all()


# ----------------------------------------------------------------------------------------------
# GPU


def _gpu_cases(n, batch):
    """(name, kwargs of flash_attention_with_lse, element mask) on the GPU."""
    from test_kernels_masked import element_mask

    gen = torch.Generator().manual_seed(n)
    ids = torch.sort(torch.randint(0, 5, (batch, n), generator=gen), dim=-1).values
    t = -(-n // 128)
    layout = torch.rand(t, t, generator=gen) < 0.4
    layout[1] = False  # a Q tile that sees no key: o = 0, lse = -inf
    keep = (torch.rand(n, n, generator=gen) < 0.6) & (torch.arange(n)[None, :] <= torch.arange(n)[:, None] + 200)
    return [
        ("causal+window", dict(causal=True, window=(300, 0)), element_mask(n, n, True, (300, 0))),
        ("documents", dict(block_mask=bm.document_block_mask(ids, 128, 128).to("cuda")),
         (ids[:, :, None] == ids[:, None, :])[:, None]),
        ("random blocks", dict(block_mask=bm.BlockMask.from_layout(layout, n, n, 128, 128).to("cuda")),
         layout.repeat_interleave(128, 0).repeat_interleave(128, 1)[None, None, :n, :n]),
        ("dense mask", dict(block_mask=bm.BlockMask.from_mask_mod(lambda b, h, i, j: keep[i, j], None, None, n, n,
                                                                  128, 128).to("cuda")), keep[None, None]),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_matches_triton_and_float64(d, dtype, monkeypatch):
    """On Hopper, masked calls (ragged N, GQA group 2) take the Gluon kernel; its o and lse are as
    close to a float64 reference as the Triton kernel's, rows that see no key get o = 0 and
    lse = -inf exactly, and COURSE_LIB_GLUON=0 gives the Triton kernel back."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are Hopper-only (compute capability 9.x); this GPU is not")
    from test_kernels_masked import reference

    from course_lib import flash_attention_with_lse

    calls = []
    real = gm.masked_forward_gluon
    monkeypatch.setattr(gm, "masked_forward_gluon", lambda *a: calls.append(1) or real(*a))
    for n in (1000, 1008):  # 1008: the dense mask's rows are 16-byte aligned (1000: Triton's)
        gen = torch.Generator(device="cuda").manual_seed(d)
        q = torch.randn(2, 4, n, d, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(2, 2, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        for name, kwargs, mask in _gpu_cases(n, 2):
            o_ref, lse_ref = reference(q, k, v, mask.cuda())
            calls.clear()
            o, lse = flash_attention_with_lse(q, k, v, **kwargs)
            assert calls == ([] if (name == "dense mask" and n == 1000) else [1]), name
            monkeypatch.setenv("COURSE_LIB_GLUON", "0")
            o_t, lse_t = flash_attention_with_lse(q, k, v, **kwargs)
            monkeypatch.delenv("COURSE_LIB_GLUON")
            assert len(calls) <= 1
            empty = torch.isinf(lse_ref)
            assert torch.equal(torch.isinf(lse), empty) and (o[empty] == 0).all(), name
            err = (o.double() - o_ref).abs().max().item()
            err_t = (o_t.double() - o_ref).abs().max().item()
            assert err <= O_TOL[dtype] and err <= 2 * err_t + 1e-3, (name, n, err, err_t)
            lse_err = (lse.double() - lse_ref)[~empty].abs().max().item()
            assert lse_err < 1e-3, (name, n, lse_err)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_varlen_runs_as_documents_on_gluon(d, monkeypatch):
    """On Hopper, flash_attention_varlen with shared offsets runs the Gluon kernels (forward and
    backward) on a document mask over the packed tokens; its output and gradients match float64 as
    closely as the Triton path's (deterministic=True backward; different offsets keep the ragged
    Triton plan)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are Hopper-only (compute capability 9.x); this GPU is not")
    from test_kernels_masked import reference, varlen_reference_mask

    from course_lib import flash_attention_varlen
    from course_lib.kernels import gluon_backward as gb

    calls = []
    real_f, real_b = gm.masked_forward_gluon, gb.masked_backward_gluon
    monkeypatch.setattr(gm, "masked_forward_gluon", lambda *a, **kw: calls.append("f") or real_f(*a, **kw))
    monkeypatch.setattr(gb, "masked_backward_gluon", lambda *a, **kw: calls.append("b") or real_b(*a, **kw))
    lens = [300, 1000, 1, 0, 555]
    gen = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(sum(lens), 8, d, device="cuda", dtype=torch.float16, generator=gen)
    k, v = (torch.randn(sum(lens), 2, d, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
    do = torch.randn(q.shape, device="cuda", dtype=torch.float16, generator=gen)
    for causal, window in ((True, None), (False, None), (True, (100, 0))):
        mask, cq, ck = varlen_reference_mask(lens, lens, causal, window)
        exact = [x.double().transpose(0, 1)[None].requires_grad_() for x in (q, k, v)]
        o_ref, _ = reference(*exact, mask.cuda())
        o_ref = o_ref[0].transpose(0, 1)
        ref = torch.autograd.grad(o_ref, exact, do.double())
        out = {}
        for deterministic in (False, True):
            calls.clear()
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            o = flash_attention_varlen(*leaves, cq.cuda(), ck.cuda(), max(lens), max(lens), causal=causal,
                                       window=window, deterministic=deterministic)
            grads = torch.autograd.grad(o, leaves, do)
            assert calls == (["f"] if deterministic else ["f", "b"]), (causal, window, deterministic)
            out[deterministic] = [o, *grads]
        for i, name in enumerate(("o", "dq", "dk", "dv")):
            want = o_ref if i == 0 else ref[i - 1][0].transpose(0, 1)
            err = (out[False][i].double() - want).abs().max().item()
            err_t = (out[True][i].double() - want).abs().max().item()
            assert err <= 2 * err_t + 2e-3, (causal, window, name, err, err_t)
    calls.clear()
    cq_other = torch.tensor([0, 300, 1300, 1301, 1301, sum(lens)], device="cuda")
    ck_other = torch.tensor([0, 301, 1300, 1301, 1301, sum(lens)], device="cuda")
    flash_attention_varlen(q, k, v, cq_other, ck_other, 1000, 1000)
    assert calls == []  # offsets that differ: the ragged Triton kernels
