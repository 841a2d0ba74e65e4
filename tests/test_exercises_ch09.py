"""Chapter 09 checks: the reference passes, a stub is "not done yet", and every known mistake is
rejected with its cause named."""

from __future__ import annotations

import ast
import math

import pytest
import torch
import triton
import triton.language as tl

from corpus_checks import assert_cause, one  # noqa: F401
from course_lib.attention import fp8
from course_lib.teaching.checks import ExerciseFailed
from course_lib.teaching.exercises import ch09
from course_lib.kernels import hopper

pytestmark = pytest.mark.ch09


def expect(cpu, gpu):
    """What a diagnosis must contain in this mode. In the interpreter (CPU) the memory guard
    stops an access outside the tensors before it happens and names tensor, index and program
    id, and NumPy traces a NaN to the kernel's line; on a GPU the guard is off and the guarded
    buffers diagnose it after the launch (values written outside an output, NaN that came from
    an input's margin)."""
    from course_lib.platform import runtime

    return gpu if runtime.current().on_gpu else cpu

CHECKS = {
    "9.1": (ch09.check_rotate_qk, ch09.ROTATE_MISTAKES, ch09.rotate_qk_reference),
    "9.2": (ch09.check_quantize_e4m3, ch09.QUANTIZE_MISTAKES, fp8.quantize_e4m3),
}


def _stub(*args):
    raise NotImplementedError("Exercise 9.x")


@pytest.mark.parametrize("exercise", CHECKS)
def test_reference_passes_and_stub_falls_back(exercise, capsys):
    check, _, reference = CHECKS[exercise]
    assert check(reference) is reference
    assert check(_stub) is reference
    out = capsys.readouterr().out
    assert f"Exercise {exercise}: passed" in out and "not done yet" in out


@pytest.mark.parametrize("exercise, cause",
                         [(e, c) for e, (_, ms, _) in CHECKS.items() for c in ms])
def test_each_mistake_is_rejected_with_its_cause(exercise, cause):
    check, mistakes, _ = CHECKS[exercise]
    assert len(mistakes) >= 6
    with pytest.raises(ExerciseFailed) as info:
        check(mistakes[cause])
    message = str(info.value)
    assert f"Exercise {exercise}" in message and f"likely cause: {cause}" in message


# ----------------------------------------------------------------------------------------------
# Exercise 9.1: any right rotation passes, whatever its random signs


