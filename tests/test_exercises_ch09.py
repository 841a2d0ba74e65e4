"""Chapter 09 checks: the reference passes, a stub is "not done yet", and every known mistake is
rejected with its cause named."""

from __future__ import annotations

import ast
import math

import pytest
import torch
import triton
import triton.language as tl

from course_lib import fp8
from course_lib.checks import ExerciseFailed
from course_lib.exercises import ch09

pytestmark = pytest.mark.ch09

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
    assert "Exercise 9.2: passed (5 cases)" in capsys.readouterr().out


def test_quantize_model_defaults_are_the_library():
    for case in ch09._quantize_cases():
        got, want = ch09.quantize_model(*case.args), fp8.quantize_e4m3(*case.args)
        assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])


def test_wrong_dtypes_are_diagnosed():
    with pytest.raises(ExerciseFailed, match="dtype float32 but expected float8_e4m3fn"):
        ch09.check_quantize_e4m3(lambda x, block: (fp8.quantize_e4m3(x, block)[0].float(),
                                                   fp8.quantize_e4m3(x, block)[1]))


@pytest.mark.parametrize("name, hints, skeleton, words", [
    ("Exercise 9.1", ch09.ROTATE_HINTS, ch09.ROTATE_SKELETON, "[[h, h], [h, -h]]"),
    ("Exercise 9.2", ch09.QUANTIZE_HINTS, ch09.QUANTIZE_SKELETON, "E4M3_MAX"),
    ("Exercise 9.3", ch09.SCORES_KERNEL_HINTS, ch09.SCORES_KERNEL_SKELETON,
     "make_tensor_descriptor"),
])
def test_hint_ladders_and_skeletons(name, hints, skeleton, words):
    from course_lib.widgets.hints import HintLadder

    ladder = HintLadder(name, hints, skeleton=skeleton)
    assert ladder.show_skeleton() == skeleton
    ast.parse(f"def answer():\n" + "\n".join("    " + line for line in skeleton.splitlines()))
    assert any(words in hint for hint in hints) or words in skeleton


# ----------------------------------------------------------------------------------------------
# Exercise 9.3: the descriptor scores kernel. The corpus is one kernel with a constexpr MISTAKE
# switch: 0 is right, each other value makes exactly one classic mistake.

