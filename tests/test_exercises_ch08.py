"""Chapter 08 checks: the reference passes, a stub is "not done yet", and every known mistake is
rejected with its cause named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib import decoding
from course_lib.checks import ExerciseFailed
from course_lib.exercises import ch08

pytestmark = pytest.mark.ch08

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


# ----------------------------------------------------------------------------------------------
# Exercise 8.4: the split kernel of flash-decoding. The corpus is one kernel with a constexpr
# MISTAKE switch: 0 is right, each other value makes exactly one classic mistake.

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from course_lib.kernels import decoding as kernels_decoding  # noqa: E402
from course_lib.kernels import tiles  # noqa: E402
from course_lib.kernels.tiles import LN_2, LOG2_E, MASK_VALUE  # noqa: E402

# The switch's values, as tl.constexpr so that the kernel may read them (compiled or interpreted).
(RIGHT, KV_MODULO, NO_RESCALE, M_LOG2, SCORES_UNMASKED, MASK_TO_CACHE, FLOOR_SPLIT, NO_SCALE,
 L_NOT_STORED, LOADS_UNMASKED) = (tl.constexpr(i) for i in range(10))


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
    if MISTAKE == KV_MODULO:
        kv_h = h % n_kv_heads
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
    q = tiles.load_tile(Q, b, h, offs_m, offs_d, tiles.row_mask(offs_m, n_q, d_mask),
                        stride_qb, stride_qh, stride_qm, stride_qd)
    k_ptrs = tiles.tile_ptrs(K, b, kv_h, offs_n, offs_d, stride_kb, stride_kh, stride_kn, stride_kd)
    v_ptrs = tiles.tile_ptrs(V, b, kv_h, offs_n, offs_d, stride_vb, stride_vh, stride_vn, stride_vd)
    m_i = tl.full((BLOCK_M,), MASK_VALUE, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        keys = start_n + offs_n
        kv_mask = (keys[:, None] < mask_end) & d_mask[None, :]
        if MISTAKE == LOADS_UNMASKED:
            k = tl.load(k_ptrs + start_n * stride_kn)
            v = tl.load(v_ptrs + start_n * stride_vn)
        else:
            k = tl.load(k_ptrs + start_n * stride_kn, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vn, mask=kv_mask, other=0.0)
        s = tiles.scores_log2(q, k, qk_scale_log2, ACC_DTYPE=tl.float32, DOT_PRECISION=DOT_PRECISION)
        if MISTAKE != SCORES_UNMASKED:
            if MISTAKE != LOADS_UNMASKED:
                s = tl.where(keys[None, :] < mask_end, s, MASK_VALUE)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MISTAKE != NO_RESCALE:
            acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    rows = offs_m < n_q
    ml_off = b * stride_mb + h * stride_mh + split * stride_ms + offs_m * stride_mm
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

# mistake -> text its diagnosis must contain: the replayed cause, or the guarded run's finding
SPLIT_KERNEL_CORPUS = {k.value: text for k, text in {
    KV_MODULO: f"likely cause: {_SPLIT_CAUSES[0]}",
    NO_RESCALE: f"likely cause: {_SPLIT_CAUSES[1]}",
    M_LOG2: f"likely cause: {_SPLIT_CAUSES[2]}",
    SCORES_UNMASKED: f"likely cause: {_SPLIT_CAUSES[3]}",
    MASK_TO_CACHE: f"likely cause: {_SPLIT_CAUSES[4]}",
    FLOOR_SPLIT: f"likely cause: {_SPLIT_CAUSES[5]}",
    NO_SCALE: f"likely cause: {_SPLIT_CAUSES[6]}",
    L_NOT_STORED: "of l (1, 4, 3, 3) were never written",
    LOADS_UNMASKED: "the last tile of a chunk is ragged",
}.items()}


def test_split_kernel_corpus_is_right_with_no_mistake(capsys):
    kernel = _WithMistake(RIGHT)
    assert ch08.check_split_kv_kernel(kernel) is kernel
    assert "Exercise 8.4: passed" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", SPLIT_KERNEL_CORPUS)
def test_each_wrong_split_kernel_is_rejected_with_its_cause(mistake):
    with pytest.raises(ExerciseFailed) as info:
        ch08.check_split_kv_kernel(_WithMistake(mistake))
    message = str(info.value)
    assert message.startswith("✗ Exercise 8.4") and "case 1 of 4" in message
    assert SPLIT_KERNEL_CORPUS[mistake] in message, message
    assert message.count("likely cause") <= 1  # one diagnosis


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
    np.testing.assert_allclose(o.numpy()[:, :, :, 0], np.moveaxis(o_np, 0, 2), atol=1e-12)


def test_split_kernel_hint_ladder_and_skeleton():
    import ast

    from course_lib.widgets.hints import HintLadder

    ladder = HintLadder("Exercise 8.4", ch08.SPLIT_KERNEL_HINTS, skeleton=ch08.SPLIT_KERNEL_SKELETON)
    assert ladder.show_skeleton() == ch08.SPLIT_KERNEL_SKELETON
    ast.parse(ch08.SPLIT_KERNEL_SKELETON)  # valid Python, with `...` where the learner writes
    assert "h // (n_heads // n_kv_heads)" in ch08.SPLIT_KERNEL_HINTS[0]
