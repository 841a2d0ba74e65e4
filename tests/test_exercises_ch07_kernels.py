"""Exercise checks of chapter 07, Triton exercises 7.5 (the dK/dV and dQ kernels) and 7.6 (the
autograd Function): correct kernels in several styles pass, stubs fall back to the library's
kernels, and wrong kernels written as a learner would — two independent styles, natural exp in
the tiles' own layout and exp2 on transposed tiles — are rejected with the right cause named or
none, never a wrong one; out-of-bounds accesses get the memory guard's diagnosis."""

from __future__ import annotations

import time

import pytest

from corpus_checks import assert_rejected  # noqa: E402
from course_lib.platform import runtime

runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from course_lib.teaching import checks
from course_lib.teaching.exercises import ch07  # noqa: E402
from course_lib.kernels import backward  # noqa: E402
from course_lib.kernels.api import FlashAttentionFunction  # noqa: E402
from course_lib.kernels.forward import attention_forward  # noqa: E402
from course_lib.kernels.tiles import LOG2_E  # noqa: E402

pytestmark = pytest.mark.ch07

def check_pair(pair):
    return ch07.check_backward_kernels(*pair)


# ---- Exercise 7.5, style 1: exp2 on transposed tiles (keys along the rows) --------------------
# ``BUG`` switches on one mistake; WithBug binds it at launch, so the check sees an ordinary kernel.