(RIGHT, TILE_OFFSETS, K_BLOCK_M, K_FIXED, K_ROWS_NQ, NO_SCALE, LOG2_SCALE, STORE_UNMASKED,
 SHAPE_PADDED, PIDS_SWAPPED, NO_TRANS) = (tl.constexpr(i) for i in range(11))


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
    cols = HEAD_DIM_REAL
    if MISTAKE == SHAPE_PADDED:
        cols = HEAD_DIM
    q_desc = tl.make_tensor_descriptor(Q, shape=[q_rows, cols], strides=[stride_qm, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K, shape=[k_rows, cols], strides=[stride_kn, 1],
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
        else:
            k = k_desc.load([pid_n * BLOCK_N, 0])
    if MISTAKE == NO_TRANS:
        s = tl.dot(q, k)
    else:
        s = tl.dot(q, tl.trans(k))
    if MISTAKE == LOG2_SCALE:
        s = s * (scale * 1.4426950408889634)
    elif MISTAKE != NO_SCALE:
        s = s * scale
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = S + rows[:, None] * stride_sm + cols[None, :]
    if MISTAKE == STORE_UNMASKED:
        tl.store(ptrs, s)
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

# mistake -> (text its diagnosis must contain: the replayed cause or the guarded run's finding,
# the case it fails on). A descriptor whose shape has rows padded to whole tiles is not in the
# corpus: the padded rows only reach the masked-out part of S, so no output shows it (on a GPU it
# is still a read past the tensor, which can fault at the end of an allocation).
SCORES_KERNEL_CORPUS = {k.value: found for k, found in {
    TILE_OFFSETS: (f"likely cause: {_CAUSES[0]}", "case 1 of 3"),
    K_BLOCK_M: (f"likely cause: {_CAUSES[1]}", "case 1 of 3"),
    K_FIXED: (f"likely cause: {_CAUSES[2]}", "case 1 of 3"),
    K_ROWS_NQ: (f"likely cause: {_CAUSES[3]}", "case 1 of 3"),
    NO_SCALE: (f"likely cause: {_CAUSES[4]}", "case 1 of 3"),
    LOG2_SCALE: (f"likely cause: {_CAUSES[5]}", "case 1 of 3"),
    STORE_UNMASKED: ("outside S (37, 45) — mask the store with rows < n_q and cols < n_k",
                     "case 1 of 3"),
    # d = 48 < HEAD_DIM = 64 in case 2: columns 48 to 63 come from the row's margin
    SHAPE_PADDED: ("a descriptor reads past the tensor: its shape must be the tensor's real shape",
                   "case 2 of 3"),
    PIDS_SWAPPED: ("were never written", "case 1 of 3"),
    # tl.dot's words, in the interpreter and from the compiler (which also quotes the line)
    NO_TRANS: ("hint: tl.dot(a, b) needs a (M, K) @ b (K, N)", "case 1 of 3"),
}.items()}


def test_scores_corpus_is_right_with_no_mistake(capsys):
    kernel = _WithMistake(RIGHT)
    assert ch09.check_scores_kernel(kernel) is kernel
    assert "Exercise 9.3: passed (3 cases)" in capsys.readouterr().out


def test_library_scores_kernel_passes(capsys):
    assert ch09.check_scores_kernel(ch09.scores_kernel) is ch09.scores_kernel
    assert "Exercise 9.3: passed (3 cases)" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", SCORES_KERNEL_CORPUS)
def test_each_wrong_scores_kernel_is_rejected_with_its_cause(mistake):
    assert len(ch09.SCORES_KERNEL_MISTAKES) >= 5
    with pytest.raises(ExerciseFailed) as info:
        ch09.check_scores_kernel(_WithMistake(mistake))
    message = str(info.value)
    text, case = SCORES_KERNEL_CORPUS[mistake]
    assert message.startswith("✗ Exercise 9.3") and case in message, message
    assert text in message, message
    assert message.count("likely cause") <= 1  # one diagnosis


def test_a_wrong_tile_is_located():
    with pytest.raises(ExerciseFailed) as info:
        ch09.check_scores_kernel(_WithMistake(K_BLOCK_M))
    assert "is written by program (pid_m, pid_n) = (0, 1)" in str(info.value)


@triton.jit
def _stub_scores_kernel(Q, K, S, n_q, n_k, stride_qm, stride_kn, stride_sm, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_REAL: tl.constexpr):
    raise NotImplementedError("Exercise 9.3: write the scores kernel")


def test_scores_stub_is_not_done_and_falls_back(capsys):
    assert ch09.check_scores_kernel(_stub_scores_kernel) is ch09.scores_kernel
    assert "Exercise 9.3: not done yet" in capsys.readouterr().out


def test_scores_tiles_model_matches_the_reference():
    for case in ch09._scores_cases("cpu"):
        torch.testing.assert_close(ch09.scores_tiles(*case.args), ch09.scores_reference(*case.args))


def test_launch_scores_matches_the_reference(device):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(50, 32, generator=gen).to(device=device, dtype=torch.float16)
    k = torch.randn(19, 32, generator=gen).to(device=device, dtype=torch.float16)
    s = torch.empty(50, 19, device=device)
    ch09.launch_scores(ch09.scores_kernel, q, k, s)
    torch.testing.assert_close(s, ch09.scores_reference(q, k), atol=2e-5, rtol=2e-4)


def test_descriptor_allocator_is_set_only_on_a_gpu(monkeypatch):
    from course_lib import runtime

    calls = []
    monkeypatch.setattr(triton, "set_allocator", calls.append)
    ch09.ensure_descriptor_allocator()
    assert len(calls) == (1 if runtime.current().on_gpu else 0)
