"""Chapter 10 checks: the reference passes, a stub is "not done yet", every known mistake is named
on its own output, and corpora of wrong answers written as learners write them are rejected with
the right cause or with none (never a wrong one); right answers in other styles pass."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from corpus_checks import assert_cause, assert_rejected, one
from course_lib.attention import masks
from course_lib.teaching.checks import ExerciseFailed, library_answers_allowed
from course_lib.teaching.exercises import ch10
from course_lib.kernels.tiles import LN_2, LOG2_E

pytestmark = pytest.mark.ch10

CHECK_TIME_LIMIT_S = 5.0


def expect(cpu, gpu):
    """What a diagnosis contains in this mode (the memory guard's text in the interpreter, the
    guarded buffers' evidence on a GPU)."""
    from course_lib.platform import runtime

    return gpu if runtime.current().on_gpu else cpu


# ----------------------------------------------------------------------------------------------
# Exercise 10.1: tile_lists


def _stub(*args):
    raise NotImplementedError("Exercise 10.1")


def test_tile_lists_reference_passes_and_stub_falls_back(capsys):
    with library_answers_allowed():
        assert ch10.check_tile_lists(ch10.tile_lists_reference) is ch10.tile_lists_reference
    assert ch10.check_tile_lists(_stub) is ch10.tile_lists_reference
    out = capsys.readouterr().out
    assert "Exercise 10.1: passed (7 cases)" in out and "not done yet" in out


@pytest.mark.parametrize("cause", list(ch10.TILE_LIST_MISTAKES))
def test_each_tile_list_mistake_is_named_on_its_own_output(cause):
    model = ch10.TILE_LIST_MISTAKES[cause]
    with pytest.raises(ExerciseFailed) as info:
        ch10.check_tile_lists(lambda mask, block_m, block_n: model(mask, block_m, block_n))
    assert_cause(str(info.value), ch10.TILE_LIST_MISTAKES, cause)


def _loops(mask, block_m, block_n, *, edge=0, pad_masked=False, partial_any=False,
           t_floor=False, transpose=False, compact=True, only_full=False, order=1):
    """tile_lists as a learner writes it with two loops, with one switch per mistake."""
    if transpose:
        mask = mask.T
    n_q, n_k = mask.shape
    t_r = n_q // block_m if t_floor else (n_q + block_m - 1) // block_m
    t_c = n_k // block_n if t_floor else (n_k + block_n - 1) // block_n
    num = np.zeros(t_r, dtype=np.int32)
    idx = np.zeros((t_r, t_c), dtype=np.int32)
    part = np.zeros((t_r, t_c), dtype=bool)
    for i in range(t_r):
        for j in list(range(t_c))[::order]:
            tile = mask[i * block_m:(i + 1) * block_m + edge, j * block_n:(j + 1) * block_n + edge]
            if pad_masked and tile.shape != (block_m, block_n):
                padded = np.zeros((block_m, block_n), dtype=bool)
                padded[:tile.shape[0], :tile.shape[1]] = tile
                tile = padded
            visible = tile.all() if only_full else tile.any()
            if visible:
                slot = num[i] if compact else j
                idx[i, slot] = j
                part[i, slot] = tile.any() if partial_any else not tile.all()
                num[i] += 1
    return num, idx, part


def _vectorised(mask, block_m, block_n):
    """Right, with NumPy: pad, reshape to tiles, any/all."""
    n_q, n_k = mask.shape
    t_r, t_c = -(-n_q // block_m), -(-n_k // block_n)
    out = []
    for fill in (False, True):
        padded = np.full((t_r * block_m, t_c * block_n), fill)
        padded[:n_q, :n_k] = mask
        out.append(padded.reshape(t_r, block_m, t_c, block_n))
    any_, all_ = out[0].any(axis=(1, 3)), out[1].all(axis=(1, 3))
    num = any_.sum(axis=1)
    idx = np.zeros((t_r, t_c), dtype=np.int64)
    part = np.zeros((t_r, t_c), dtype=bool)
    for i in range(t_r):
        cols = np.nonzero(any_[i])[0]
        idx[i, :len(cols)] = cols
        part[i, :len(cols)] = ~all_[i, cols]
    return num, idx, part


def _with_masks_module(mask, block_m, block_n):
    """Right, from the library's tile classes; the lists padded with -1, in descending order."""
    classes = masks.classify_tiles(mask, block_m, block_n)
    num = (classes != masks.SKIP).sum(axis=1)
    idx = np.full(classes.shape, -1)
    part = np.zeros(classes.shape, dtype=bool)
    for i, row in enumerate(classes):
        cols = np.flatnonzero(row != masks.SKIP)[::-1]
        idx[i, :len(cols)] = cols
        part[i, :len(cols)] = row[cols] == masks.PARTIAL
    return num, idx, part


def _torch_style(mask, block_m, block_n):
    """Right, with torch and int32 outputs (tensors)."""
    m = torch.from_numpy(mask)
    n_q, n_k = m.shape
    t_r, t_c = -(-n_q // block_m), -(-n_k // block_n)
    num = torch.zeros(t_r, dtype=torch.int32)
    idx = torch.zeros(t_r, t_c, dtype=torch.int32)
    part = torch.zeros(t_r, t_c, dtype=torch.bool)
    for i in range(t_r):
        for j in range(t_c):
            tile = m[i * block_m:min((i + 1) * block_m, n_q), j * block_n:min((j + 1) * block_n, n_k)]
            if tile.any():
                idx[i, num[i]] = j
                part[i, num[i]] = not bool(tile.all())
                num[i] += 1
    return num, idx, part


def _tile_corpus():
    c = ch10.TILE_LIST_MISTAKES
    return [
        (lambda m, bm, bn: _loops(m, bm, bn, pad_masked=True), one(c, "the padding of a ragged")),
        (lambda m, bm, bn: _loops(m, bm, bn, edge=1), one(c, "each tile is one row")),
        (lambda m, bm, bn: _loops(m, bm, bn, t_floor=True), one(c, "the tile counts are N //")),
        (lambda m, bm, bn: _loops(m, bn, bm), one(c, "block_m and block_n are swapped")),
        (lambda m, bm, bn: _loops(m, bm, bn, transpose=True), one(c, "the lists are built per")),
        (lambda m, bm, bn: _loops(m, bm, bn, partial_any=True), one(c, "every visited tile is")),
        (lambda m, bm, bn: _loops(m, bm, bn, compact=False), one(c, "the listed tiles stay")),
        (lambda m, bm, bn: _loops(m, bm, bn, only_full=True), one(c, "only full tiles are")),
        # the partial flags inverted (the padding past kv_num_blocks too: it may hold anything)
        (lambda m, bm, bn: (lambda n, i, p: (n, i, ~p))(*_loops(m, bm, bn)),
         one(c, "the partial flag is inverted")),
        # kv_num_blocks off by one (counts from 1)
        (lambda m, bm, bn: (lambda n, i, p: (n + 1, i, p))(*_loops(m, bm, bn)), None),
        # T_c taken from N_q (a square-mask habit)
        (lambda m, bm, bn: _loops(m[:, :m.shape[0]] if m.shape[1] > m.shape[0] else m, bm, bn),
         None),
    ]


@pytest.mark.parametrize("i", range(len(_tile_corpus())))
def test_wrong_tile_lists_are_rejected_and_never_misdiagnosed(i):
    answer, cause = _tile_corpus()[i]
    message = assert_rejected(ch10.check_tile_lists, answer, cause)
    assert message.startswith("✗ Exercise 10.1"), message
    assert_cause(message, ch10.TILE_LIST_MISTAKES, cause)


@pytest.mark.parametrize("answer", [_vectorised, _with_masks_module, _torch_style,
                                    lambda m, bm, bn: _loops(m, bm, bn, order=-1)])
def test_right_tile_lists_in_other_styles_pass(answer, capsys):
    assert ch10.check_tile_lists(answer) is answer
    assert "Exercise 10.1: passed" in capsys.readouterr().out


def test_tile_list_cases_hold_every_tile_class_and_ragged_tiles():
    seen = set()
    for case in ch10._tile_list_cases():
        mask, bm, bn = case.args
        seen |= set(np.unique(masks.classify_tiles(mask, bm, bn)).tolist())
    assert seen == {masks.SKIP, masks.PARTIAL, masks.FULL}
    assert any(m.shape[0] % bm and m.shape[1] % bn for m, bm, bn in
               (c.args for c in ch10._tile_list_cases()))


# ----------------------------------------------------------------------------------------------
# Exercise 10.2: varlen offsets. One kernel as a learner writes it, its offset lines switched by
# a constexpr (0 right, VALID_* right in other styles, the rest one mistake each).

(RIGHT, START_NEXT, LEN_IS_END, NO_START_KV, KV_MODULO, KV_DIVIDE, NO_HEAD_KV, Q_HEAD_FOR_KV,
 O_NO_START, K_STRIDE_OF_Q, VALID_PAIR, VALID_GROUP_MUL, VALID_INT64, BASE_HAS_TILE) = range(14)


@triton.jit
def _varlen_learner(Q, K, V, O, CU_SEQLENS,
                    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                    n_heads, n_kv_heads, qk_scale_log2,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    WHICH: tl.constexpr):
    tile, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if WHICH == START_NEXT:
        start = tl.load(CU_SEQLENS + b + 1)
        seq_len = tl.load(CU_SEQLENS + b + 2) - start
    elif WHICH == LEN_IS_END:
        start = tl.load(CU_SEQLENS + b)
        seq_len = tl.load(CU_SEQLENS + b + 1)
    elif WHICH == VALID_PAIR:
        two = tl.arange(0, 2)
        bounds = tl.load(CU_SEQLENS + b + two)
        start = tl.sum(tl.where(two == 0, bounds, 0))
        seq_len = tl.sum(tl.where(two == 1, bounds, 0)) - start
    else:
        start = tl.load(CU_SEQLENS + b)
        seq_len = tl.load(CU_SEQLENS + b + 1) - start
    if WHICH == VALID_INT64:
        start = start.to(tl.int64)
    group = n_heads // n_kv_heads
    kv_h = h // group
    if WHICH == KV_MODULO:
        kv_h = h % n_kv_heads
    if WHICH == KV_DIVIDE:
        kv_h = h // n_kv_heads
    if WHICH == VALID_GROUP_MUL:
        kv_h = h * n_kv_heads // n_heads
    if WHICH == Q_HEAD_FOR_KV:
        kv_h = h
    q_base = Q + start * stride_qt + h * stride_qh
    if WHICH == NO_START_KV:
        k_base = K + kv_h * stride_kh
        v_base = V + kv_h * stride_vh
    elif WHICH == NO_HEAD_KV:
        k_base = K + start * stride_kt
        v_base = V + start * stride_vt
    elif WHICH == K_STRIDE_OF_Q:
        k_base = K + start * stride_qt + kv_h * stride_qh
        v_base = V + start * stride_vt + kv_h * stride_vh
    else:
        k_base = K + start * stride_kt + kv_h * stride_kh
        v_base = V + start * stride_vt + kv_h * stride_vh
    if WHICH == O_NO_START:
        o_base = O + h * stride_oh
    else:
        o_base = O + start * stride_ot + h * stride_oh
    if WHICH == BASE_HAS_TILE:  # the tile's rows in the base, and again in offs_m below
        q_base = Q + (start + tile * BLOCK_M) * stride_qt + h * stride_qh
        o_base = O + (start + tile * BLOCK_M) * stride_ot + h * stride_oh
    # (the part the notebook gives)
    start_m = tile * BLOCK_M
    if start_m < seq_len:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                    mask=offs_m[:, None] < seq_len, other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        for start_n in range(0, seq_len, BLOCK_N):
            keys = start_n + offs_n
            k = tl.load(k_base + keys[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                        mask=keys[:, None] < seq_len, other=0.0)
            v = tl.load(v_base + keys[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                        mask=keys[:, None] < seq_len, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale_log2
            s = tl.where(keys[None, :] < seq_len, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
                 (acc / l_i[:, None]).to(O.dtype.element_ty), mask=offs_m[:, None] < seq_len)



class _Learner:
    """``kernel[grid](...)`` of a corpus kernel with its WHICH switch set."""

    def __init__(self, kernel, which):
        self.kernel, self.which = kernel, which

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **kwargs, WHICH=self.which)


_V = list(ch10.VARLEN_MISTAKES)
VARLEN_CORPUS = {
    START_NEXT: ("seen", expect(cpu="`cu_seqlens`", gpu="✗ Exercise 10.2")),
    LEN_IS_END: ("seen", expect(cpu="past the end of the packed batch", gpu="✗ Exercise 10.2")),
    NO_START_KV: ("cause", one(_V, "K and V are read from the start")),
    KV_MODULO: ("cause", one(_V, "the K/V head is h % n_kv_heads")),
    KV_DIVIDE: ("cause", one(_V, "the K/V head is h // n_kv_heads")),
    NO_HEAD_KV: ("cause", one(_V, "K and V have no head offset")),
    Q_HEAD_FOR_KV: ("seen", expect(cpu="does not exist (H_kv =", gpu="✗ Exercise 10.2")),
    O_NO_START: ("seen", "were never written"),
    K_STRIDE_OF_Q: ("seen", "✗ Exercise 10.2"),
}


def _assert_diagnosed(message, expected, causes):
    kind, text = expected
    if kind == "cause":
        assert_cause(message, causes, text)
    else:
        assert_cause(message, causes, None)
        assert text in message, message


@pytest.mark.parametrize("which", list(VARLEN_CORPUS))
def test_wrong_varlen_kernels_are_rejected_and_never_misdiagnosed(which):
    with pytest.raises(ExerciseFailed) as info:
        ch10.check_varlen_kernel(_Learner(_varlen_learner, which))
    message = str(info.value)
    assert message.startswith("✗ Exercise 10.2"), message
    _assert_diagnosed(message, VARLEN_CORPUS[which], _V)


@pytest.mark.parametrize("which", [RIGHT, VALID_PAIR, VALID_GROUP_MUL, VALID_INT64])
def test_right_varlen_kernels_in_other_styles_pass(which, capsys):
    kernel = _Learner(_varlen_learner, which)
    assert ch10.check_varlen_kernel(kernel) is kernel
    assert "Exercise 10.2: passed (3 cases)" in capsys.readouterr().out


def test_varlen_model_kernel_passes_in_under_5_s_and_stub_falls_back(capsys):
    start = time.perf_counter()
    with library_answers_allowed():
        assert ch10.check_varlen_kernel(ch10.VARLEN_KERNEL) is ch10.VARLEN_KERNEL
    assert time.perf_counter() - start < CHECK_TIME_LIMIT_S
    stub = _Learner(_varlen_stub, 0)
    assert ch10.check_varlen_kernel(stub) is ch10.VARLEN_KERNEL
    out = capsys.readouterr().out
    assert "Exercise 10.2: passed" in out and "not done yet" in out


@triton.jit
def _varlen_stub(Q, K, V, O, CU_SEQLENS, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh,
                 stride_kd, stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                 n_heads, n_kv_heads, qk_scale_log2, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WHICH: tl.constexpr):
    raise NotImplementedError("Exercise 10.2")


# ----------------------------------------------------------------------------------------------
# Exercise 10.3: the block-sparse forward, as a learner writes it

(B_RIGHT, NO_PARTIAL_MASK, T_AS_TILE, LIST_ROW0, FLAG_BY_TILE, NO_RESCALE, RAGGED_OPEN, NO_SAFE_MAX,
 LSE_LOG2, MASK_ZERO, KV_UNMASKED_LOADS, FLAG_INVERTED, MASK_LOAD_UNMASKED, NO_HEAD_KV_3,
 MASK_STRIDES_SWAPPED, VALID_MASK_EVERY_TILE, VALID_NATURAL_EXP, VALID_FINITE_MASK,
 LSE_CONTIGUOUS, Q_UNMASKED) = range(20)


@triton.jit
def _sparse_learner(Q, K, V, O, LSE, KV_NUM_BLOCKS, KV_INDICES, KV_PARTIAL, MASK,
                    stride_qh, stride_qn, stride_qd, stride_kh, stride_kn, stride_kd,
                    stride_vh, stride_vn, stride_vd, stride_oh, stride_on, stride_od,
                    stride_lh, stride_ln, stride_ir, stride_ic, stride_pr, stride_pc,
                    stride_mq, stride_mk, n_q, n_k, qk_scale_log2,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    WHICH: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if WHICH == Q_UNMASKED:
        q = tl.load(Q + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd)
    else:
        q = tl.load(Q + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                    mask=offs_m[:, None] < n_q, other=0.0)
    neg = float("-inf")
    if WHICH == VALID_FINITE_MASK:
        neg = -1.0e30
    m_i = tl.zeros((BLOCK_M,), tl.float32) + neg
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    k_head = K + h * stride_kh
    v_head = V + h * stride_vh
    if WHICH == NO_HEAD_KV_3:
        k_head = K
        v_head = V
    row = pid_m
    if WHICH == LIST_ROW0:
        row = 0
    n_tiles = tl.load(KV_NUM_BLOCKS + pid_m)
    for t in range(n_tiles):
        j = tl.load(KV_INDICES + row * stride_ir + t * stride_ic)
        if WHICH == FLAG_BY_TILE:
            is_partial = tl.load(KV_PARTIAL + row * stride_pr + j * stride_pc)
        else:
            is_partial = tl.load(KV_PARTIAL + row * stride_pr + t * stride_pc)
        if WHICH == T_AS_TILE:
            offs_k = t * BLOCK_N + offs_n
        else:
            offs_k = j * BLOCK_N + offs_n
        if WHICH == KV_UNMASKED_LOADS:
            k = tl.load(k_head + offs_k[:, None] * stride_kn + offs_d[None, :] * stride_kd)
            v = tl.load(v_head + offs_k[:, None] * stride_vn + offs_d[None, :] * stride_vd)
        else:
            k = tl.load(k_head + offs_k[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        mask=offs_k[:, None] < n_k, other=0.0)
            v = tl.load(v_head + offs_k[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=offs_k[:, None] < n_k, other=0.0)
        if WHICH == VALID_NATURAL_EXP:
            s = tl.dot(q, tl.trans(k)) * (qk_scale_log2 * LN_2)
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale_log2
        if WHICH != RAGGED_OPEN:
            s = tl.where(offs_k[None, :] < n_k, s, neg)
        apply = is_partial != 0
        if WHICH == FLAG_INVERTED:
            apply = is_partial == 0
        if WHICH == VALID_MASK_EVERY_TILE:
            apply = n_k > 0
        if WHICH != NO_PARTIAL_MASK:
            if apply:
                inside = (offs_m[:, None] < n_q) & (offs_k[None, :] < n_k)
                if WHICH == MASK_LOAD_UNMASKED:
                    keep = tl.load(MASK + offs_m[:, None] * stride_mq + offs_k[None, :] * stride_mk)
                elif WHICH == MASK_STRIDES_SWAPPED:
                    keep = tl.load(MASK + offs_m[:, None] * stride_mk + offs_k[None, :] * stride_mq,
                                   mask=inside, other=0)
                else:
                    keep = tl.load(MASK + offs_m[:, None] * stride_mq + offs_k[None, :] * stride_mk,
                                   mask=inside, other=0)
                if WHICH == MASK_ZERO:
                    s = tl.where(keep != 0, s, 0.0)
                else:
                    s = tl.where(keep != 0, s, neg)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WHICH == NO_SAFE_MAX or WHICH == VALID_FINITE_MASK:
            m_use = m_new
        else:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        if WHICH == VALID_NATURAL_EXP:
            p = tl.exp(s - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
        else:
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if WHICH == NO_RESCALE:
            acc += tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    if WHICH == VALID_NATURAL_EXP:
        lse = m_i + tl.log(l_i)
    elif WHICH == LSE_LOG2:
        lse = m_i + tl.math.log2(l_i)
    else:
        lse = (m_i + tl.math.log2(l_i)) / LOG2_E
    rows = offs_m < n_q
    tl.store(O + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
             o.to(O.dtype.element_ty), mask=rows[:, None])
    if WHICH == LSE_CONTIGUOUS:  # lse assumed dense (H, N_q): its strides ignored
        tl.store(LSE + h * n_q + offs_m, lse, mask=rows)
    else:
        tl.store(LSE + h * stride_lh + offs_m * stride_ln, lse, mask=rows)


_B = list(ch10.BLOCK_SPARSE_MISTAKES)
SPARSE_CORPUS = {
    NO_PARTIAL_MASK: ("cause", one(_B, "the element mask is never applied")),
    T_AS_TILE: ("cause", one(_B, "the K/V tile is placed by the loop counter")),
    LIST_ROW0: ("cause", one(_B, "every Q tile reads row 0")),
    FLAG_BY_TILE: ("cause", one(_B, "the partial flag is read at the tile's column")),
    NO_RESCALE: ("cause", one(_B, "acc is not rescaled")),
    RAGGED_OPEN: ("cause", one(_B, "the padded keys of the ragged last K/V tile")),
    NO_SAFE_MAX: ("cause", one(_B, "a row that sees no key in its first visited tile")),
    LSE_LOG2: ("cause", one(_B, "lse is left in log2 units")),
    MASK_ZERO: ("cause", one(_B, "masked scores are set to 0")),
    # applying the mask on full tiles only leaves the partial ones unmasked: that cause
    FLAG_INVERTED: ("cause", one(_B, "the element mask is never applied")),
    KV_UNMASKED_LOADS: ("seen", expect(cpu="a full tile can be ragged too", gpu="✗ Exercise 10.3")),
    MASK_LOAD_UNMASKED: ("seen", expect(cpu="hint: load the element mask masked",
                                        gpu="✗ Exercise 10.3")),
    NO_HEAD_KV_3: ("seen", "wrong answer on case 1 of 4"),
    MASK_STRIDES_SWAPPED: ("seen", "✗ Exercise 10.3"),
}


@pytest.mark.parametrize("which", list(SPARSE_CORPUS))
def test_wrong_block_sparse_kernels_are_rejected_and_never_misdiagnosed(which):
    with pytest.raises(ExerciseFailed) as info:
        ch10.check_block_sparse_kernel(_Learner(_sparse_learner, which))
    message = str(info.value)
    assert message.startswith("✗ Exercise 10.3"), message
    _assert_diagnosed(message, SPARSE_CORPUS[which], _B)


@pytest.mark.parametrize("which", [B_RIGHT, VALID_MASK_EVERY_TILE, VALID_NATURAL_EXP,
                                   VALID_FINITE_MASK])
def test_right_block_sparse_kernels_in_other_styles_pass(which, capsys):
    kernel = _Learner(_sparse_learner, which)
    assert ch10.check_block_sparse_kernel(kernel) is kernel
    assert "Exercise 10.3: passed (4 cases)" in capsys.readouterr().out


def test_block_sparse_model_passes_in_under_5_s(capsys):
    start = time.perf_counter()
    with library_answers_allowed():
        kernel = ch10.BLOCK_SPARSE_KERNEL
        assert ch10.check_block_sparse_kernel(kernel) is kernel
    assert time.perf_counter() - start < CHECK_TIME_LIMIT_S
    assert "Exercise 10.3: passed (4 cases)" in capsys.readouterr().out


def test_block_sparse_cases_hold_what_the_mistakes_need():
    cases = ch10._block_sparse_cases("cpu")
    kinds = set()
    for case in cases:
        mask, bm, bn = case.args[6].bool().numpy(), case.kwargs["block_m"], case.kwargs["block_n"]
        classes = masks.classify_tiles(mask, bm, bn)
        kinds |= set(np.unique(classes).tolist())
        assert mask.any(axis=1).all()  # every row sees a key (lse finite)
    assert kinds == {masks.SKIP, masks.PARTIAL, masks.FULL}
    # a Q tile whose list differs from 0, 1, 2, ... (the flag-by-tile and t-as-tile mistakes)
    assert any((c.args[4][i, :n] != torch.arange(n)).any()
               for c in cases for i, n in enumerate(c.args[3].tolist()))


def test_block_sparse_hint_ladder_and_skeleton():
    from course_lib.teaching.widgets.hints import HintLadder

    ladder = HintLadder("Exercise 10.3", ch10.BLOCK_SPARSE_HINTS,
                        skeleton=ch10.BLOCK_SPARSE_SKELETON)
    assert ladder.next_hint() == ch10.BLOCK_SPARSE_HINTS[0]
    assert "for t in range(0, num)" in ladder.show_skeleton()


# ----------------------------------------------------------------------------------------------
# Issue 32: inputs the contract allows (lse with its own strides), messages made true


def test_10_1_names_its_outputs():
    """The lists are named in the message (it said "output [0]" for kv_num_blocks)."""
    def counts_from_one(mask, block_m, block_n):
        num, idx, part = ch10.tile_lists_reference(mask, block_m, block_n)
        return num + 1, idx, part
    message = assert_rejected(ch10.check_tile_lists, counts_from_one, None)
    assert "`kv_num_blocks`: " in message and "output [0]" not in message, message


def test_10_2_a_row_past_the_batch_is_told_by_the_slip_it_fits():
    """A row past the packed batch was always "seq_len is its length, not its end"; a base offset
    that already includes the tile's rows reads past it too, and is now told apart."""
    with pytest.raises(ExerciseFailed) as info:
        ch10.check_varlen_kernel(_Learner(_varlen_learner, BASE_HAS_TILE))
    message = str(info.value)
    if expect(cpu=True, gpu=False):
        assert "It fits one slip: the base offset already includes the tile's rows" in message, \
            message
    assert "its length, not its end" not in message and "sample's end, not its length" \
        not in message
    with pytest.raises(ExerciseFailed) as info:
        ch10.check_varlen_kernel(_Learner(_varlen_learner, LEN_IS_END))
    if expect(cpu=True, gpu=False):
        assert "It fits one slip: seq_len is the sample's end, not its length" in str(info.value)


def test_10_2_other_failing_cases_include_the_out_of_bounds_one():
    """h // n_kv_heads is wrong on case 1 and reads a K/V head that does not exist on case 3:
    "(also wrong on …)" left case 3 out."""
    with pytest.raises(ExerciseFailed) as info:
        ch10.check_varlen_kernel(_Learner(_varlen_learner, KV_DIVIDE))
    assert "(also wrong on cases 2, 3 (3 crashed); right on 0 of 3)" in str(info.value), \
        str(info.value)


def test_10_3_lse_has_its_own_strides_in_the_cases():
    dense = []
    for case in ch10._block_sparse_cases("cpu"):
        lse_layout = case.kwargs["layouts"][-1]
        q = case.args[0]
        dense.append(lse_layout.strides(tuple(q.shape[:2])) == (q.shape[1], 1))
    assert not any(dense)
    message = assert_rejected(ch10.check_block_sparse_kernel,
                              _Learner(_sparse_learner, LSE_CONTIGUOUS), None)
    assert message.startswith("✗ Exercise 10.3"), message


def test_10_3_an_unmasked_q_load_is_told_as_a_missing_row_mask():
    """The last Q tile's rows run past N_q: the guard said "the batch or head offset is too
    large … lanes of one tile never need a mask there"."""
    message = assert_rejected(ch10.check_block_sparse_kernel,
                              _Learner(_sparse_learner, Q_UNMASKED), None)
    if expect(cpu=True, gpu=False):
        assert "run past the last row" in message and "needs a mask on its rows" in message, \
            message
    assert "never need a mask" not in message and "batch or head offset" not in message


def test_10_3_says_the_first_invalid_operation_once():
    with pytest.raises(ExerciseFailed) as info:
        ch10.check_block_sparse_kernel(_Learner(_sparse_learner, NO_SAFE_MAX))
    message = str(info.value)
    assert message.count("first invalid operation") <= 1, message
    assert_cause(message, _B, one(_B, "a row that sees no key in its first visited tile"))


def test_concept_question_1_takes_the_hints_arithmetic_and_says_the_window_is_one_sided():
    from course_lib.teaching import concept_questions
    from course_lib.teaching.quiz_types import MultipleChoice

    question = concept_questions.questions("10")[0]
    assert "one-sided" in question.prompt and "none after" in question.prompt
    hint_estimate = 100 * (4096 // 128 + 1) / (65_536 // 128)  # W / BLOCK_N + 1 of N / BLOCK_N
    assert question.grade(hint_estimate).correct and question.grade(question.answer).correct
    assert not question.grade(100 - question.answer).correct and not question.grade(50.0).correct
    for chapter in ("10", "11"):  # the widget writes "✓ Right." itself: no "Right:" after it
        for q in concept_questions.questions(chapter):
            if isinstance(q, MultipleChoice):
                assert not q.explanations[q.answer].startswith(("Right", "Correct")), q.prompt


def _prose(cell_id: str) -> str:
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parent.parent / "solutions"
                     / "10_masks_in_triton.ipynb").read_text(encoding="utf-8"))
    return next("".join(c["source"]) for c in nb["cells"] if c.get("id") == cell_id)


def test_reading_the_measurements_quotes_the_recorded_speedups_and_says_how():
    """Two speedups against FA2 varlen (1.85× and 1.43×): the prose says the first takes the
    faster of two course calls per cell, and every number quoted is the recorded one."""
    import re
    import statistics

    from course_lib.measure import mask_results

    data = mask_results.recorded()
    if data is None:
        pytest.skip("chapter 10's H100 results are not recorded in this checkout")
    prose = " ".join(_prose("4893e6a6").split())
    assert "the faster of the course's two ways to run a packed batch" in prose

    def quoted(pattern):
        found = re.search(pattern, prose)
        assert found, pattern
        return float(found.group(1))

    flex = mask_results.speedup_summary(data, "fwd", "flex")
    fa2 = mask_results.speedup_summary(data, "fwd", "fa2_varlen")
    flex_b = mask_results.speedup_summary(data, "fwd+bwd", "flex")
    fa2_b = mask_results.speedup_summary(data, "fwd+bwd", "fa2_varlen")
    assert quoted(r"forward ([\d.]+)× FlexAttention") == round(flex["median"], 2)
    assert quoted(r"\(([\d.]+)× at worst, 88 cells\)") == round(flex["min"], 2)
    assert quoted(r"and ([\d.]+)× FlashAttention-2's varlen") == round(fa2["median"], 2)
    assert quoted(r"forward \+ backward ([\d.]+)× FlexAttention") == round(flex_b["median"], 2)
    assert quoted(r"and ([\d.]+)× FA2 varlen\.") == round(fa2_b["median"], 2)
    alone = {}
    for pass_ in mask_results.PASSES:  # flash_attention_varlen alone, cell by cell
        alone[pass_] = [row["ms"] / mine["ms"] for row in
                        mask_results.rows_of(data, "fa2_varlen", pass_, None)
                        if (mine := mask_results.cell(data, "course_varlen", row)) is not None]
    assert quoted(r"runs at ([\d.]+)× FA2 varlen forward") == round(
        statistics.median(alone["fwd"]), 2)
    assert quoted(r"and ([\d.]+)× forward \+ backward at the median") == round(
        statistics.median(alone["fwd+bwd"]), 2)
    assert quoted(r"forward \+ backward down to ([\d.]+)×") == round(min(alone["fwd+bwd"]), 2)


def test_tile_picker_caption_says_the_recorded_mask_may_be_another():
    """The picker shows, for a causal mask of 4 documents, the time of a recorded non-causal
    mask of 10 documents: the caption says so, and the widget's line names that mask."""
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.teaching.widgets.tile_patterns import TilePatterns

    caption = " ".join(_prose("71e6943d").split())
    assert "need not be the one you picked" in caption and "not causal" in caption
    picker = TilePatterns(pattern="document", documents=4, seq_len=16384)
    if picker.recorded is None:
        pytest.skip("chapter 10's H100 results are not recorded in this checkout")
    assert picker.recorded["label"] != "4 documents"
    assert f"nearest recorded mask \"{picker.recorded['label']}\"" in picker.summary.value