@triton.jit
def learner_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
                 stride_qb, stride_qh, stride_qn, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_don, stride_dod,
                 stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                 n_heads, n_q, n_k, scale,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr = ""):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    keys = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    key_ok = keys < n_k
    k = tl.load(K + b * stride_kb + h * stride_kh + keys[:, None] * stride_kn + d[None, :] * stride_kd,
                mask=key_ok[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + keys[:, None] * stride_vn + d[None, :] * stride_vd,
                mask=key_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    start = 0
    if CAUSAL:
        start = (pid * BLOCK_N // BLOCK_M) * BLOCK_M
    for m0 in range(start, n_q, BLOCK_M):
        qs = m0 + tl.arange(0, BLOCK_M)
        q_ok = qs < n_q
        if BUG == "unmasked_load":
            q = tl.load(Q + b * stride_qb + h * stride_qh + qs[:, None] * stride_qn + d[None, :] * stride_qd)
        else:
            q = tl.load(Q + b * stride_qb + h * stride_qh + qs[:, None] * stride_qn + d[None, :] * stride_qd,
                        mask=q_ok[:, None], other=0.0)
        do = tl.load(DO + b * stride_dob + h * stride_doh + qs[:, None] * stride_don + d[None, :] * stride_dod,
                     mask=q_ok[:, None], other=0.0)
        lse = tl.load(LSE + bh * n_q + qs, mask=q_ok, other=0.0)
        delta = tl.load(DELTA + bh * n_q + qs, mask=q_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q)) * (scale * LOG2_E)  # (BLOCK_N, BLOCK_M), log2 units
        if BUG == "exp2_lse_natural":
            p_t = tl.math.exp2(s_t - lse[None, :])
        else:
            p_t = tl.math.exp2(s_t - lse[None, :] * LOG2_E)
        ok = q_ok[None, :] & key_ok[:, None]
        if CAUSAL:
            if BUG != "no_causal_mask":
                ok = ok & (keys[:, None] <= qs[None, :])
        p_t = tl.where(ok, p_t, 0.0)
        if BUG == "dv_p":
            dv += tl.dot(tl.trans(p_t).to(do.dtype), do)
        else:
            dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        if BUG == "d_from_tile":
            delta = tl.sum(p_t * dp_t, axis=0)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    if BUG != "dk_no_scale":
        dk *= scale
    ptrs = b * stride_dkb + h * stride_dkh + keys[:, None] * stride_dkn + d[None, :] * stride_dkd
    if BUG == "unmasked_store":
        tl.store(DK + ptrs, dk.to(DK.dtype.element_ty))
    else:
        tl.store(DK + ptrs, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def learner_dq(Q, K, V, DO, LSE, DELTA, DQ,
               stride_qb, stride_qh, stride_qn, stride_qd,
               stride_kb, stride_kh, stride_kn, stride_kd,
               stride_vb, stride_vh, stride_vn, stride_vd,
               stride_dob, stride_doh, stride_don, stride_dod,
               stride_dqb, stride_dqh, stride_dqn, stride_dqd,
               n_heads, n_q, n_k, scale,
               HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr = ""):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    qs = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q_ok = qs < n_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + qs[:, None] * stride_qn + d[None, :] * stride_qd,
                mask=q_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + qs[:, None] * stride_don + d[None, :] * stride_dod,
                 mask=q_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh * n_q + qs, mask=q_ok, other=0.0)
    delta = tl.load(DELTA + bh * n_q + qs, mask=q_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    end = n_k
    if CAUSAL:
        end = tl.minimum(n_k, pid * BLOCK_M + BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < n_k
        k = tl.load(K + b * stride_kb + h * stride_kh + keys[:, None] * stride_kn + d[None, :] * stride_kd,
                    mask=key_ok[:, None], other=0.0)
        v = tl.load(V + b * stride_vb + h * stride_vh + keys[:, None] * stride_vn + d[None, :] * stride_vd,
                    mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * (scale * LOG2_E)
        if BUG == "exp2_lse_natural":
            p = tl.math.exp2(s - lse[:, None])
        else:
            p = tl.math.exp2(s - lse[:, None] * LOG2_E)
        ok = q_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            if BUG != "no_causal_mask":
                ok = ok & (keys[None, :] <= qs[:, None])
        p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        if BUG == "d_from_tile":
            delta = tl.sum(p * dp, axis=1)
        ds = p * (dp - delta[:, None])
        if BUG == "dq_overwrite":
            dq = tl.dot(ds.to(k.dtype), k).to(tl.float32)
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    if BUG != "dq_no_scale":
        dq *= scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + qs[:, None] * stride_dqn + d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=q_ok[:, None])


class WithBug:
    """``kernel[grid](...)`` with ``BUG=bug`` added: a learner's kernel with one mistake."""

    def __init__(self, kernel, bug):
        self.kernel, self.bug = kernel, bug

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, BUG=self.bug, **kwargs)


def learner_kernels(bug=""):
    return WithBug(learner_dkdv, bug), WithBug(learner_dq, bug)


@triton.jit
def stub_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
              stride_qb, stride_qh, stride_qn, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_dob, stride_doh, stride_don, stride_dod,
              stride_dkb, stride_dkh, stride_dkn, stride_dkd,
              n_heads, n_q, n_k, scale,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    raise NotImplementedError("Exercise 7.5")


@triton.jit
def stub_dq(Q, K, V, DO, LSE, DELTA, DQ,
            stride_qb, stride_qh, stride_qn, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_dob, stride_doh, stride_don, stride_dod,
            stride_dqb, stride_dqh, stride_dqn, stride_dqd,
            n_heads, n_q, n_k, scale,
            HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    raise NotImplementedError("Exercise 7.5")


# ---- Exercise 7.5, style 2: natural exp in the tiles' own layout, as the notebook's answer --------


@triton.jit
def plain_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
               stride_qb, stride_qh, stride_qn, stride_qd,
               stride_kb, stride_kh, stride_kn, stride_kd,
               stride_vb, stride_vh, stride_vn, stride_vd,
               stride_dob, stride_doh, stride_don, stride_dod,
               stride_dkb, stride_dkh, stride_dkn, stride_dkd,
               n_heads, n_q, n_k, scale,
               HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr = ""):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, HEAD_DIM)
    if BUG == "default_scale":
        scale = 1.0 / tl.sqrt(tl.full([], HEAD_DIM, tl.float32))
    kv_mask = cols[:, None] < n_k
    if BUG == "batch_as_head":
        k_base = K + bh * stride_kh
    else:
        k_base = K + b * stride_kb + h * stride_kh
    k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_lo = 0
    if CAUSAL:
        if BUG == "q_lo_start_n":
            q_lo = start_n  # not a multiple of BLOCK_M: the tiles are just placed differently
        else:
            q_lo = (start_n // BLOCK_M) * BLOCK_M
    for start_m in range(q_lo, n_q, BLOCK_M):
        rows = start_m + offs_m
        q_mask = rows[:, None] < n_q
        if BUG == "no_stride_d":
            q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + offs_d[None, :],
                        mask=q_mask, other=0.0)
        else:
            q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn
                        + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
        if BUG == "q_strides_for_do":
            do = tl.load(DO + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn
                         + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
        else:
            do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don
                         + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
        row_base = bh * n_q
        if BUG == "rowstats_no_head":
            row_base = 0
        lse = tl.load(LSE + row_base + rows, mask=rows < n_q, other=0.0)
        delta = tl.load(DELTA + row_base + rows, mask=rows < n_q, other=0.0)
        visible = (rows[:, None] < n_q) & (cols[None, :] < n_k)
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        s = tl.dot(q, tl.trans(k)) * scale
        if BUG == "tile_softmax":
            s = tl.where(visible, s, float("-inf"))
            e = tl.exp(s - tl.max(s, axis=1)[:, None])
            p = e / tl.sum(e, axis=1)[:, None]
        elif BUG == "no_lse":
            p = tl.exp(s)
        else:
            p = tl.exp(s - lse[:, None])
        p = tl.where(visible, p, 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do)
        if BUG == "ds_sign":
            ds = p * (delta[:, None] - tl.dot(do, tl.trans(v)))
        else:
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        if BUG == "dk_ds":
            dk += tl.dot(ds.to(q.dtype), q)
        else:
            dk += tl.dot(tl.trans(ds).to(q.dtype), q)
    dk = dk * scale
    out = b * stride_dkb + h * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def plain_dq(Q, K, V, DO, LSE, DELTA, DQ,
             stride_qb, stride_qh, stride_qn, stride_qd,
             stride_kb, stride_kh, stride_kn, stride_kd,
             stride_vb, stride_vh, stride_vn, stride_vd,
             stride_dob, stride_doh, stride_don, stride_dod,
             stride_dqb, stride_dqh, stride_dqn, stride_dqd,
             n_heads, n_q, n_k, scale,
             HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr = ""):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    if BUG == "default_scale":
        scale = 1.0 / tl.sqrt(tl.full([], HEAD_DIM, tl.float32))
    q_mask = rows[:, None] < n_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=q_mask, other=0.0)
    row_base = bh * n_q
    if BUG == "rowstats_no_head":
        row_base = 0
    lse = tl.load(LSE + row_base + rows, mask=rows < n_q, other=0.0)
    delta = tl.load(DELTA + row_base + rows, mask=rows < n_q, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    kv_end = n_k
    if CAUSAL:
        if BUG == "kv_end_block_n":
            kv_end = tl.minimum(n_k, start_m + BLOCK_N)
        else:
            kv_end = tl.minimum(n_k, start_m + BLOCK_M)
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqn + offs_d[None, :] * stride_dqd
    for start_n in range(0, kv_end, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = cols[:, None] < n_k
        k = tl.load(K + b * stride_kb + h * stride_kh + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(V + b * stride_vb + h * stride_vh + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        visible = (rows[:, None] < n_q) & (cols[None, :] < n_k)
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        s = tl.dot(q, tl.trans(k)) * scale
        if BUG == "tile_softmax":
            s = tl.where(visible, s, float("-inf"))
            e = tl.exp(s - tl.max(s, axis=1)[:, None])
            p = e / tl.sum(e, axis=1)[:, None]
        elif BUG == "no_lse":
            p = tl.exp(s)
        else:
            p = tl.exp(s - lse[:, None])
        p = tl.where(visible, p, 0.0)
        if BUG == "ds_sign":
            ds = p * (delta[:, None] - tl.dot(do, tl.trans(v)))
        else:
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        if BUG == "atomic_dq":  # each K/V tile adds its part straight into DQ (zeroed by the launcher)
            tl.atomic_add(dq_ptrs, (tl.dot(ds.to(k.dtype), k) * scale).to(DQ.dtype.element_ty), mask=q_mask)
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    if BUG != "atomic_dq":
        if BUG == "unmasked_store":
            tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty))
        else:
            tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def plain_kernels(bug=""):
    return WithBug(plain_dkdv, bug), WithBug(plain_dq, bug)


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


@pytest.mark.parametrize("pair", [learner_kernels(), plain_kernels(), plain_kernels("q_lo_start_n"),
                                  plain_kernels("atomic_dq")],
                         ids=["exp2-transposed", "natural-exp", "q-loop-from-start_n", "atomic-dq"])
def test_backward_kernels_correct_answers_pass(pair, capsys):
    chosen, seconds = timed(check_pair, pair)
    assert chosen == pair
    assert "✓ Exercise 7.5: passed (4 cases)" in capsys.readouterr().out
    print(f"check took {seconds:.1f} s")  # timed by tools/check_times.py, not asserted


def test_backward_kernel_stubs_fall_back_to_the_library(capsys):
    fallback = (backward.dkdv_kernel, backward.dq_kernel)
    assert ch07.check_backward_kernels(stub_dkdv, stub_dq) == fallback
    assert "not done yet" in capsys.readouterr().out
    # the notebook goes on with them: launch_backward runs the library's pair, and it is right
    case = ch07.kernel_cases()[1]
    got = ch07.launch_backward(*fallback, *case.args, case.kwargs["causal"], case.kwargs["scale"])
    want = ch07.reference_gradients(*case.args, **case.kwargs)
    for g, w in zip(got, want):  # the check's own tolerance for the case's dtype
        atol, rtol = checks.TOLERANCES[str(g.dtype).replace("torch.", "")]
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


@pytest.mark.library_answers_refused
def test_library_kernels_handed_back_are_not_done(capsys):
    pair = (backward.dkdv_kernel, backward.dq_kernel)
    assert ch07.check_backward_kernels(*pair) == pair
    out = capsys.readouterr().out
    assert "not done yet" in out and "✓" not in out


@pytest.mark.parametrize("pair,cause", [
    (learner_kernels("dk_no_scale"), "the scale is missing from dK"),
    (learner_kernels("dq_no_scale"), "the scale is missing from dQ"),
    (learner_kernels("d_from_tile"), "DELTA was recomputed from this tile's P ∘ dP"),
    (learner_kernels("no_causal_mask"), "the causal mask is missing in the backward"),
    (learner_kernels("dv_p"), "dV uses P instead of Pᵀ"),
    (learner_kernels("dq_overwrite"), "dq is overwritten in the K/V loop"),
    (learner_kernels("exp2_lse_natural"), "exp2 with the scores in log2 units but lse in natural-log"),
    (plain_kernels("tile_softmax"), "P was rebuilt with a softmax over this tile alone"),
    (plain_kernels("ds_sign"), "the sign of dS is flipped"),
    (plain_kernels("dk_ds"), "dK uses dS instead of dSᵀ"),
    (plain_kernels("kv_end_block_n"), "stops at start_m + BLOCK_N"),
    (plain_kernels("rowstats_no_head"), "LSE and DELTA are read without the head's offset"),
    (plain_kernels("default_scale"), "the kernels use 1/√d instead of the scale argument"),
    (plain_kernels("no_lse"), "P = exp(S) without subtracting the saved lse"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 12 else None)
def test_backward_kernel_mistakes_are_rejected(pair, cause):
    _, seconds = timed(assert_rejected, check_pair, pair, cause)
    print(f"check took {seconds:.1f} s")  # timed by tools/check_times.py, not asserted


@pytest.mark.parametrize("pair,expected", [
    (learner_kernels("unmasked_load"), "past the end of"),
    (learner_kernels("unmasked_store"), "outside"),
    (plain_kernels("unmasked_store"), "outside"),
    (plain_kernels("q_strides_for_do"), "`DO`"),
    (plain_kernels("no_stride_d"), "`Q`"),
    (plain_kernels("batch_as_head"), "`K`"),
])
def test_backward_kernel_memory_mistakes_get_the_guards_diagnosis(pair, expected):
    message = assert_rejected(check_pair, pair, None)
    if runtime.current().interpreted:  # the memory guard stops the access before it happens
        assert "stopped before the access" in message and expected in message, message
        assert "program id" in message
    assert len(message.splitlines()) <= 8, message


def test_backward_kernel_diagnosis_is_one_short_message():
    message = assert_rejected(check_pair, learner_kernels("no_causal_mask"), "the causal mask is missing")
    assert "case 2 of 4" in message and "causal" in message and "N_q=45" in message
    assert "dq is wrong" in message and "first bad row 0 (batch 0, head 0)" in message
    assert "Q tile 0 (rows 0..31, block_m=32)" in message and "max abs error" in message
    assert len(message.splitlines()) <= 7


def test_kernel_cases_vary_what_mistakes_depend_on():
    cases = ch07.kernel_cases()
    blocks = {(c.kwargs["block_m"], c.kwargs["block_n"]) for c in cases}
    assert any(m > n for m, n in blocks) and any(m < n for m, n in blocks)
    assert any(c.args[0].shape[0] > 1 for c in cases) and any(c.args[0].shape[1] > 1 for c in cases)
    assert any(c.kwargs["scale"] != c.args[0].shape[-1] ** -0.5 for c in cases)
    assert any(c.args[0].shape[2] > c.args[1].shape[2] and c.kwargs["causal"] for c in cases)
    for c in cases:  # q, k, v, o, do each in its own layout
        assert len(set(c.kwargs["layouts"][:5])) == 5
    for i, name in enumerate(("q", "k", "v", "o", "do")):  # each with a column stride != 1 once
        assert any(ch07.LAYOUTS[c.kwargs["layouts"][i]][1] > 1 for c in cases), name
    layouts = {lay for c in cases for lay in c.kwargs["layouts"]}
    assert any(ch07.LAYOUTS[lay][0].index("n") < ch07.LAYOUTS[lay][0].index("h") for lay in layouts)


# ---- Exercise 7.6: the autograd Function -----------------------------------------------------

class GoodFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ch07.launch_backward(*learner_kernels(), q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


class SwappedGradients(GoodFunction):
    @staticmethod
    def backward(ctx, do):
        dq, dk, dv, _, _ = GoodFunction.backward(ctx, do)
        return dk, dq, dv, None, None


class NoNones(GoodFunction):
    @staticmethod
    def backward(ctx, do):
        return GoodFunction.backward(ctx, do)[:3]


class NoSave(GoodFunction):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.causal, ctx.scale = causal, scale
        return o


class ReturnsLse(GoodFunction):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o, lse


class SavesReshapedO(GoodFunction):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        b, h, n, d = o.shape
        o_bnhd = o.transpose(1, 2).contiguous()  # (B, N, H, d), e.g. to merge the heads
        ctx.save_for_backward(q, k, v, o_bnhd.view(b, h, n, d), lse)  # view, not transpose, back
        ctx.causal, ctx.scale = causal, scale
        return o


class ForgetsCausal(GoodFunction):
    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*ch07.launch_backward(*learner_kernels(), q, k, v, o, lse, do, False, ctx.scale),
                None, None)


class DefaultScale(GoodFunction):
    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*ch07.launch_backward(*learner_kernels(), q, k, v, o, lse, do, ctx.causal,
                                      q.shape[-1] ** -0.5), None, None)


class KVSwapped(GoodFunction):
    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*ch07.launch_backward(*learner_kernels(), q, v, k, o, lse, do, ctx.causal,
                                      ctx.scale), None, None)


class StubFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        raise NotImplementedError("Exercise 7.6")

    @staticmethod
    def backward(ctx, do):
        raise NotImplementedError("Exercise 7.6")


def test_autograd_function_correct_answer_passes_and_trains(capsys):
    chosen, seconds = timed(ch07.check_autograd_function, GoodFunction)
    assert chosen is GoodFunction
    out = capsys.readouterr().out
    assert "✓ Exercise 7.6: passed (5 gradient cases; the tiny LM trains like SDPA" in out
    print(f"check took {seconds:.1f} s")  # timed by tools/check_times.py, not asserted


class SavedOnCtx(GoodFunction):
    """Right numbers, but the tensors kept as ctx attributes: the notebook asks for
    ctx.save_for_backward (autograd's version checks; an output kept on ctx is a reference
    cycle), so the check names it."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.saved = (q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved
        dq, dk, dv = ch07.launch_backward(*plain_kernels(), q, k, v, o, lse, do.contiguous(),
                                          ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def test_tensors_kept_as_ctx_attributes_are_named_although_the_numbers_are_right():
    message = assert_rejected(ch07.check_autograd_function, SavedOnCtx, None)
    assert ch07.TENSORS_AS_ATTRIBUTES[:60] in message, message


def test_autograd_function_stub_falls_back_to_the_library(capsys):
    assert ch07.check_autograd_function(StubFunction) is FlashAttentionFunction
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("fn_cls,cause", [
    (SwappedGradients, "backward returns the gradients in the wrong order"),
    (SavesReshapedO, "the o saved for backward is not laid out like the forward's"),
    (ForgetsCausal, "backward ignores causal"),
    (DefaultScale, "backward uses 1/√d instead of the forward's scale"),
    (KVSwapped, "k and v are exchanged in the call to launch_backward"),
])
def test_autograd_function_mistakes_are_rejected(fn_cls, cause):
    assert_rejected(ch07.check_autograd_function, fn_cls, cause)


@pytest.mark.parametrize("fn_cls,expected", [
    (NoSave, "no saved tensors found — save them with ctx.save_for_backward"),
    (NoNones, "return dq, dk, dv, None, None"),
    (ReturnsLse, "forward must return o alone"),
])
def test_autograd_function_glue_errors_are_named(fn_cls, expected):
    message = assert_rejected(ch07.check_autograd_function, fn_cls, None)
    assert expected in message and "case 1 of 5" in message and "Traceback" not in message