def _learner_rotation(q, k, seed, signs_first=True):
    """A learner's answer that draws its signs its own way (not the skeleton's recipe)."""
    d = q.shape[-1]
    h = torch.tensor(1.0, dtype=torch.float64).reshape(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(d)
    gen = torch.Generator().manual_seed(seed + 1000)
    signs = torch.where(torch.rand(d, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
    r = signs[:, None] * h if signs_first else h * signs[None, :]
    return (q.double() @ r).to(q.dtype), (k.double() @ r).to(k.dtype)


def test_a_rotation_with_other_random_signs_passes(capsys):
    assert ch09.check_rotate_qk(_learner_rotation) is _learner_rotation
    assert "Exercise 9.1: passed (6 cases)" in capsys.readouterr().out


def test_signs_after_the_hadamard_are_caught_even_with_other_signs():
    def signs_after(q, k, seed):
        return _learner_rotation(q, k, seed, signs_first=False)

    with pytest.raises(ExerciseFailed, match="case 6 of 6") as info:
        ch09.check_rotate_qk(signs_after)
    assert "came out one-hot" in str(info.value)


def test_rotation_answers_of_the_wrong_kind_are_diagnosed():
    with pytest.raises(ExerciseFailed, match="must return two tensors"):
        ch09.check_rotate_qk(lambda q, k, seed: q)
    with pytest.raises(ExerciseFailed, match="must have the dtypes of q and k"):
        ch09.check_rotate_qk(lambda q, k, seed: (q.double(), k.double()))
    with pytest.raises(ExerciseFailed, match="changed its input `q` in place"):
        ch09.check_rotate_qk(lambda q, k, seed: (q.mul_(1.0).zero_(), k))


def test_rotation_probe_rejects_an_unknown_probe():
    q = torch.randn(2, 16)
    with pytest.raises(ValueError, match="probe must be one of"):
        ch09.rotation_probe(ch09.rotate_qk_reference, q, q, 0, "norms")


def test_the_checks_h_rows_are_not_made_one_hot_by_the_librarys_signs():
    """The last case asks that no row of H comes out one-hot: true for diag(s) · H unless s is
    (±) a row of H itself, which the library's seed does not draw."""
    case = ch09._rotation_cases()[-1]
    q_rot, _ = ch09.rotate_qk_reference(*case.args)
    share = q_rot.abs().amax(dim=-1) / q_rot.norm(dim=-1)
    assert bool((share < 0.5).all()), share


# ----------------------------------------------------------------------------------------------
# Exercise 9.2


def test_dividing_by_the_reciprocal_also_passes(capsys):
    """x · (1 / scale) may round a value on an e4m3 tie the other way: one step is allowed."""
    def quantize(x, block):
        x32 = x.float()
        n = x32.shape[-2]
        block = n if block is None else block
        n_blocks = -(-n // block)
        padded = torch.nn.functional.pad(x32, (0, 0, 0, n_blocks * block - n))
        amax = padded.abs().unflatten(-2, (n_blocks, block)).amax(dim=(-2, -1))
        scale = torch.where(amax > 0, amax / fp8.E4M3_MAX, 1.0)[..., None]
        inverse = (1.0 / scale).repeat_interleave(block, dim=-2)[..., :n, :]
        return (x32 * inverse).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(torch.float8_e4m3fn), scale

    assert ch09.check_quantize_e4m3(quantize) is quantize
    assert "Exercise 9.2: passed (6 cases)" in capsys.readouterr().out


def test_quantize_model_defaults_are_the_library():
    for case in ch09._quantize_cases():
        got, want = ch09.quantize_model(*case.args), fp8.quantize_e4m3(*case.args)
        assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])


def test_wrong_dtypes_are_diagnosed():
    with pytest.raises(ExerciseFailed, match="dtype float32 but expected float8_e4m3fn"):
        ch09.check_quantize_e4m3(lambda x, block: (fp8.quantize_e4m3(x, block)[0].float(),
                                                   fp8.quantize_e4m3(x, block)[1]))


# ----------------------------------------------------------------------------------------------
# Wrong answers to 9.1 and 9.2 written as learners write them, each with the cause its diagnosis
# must name or None (no cause may be named); right answers in other styles, which must pass.


def _sylvester_loop(d):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _kron_hadamard(d):
    h = torch.ones(1, 1, dtype=torch.float64)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.kron(base, h)
    return h


def _signs_skeleton(d, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (d,), generator=gen) * 2 - 1).double()


def _rot(q, k, r_q, r_k=None):
    r_k = r_q if r_k is None else r_k
    return (q.double() @ r_q).to(q.dtype), (k.double() @ r_k).to(k.dtype)


def _rotate_corpus():
    c = ch09.ROTATE_MISTAKES

    def unnormalised(q, k, seed):
        d = q.shape[-1]
        return _rot(q, k, torch.diag(_signs_skeleton(d, seed)) @ _sylvester_loop(d))

    def zero_one(q, k, seed):
        d = q.shape[-1]
        gen = torch.Generator().manual_seed(seed)
        s = torch.randint(0, 2, (d,), generator=gen).double()
        return _rot(q, k, s[:, None] * _sylvester_loop(d) / math.sqrt(d))

    def two_draws(q, k, seed):
        d = q.shape[-1]
        gen = torch.Generator().manual_seed(seed)
        h = _sylvester_loop(d) / d ** 0.5
        s_q = (torch.randint(0, 2, (d,), generator=gen) * 2 - 1).double()
        s_k = (torch.randint(0, 2, (d,), generator=gen) * 2 - 1).double()
        return _rot(q, k, s_q[:, None] * h, s_k[:, None] * h)

    def only_q(q, k, seed):
        d = q.shape[-1]
        r = _signs_skeleton(d, seed)[:, None] * _sylvester_loop(d) / math.sqrt(d)
        return (q.double() @ r).to(q.dtype), k.clone()

    def random_pm(q, k, seed):
        d = q.shape[-1]
        gen = torch.Generator().manual_seed(seed)
        r = (torch.randint(0, 2, (d, d), generator=gen) * 2 - 1).double() / math.sqrt(d)
        return _rot(q, k, r)

    def no_minus(q, k, seed):
        d = q.shape[-1]
        h = torch.ones(1, 1, dtype=torch.float64)
        while len(h) < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, h], 1)], 0)
        return _rot(q, k, _signs_skeleton(d, seed)[:, None] * h / math.sqrt(d))

    def signs_only(q, k, seed):
        s = _signs_skeleton(q.shape[-1], seed)
        return (q.double() * s).to(q.dtype), (k.double() * s).to(k.dtype)

    def transposed(q, k, seed):  # q @ Rᵀ = q @ H · diag(s): the signs after H
        d = q.shape[-1]
        r = _signs_skeleton(d, seed)[:, None] * _sylvester_loop(d) / math.sqrt(d)
        return _rot(q, k, r.T)

    def no_signs(q, k, seed):
        d = q.shape[-1]
        return _rot(q, k, _kron_hadamard(d) / math.sqrt(d))

    def global_rng(q, k, seed):
        d = q.shape[-1]
        s = torch.randint(0, 2, (d,)).double() * 2 - 1
        return _rot(q, k, s[:, None] * _sylvester_loop(d) / math.sqrt(d))

    def wrong_dtype(q, k, seed):
        d = q.shape[-1]
        r = _signs_skeleton(d, seed)[:, None] * _sylvester_loop(d) / math.sqrt(d)
        return q.double() @ r, k.double() @ r

    def divided_by_d(q, k, seed):
        d = q.shape[-1]
        return _rot(q, k, _signs_skeleton(d, seed)[:, None] * _sylvester_loop(d) / d)

    def twice(q, k, seed):
        d = q.shape[-1]
        r = _signs_skeleton(d, seed)[:, None] * _sylvester_loop(d) / math.sqrt(d)
        return _rot(q, k, r @ r)

    return [
        (unnormalised, one(c, "H is not normalised")),
        (zero_one, one(c, "the random signs are 0 or 1")),
        (two_draws, one(c, "q and k get different random signs")),
        (only_q, one(c, "only q is rotated")),
        (random_pm, one(c, "R is a random ±1/√d matrix")),
        (no_minus, one(c, "the doubling step is [[H, H], [H, H]]")),
        (signs_only, one(c, "R = diag(s) has random signs")),
        (transposed, one(c, "the signs are applied after H")),
        (no_signs, one(c, "R = H with no random signs")),
        (global_rng, one(c, "the signs come from torch's global generator")),
        (wrong_dtype, None),
        (divided_by_d, None),
        (twice, None),
    ]


