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
from course_lib.kernels import hopper

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
    # the guard stops every access outside the tensors before it happens
    STORE_UNMASKED: ("seen", "tl.store in program"),
    ROWS_MASK_ONLY: ("seen", "past the end of `S`"),
    MASK_SWAPPED: ("seen", "tl.store in program"),
    Q_ROWS_NK: ("seen", "past the end of `q`"),  # n_q = 37 < n_k = 45: Q's rows 37.. read
    SHAPE_PADDED: ("seen", "tl.load in program"),  # d = 16 is HEAD_DIM in case 1; d = 48 later
    STRIDES_SWAPPED: ("seen", "your kernel's tl.load"),
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
    from course_lib import runtime

    calls = []
    monkeypatch.setattr(triton, "set_allocator", calls.append)
    hopper.ensure_descriptor_allocator()
    assert len(calls) == (1 if runtime.current().on_gpu else 0)
