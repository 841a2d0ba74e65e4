"""Chapter 08 checks: the reference passes, a stub is "not done yet", and every known mistake is
rejected with its cause named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from corpus_checks import assert_cause, one  # noqa: F401
from course_lib.attention import decoding
from course_lib.teaching.checks import ExerciseFailed
from course_lib.teaching.exercises import ch08

pytestmark = pytest.mark.ch08


def expect(cpu, gpu):
    """What a diagnosis must contain in this mode. In the interpreter (CPU) the memory guard
    stops an access outside the tensors before it happens and names tensor, index and program
    id, and NumPy traces a NaN to the kernel's line; on a GPU the guard is off and the guarded
    buffers diagnose it after the launch (values written outside an output, NaN that came from
    an input's margin)."""
    from course_lib.platform import runtime

    return gpu if runtime.current().on_gpu else cpu

CHECKS = {
    "8.1": (ch08.check_kv_cache_bytes, ch08.CACHE_MISTAKES, ch08.cache_bytes_reference),
    "8.2": (ch08.check_combine_splits, ch08.COMBINE_MISTAKES, decoding.combine_splits),
    "8.3": (ch08.check_kv_head_for, ch08.HEAD_MISTAKES, ch08.head_reference),
}


def _stub(*args):
    raise NotImplementedError("Exercise 8.x")


@pytest.mark.parametrize("exercise", CHECKS)
def test_reference_passes_and_stub_falls_back(exercise, capsys):
    check, _, reference = CHECKS[exercise]
    assert check(reference) is reference
    assert check(_stub) is not _stub
    out = capsys.readouterr().out
    assert f"Exercise {exercise}: passed" in out and "not done yet" in out


@pytest.mark.parametrize("exercise, cause", [(e, c) for e, (_, ms, _) in CHECKS.items() for c in ms])
def test_each_mistake_is_rejected_with_its_cause(exercise, cause):
    check, mistakes, _ = CHECKS[exercise]
    assert len(mistakes) >= 3
    with pytest.raises(ExerciseFailed) as info:
        check(mistakes[cause])
    message = str(info.value)
    assert f"Exercise {exercise}" in message and f"likely cause: {cause}" in message


def test_a_natural_vectorised_answer_passes():
    def combine(m, l, o):  # (S, ...), (S, ...), (S, ..., d)
        w = l * np.exp(m - m.max(axis=0))
        return (w[..., None] * o).sum(axis=0) / w.sum(axis=0)[..., None]

    assert ch08.check_combine_splits(combine) is combine


def test_crash_and_wrong_type_are_diagnosed():
    with pytest.raises(ExerciseFailed, match="raised"):
        ch08.check_combine_splits(lambda m, l, o: o[5])
    with pytest.raises(ExerciseFailed, match="returned None"):
        ch08.check_kv_head_for(lambda h, n_heads, n_kv_heads: None)
    with pytest.raises(ExerciseFailed, match="Exercise 8.1"):
        ch08.check_kv_cache_bytes(lambda *a: 0)


def test_a_size_in_bytes_must_be_an_int():
    """The right number as a float (a `/` that divides exactly, a 2.0 factor) is wrong, and said
    why (the exercise asks for an int; a float once passed here as "another style"); NumPy
    integers are whole numbers and pass."""
    def floats(layers, n_heads, n_kv_heads, head_dim, seq_len, batch, nbytes):
        return 2.0 * layers * n_kv_heads * head_dim * seq_len * batch * nbytes

    def halves(layers, n_heads, n_kv_heads, head_dim, seq_len, batch, nbytes):
        return 4 * layers * n_kv_heads * head_dim * seq_len * batch * nbytes / 2

    for answer in (floats, halves):
        with pytest.raises(ExerciseFailed, match=r"returned \d+\.0 \(float\).*whole number, an int"):
            ch08.check_kv_cache_bytes(answer)

    def numpy_ints(*args):
        return np.prod(np.array([2, *args[:1], *args[2:]], dtype=np.int64))

    assert ch08.check_kv_cache_bytes(numpy_ints) is numpy_ints


# ----------------------------------------------------------------------------------------------
# Wrong answers written as learners write them (loops, other NumPy idioms, off-by-ones), each
# with the cause its diagnosis must name, or None: no cause may be named (never a wrong one);
# and right answers in other styles, which must pass.


def _diagnosis(check, answer):
    with pytest.raises(ExerciseFailed) as info:
        check(answer)
    return str(info.value)


def _cache_corpus():
    c = ch08.CACHE_MISTAKES

    def no_two(layers, n_heads, n_kv_heads, head_dim, seq_len, batch, nbytes):
        total = 0
        for _ in range(layers):
            total += n_kv_heads * head_dim * seq_len * batch * nbytes
        return total

    return [
        (no_two, one(c, "the factor 2 is missing")),
        (lambda L, nh, nkv, hd, n, b, nb: 2 * L * nh * hd * n * b * nb,
         one(c, "n_heads is used instead")),
        (lambda L, nh, nkv, hd, n, b, nb: 2 * L * nkv * hd * n * b, one(c, "the result counts")),
        (lambda L, nh, nkv, hd, n, b, nb: 2 * nkv * hd * n * b * nb, one(c, "the number of lay")),
        (lambda L, nh, nkv, hd, n, b, nb: 2 * L * nkv * hd * n * nb, one(c, "the batch is miss")),
        (lambda L, nh, nkv, hd, n, b, nb: 2 * L * nh * nkv * hd * n * b * nb,
         one(c, "n_heads and n_kv_heads")),
        (lambda L, nh, nkv, hd, n, b, nb: 2 * L * nkv * hd * n * b * nb * 8, None),  # bits
        (lambda L, nh, nkv, hd, n, b, nb: 2 * L * nkv * hd * (n + 1) * b * nb, None),
        (lambda L, nh, nkv, hd, n, b, nb: 2 * L * nkv * n * b * nb, None),  # no head_dim
        (lambda L, nh, nkv, hd, n, b, nb: 2 * L * nkv * hd * n * b * nb / 2**30, None),  # GiB
        (lambda L, nh, nkv, hd, n, b, nb: 2 * L * (nh // nkv) * hd * n * b * nb, None),
    ]


def _combine_corpus():
    c = ch08.COMBINE_MISTAKES

    def loop_no_correction(m, l, o):
        num = np.zeros(o.shape[1:])
        den = np.zeros(l.shape[1:])
        for s in range(len(m)):
            num += l[s][..., None] * o[s]
            den += l[s]
        return num / den[..., None]

    def global_max(m, l, o):
        w = l * np.exp(m - np.max(m))
        return np.sum(w[..., None] * o, axis=0) / np.sum(w, axis=0)[..., None]

    def no_l(m, l, o):
        w = np.exp(m - m.max(0))
        return np.einsum("s...,s...d->...d", w, o) / w.sum(0)[..., None]

    def no_max(m, l, o):
        w = l * np.exp(m)
        return (w[..., None] * o).sum(0) / w.sum(0)[..., None]

    def flipped(m, l, o):
        w = l * np.exp(np.max(m, axis=0, keepdims=True) - m)
        return (w[..., None] * o).sum(0) / w.sum(0)[..., None]

    def unnormalised(m, l, o):
        w = l * np.exp(m - m.max(axis=0))
        return (w[..., None] * o).sum(axis=0)

    def best_only(m, l, o):
        best = np.argmax(m, axis=0)
        return np.take_along_axis(o, best[None, ..., None], axis=0)[0]

    def rescaled_out_plain_sum(m, l, o):
        c_ = np.exp(m - m.max(0))
        return ((l * c_)[..., None] * o).sum(0) / l.sum(0)[..., None]

    def double_l(m, l, o):
        w = l * np.exp(m - m.max(0))
        return (w[..., None] * l[..., None] * o).sum(0) / w.sum(0)[..., None]

    def by_chunks(m, l, o):
        w = l * np.exp(m - m.max(0))
        return (w[..., None] * o).sum(0) / len(m)

    def in_place(m, l, o):
        m -= m.max(axis=0)
        w = l * np.exp(m)
        return (w[..., None] * o).sum(0) / w.sum(0)[..., None]

    def mean_of_nonempty(m, l, o):
        keep = (l > 0)[..., None]
        return (o * keep).sum(0) / keep.sum(0)

    return [
        (loop_no_correction, one(c, "the chunk outputs are weighted by l_s without")),
        (lambda m, l, o: np.average(o, axis=0, weights=np.broadcast_to(l[..., None], o.shape)),
         one(c, "the chunk outputs are weighted by l_s without")),
        (global_max, one(c, "the max is taken over the whole array")),
        (no_l, one(c, "the outputs are weighted by exp(m_s − m) alone")),
        (no_max, one(c, "the weights are l_s · exp(m_s) with no max")),
        (flipped, one(c, "the correction has the wrong sign")),
        (unnormalised, one(c, "the weighted sum is not divided")),
        (best_only, one(c, "only the chunk with the largest max")),
        (rescaled_out_plain_sum, one(c, "the outputs are rescaled by exp(m_s − m) but")),
        (lambda m, l, o: o.mean(axis=0), one(c, "the chunk outputs are simply averaged")),
        (double_l, None),
        (by_chunks, None),
        (in_place, None),
        (mean_of_nonempty, None),
    ]


def _combine_valid():
    def running_merge(m, l, o):  # chapter 03's two-state merge, one chunk at a time
        m_run = np.full(m.shape[1:], -np.inf)
        l_run = np.zeros(l.shape[1:])
        o_run = np.zeros(o.shape[1:])
        for s in range(len(m)):
            m_new = np.maximum(m_run, m[s])
            with np.errstate(invalid="ignore"):
                a = np.where(np.isneginf(m_run), 0.0, np.exp(m_run - m_new))
                b = np.where(np.isneginf(m[s]), 0.0, np.exp(m[s] - m_new))
            l_new = l_run * a + l[s] * b
            o_run = (o_run * (l_run * a)[..., None] + o[s] * (l[s] * b)[..., None]) \
                / np.where(l_new > 0, l_new, 1)[..., None]
            m_run, l_run = m_new, l_new
        return o_run

    def base_two(m, l, o):
        log2e = 1 / np.log(2)
        w = l * np.exp2((m - m.max(axis=0)) * log2e)
        return np.einsum("s...,s...d->...d", w, o) / w.sum(axis=0)[..., None]

    def guarded(m, l, o):
        m_max = m.max(axis=0, keepdims=True)
        w = np.where(l > 0, l * np.exp(m - m_max), 0.0)
        return (w[..., None] * o).sum(axis=0) / w.sum(axis=0)[..., None]

    def via_lse(m, l, o):
        with np.errstate(divide="ignore"):
            lse = m + np.log(l)  # -inf for an empty chunk
        w = np.exp(lse - lse.max(axis=0))
        return (w[..., None] * o).sum(axis=0) / w.sum(axis=0)[..., None]

    return [running_merge, base_two, guarded, via_lse]


def _head_corpus():
    c = ch08.HEAD_MISTAKES
    return [
        (lambda h, n, nkv: h % nkv, one(c, "h % n_kv_heads interleaves")),
        (lambda h, n, nkv: np.floor_divide(h, nkv), one(c, "h // n_kv_heads divides")),
        (lambda h, n, nkv: h % (n // nkv), one(c, "h % group gives")),
        (lambda h, n, nkv: h * (n // nkv), one(c, "h * group maps")),
        (lambda h, n, nkv: np.floor(h / (n // nkv)), None),  # float indices
        (lambda h, n, nkv: np.round(h / (n // nkv)).astype(h.dtype), one(c, "the group is rounded")),
        (lambda h, n, nkv: (h + 1) // (n // nkv), one(c, "(h + 1) // group")),
        (lambda h, n, nkv: (nkv - 1) - h // (n // nkv), None),
        (lambda h, n, nkv: h // (n // nkv + 1), None),
        (lambda h, n, nkv: h >> 1, None),
        (lambda h, n, nkv: np.minimum(h, nkv - 1), None),
    ]


def _head_valid():
    def loop(h, n_heads, n_kv_heads):
        group = n_heads // n_kv_heads
        return np.array([x // group for x in h.ravel()], dtype=h.dtype).reshape(h.shape)

    return [lambda h, n, nkv: h * nkv // n, loop,
            lambda h, n, nkv: (h / (n // nkv)).astype(h.dtype),
            lambda h, n, nkv: np.floor_divide(h, n // nkv)]


NUMPY_CORPORA = {
    "8.1": (ch08.check_kv_cache_bytes, ch08.CACHE_MISTAKES, _cache_corpus()),
    "8.2": (ch08.check_combine_splits, ch08.COMBINE_MISTAKES, _combine_corpus()),
    "8.3": (ch08.check_kv_head_for, ch08.HEAD_MISTAKES, _head_corpus()),
}


@pytest.mark.parametrize("exercise, i", [(e, i) for e, (_, _, corpus) in NUMPY_CORPORA.items()
                                         for i in range(len(corpus))])
def test_learner_wrong_answers_are_rejected_and_never_misdiagnosed(exercise, i):
    check, mistakes, corpus = NUMPY_CORPORA[exercise]
    answer, cause = corpus[i]
    message = _diagnosis(check, answer)
    assert message.startswith(f"✗ Exercise {exercise}"), message
    assert_cause(message, mistakes, cause)


@pytest.mark.parametrize("exercise, answer", [
    *[("8.2", a) for a in _combine_valid()], *[("8.3", a) for a in _head_valid()],
    ("8.1", lambda L, nh, nkv, hd, n, b, nb: 2 * L * nh * hd * n * b * nb * nkv // nh),
    ("8.1", lambda L, nh, nkv, hd, n, b, nb: L * 2 * (nkv * hd) * (n * b) * nb)])
def test_right_answers_in_other_styles_pass(exercise, answer, capsys):
    check = NUMPY_CORPORA[exercise][0]
    assert check(answer) is answer
    assert f"Exercise {exercise}: passed" in capsys.readouterr().out


def test_combine_cases_include_rows_far_apart():
    cases = ch08._combine_cases()
    spreads = [np.ptp(c.args[0][np.isfinite(c.args[0])]) for c in cases]
    assert max(spreads) >= 1000  # two rows 1200 apart: a max over the whole array fails


# ----------------------------------------------------------------------------------------------
# Exercise 8.4: the split kernel of flash-decoding. The corpus is one kernel written as a learner
# would (its own pointer arithmetic, exp2, the online softmax) with a constexpr MISTAKE switch:
# RIGHT and VALID_* are right answers in other styles, every other value one learner's mistake.

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from course_lib.kernels import decoding as kernels_decoding  # noqa: E402
from course_lib.kernels import tiles  # noqa: E402
from course_lib.kernels.tiles import LN_2, LOG2_E, MASK_VALUE  # noqa: E402

(RIGHT, KV_MODULO, NO_RESCALE, M_LOG2, SCORES_UNMASKED, MASK_TO_CACHE, FLOOR_SPLIT, NO_SCALE,
 L_NOT_STORED, LOADS_UNMASKED, KV_DIVIDE, EXP_OF_LOG2, M_INIT_ZERO, NO_BATCH_OFFSET,
 STORE_NO_ROW_MASK, ALPHA_REVERSED, D_STRIDE_ONE, O_NOT_NORMALISED, EMPTY_NAN, Q_FROM_KV_HEAD,
 SPLIT_STRIDE_OF_HEAD, VALID_EXP, VALID_FINITE_INIT, VALID_WHERE_P) = (
    tl.constexpr(i) for i in range(24))


@triton.jit
def _split_kernel_with_mistake(Q, K, V, M, L, O,
                               stride_qb, stride_qh, stride_qm, stride_qd,
                               stride_kb, stride_kh, stride_kn, stride_kd,
                               stride_vb, stride_vh, stride_vn, stride_vd,
                               stride_mb, stride_mh, stride_ms, stride_mm,
                               stride_ob, stride_oh, stride_os, stride_om, stride_od,
                               n_q, n_k, n_heads, n_kv_heads, qk_scale_log2,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               HEAD_DIM: tl.constexpr, HEAD_DIM_REAL: tl.constexpr,
                               DOT_PRECISION: tl.constexpr, MISTAKE: tl.constexpr):
    h = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    if MISTAKE == NO_BATCH_OFFSET:
        b_q = 0
        b_kv = 0
    else:
        b_q = b
        b_kv = b
    if MISTAKE == KV_MODULO:
        kv_h = h % n_kv_heads
    elif MISTAKE == KV_DIVIDE:
        kv_h = h // n_kv_heads
    else:
        kv_h = h // (n_heads // n_kv_heads)
    if MISTAKE == FLOOR_SPLIT:
        keys_per_split = n_k // tl.num_programs(1)
    else:
        keys_per_split = tl.cdiv(n_k, tl.num_programs(1))
    split_start = split * keys_per_split
    split_end = tl.minimum(split_start + keys_per_split, n_k)
    mask_end = split_end
    if MISTAKE == MASK_TO_CACHE:
        mask_end = n_k
    if MISTAKE == NO_SCALE:
        qk_scale_log2 = LOG2_E
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM_REAL
    q_head = h
    if MISTAKE == Q_FROM_KV_HEAD:
        q_head = kv_h
    q = tl.load(Q + b_q * stride_qb + q_head * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < n_q) & d_mask[None, :], other=0.0)
    if MISTAKE == D_STRIDE_ONE:
        k_cols = offs_d[None, :]
    else:
        k_cols = offs_d[None, :] * stride_kd
    k_base = K + b_kv * stride_kb + kv_h * stride_kh
    v_base = V + b_kv * stride_vb + kv_h * stride_vh
    if MISTAKE == M_INIT_ZERO:
        m_i = tl.zeros((BLOCK_M,), tl.float32)
    elif MISTAKE == VALID_FINITE_INIT:
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        keys = start_n + offs_n
        kv_mask = (keys[:, None] < mask_end) & d_mask[None, :]
        if MISTAKE == LOADS_UNMASKED:
            k = tl.load(k_base + keys[:, None] * stride_kn + k_cols)
            v = tl.load(v_base + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd)
        else:
            k = tl.load(k_base + keys[:, None] * stride_kn + k_cols, mask=kv_mask, other=0.0)
            v = tl.load(v_base + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32)
        s = s * qk_scale_log2
        if MISTAKE != SCORES_UNMASKED and MISTAKE != LOADS_UNMASKED:
            s = tl.where(keys[None, :] < mask_end, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if MISTAKE == EXP_OF_LOG2:
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
        elif MISTAKE == VALID_EXP:  # natural units: exp((s - m) · ln 2) = exp2(s - m)
            p = tl.exp((s - m_new[:, None]) * LN_2)
            alpha = tl.exp((m_i - m_new) * LN_2)
        elif MISTAKE == ALPHA_REVERSED:
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_new - m_i)
        else:
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        if MISTAKE == VALID_WHERE_P:
            p = tl.where(keys[None, :] < split_end, p, 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MISTAKE != NO_RESCALE:
            acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        m_i = m_new
    if MISTAKE == O_NOT_NORMALISED:
        o = acc
    elif MISTAKE == EMPTY_NAN:
        o = acc / l_i[:, None]
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if MISTAKE == STORE_NO_ROW_MASK:
        rows = offs_m < BLOCK_M
    else:
        rows = offs_m < n_q
    split_stride = stride_ms
    if MISTAKE == SPLIT_STRIDE_OF_HEAD:
        split_stride = stride_mh
    ml_off = b * stride_mb + h * stride_mh + split * split_stride + offs_m * stride_mm
    if MISTAKE == M_LOG2:
        tl.store(M + ml_off, m_i, mask=rows)
    else:
        tl.store(M + ml_off, m_i * LN_2, mask=rows)
    if MISTAKE != L_NOT_STORED:
        tl.store(L + ml_off, l_i, mask=rows)
    o_ptrs = (O + b * stride_ob + h * stride_oh + split * stride_os
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, o, mask=rows[:, None] & d_mask[None, :])


class _WithMistake:
    """``kernel[grid](...)`` of the corpus kernel with its MISTAKE switch set."""

    def __init__(self, mistake):
        self.mistake = int(getattr(mistake, "value", mistake))

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return _split_kernel_with_mistake[grid](*args, **kwargs, MISTAKE=self.mistake)
        return launch


_SPLIT_CAUSES = list(ch08.SPLIT_KERNEL_MISTAKES)


def _cause(causes, start):
    found = [c for c in causes if c.startswith(start)]
    assert len(found) == 1, start
    return found[0]


def assert_diagnosed(message, expected, causes):
    """The message names the expected cause, or (for "seen") shows the evidence and names no
    cause; never a wrong cause."""
    kind, text = expected
    named = [c for c in causes if f"likely cause: {c}" in message]
    # the check's own NaN margins are never where a NaN "came from"
    assert "came from torch's full" not in message, message
    if kind == "cause":
        assert named == [text], message
    else:
        assert not named and "likely cause" not in message, message
        assert "two known mistakes reproduce" not in message, message
        assert text in message, message


def _split(start):
    return ("cause", _cause(_SPLIT_CAUSES, start))


# mistake -> ("cause", the cause that must be named) or ("seen", the evidence shown, no cause)
SPLIT_KERNEL_CORPUS = {k.value: found for k, found in {
    KV_MODULO: _split("the K/V head is h % n_kv_heads"),
    KV_DIVIDE: _split("the K/V head is h // n_kv_heads"),
    NO_RESCALE: _split("acc is not rescaled"),
    M_LOG2: _split("m is stored in log2 units"),
    SCORES_UNMASKED: _split("the ragged last tile of the chunk is loaded with a mask"),
    MASK_TO_CACHE: _split("the last tile of a chunk runs into the next chunk"),
    FLOOR_SPLIT: _split("the chunks are n_k // SPLITS keys long"),
    NO_SCALE: _split("the scores are not scaled"),
    EXP_OF_LOG2: _split("the scores are in log2 units (qk_scale_log2) but go through tl.exp"),
    M_INIT_ZERO: _split("the running max starts at 0"),
    NO_BATCH_OFFSET: _split("the batch offset is missing"),
    L_NOT_STORED: ("seen", "element(s) of l (1, 4, 3, 3) were never written"),
    LOADS_UNMASKED: ("seen", expect(cpu="past the end of `k`",
                                    gpu="depends on memory outside the inputs (their margins hold NaN, "
                                        "and NaN came out) — a tile reads keys past the end of the cache")),
    STORE_NO_ROW_MASK: ("seen", "✗ Exercise 8.4"),
    ALPHA_REVERSED: ("seen", "value(s) are NaN/inf where the answer is finite"),
    D_STRIDE_ONE: ("seen", "✗ Exercise 8.4"),
    O_NOT_NORMALISED: ("seen", "wrong answer on case 1 of 3"),
    # NumPy's first 0/0, on its line (interpreter); on a GPU the NaN state of the empty chunk
    EMPTY_NAN: ("seen", expect(cpu="`o = acc / l_i[:, None]`",
                               gpu="split 3 is an empty chunk: 5 keys in 4 splits of 2 leave it none")),
    Q_FROM_KV_HEAD: ("seen", "wrong answer on case 1 of 3"),
    SPLIT_STRIDE_OF_HEAD: ("seen", "✗ Exercise 8.4"),
}.items()}
SPLIT_VALID = [RIGHT.value, VALID_EXP.value, VALID_FINITE_INIT.value, VALID_WHERE_P.value]


@pytest.mark.parametrize("mistake", SPLIT_VALID)
def test_split_kernels_in_other_styles_pass(mistake, capsys):
    kernel = _WithMistake(mistake)
    assert ch08.check_split_kv_kernel(kernel) is kernel
    assert "Exercise 8.4: passed (3 cases)" in capsys.readouterr().out


def test_library_split_kernel_passes_in_under_5_s(capsys):
    import time

    start = time.perf_counter()
    kernel = kernels_decoding.split_kv_kernel
    assert ch08.check_split_kv_kernel(kernel) is kernel
    assert time.perf_counter() - start < 5.0
    assert "Exercise 8.4: passed (3 cases)" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", SPLIT_KERNEL_CORPUS)
def test_each_wrong_split_kernel_is_rejected_and_never_misdiagnosed(mistake):
    with pytest.raises(ExerciseFailed) as info:
        ch08.check_split_kv_kernel(_WithMistake(mistake))
    message = str(info.value)
    assert message.startswith("✗ Exercise 8.4"), message
    assert_diagnosed(message, SPLIT_KERNEL_CORPUS[mistake], _SPLIT_CAUSES)


def test_every_split_mistake_model_is_named_on_its_own_output():
    """Each model, handed to the check as an answer, is singled out by the evidence."""
    from course_lib.teaching.checks import check_function

    cases = ch08._split_kernel_cases("cpu")
    for cause, model in ch08.SPLIT_KERNEL_MISTAKES.items():
        with pytest.raises(ExerciseFailed) as info:
            check_function("Exercise 8.4", model, ch08._checked_states, cases,
                           mistakes=ch08.SPLIT_KERNEL_MISTAKES)
        assert f"likely cause: {cause}" in str(info.value), (cause, str(info.value))


def test_split_cases_vary_what_a_mistake_can_depend_on():
    cases = ch08._split_kernel_cases("cpu")
    groups = {c.args[0].shape[1] // c.args[1].shape[1] for c in cases}
    assert {1, 2, 4} <= groups and any(c.args[1].shape[1] == 1 for c in cases)  # GQA, MQA
    assert any(c.args[0].shape[0] > 1 for c in cases)  # a spare batch
    assert any(c.kwargs["scale"] is not None for c in cases)  # an explicit scale
    assert any(c.kwargs["block_n"] != 16 for c in cases)  # BLOCK_N ≠ BLOCK_M = 16
    assert any(c.args[0].shape[-1] & (c.args[0].shape[-1] - 1) for c in cases)  # d = 24
    assert any(x.stride(-1) != 1 for c in cases for x in c.args)  # a column stride ≠ 1
    empty = [c for c in cases if ch08._cdiv(c.args[1].shape[2], c.kwargs["splits"])
             * (c.kwargs["splits"] - 1) >= c.args[1].shape[2]]
    assert empty  # a chunk with no keys
    o, m, l = ch08.split_states(*cases[0].args, cases[0].kwargs["splits"],
                                scale=cases[0].kwargs["scale"])
    spread = m[0, 0, :, 0].max() - m[0, 0, :, 0].min()
    assert spread > 300  # chunk maxima hundreds apart


def test_a_finite_empty_chunk_max_is_reported_as_the_empty_state():
    m = torch.tensor([-torch.inf, -6.9e29, -5.0, -6.9e29])
    l = torch.tensor([0.0, 0.0, 0.0, 2.0])
    reported = ch08._report_empty(m, l)
    assert reported.tolist()[:2] == [ch08.EMPTY_CHUNK_M_REPORTED] * 2
    assert reported[2] == -5.0 and reported[3] == -6.9e29  # not empty: reported as they are


@triton.jit
def _stub_split_kernel(Q, K, V, M, L, O,
                       stride_qb, stride_qh, stride_qm, stride_qd,
                       stride_kb, stride_kh, stride_kn, stride_kd,
                       stride_vb, stride_vh, stride_vn, stride_vd,
                       stride_mb, stride_mh, stride_ms, stride_mm,
                       stride_ob, stride_oh, stride_os, stride_om, stride_od,
                       n_q, n_k, n_heads, n_kv_heads, qk_scale_log2,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HEAD_DIM: tl.constexpr, HEAD_DIM_REAL: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    raise NotImplementedError("Exercise 8.4: write the split kernel")


def test_split_kernel_stub_is_not_done_and_falls_back(capsys):
    assert ch08.check_split_kv_kernel(_stub_split_kernel) is kernels_decoding.split_kv_kernel
    assert "Exercise 8.4: not done yet" in capsys.readouterr().out


def test_split_states_model_matches_the_numpy_partials():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 29, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    o, m, l = ch08.split_states(q, k, v, 3)
    # decoding.split_bounds(29, 3) gives 10, 10, 9 keys; the kernel's chunks are cdiv = 10 too
    m_np, l_np, o_np = decoding.split_kv_partials(q[:, :, 0].numpy(), k.numpy(), v.numpy(), 3)
    np.testing.assert_allclose(m.double().numpy()[:, :, :, 0], np.moveaxis(m_np, 0, -1), rtol=1e-6)
    np.testing.assert_allclose(l.double().numpy()[:, :, :, 0], np.moveaxis(l_np, 0, -1), rtol=1e-6)
    # the model rounds its exponentials to float32, as the kernel does
    np.testing.assert_allclose(o.numpy()[:, :, :, 0], np.moveaxis(o_np, 0, 2), atol=1e-6)


def test_split_kernel_hint_ladder_and_skeleton():
    import ast

    from course_lib.teaching.widgets.hints import HintLadder

    ladder = HintLadder("Exercise 8.4", ch08.SPLIT_KERNEL_HINTS, skeleton=ch08.SPLIT_KERNEL_SKELETON)
    assert ladder.show_skeleton() == ch08.SPLIT_KERNEL_SKELETON
    ast.parse(ch08.SPLIT_KERNEL_SKELETON)  # valid Python, with `...` where the learner writes
    assert "h // (n_heads // n_kv_heads)" in ch08.SPLIT_KERNEL_HINTS[0]


# ----------------------------------------------------------------------------------------------
# Exercise 8.5: the combine kernel. The same kind of corpus: one kernel written as a learner
# would, a constexpr MISTAKE switch; C_RIGHT and C_VALID_* are right answers in other styles.

(C_RIGHT, C_PLAIN_L, C_AVERAGE, C_LSE_NO_M, C_FIRST_M, C_DIVIDE_BY_S, C_LSE_LOG2,
 C_LOADS_UNMASKED, C_NO_MAX, C_WRONG_SIGN, C_DIVIDE_BY_L, C_PAD_M_ZERO, C_STORE_NO_D_MASK,
 C_O_ROW_STRIDE_OF_M, C_PIDS_REVERSED, C_LSE_PLAIN_L, C_VALID_EXP2, C_VALID_WHERE,
 C_VALID_LOOP) = (tl.constexpr(i) for i in range(19))


@triton.jit
def _combine_kernel_with_mistake(M, L, O_part, Out, Lse,
                                 stride_mb, stride_mh, stride_ms, stride_mm,
                                 stride_pb, stride_ph, stride_ps, stride_pm, stride_pd,
                                 stride_ob, stride_oh, stride_om, stride_od,
                                 stride_lb, stride_lh, stride_lm,
                                 n_splits,
                                 BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                                 HEAD_DIM_REAL: tl.constexpr, MISTAKE: tl.constexpr):
    if MISTAKE == C_PIDS_REVERSED:
        row = tl.program_id(2)
        h = tl.program_id(1)
        b = tl.program_id(0)
    else:
        row = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < n_splits
    d_mask = offs_d < HEAD_DIM_REAL
    if MISTAKE == C_VALID_LOOP:  # one split at a time, a running max (chapter 03's merge)
        m_run = float("-inf")
        l_run = 0.0
        acc = tl.zeros((HEAD_DIM,), tl.float32)
        for s in range(0, n_splits):
            off = b * stride_mb + h * stride_mh + s * stride_ms + row * stride_mm
            m_s = tl.load(M + off)
            l_s = tl.load(L + off)
            o_s = tl.load(O_part + b * stride_pb + h * stride_ph + s * stride_ps
                          + row * stride_pm + offs_d * stride_pd, mask=d_mask, other=0.0)
            if l_s > 0:
                m_new = tl.maximum(m_run, m_s)
                acc = acc * tl.exp(m_run - m_new) + l_s * tl.exp(m_s - m_new) * o_s
                l_run = l_run * tl.exp(m_run - m_new) + l_s * tl.exp(m_s - m_new)
                m_run = m_new
        out = acc / l_run
        m_max = m_run
        l_sum = l_run
    else:
        ml_off = b * stride_mb + h * stride_mh + offs_s * stride_ms + row * stride_mm
        if MISTAKE == C_LOADS_UNMASKED:
            m = tl.load(M + ml_off)
            l = tl.load(L + ml_off)
        elif MISTAKE == C_PAD_M_ZERO:
            m = tl.load(M + ml_off, mask=s_mask, other=0.0)
            l = tl.load(L + ml_off, mask=s_mask, other=0.0)
        else:
            m = tl.load(M + ml_off, mask=s_mask, other=MASK_VALUE)
            l = tl.load(L + ml_off, mask=s_mask, other=0.0)
        if MISTAKE == C_O_ROW_STRIDE_OF_M:
            o_row = row * stride_mm
        else:
            o_row = row * stride_pm
        o = tl.load(O_part + b * stride_pb + h * stride_ph + o_row
                    + offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd,
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        if MISTAKE == C_FIRST_M:
            m_max = tl.load(M + b * stride_mb + h * stride_mh + row * stride_mm)  # split 0's m
        elif MISTAKE == C_NO_MAX:
            m_max = 0.0
        else:
            m_max = tl.max(m, axis=0)
        if MISTAKE == C_PLAIN_L:
            w = l
        elif MISTAKE == C_WRONG_SIGN:
            w = l * tl.exp(m_max - m)
        elif MISTAKE == C_VALID_EXP2:
            w = l * tl.math.exp2((m - m_max) * LOG2_E)
        elif MISTAKE == C_VALID_WHERE:
            w = tl.where(l > 0, l * tl.exp(m - m_max), 0.0)
        else:
            w = l * tl.exp(m - m_max)
        l_sum = tl.sum(w, axis=0)
        if MISTAKE == C_AVERAGE:
            out = tl.sum(o, axis=0) / n_splits
        elif MISTAKE == C_DIVIDE_BY_S:
            out = tl.sum(w[:, None] * o, axis=0) / n_splits
        elif MISTAKE == C_DIVIDE_BY_L:
            out = tl.sum(w[:, None] * o, axis=0) / tl.sum(l, axis=0)
        else:
            out = tl.sum(w[:, None] * o, axis=0) / l_sum
        if MISTAKE == C_LSE_PLAIN_L:
            l_sum = tl.sum(l, axis=0)
    if MISTAKE == C_LSE_NO_M:
        lse = tl.log(l_sum)
    elif MISTAKE == C_LSE_LOG2:
        lse = m_max * LOG2_E + tl.log2(l_sum)
    else:
        lse = m_max + tl.log(l_sum)
    out_ptrs = Out + b * stride_ob + h * stride_oh + row * stride_om + offs_d * stride_od
    if MISTAKE == C_STORE_NO_D_MASK:
        tl.store(out_ptrs, out.to(Out.dtype.element_ty))
    else:
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=d_mask)
    tl.store(Lse + b * stride_lb + h * stride_lh + row * stride_lm, lse)


class _CombineWithMistake:
    """``kernel[grid](...)`` of the combine corpus kernel with its MISTAKE switch set."""

    def __init__(self, mistake):
        self.mistake = int(getattr(mistake, "value", mistake))

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return _combine_kernel_with_mistake[grid](*args, **kwargs, MISTAKE=self.mistake)
        return launch


_COMBINE_CAUSES = list(ch08.COMBINE_KERNEL_MISTAKES)


def _merge(start):
    return ("cause", _cause(_COMBINE_CAUSES, start))


# mistake -> ("cause", the cause that must be named) or ("seen", the evidence shown, no cause)
COMBINE_KERNEL_CORPUS = {k.value: found for k, found in {
    C_PLAIN_L: _merge("the weights are the plain l_s"),
    C_AVERAGE: _merge("the o_s are averaged"),
    C_LSE_NO_M: _merge("lse is log Σ w_s without the max"),
    C_FIRST_M: _merge("m is split 0's m"),
    C_DIVIDE_BY_S: _merge("Σ w_s o_s is divided by the number of splits"),
    C_DIVIDE_BY_L: _merge("Σ w_s o_s is divided by Σ l_s"),
    C_LSE_LOG2: _merge("lse is stored in log2 units"),
    C_NO_MAX: _merge("the weights are l_s · exp(m_s) with no max subtracted"),
    C_WRONG_SIGN: _merge("the correction has the wrong sign"),
    C_PAD_M_ZERO: _merge("the padded split lanes load m with other=0.0"),
    C_LOADS_UNMASKED: ("seen", expect(cpu="past the end of `m`",
                                      gpu="depends on memory outside the inputs (their margins hold NaN, "
                                          "and NaN came out) — a load reads past the last split")),
    C_STORE_NO_D_MASK: ("seen", expect(cpu="tl.store in program",
                                       gpu="your kernel wrote 96 value(s) outside out (2, 3, 2, 24)")),
    C_O_ROW_STRIDE_OF_M: ("seen", "✗ Exercise 8.5"),
    C_PIDS_REVERSED: ("seen", "✗ Exercise 8.5"),
    C_LSE_PLAIN_L: ("seen", "`lse`: max abs error"),
}.items()}
COMBINE_VALID = [C_RIGHT.value, C_VALID_EXP2.value, C_VALID_WHERE.value, C_VALID_LOOP.value]


@pytest.mark.parametrize("mistake", COMBINE_VALID)
def test_combine_kernels_in_other_styles_pass(mistake, capsys):
    kernel = _CombineWithMistake(mistake)
    assert ch08.check_combine_kernel(kernel) is kernel
    assert "Exercise 8.5: passed (4 cases)" in capsys.readouterr().out


def test_library_combine_kernel_passes_in_under_5_s(capsys):
    import time

    start = time.perf_counter()
    kernel = kernels_decoding.combine_kernel
    assert ch08.check_combine_kernel(kernel) is kernel
    assert time.perf_counter() - start < 5.0
    assert "Exercise 8.5: passed (4 cases)" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", COMBINE_KERNEL_CORPUS)
def test_each_wrong_combine_kernel_is_rejected_and_never_misdiagnosed(mistake):
    with pytest.raises(ExerciseFailed) as info:
        ch08.check_combine_kernel(_CombineWithMistake(mistake))
    message = str(info.value)
    assert message.startswith("✗ Exercise 8.5"), message
    assert_diagnosed(message, COMBINE_KERNEL_CORPUS[mistake], _COMBINE_CAUSES)


def test_every_combine_mistake_model_is_named_on_its_own_output():
    from course_lib.teaching.checks import check_function

    cases = ch08._combine_kernel_cases("cpu")
    for cause, model in ch08.COMBINE_KERNEL_MISTAKES.items():
        with pytest.raises(ExerciseFailed) as info:
            check_function("Exercise 8.5", model, ch08.combine_reference, cases,
                           mistakes=ch08.COMBINE_KERNEL_MISTAKES)
        assert f"likely cause: {cause}" in str(info.value), (cause, str(info.value))


def test_combine_cases_vary_what_a_mistake_can_depend_on():
    cases = ch08._combine_kernel_cases("cpu")
    splits = [c.args[0].shape[2] for c in cases]
    assert any(s & (s - 1) for s in splits) and 8 in splits  # padded lanes, and none
    ms = [c.args[0] for c in cases]
    assert any(bool(torch.isinf(m[:, :, 0]).all()) for m in ms)  # split 0 empty
    assert any(bool(torch.isinf(m[:, :, -1]).all()) for m in ms)  # the last splits empty
    finite = [m[torch.isfinite(m)] for m in ms]
    assert any(float(f.max() - f.min()) > 300 for f in finite)  # maxima hundreds apart
    assert any(float(f.max()) < -100 for f in finite)  # every m far below 0
    assert any(c.args[2].stride(-1) != 1 for c in cases)  # o's column stride ≠ 1
    assert any(c.args[2].shape[-1] & (c.args[2].shape[-1] - 1) for c in cases)  # d = 24, 40


@triton.jit
def _stub_combine_kernel(M, L, O_part, Out, Lse,
                         stride_mb, stride_mh, stride_ms, stride_mm,
                         stride_pb, stride_ph, stride_ps, stride_pm, stride_pd,
                         stride_ob, stride_oh, stride_om, stride_od,
                         stride_lb, stride_lh, stride_lm,
                         n_splits,
                         BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_REAL: tl.constexpr):
    raise NotImplementedError("Exercise 8.5: write the combine kernel")


def test_combine_kernel_stub_is_not_done_and_falls_back(capsys):
    assert ch08.check_combine_kernel(_stub_combine_kernel) is kernels_decoding.combine_kernel
    assert "Exercise 8.5: not done yet" in capsys.readouterr().out


def test_merged_output_model_matches_the_reference():
    for case in ch08._combine_kernel_cases("cpu"):
        want = ch08.combine_reference(*case.args, **case.kwargs)
        got = ch08.merged_output(*case.args, **case.kwargs)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_combine_kernel_hint_ladder_and_skeleton():
    import ast

    from course_lib.teaching.widgets.hints import HintLadder

    ladder = HintLadder("Exercise 8.5", ch08.COMBINE_KERNEL_HINTS,
                        skeleton=ch08.COMBINE_KERNEL_SKELETON)
    assert ladder.show_skeleton() == ch08.COMBINE_KERNEL_SKELETON
    ast.parse(ch08.COMBINE_KERNEL_SKELETON)
    assert "l * tl.exp(m - m_max)" in ch08.COMBINE_KERNEL_HINTS[2]