def _rotate_valid():
    def kron_numpy_signs(q, k, seed):
        import numpy as np

        d = q.shape[-1]
        s = torch.from_numpy(np.random.default_rng(seed).choice([-1.0, 1.0], size=d))
        r = torch.diag(s) @ _kron_hadamard(d) / math.sqrt(d)
        return (q.double() @ r).to(q.dtype), (k.double() @ r).to(k.dtype)

    def fast_walsh(q, k, seed):  # the butterfly, no matrix
        d = q.shape[-1]
        s = _signs_skeleton(d, seed + 7)

        def transform(x):
            y = x.double() * s
            h = 1
            while h < d:
                y = y.unflatten(-1, (d // (2 * h), 2, h))
                a, b = y[..., 0, :], y[..., 1, :]
                y = torch.stack([a + b, a - b], dim=-2).flatten(-3)
                h *= 2
            return (y / math.sqrt(d)).to(x.dtype)
        return transform(q), transform(k)

    def float32_throughout(q, k, seed):
        d = q.shape[-1]
        r = (_signs_skeleton(d, seed)[:, None] * _sylvester_loop(d) / math.sqrt(d))
        r = r.to(q.dtype)
        return q @ r, k @ r.to(k.dtype)

    return [kron_numpy_signs, fast_walsh, float32_throughout]


def _quantize_corpus():
    c = ch09.QUANTIZE_MISTAKES
    E = fp8.E4M3_MAX

    def blocks_of(x, block):
        n = x.shape[-2]
        block = n if block is None else block
        n_blocks = math.ceil(n / block)
        padded = torch.nn.functional.pad(x.float(), (0, 0, 0, n_blocks * block - n))
        return n, block, n_blocks, padded

    def quantize_with(amax_of, scale_of=lambda amax: torch.where(amax > 0, amax / E, 1.0),
                      apply=lambda x, rows: x / rows, pad_value=0.0):
        def quantize(x, block=None):
            n, block, n_blocks, padded = blocks_of(x, block)
            if pad_value:
                padded[..., n:, :] = pad_value
            scale = scale_of(amax_of(padded, n_blocks, block))[..., None]
            rows = scale.repeat_interleave(block, dim=-2)[..., :n, :]
            return apply(x.float(), rows).clamp(-E, E).to(torch.float8_e4m3fn), scale
        return quantize

    def block_amax(p, nb, b):
        return p.abs().unflatten(-2, (nb, b)).amax(dim=(-2, -1))

    def per_row(x, block=None):
        amax = x.float().abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / E, 1.0)
        return (x.float() / scale).clamp(-E, E).to(torch.float8_e4m3fn), scale

    def whole_tensor(x, block=None):
        n, block, n_blocks, padded = blocks_of(x, block)
        scale = torch.full(x.shape[:-2] + (n_blocks, 1), float(x.float().abs().max()) / E)
        rows = scale.repeat_interleave(block, dim=-2)[..., :n, :]
        return (x.float() / rows).clamp(-E, E).to(torch.float8_e4m3fn), scale

    def loop_no_guard(x, block=None):
        n = x.shape[-2]
        block = n if block is None else block
        scales, parts = [], []
        for start in range(0, n, block):
            part = x[..., start:start + block, :].float()
            s = part.abs().amax(dim=(-2, -1), keepdim=True) / E
            scales.append(s)
            parts.append(part / s)
        return (torch.cat(parts, -2).clamp(-E, E).to(torch.float8_e4m3fn),
                torch.cat(scales, -2))

    def scale_without_trailing_one(x, block=None):
        x_fp8, scale = fp8.quantize_e4m3(x, block)
        return x_fp8, scale[..., 0]

    def scale_in_input_dtype(x, block=None):
        x_fp8, scale = fp8.quantize_e4m3(x, block)
        return x_fp8, scale.to(x.dtype)

    def floor_blocks(x, block=None):
        n = x.shape[-2]
        block = n if block is None else block
        n_blocks = n // block
        amax = x.float()[..., :n_blocks * block, :].abs().unflatten(-2, (n_blocks, block)).amax(
            dim=(-2, -1))
        scale = torch.where(amax > 0, amax / E, 1.0)[..., None]
        rows = scale.repeat_interleave(block, dim=-2)
        rows = torch.cat([rows, rows[..., -1:, :].expand(*rows.shape[:-2], n - rows.shape[-2], 1)],
                         -2)
        return (x.float() / rows).clamp(-E, E).to(torch.float8_e4m3fn), scale

    return [
        (quantize_with(block_amax, scale_of=lambda a: torch.where(a > 0, E / a, 1.0),
                       apply=lambda x, rows: x * rows), one(c, "the scale is inverted")),
        (quantize_with(block_amax, apply=lambda x, rows: x * rows), one(c, "x is multiplied")),
        (whole_tensor, one(c, "one amax for the whole tensor")),
        (quantize_with(lambda p, nb, b: p.unflatten(-2, (nb, b)).amax(dim=(-2, -1))),
         one(c, "the amax is max(x), not max(|x|)")),
        (quantize_with(block_amax, scale_of=lambda a: torch.where(a > 0, a / 127.0, 1.0)),
         one(c, "the peak is mapped to 127")),
        (quantize_with(block_amax, scale_of=lambda a: torch.where(a > 0, a / 240.0, 1.0)),
         one(c, "the peak is mapped to 240")),
        (loop_no_guard, one(c, "a block of zeros gets scale 0")),
        (quantize_with(lambda p, nb, b: p.abs().view(*p.shape[:-2], b, nb, p.shape[-1]).amax(
            dim=(-3, -1))), one(c, "the blocks interleave the rows")),
        (per_row, one(c, "one scale per row")),
        (quantize_with(block_amax, apply=lambda x, rows: torch.round(x / rows)),
         one(c, "the scaled values are rounded")),
        (quantize_with(block_amax, pad_value=1.0), None),
        (scale_without_trailing_one, None),
        (scale_in_input_dtype, None),
        (floor_blocks, None),
    ]


def _quantize_valid():
    E = fp8.E4M3_MAX

    def loop(x, block=None):
        n = x.shape[-2]
        block = n if block is None else block
        scales, parts = [], []
        for start in range(0, n, block):
            part = x[..., start:start + block, :].float()
            amax = part.abs().amax(dim=(-2, -1), keepdim=True)
            s = torch.where(amax > 0, amax / E, torch.ones_like(amax))
            scales.append(s)
            parts.append(part / s)
        return torch.cat(parts, -2).to(torch.float8_e4m3fn), torch.cat(scales, -2)

    def no_clamp(x, block=None):
        x_fp8, scale = fp8.quantize_e4m3(x, block)
        n = x.shape[-2]
        b = n if block is None else block
        rows = scale.repeat_interleave(b, dim=-2)[..., :n, :]
        return (x.float() / rows).to(torch.float8_e4m3fn), scale

    def reshape_with_index(x, block=None):
        n = x.shape[-2]
        b = n if block is None else block
        which = torch.arange(n) // b  # the block of each row
        n_blocks = int(which[-1]) + 1
        amax = torch.zeros(*x.shape[:-2], n_blocks)
        amax = amax.index_reduce(-1, which, x.float().abs().amax(dim=-1), "amax")
        scale = torch.where(amax > 0, amax / E, 1.0)[..., None]
        return (x.float() / scale[..., which, :]).clamp(-E, E).to(torch.float8_e4m3fn), scale

    return [loop, no_clamp, reshape_with_index]


CORPORA = {
    "9.1": (ch09.check_rotate_qk, ch09.ROTATE_MISTAKES, _rotate_corpus()),
    "9.2": (ch09.check_quantize_e4m3, ch09.QUANTIZE_MISTAKES, _quantize_corpus()),
}


@pytest.mark.parametrize("exercise, i", [(e, i) for e, (_, _, corpus) in CORPORA.items()
                                         for i in range(len(corpus))])
def test_learner_wrong_answers_are_rejected_and_never_misdiagnosed(exercise, i):
    check, mistakes, corpus = CORPORA[exercise]
    answer, cause = corpus[i]
    with pytest.raises(ExerciseFailed) as info:
        check(answer)
    message = str(info.value)
    assert message.startswith(f"✗ Exercise {exercise}"), message
    assert_cause(message, mistakes, cause)


@pytest.mark.parametrize("exercise, answer", [*[("9.1", a) for a in _rotate_valid()],
                                              *[("9.2", a) for a in _quantize_valid()]])
def test_right_answers_in_other_styles_pass(exercise, answer, capsys):
    check = CORPORA[exercise][0]
    assert check(answer) is answer
    assert f"Exercise {exercise}: passed" in capsys.readouterr().out


@pytest.mark.parametrize("name, hints, skeleton, words", [
    ("Exercise 9.1", ch09.ROTATE_HINTS, ch09.ROTATE_SKELETON, "[[h, h], [h, -h]]"),
    ("Exercise 9.2", ch09.QUANTIZE_HINTS, ch09.QUANTIZE_SKELETON, "E4M3_MAX"),
    ("Exercise 9.3", ch09.SCORES_KERNEL_HINTS, ch09.SCORES_KERNEL_SKELETON,
     "make_tensor_descriptor"),
])
def test_hint_ladders_and_skeletons(name, hints, skeleton, words):
    from course_lib.teaching.widgets.hints import HintLadder

    ladder = HintLadder(name, hints, skeleton=skeleton)
    assert ladder.show_skeleton() == skeleton
    ast.parse(f"def answer():\n" + "\n".join("    " + line for line in skeleton.splitlines()))
    assert any(words in hint for hint in hints) or words in skeleton


# ----------------------------------------------------------------------------------------------
# Exercise 9.3: the descriptor scores kernel. The corpus is one kernel written as a learner would
# (descriptors, offsets, a pointer store) with a constexpr MISTAKE switch: RIGHT and the VALID_*
# values are right answers in other styles, every other value makes one mistake a learner makes.

(RIGHT, TILE_OFFSETS, K_BLOCK_M, K_FIXED, K_ROWS_NQ, NO_SCALE, LOG2_SCALE, STORE_UNMASKED,
 SHAPE_PADDED, PIDS_SWAPPED, NO_TRANS, Q_ROWS_NK, STRIDES_SWAPPED, MASK_SWAPPED, STORE_ROW_N_K,
 SCALE_RECOMPUTED, SCALE_HEAD_DIM, ROWS_MASK_ONLY, SCALE_TWICE, K_OFFSET_COLUMN,
 VALID_FOLD_SCALE, VALID_K_MAJOR, VALID_T_ATTRIBUTE) = (tl.constexpr(i) for i in range(23))


@triton.jit
def _scores_kernel_with_mistake(Q, K, S, n_q, n_k, stride_qm, stride_kn, stride_sm, scale,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                HEAD_DIM: tl.constexpr, HEAD_DIM_REAL: tl.constexpr,
                                MISTAKE: tl.constexpr):
    if MISTAKE == PIDS_SWAPPED:
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    q_rows = n_q
    k_rows = n_k
    if MISTAKE == K_ROWS_NQ:
        k_rows = n_q
    if MISTAKE == Q_ROWS_NK:
        q_rows = n_k
    cols = HEAD_DIM_REAL
    if MISTAKE == SHAPE_PADDED:
        cols = HEAD_DIM
    q_stride = stride_qm
    k_stride = stride_kn
    if MISTAKE == STRIDES_SWAPPED:
        q_stride = stride_kn
        k_stride = stride_qm
    q_desc = tl.make_tensor_descriptor(Q, shape=[q_rows, cols], strides=[q_stride, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K, shape=[k_rows, cols], strides=[k_stride, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    if MISTAKE == TILE_OFFSETS:
        q = q_desc.load([pid_m, 0])
        k = k_desc.load([pid_n, 0])
    else:
        q = q_desc.load([pid_m * BLOCK_M, 0])
        if MISTAKE == K_BLOCK_M:
            k = k_desc.load([pid_n * BLOCK_M, 0])
        elif MISTAKE == K_FIXED:
            k = k_desc.load([0, 0])
        elif MISTAKE == K_OFFSET_COLUMN:
            k = k_desc.load([0, pid_n * BLOCK_N])
        else:
            k = k_desc.load([pid_n * BLOCK_N, 0])
    if MISTAKE == VALID_FOLD_SCALE:  # Triton's tutorial: scale q once, back in fp16
        q = (q * scale).to(tl.float16)
    if MISTAKE == NO_TRANS:
        s = tl.dot(q, k)
    elif MISTAKE == VALID_K_MAJOR:
        s = tl.trans(tl.dot(k, tl.trans(q)))
    elif MISTAKE == VALID_T_ATTRIBUTE:
        s = tl.dot(q, k.T)
    else:
        s = tl.dot(q, tl.trans(k))
    if MISTAKE == LOG2_SCALE:
        s = s * (scale * 1.4426950408889634)
    elif MISTAKE == SCALE_RECOMPUTED:
        s = s / tl.sqrt(HEAD_DIM_REAL * 1.0)
    elif MISTAKE == SCALE_HEAD_DIM:
        s = s * (1.0 / tl.sqrt(HEAD_DIM * 1.0))
    elif MISTAKE == SCALE_TWICE:
        s = s * scale * scale
    elif MISTAKE != NO_SCALE and MISTAKE != VALID_FOLD_SCALE:
        s = s * scale
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if MISTAKE == STORE_ROW_N_K:  # S taken as contiguous: row stride n_k
        ptrs = S + rows[:, None] * n_k + cols[None, :]
    else:
        ptrs = S + rows[:, None] * stride_sm + cols[None, :]
    if MISTAKE == STORE_UNMASKED:
        tl.store(ptrs, s)
    elif MISTAKE == MASK_SWAPPED:
        tl.store(ptrs, s, mask=(rows[:, None] < n_k) & (cols[None, :] < n_q))
    elif MISTAKE == ROWS_MASK_ONLY:
        tl.store(ptrs, s, mask=rows[:, None] < n_q)
    else:
        tl.store(ptrs, s, mask=(rows[:, None] < n_q) & (cols[None, :] < n_k))


class _WithMistake:
    """``kernel[grid](...)`` of the corpus kernel with its MISTAKE switch set."""

    def __init__(self, mistake):
        self.mistake = int(getattr(mistake, "value", mistake))

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return _scores_kernel_with_mistake[grid](*args, **kwargs, MISTAKE=self.mistake)
        return launch


_CAUSES = list(ch09.SCORES_KERNEL_MISTAKES)


def _cause(start):
    """The one cause of SCORES_KERNEL_MISTAKES that starts with ``start``."""
    found = [c for c in _CAUSES if c.startswith(start)]
    assert len(found) == 1, start
    return found[0]


# mistake -> what its diagnosis must say: ("cause", the cause that must be named) or ("seen",
# text of the evidence, and no cause may be named)
SCORES_KERNEL_CORPUS = {k.value: found for k, found in {
    TILE_OFFSETS: ("cause", _cause("the descriptor offsets count tiles")),
    K_BLOCK_M: ("cause", _cause("K's tiles start at pid_n * BLOCK_M")),
    K_FIXED: ("cause", _cause("every program loads the same K tile")),
    K_ROWS_NQ: ("cause", _cause("K's descriptor has n_q rows")),
    NO_SCALE: ("cause", _cause("the scores are not scaled")),
    LOG2_SCALE: ("cause", _cause("the scores are in log2 units")),
    SCALE_RECOMPUTED: ("cause", _cause("the scale is recomputed in the kernel as 1/√d")),
    SCALE_HEAD_DIM: ("cause", _cause("the scale is recomputed in the kernel as 1/√HEAD_DIM")),
    # in the interpreter the guard stops every access outside the tensors before it happens;
    # on a GPU the sentinel around S counts the values written outside it
    STORE_UNMASKED: ("seen", expect(cpu="tl.store in program", gpu="value(s) outside S (37, 45)")),
    ROWS_MASK_ONLY: ("seen", expect(cpu="past the end of `S`", gpu="value(s) outside S (37, 45)")),
    MASK_SWAPPED: ("seen", expect(cpu="tl.store in program", gpu="value(s) outside S (37, 45)")),
    # n_q = 37 < n_k = 45 in case 1: Q's rows 37.. are read, which the guard stops; on a GPU they
    # feed only S's masked rows, and case 3 (n_q > n_k, Q's rows past n_k read as 0) names it
    # the guard names the access a descriptor load, and the declared shape as the place to look
    Q_ROWS_NK: expect(cpu=("seen", "declared shape larger than `q`'s own"),
                      gpu=("cause", _cause("Q's descriptor has n_k rows"))),
    # d = 16 is HEAD_DIM in case 1; d = 48 later: on a GPU the padded columns read Q's NaN margin
    SHAPE_PADDED: ("seen", expect(cpu="descriptor load (desc.load) in program",
                                  gpu="depends on memory outside the inputs (their margins hold NaN")),
    STRIDES_SWAPPED: ("seen", expect(cpu="your kernel's descriptor load",
                                     gpu="depends on memory outside the inputs (their margins hold NaN")),
    STORE_ROW_N_K: ("seen", "✗ Exercise 9.3"),
    PIDS_SWAPPED: ("seen", "✗ Exercise 9.3"),
    SCALE_TWICE: ("seen", "wrong answer on case 1 of 4"),
    K_OFFSET_COLUMN: ("seen", "✗ Exercise 9.3"),
    # tl.dot's words, in the interpreter and from the compiler (which also quotes the line)
    NO_TRANS: ("seen", "hint: tl.dot(a, b) needs a (M, K) @ b (K, N)"),
}.items()}
SCORES_VALID = [RIGHT.value, VALID_FOLD_SCALE.value, VALID_K_MAJOR.value, VALID_T_ATTRIBUTE.value]


def assert_diagnosed(message, expected, causes):
    """The message names the expected cause, or (for "seen") shows the evidence and names no
    cause; never a wrong cause."""
    kind, text = expected
    named = [c for c in causes if f"likely cause: {c}" in message]
    assert "two known mistakes reproduce" not in message or kind == "cause", message
    # the check's own NaN margins are never where a NaN "came from"
    assert "came from torch's full" not in message, message
    if kind == "cause":
        assert named == [text], message
    else:
        assert not named and "likely cause" not in message, message
        assert text in message, message


@pytest.mark.parametrize("mistake", SCORES_VALID)
def test_scores_kernels_in_other_styles_pass(mistake, capsys):
    kernel = _WithMistake(mistake)
    assert ch09.check_scores_kernel(kernel) is kernel
    assert "Exercise 9.3: passed (4 cases)" in capsys.readouterr().out


def test_library_scores_kernel_passes(capsys):
    assert ch09.check_scores_kernel(hopper.scores_kernel) is hopper.scores_kernel
    assert "Exercise 9.3: passed (4 cases)" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", SCORES_KERNEL_CORPUS)
def test_each_wrong_scores_kernel_is_rejected_and_never_misdiagnosed(mistake):
    with pytest.raises(ExerciseFailed) as info:
        ch09.check_scores_kernel(_WithMistake(mistake))
    message = str(info.value)
    assert message.startswith("✗ Exercise 9.3"), message
    assert_diagnosed(message, SCORES_KERNEL_CORPUS[mistake], _CAUSES)


def test_every_scores_mistake_model_is_named_on_its_own_output():
    for cause, model in ch09.SCORES_KERNEL_MISTAKES.items():
        with pytest.raises(ExerciseFailed) as info:
            ch09.check_function("Exercise 9.3", model, ch09.scores_reference,
                                ch09._scores_cases("cpu"), mistakes=ch09.SCORES_KERNEL_MISTAKES,
                                tolerance=ch09.SCORES_TOLERANCE)
        assert f"likely cause: {cause}" in str(info.value), cause


def test_a_wrong_tile_is_located_with_the_cases_tiles():
    with pytest.raises(ExerciseFailed) as info:
        ch09.check_scores_kernel(_WithMistake(K_BLOCK_M))
    assert "is written by program (pid_m, pid_n) = (0, 1) of that case (BLOCK_M = 16" \
        in str(info.value)


def test_scores_cases_vary_what_a_mistake_can_depend_on():
    cases = ch09._scores_cases("cpu")
    blocks = {(c.kwargs["block_m"], c.kwargs["block_n"]) for c in cases}
    assert (16, 32) in blocks and (32, 16) in blocks  # BLOCK_M ≠ BLOCK_N, both ways
    assert any(c.kwargs["scale"] is not None for c in cases)  # an explicit scale ≠ 1/√d
    dims = [c.args[0].shape[1] for c in cases]
    assert any(d & (d - 1) for d in dims)  # a head dim that is not a power of two
    assert any(c.args[0].shape[0] > c.args[1].shape[0] for c in cases)  # n_q > n_k
    assert any(c.args[0].shape[0] < c.args[1].shape[0] for c in cases)  # n_q < n_k
    assert ch09.SCORES_Q_COL_MARGIN != ch09.SCORES_K_COL_MARGIN  # Q's and K's row strides differ


@triton.jit
def _stub_scores_kernel(Q, K, S, n_q, n_k, stride_qm, stride_kn, stride_sm, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_REAL: tl.constexpr):
    raise NotImplementedError("Exercise 9.3: write the scores kernel")


def test_scores_stub_is_not_done_and_falls_back(capsys):
    assert ch09.check_scores_kernel(_stub_scores_kernel) is hopper.scores_kernel
    assert "Exercise 9.3: not done yet" in capsys.readouterr().out


def test_the_answer_kernel_lives_in_the_library():
    assert ch09.scores_kernel is hopper.scores_kernel
    assert ch09.launch_scores is hopper.launch_scores
    assert ch09.ensure_descriptor_allocator is hopper.ensure_descriptor_allocator


def test_scores_tiles_model_matches_the_reference():
    for case in ch09._scores_cases("cpu"):
        torch.testing.assert_close(ch09.scores_tiles(*case.args, **{
            "scale": case.kwargs["scale"], "block_m": case.kwargs["block_m"],
            "block_n": case.kwargs["block_n"]}), ch09.scores_reference(*case.args, **case.kwargs))


def test_check_times_stay_short():
    import time

    start = time.perf_counter()
    ch09.check_scores_kernel(hopper.scores_kernel)
    assert time.perf_counter() - start < 5.0


def test_launch_scores_matches_the_reference(device):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(50, 32, generator=gen).to(device=device, dtype=torch.float16)
    k = torch.randn(19, 32, generator=gen).to(device=device, dtype=torch.float16)
    s = torch.empty(50, 19, device=device)
    hopper.launch_scores(hopper.scores_kernel, q, k, s, scale=0.3)
    torch.testing.assert_close(s, ch09.scores_reference(q, k, 0.3), atol=2e-5, rtol=2e-4)


def test_descriptor_allocator_is_set_only_on_a_gpu(monkeypatch):
    from course_lib.platform import runtime

    calls = []
    monkeypatch.setattr(triton, "set_allocator", calls.append)
    hopper.ensure_descriptor_allocator()
    assert len(calls) == (1 if runtime.current().on_gpu else 0)


def test_a_dtype_slip_in_scale_is_reported_on_scale():
    """Issue 32: without x.float(), a float16 input gives a float16 scale, which also changes
    x_fp8's values; the message named x_fp8's values (whose dtype is right), now the dtype of
    `scale`."""
    def no_upcast(x, block=None):
        n = x.shape[-2]
        block = n if block is None else block
        n_blocks = -(-n // block)
        padded = torch.nn.functional.pad(x, (0, 0, 0, n_blocks * block - n))
        amax = padded.abs().unflatten(-2, (n_blocks, block)).amax(dim=(-2, -1))
        scale = torch.where(amax > 0, amax / fp8.E4M3_MAX, torch.ones_like(amax))[..., None]
        rows = scale.repeat_interleave(block, dim=-2)[..., :n, :]
        return (x / rows).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(torch.float8_e4m3fn), scale

    with pytest.raises(ExerciseFailed) as info:
        ch09.check_quantize_e4m3(no_upcast)
    message = str(info.value)
    assert "`scale`: dtype float16 but expected float32" in message, message
    assert "`x_fp8`: max abs error" not in message and "output [0]" not in message
