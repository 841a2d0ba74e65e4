"""The differential diagnosis (course_lib.teaching.diagnosis), as every check uses it, and the messages that
issue 32 found misleading: each wrong answer is built here and its new message asserted, with the
old misleading phrase gone."""

from __future__ import annotations

import math
import re
import sys

import numpy as np
import pytest
import torch

from corpus_checks import assert_rejected
from course_lib.teaching import checks, diagnosis, kernel_checks
from course_lib.teaching.checks import Case, ExerciseFailed, check_function
from course_lib.constants import LN_2, LOG2_E
from course_lib.teaching.diagnosis import RIGHT, WRONG, Outcome
from course_lib.attention.reference import naive_attention_numpy

TOL = (1e-9, 1e-7)


def _on_gpu() -> bool:
    from course_lib.platform import runtime

    return runtime.current().on_gpu


# the memory guard checks accesses in Triton's interpreter only (CPU tensors, before the access)
interpreter_only = pytest.mark.skipif(_on_gpu(), reason="the memory guard and the interpreter's "
                                      "error messages exist only in CPU mode")


def outcome(n, status, features=None, got=None, want=None, inputs=None):
    return Outcome(n, dict(features or {}), status, got, want, TOL, dict(inputs or {}))


def evidence(outcomes, names=None, experiments=None):
    return "\n".join(diagnosis.diagnose(outcomes, names, experiments=experiments))


# ----------------------------------------------------------------------------------------------
# contrast: what every failing case has and no right case has


def test_contrast_names_the_one_feature_that_only_failing_cases_have():
    out = [outcome(1, RIGHT, {"causal": False, "big": False}),
           outcome(2, WRONG, {"causal": True, "big": False}),
           outcome(3, RIGHT, {"causal": False, "big": True}),
           outcome(4, WRONG, {"causal": True, "big": True})]
    text = evidence(out)
    assert "fails exactly on the cases with causal (cases 2 and 4); right on every other case" \
        in text, text


def test_contrast_says_when_the_cases_cannot_tell_features_apart():
    out = [outcome(1, RIGHT, {"a": False, "b": False}), outcome(2, WRONG, {"a": True, "b": True}),
           outcome(3, WRONG, {"a": True, "b": True}), outcome(4, RIGHT, {"a": False, "b": False})]
    text = evidence(out)
    assert "what sets the failing cases apart: with a; with b — the cases do not tell which" in text


def test_absences_and_lone_numbers_are_no_evidence():
    """'Fails on the cases *without* X' separates by chance too often with a handful of cases; a
    single failing case with a number of its own (a block size) proves nothing."""
    absent = [outcome(1, WRONG, {"heads": False}), outcome(2, RIGHT, {"heads": True}),
              outcome(3, WRONG, {"heads": False})]
    assert "evidence" not in evidence(absent)
    lone = [outcome(1, WRONG, {"`block_size`": 64}), outcome(2, RIGHT, {"`block_size`": 128})]
    assert "evidence" not in evidence(lone)


def test_an_experiment_decides_whether_a_feature_is_evidence():
    out = [outcome(1, WRONG, {"a scale other than 1/√d": True}),
           outcome(2, RIGHT, {"a scale other than 1/√d": False})]
    assert "evidence" not in evidence(out, experiments={"a scale other than 1/√d": False})
    text = evidence(out, experiments={"a scale other than 1/√d": True})
    assert "case 1 passes when only that is changed (the scale set to 1/√d)" in text


def test_check_function_runs_the_experiment_and_names_the_scale():
    """Wrong exactly on the cases with an explicit scale, and right on such a case once its
    scale is 1/√d: the diagnosis says so, from the evidence alone (no mistake model)."""
    rng = np.random.default_rng(0)
    cases = [Case(tuple(rng.standard_normal((n, 8)) for _ in range(3)),
                  {} if scale is None else {"scale": scale}, label=f"case {i}")
             for i, (n, scale) in enumerate([(5, None), (7, 0.3), (6, None), (9, 0.7)])]

    def reference(q, k, v, scale=None):
        return naive_attention_numpy(q, k, v, scale=scale)[0]

    def ignores_scale(q, k, v, scale=None):
        return naive_attention_numpy(q, k, v)[0]

    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", ignores_scale, reference, cases)
    text = str(info.value)
    assert ("evidence: fails exactly on the cases with a scale other than 1/√d (cases 2 and 4); "
            "right on every other case, and case 2 passes when only that is changed (the scale "
            "set to 1/√d)") in text, text


def test_a_crash_is_evidence_too_and_every_case_still_runs():
    rng = np.random.default_rng(1)
    cases = [Case(tuple(rng.standard_normal((6, 4)) for _ in range(3)), {"causal": c})
             for c in (False, True, False, True)]

    def reference(q, k, v, causal=False):
        return naive_attention_numpy(q, k, v, causal)[0]

    def crashes_when_causal(q, k, v, causal=False):
        if causal:
            raise IndexError("mask index out of range")
        return reference(q, k, v)

    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", crashes_when_causal, reference, cases)
    text = str(info.value)
    assert text.startswith("✗ Exercise 9.9: your function raised on case 2"), text
    assert "crashes exactly on the cases with a causal mask (cases 2 and 4)" in text, text
    assert "(also crashes on case 4; right on 2 of 4)" in text


# ----------------------------------------------------------------------------------------------
# which parts are right, and where the wrong entries lie


def test_parts_right_and_wrong_are_named():
    want = (np.ones((2, 3)), np.zeros(2))
    got = (np.ones((2, 3)), np.full(2, 0.5))
    text = evidence([outcome(1, WRONG, got=got, want=want), outcome(2, RIGHT, got=want, want=want)],
                    names=("o", "lse"))
    assert "`o` is right on every failing case; `lse` wrong on every one" in text


def test_wrong_rows_of_the_ragged_last_q_tile_are_named():
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((37, 4)), rng.standard_normal((37, 4))
    want = rng.standard_normal((37, 4))
    got = want.copy()
    got[32:] += 1.0
    inputs = {"q": q, "k": k, "v": k, "block_m": 16}
    text = evidence([outcome(1, WRONG, got=got, want=want, inputs=inputs)])
    assert ("in case 1, only rows 32–36 of the output are wrong — exactly Q tile 2 (the ragged "
            "last tile) of BLOCK_M=16; the other 32 of its 37 rows are right") in text, text


def test_wrong_entries_on_one_side_of_the_diagonal_are_named():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((6, 4))
    want = rng.random((6, 6))  # (N_q, N_k): P of a causal case
    got = want + np.triu(np.ones((6, 6)), k=1)
    text = evidence([outcome(1, WRONG, got=got, want=want,
                             inputs={"q": q, "k": q, "causal": True})])
    assert "every wrong entry of the output lies above the diagonal (key after query)" in text


# ----------------------------------------------------------------------------------------------
# simple transforms of the right output


@pytest.mark.parametrize("factor, name", [
    (LOG2_E, "log2(e) = 1.4427"), (LN_2, "ln 2 = 0.6931"), (2.0, "2"), (0.5, "½"),
    (-1.0, "−1 (the sign is flipped)"), (8 ** -0.5, "1/√d = 0.3536"), (8 ** 0.5, "√d = 2.828")])
def test_a_known_constant_factor_is_named(factor, name):
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((5, 8)), rng.standard_normal((6, 8))
    want = rng.standard_normal((5, 6))
    text = evidence([outcome(1, WRONG, got=want * factor, want=want,
                             inputs={"q": q, "k": k, "causal": False})])
    assert f"the output is the right one times {name}" in text, text


def test_transposed_permuted_and_shifted_outputs_are_recognised():
    rng = np.random.default_rng(5)
    want = rng.standard_normal((4, 4))
    assert "the right one transposed" in evidence([outcome(1, WRONG, got=want.T, want=want)])
    heads = rng.standard_normal((3, 10, 4))  # (H, N, d) in the attention notation
    q = rng.standard_normal((3, 10, 4))
    text = evidence([outcome(1, WRONG, got=heads[[1, 0, 2]], want=heads,
                             inputs={"q": q, "k": q, "v": q})])
    assert "along the head axis (size 3), your index i holds the right index π(i): 0→1, 1→0" \
        in text, text
    rows = rng.standard_normal((40, 4))
    shifted = np.concatenate([rows[16:], np.zeros((16, 4))])
    text = evidence([outcome(1, WRONG, got=shifted, want=rows,
                             inputs={"q": rows, "k": rows, "v": rows, "block_m": 16})])
    assert "shifted by 16 (one BLOCK_M tile): your row i holds the right row i + 16" in text, text


# ----------------------------------------------------------------------------------------------
# invariants of the math, used only where the right output has them


def test_probability_rows_zero_rows_and_averages():
    p = np.full((3, 4), 0.25)
    text = evidence([outcome(1, WRONG, got=p * 1.5 + 0.1, want=p)])
    assert "the rows of the output should each sum to 1" in text, text
    ds = np.array([[0.5, -0.5, 0.0], [1.0, 0.0, -1.0]])
    text = evidence([outcome(1, WRONG, got=ds + [[0.3, 0.0, 0.0]] * 2, want=ds)])
    assert "the rows of the output should each sum to 0" in text, text
    v = np.array([[0.0, 1.0], [2.0, 3.0]])
    text = evidence([outcome(1, WRONG, got=np.array([[5.0, 2.0]]), want=np.array([[1.0, 2.0]]),
                             inputs={"v": v})])
    assert "leaves the range of the rows of `v`" in text and "stays inside it" in text, text


def test_lse_bounds_from_the_scores():
    rng = np.random.default_rng(6)
    q, k = rng.standard_normal((4, 8)), rng.standard_normal((5, 8))
    s = q @ k.T / math.sqrt(8)
    lse = np.log(np.exp(s).sum(-1))
    inputs = {"q": q, "k": k, "v": k}
    below = evidence([outcome(1, WRONG, got=(lse - s.max(-1)) - 1, want=lse, inputs=inputs)],
                     names=None)
    assert "is below the row's largest visible score" in below, below
    above = evidence([outcome(1, WRONG, got=lse + 5, want=lse, inputs=inputs)])
    assert "exceeds the largest it can be — the row's largest visible score plus ln(#terms)" \
        in above, above


def test_an_invariant_the_right_answer_breaks_is_never_stated():
    """lse ≥ 0 holds on these cases by chance: it is no rule of the math, and nothing is said."""
    want = np.array([3.0, 4.0])
    text = evidence([outcome(1, WRONG, got=np.array([-1.0, 7.0]), want=want)])
    assert "negative" not in text and "should" not in text


# ----------------------------------------------------------------------------------------------
# messages made true (issue 32, item 3)


def test_a_dtype_slip_is_reported_on_the_output_that_has_it():
    """The slip (scale in float16) also changes x_fp8's values: the message names the dtype of
    `scale`, not an error in `x_fp8`, whose dtype is right."""
    x = torch.randn(4, 8)

    def reference(x):
        scale = x.abs().amax().float() / 2
        return (x / scale).float(), scale.float()

    def learner(x):
        scale = (x.abs().amax() / 2).half()
        return (x / scale).float(), scale

    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", learner, reference, [Case((x,))],
                       output_names=("x_fp8", "scale"))
    text = str(info.value)
    assert "`scale`: dtype float16 but expected float32" in text, text
    assert "`x_fp8`: max abs error" not in text


def test_nested_outputs_are_named_by_their_path():
    got = ([np.zeros(2), np.ones(2)], [np.zeros(2)])
    want = ([np.zeros(2), np.zeros(2)], [np.zeros(2)])
    assert checks.compare(got, want, *TOL).startswith("output [0][1]: max abs error")
    assert checks.compare(got, want, *TOL, names=("o_shards", "lse_shards")).startswith(
        "`o_shards`[1]: max abs error")
    assert "output [0]: output [1]" not in checks.compare(got, want, *TOL)


def test_a_function_in_the_inputs_line_has_no_address():
    def _attend(q, k, v, causal):
        return q
    text = checks.describe_value(_attend)
    assert text == "function `_attend`" and "0x" not in text


def test_a_swapped_np_where_is_not_told_to_add_a_guard():
    """np.where(visible, -inf, s): the last row sees no key, so s - max is inf - inf. No row of
    the case is fully masked, so 'such a row needs a guard' would send the learner the wrong
    way; the message says the mask hides visible keys."""
    rng = np.random.default_rng(7)
    cases = [Case(tuple(rng.standard_normal((9, 4)) for _ in range(3)), {"causal": True})]

    def reference(q, k, v, causal=False):
        return naive_attention_numpy(q, k, v, causal)[0]

    def swapped(q, k, v, causal=False):
        s = q @ k.T / np.sqrt(q.shape[-1])
        i, j = np.arange(len(q))[:, None], np.arange(len(k))[None, :]
        s = np.where(j <= i, -np.inf, s)  # the branches swapped
        p = np.exp(s - s.max(-1, keepdims=True))
        return p @ v / p.sum(-1, keepdims=True)

    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", swapped, reference, cases)
    message = str(info.value)
    assert "invalid value encountered in subtract" in message, message
    assert "No row of this case is fully masked" in message, message
    assert "such a row needs a guard" not in message


@interpreter_only
def test_a_mask_that_does_not_broadcast_gets_no_tl_dot_hint():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, O, n, M: tl.constexpr, D: tl.constexpr):
        rows, cols = tl.arange(0, M), tl.arange(0, D)
        x = tl.load(X + rows[:, None] * D + cols[None, :], mask=rows < n, other=0.0)
        tl.store(O + rows[:, None] * D + cols[None, :], x)

    x, o = torch.randn(16, 32), torch.empty(16, 32)
    with pytest.raises(Exception) as info:
        kernel[(1,)](x, o, 10, M=16, D=32)
    text = kernel_checks.summarize_kernel_error(info.value)
    assert "shapes do not broadcast" in text and "mask" in text, text
    assert "tl.dot" not in text
    assert "a tile 32 long meets one 16 long" in text, text


@interpreter_only
def test_a_row_max_over_the_wrong_axis_is_among_the_hints():
    """tl.max(s, axis=0) on a (BLOCK_M, BLOCK_N) tile, then s - m[:, None]: the hint names the
    reduction's axis as one way the two lengths meet, not only a missing [:, None] (the held-out
    judge found that hint misleading for exactly this answer)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(S, O, M: tl.constexpr, N: tl.constexpr):
        rows, cols = tl.arange(0, M), tl.arange(0, N)
        s = tl.load(S + rows[:, None] * N + cols[None, :])
        m = tl.max(s, axis=0)
        tl.store(O + rows[:, None] * N + cols[None, :], s - m[:, None])

    s, o = torch.randn(16, 32), torch.empty(16, 32)
    with pytest.raises(Exception) as info:
        kernel[(1,)](s, o, M=16, N=32)
    text = kernel_checks.summarize_kernel_error(info.value)
    assert "a tile 32 long meets one 16 long" in text or "a tile 16 long meets one 32 long" in text, text
    assert "axis=0 one per key column" in text and "[:, None]" in text, text
    assert "block_shape" in text  # the third way: a tile loaded in the other shape


def _guarded(kernel, q, o, *args):
    with kernel_checks.memory_guard() as guard:
        guard.allow("q", q)
        guard.allow("o", o, write=True)
        kernel(*args)


@pytest.fixture(scope="module")
def tile_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rows_unmasked(Q, O, stride_qh, stride_qn, stride_oh, stride_on, n, BLOCK: tl.constexpr,
                      D: tl.constexpr):
        t, h = tl.program_id(0), tl.program_id(1)
        rows, cols = t * BLOCK + tl.arange(0, BLOCK), tl.arange(0, D)
        x = tl.load(Q + h * stride_qh + rows[:, None] * stride_qn + cols[None, :])  # no row mask
        tl.store(O + h * stride_oh + rows[:, None] * stride_on + cols[None, :], x,
                 mask=rows[:, None] < n)

    @triton.jit
    def strides_swapped(Q, O, stride_qh, stride_qn, stride_oh, stride_on, n,
                        BLOCK: tl.constexpr, D: tl.constexpr):
        t, h = tl.program_id(0), tl.program_id(1)
        rows, cols = t * BLOCK + tl.arange(0, BLOCK), tl.arange(0, D)
        inside = rows[:, None] < n
        x = tl.load(Q + h * stride_qn + rows[:, None] * stride_qh + cols[None, :], mask=inside)
        tl.store(O + h * stride_oh + rows[:, None] * stride_on + cols[None, :], x, mask=inside)

    return rows_unmasked, strides_swapped


@interpreter_only
def test_rows_past_the_last_row_are_told_as_a_missing_row_mask(tile_kernels):
    """The last tile's rows past N run into the next head or past the tensor: the guard said
    "the batch or head offset is too large … lanes of one tile never need a mask there"."""
    import triton
    q = torch.randn(2, 20, 16)
    o = torch.empty_like(q)
    with pytest.raises(kernel_checks.MemoryViolation) as info:
        _guarded(lambda *a: tile_kernels[0][(triton.cdiv(20, 16), 2)](*a, BLOCK=16, D=16), q, o,
                 q, o, *q.stride()[:2], *o.stride()[:2], 20)
    text = str(info.value)
    assert "this tile's rows 16–31 run past the last row (19) of `q` in head 1" in text, text
    assert "needs a mask on its rows (mask=offs_m[:, None] < n, other=0.0)" in text
    assert "batch or head offset is too large" not in text and "never need a mask" not in text


@interpreter_only
def test_a_tensors_own_strides_swapped_are_not_blamed_on_another_tensor(tile_kernels):
    """q's row and head strides swapped, and o laid out with exactly those strides: the guard
    said only "`q` indexed with `o`'s strides"; both readings fit, and it now says both, q's own
    first."""
    import triton
    q = torch.randn(3, 8, 16)
    o = torch.empty(8, 8, 16)[:, :3].transpose(0, 1)  # o's strides: q's (head, row) swapped
    with pytest.raises(kernel_checks.MemoryViolation) as info:
        _guarded(lambda *a: tile_kernels[1][(1, 3)](*a, BLOCK=16, D=16), q, o,
                 q, o, *q.stride()[:2], *o.stride()[:2], 8)
    text = str(info.value)
    assert "`q`'s own strides (128, 16, 1) given to the wrong dims (dim 0 and dim 1 swapped)" \
        in text, text
    assert text.index("own strides") < text.index("indexed with `o`'s strides")


# ----------------------------------------------------------------------------------------------
# chapter 11's checks (issue 32, items 4 and 5)


def test_11_1_has_rows_far_apart_in_one_call_and_names_the_unweighted_block():
    from course_lib.teaching.exercises import ch11

    far = [c for c in ch11._merge_cases() if "far apart" in c.label]
    assert len(far) == 1 and far[0].args[1].dtype == torch.float32
    lse = far[0].args[1]
    assert float(lse.max() - lse.min()) > 100 and float(lse.min()) < 1.0

    def global_max(o, lse, o_blk, lse_blk):  # one max over the whole call, not per row
        m = torch.maximum(lse.max(), lse_blk.max())
        w, w_blk = torch.exp(lse - m), torch.exp(lse_blk - m)
        total = w + w_blk
        return ((w[..., None] * o + w_blk[..., None] * o_blk) / total[..., None],
                m + torch.log(total))

    message = assert_rejected(ch11.check_merge_partials, global_max, None)
    assert "far apart" in message

    def block_not_weighted(o, lse, o_blk, lse_blk):
        new = torch.logaddexp(lse, lse_blk)
        return o * torch.exp(lse - new)[..., None] + o_blk, new

    assert_rejected(ch11.check_merge_partials, block_not_weighted,
                    "the block's output is not weighted")


def test_11_2_names_its_outputs_and_shows_no_function_address():
    from course_lib.teaching.exercises import ch11

    def no_merge(q_shards, k_shards, v_shards, causal, layout, attend):
        return ch11.simulate_ring(q_shards, k_shards, v_shards, causal, layout, attend,
                                  merge=False)

    def one_wrong_rank(*args):
        o, lse = ch11.ring_reference(*args)
        o[1] = o[1] + 1.0
        return o, lse

    with pytest.raises(ExerciseFailed) as info:
        ch11.check_ring_loop(one_wrong_rank)
    text = str(info.value)
    assert "`o_shards`[1]: max abs error" in text, text
    assert "output [0]: output [1]" not in text and not re.search(r" at 0x[0-9a-f]+", text)
    assert "function `_attend`" in text
    assert_rejected(ch11.check_ring_loop, no_merge, "the block's result replaces")


# ----------------------------------------------------------------------------------------------
# "not done yet" names what the learner's cell names


@pytest.mark.library_answers_refused
def test_not_done_names_the_learners_own_name_not_the_librarys(capsys):
    from course_lib.teaching.exercises import ch10

    block_sparse_kernel = ch10.BLOCK_SPARSE_KERNEL  # what a first run of the check handed back
    block_sparse_kernel = ch10.check_block_sparse_kernel(block_sparse_kernel)
    out = capsys.readouterr().out
    assert "`block_sparse_kernel` is still the library's version" in out, out
    assert "_block_sparse_model_kernel" not in out and "_Switched" not in out
    assert block_sparse_kernel is ch10.BLOCK_SPARSE_KERNEL


@pytest.mark.library_answers_refused
def test_not_done_without_a_readable_line_names_no_library_internals(capsys):
    from course_lib.teaching.exercises import ch10

    check = ch10.check_varlen_kernel
    exec("check(ch10.VARLEN_KERNEL)", {"check": check, "ch10": ch10})  # no source line to read
    out = capsys.readouterr().out
    assert "the answer this cell passed is still the library's version" in out, out
    assert "_varlen_model_kernel" not in out


def test_diagnosis_is_one_module_used_by_every_check():
    """Issue 32: the differential diagnosis lives once, in the check layer."""
    assert checks.diagnosis is diagnosis and kernel_checks.checks is checks
    source = sys.modules["course_lib.teaching.checks"].__file__
    assert "diagnosis.diagnose(" in open(source, encoding="utf-8").read()


def test_integer_outputs_get_no_transforms_and_coarse_tolerances_no_chance_rules():
    """Index lists are not numbers to scale or shift; a sum rule of the right output holds to
    far better than a coarse tolerance before it is stated (fp8 rows summing to ~0 by chance)."""
    want = np.array([[0, 1, 2], [0, 2, 0]])
    got = np.array([[1, 2, 0], [0, 0, 0]])
    assert evidence([outcome(1, WRONG, got=got, want=want)]) == ""
    rng = np.random.default_rng(8)
    want = rng.standard_normal((4, 16))
    want -= want.mean(axis=1, keepdims=True) * 0.999  # rows sum to ~0, but not exactly
    coarse = Outcome(1, {}, WRONG, want + 1.0, want, (0.5, 0.3), {})
    assert "sum to 0" not in "\n".join(diagnosis.diagnose([coarse]))


def test_a_small_factor_within_a_loose_tolerance_is_not_called_zeros():
    """fp8's rtol (0.125) lets want/448 look like c·want for a tiny c: the output is the right one
    times 1/448, not "all zeros" (the held-out judge caught "all zeros" beside "got -1"); true
    zeros still are."""
    rng = np.random.default_rng(9)
    want = rng.uniform(-448, 448, size=(2, 40, 16)).round()
    small = Outcome(1, {}, WRONG, want / 448, want, (0.002, 0.125), {})
    text = "\n".join(diagnosis.diagnose([small]))
    assert "all zeros" not in text and "times 0.00223" in text, text
    zeros = Outcome(1, {}, WRONG, np.zeros_like(want), want, (0.002, 0.125), {})
    assert "all zeros" in "\n".join(diagnosis.diagnose([zeros]))


def test_an_empty_chunk_of_split_keys_is_a_feature_and_lifts_the_no_empty_row_claim():
    """flash-decoding's `splits`: 5 keys in 4 chunks of 2 leave the last one empty (its rows see no
    key there), 8 keys in 4 do not; the check then does not claim "no row is fully masked"."""
    q, k = np.zeros((1, 1, 1, 16)), np.zeros((1, 1, 5, 16))
    assert diagnosis.derive_features({"q": q, "k": k, "v": k, "splits": 4})[diagnosis.EMPTY_CHUNK] is True
    k8 = np.zeros((1, 1, 8, 16))
    assert diagnosis.derive_features({"q": q, "k": k8, "v": k8, "splits": 4})[diagnosis.EMPTY_CHUNK] is False
    assert diagnosis.EMPTY_CHUNK not in diagnosis.derive_features({"q": q, "k": k8, "v": k8})


# ----------------------------------------------------------------------------------------------
# wrong shapes and dtypes told from the case's sizes; rounding; absences an experiment switches on


def test_a_wrong_shape_is_told_from_the_case_sizes():
    """Each story only where the numbers fit it: an axis of size 1 missing (values right), a tile
    count rounded down, a length cut to whole tiles, another axis of the same input."""
    rng = np.random.default_rng(3)
    want = rng.standard_normal((2, 3, 1))
    text = evidence([outcome(1, WRONG, got=want[..., 0], want=want)])
    assert "an axis of size 1 missing (keepdims=True" in text and "its values are right" in text
    mask = np.ones((37, 37), dtype=bool)
    text = evidence([outcome(1, WRONG, got=np.zeros((3, 4)), want=np.zeros((3, 5)),
                             inputs={"mask": mask, "block_n": 8})])
    assert "4 = 37 // 8" in text and "ceil(37 / 8) = 5" in text, text
    x = rng.standard_normal((40, 16))
    text = evidence([outcome(1, WRONG, got=np.zeros((32, 16)), want=np.zeros((40, 16)),
                             inputs={"x": x, "block": 16})])
    assert "32 = 40 cut to a multiple of `block`=16: the last, shorter tile of 8 is dropped" in text
    o = rng.standard_normal((37, 24))
    text = evidence([outcome(1, WRONG, got=np.zeros(24), want=np.zeros(37), inputs={"o": o})])
    assert "24 is the length of axis 1 of `o`, 37 that of its axis 0" in text, text
    # sizes that no input explains: nothing said
    assert evidence([outcome(1, WRONG, got=np.zeros(5), want=np.zeros(7), inputs={"o": o})]) == ""


def test_floats_where_integers_belong_are_told_with_what_they_hold():
    want = np.array([0, 0, 1, 1, 2, 2])
    same = evidence([outcome(1, WRONG, got=want.astype(np.float64), want=want)])
    assert "holds the right values as floats" in same
    divided = evidence([outcome(1, WRONG, got=np.arange(6) / 2.0, want=want)])
    assert "before rounding down (e.g. 0.5 for 0)" in divided and "`//`" in divided
    # a float count beside a right part is not called right
    parts_text = evidence([outcome(1, WRONG, got=(want.astype(np.float64), np.ones(2)),
                                   want=(want, np.zeros(2)))], names=("n", "x"))
    assert "`n` is right" not in parts_text


def test_an_output_rounded_to_half_precision_is_recognised():
    want = np.random.default_rng(4).standard_normal(300).astype(np.float32).astype(np.float64)
    got = want.astype(np.float16).astype(np.float64)
    text = evidence([Outcome(1, {}, WRONG, got, want, (2e-5, 2e-4), {})])
    assert "exactly the right values rounded to float16" in text, text
    bf = torch.from_numpy(want).to(torch.bfloat16).double().numpy()
    assert "rounded to bfloat16" in evidence([Outcome(1, {}, WRONG, bf, want, (2e-5, 2e-4), {})])


def test_an_absence_is_evidence_only_when_switching_it_on_makes_the_case_pass():
    out = [outcome(1, RIGHT, {"a causal mask": True}), outcome(2, RIGHT, {"a causal mask": True}),
           outcome(3, WRONG, {"a causal mask": False})]
    assert "evidence" not in evidence(out)
    assert "evidence" not in evidence(out, experiments={"a causal mask": False})
    text = evidence(out, experiments={"a causal mask": True})
    assert ("fails exactly on the case without a causal mask (case 3); right on every other case, "
            "and case 3 passes when only that is changed (causal=True)") in text, text
    assert diagnosis.toggle("a causal mask", {"causal": False}, on=True) == {"causal": True}
    assert diagnosis.toggle("a causal mask", {"causal": True}, on=True) is None


def test_a_tiled_product_knows_its_steps_over_k_and_the_experiment_covers_k_in_one_step():
    a, b = np.zeros((7, 45)), np.zeros((45, 9))
    feats = diagnosis.derive_features({"a": a, "b": b, "block_m": 4, "block_n": 4, "block_k": 16})
    assert feats["more than one step over K"] and feats[
        "a ragged last step over K (K not a multiple of BLOCK_K)"]
    assert feats["a ragged last row tile"] and feats["a ragged last column tile"]
    changed = diagnosis.toggle("more than one step over K", {"a": a, "b": b, "block_k": 16})
    assert changed["block_k"] == 64


def test_flags_negated_and_indices_off_by_a_constant_are_recognised():
    flags = np.array([[True, False, True], [False, False, True]])
    text = evidence([outcome(1, WRONG, got=~flags, want=flags)])
    assert "exactly the right flags negated" in text, text
    idx = np.array([0, 0, 1, 1, 2, 2])
    assert "plus 1 on every element (an index or count off by 1)" in evidence(
        [outcome(1, WRONG, got=idx + 1, want=idx)])
    # not one constant: nothing said
    assert evidence([outcome(1, WRONG, got=np.array([1, 0, 1, 1, 2, 2]), want=idx)]) == ""


def test_packed_samples_right_and_wrong_are_told_apart():
    cu = np.array([0, 13, 18, 38])
    want = np.random.default_rng(5).standard_normal((38, 2, 4))
    got = want.copy()
    got[13:] += 1.0  # every sample after the first wrong
    inputs = {"q": want, "cu_seqlens": cu}
    text = evidence([outcome(1, WRONG, got=got, want=want, inputs=inputs)])
    assert ("every row of sample 0 of the output is right and every row of samples 1 and 2 "
            "wrong (their first rows: 13, 18)") in text, text
    got = want.copy()
    got[15:20] += 1.0  # part of samples 1 and 2: no per-sample story
    assert "sample" not in evidence([outcome(1, WRONG, got=got, want=want, inputs=inputs)])


def test_a_wrong_answer_quotes_how_its_other_cases_crashed():
    cases = [Case((np.arange(4.0),), label="four"), Case((np.arange(6.0),), label="six")]

    def wrong_or_crash(x):
        if x.size == 6:
            raise ValueError("boom on six")
        return x + 1

    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", wrong_or_crash, lambda x: x * 2, cases)
    text = str(info.value)
    assert "(also wrong on case 2 (crashed); right on 0 of 2)" in text, text
    assert "case 2 crashed: ValueError: boom on six" in text, text


def test_a_single_number_where_an_array_belongs_is_told_as_a_reduction_over_every_axis():
    o, do = np.arange(12.0).reshape(4, 3), np.ones((4, 3))
    want = (o * do).sum(axis=-1)
    text = evidence([outcome(1, WRONG, got=np.float64((o * do).sum()), want=want,
                             inputs={"o": o, "do": do})])
    assert "one number, the sum of every element of the right output (shape (4,))" in text, text
    # a number that is no reduction of the right values: nothing said about it
    assert "one number" not in evidence([outcome(1, WRONG, got=np.float64(-7.5), want=want,
                                                 inputs={"o": o, "do": do})])


def test_a_kept_axis_of_size_1_on_a_vector_output_is_told_not_lost():
    # (N, 1) for (N,): the transpose test used to raise on the 1-D expected value, so no evidence
    want = np.arange(5.0)
    text = evidence([outcome(1, WRONG, got=want[:, None], want=want, inputs={"o": np.ones((5, 3))})])
    assert "has shape (5, 1) for (5,): an axis of size 1 too many (a reduction with keepdims=True" \
        in text and "its values are right" in text, text


def test_two_swapped_axes_are_named_by_what_they_index():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 2, 9, 4))
    lse = rng.standard_normal((2, 2, 9))
    inputs = {"q": q, "k": q, "v": q, "causal": False, "scale": None}
    text = evidence([outcome(1, WRONG, got=np.swapaxes(lse, 0, 1).copy(), want=lse, inputs=inputs)])
    assert ("holds the right values with its batch element and head axes swapped (axes 0 and 1, "
            "both of size 2)") in text, text
    # the last two axes swapped is a transpose, said as such
    m = rng.standard_normal((3, 4, 4))
    assert "transposed" in evidence([outcome(1, WRONG, got=np.swapaxes(m, 1, 2).copy(), want=m)])


def test_the_default_scale_is_named_only_when_its_experiment_passes():
    q = np.zeros((1, 6, 4))
    default = diagnosis.derive_features({"q": q, "k": q, "v": q, "scale": None})
    given = diagnosis.derive_features({"q": q, "k": q, "v": q, "scale": 0.3})
    assert default[diagnosis.DEFAULT_SCALE] and not given[diagnosis.DEFAULT_SCALE]
    out = [outcome(1, WRONG, default), outcome(2, WRONG, default), outcome(3, RIGHT, given),
           outcome(4, RIGHT, given)]
    assert "default scale" not in evidence(out)  # most cases leave the scale alone: no evidence
    assert "default scale" not in evidence(out, experiments={diagnosis.DEFAULT_SCALE: False})
    text = evidence(out, experiments={diagnosis.DEFAULT_SCALE: True})
    assert ("fails exactly on the cases with the default scale (scale=None) (cases 1 and 2); right "
            "on every other case, and case 1 passes when only that is changed (the same scale, "
            "1/√d, passed explicitly)") in text, text
    changed = diagnosis.toggle(diagnosis.DEFAULT_SCALE, {"q": q, "k": q, "v": q, "scale": None})
    assert changed["scale"] == 0.5


def test_right_values_in_float64_where_float32_belongs_are_told_where_float64_comes_from():
    want = np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)
    text = evidence([outcome(1, WRONG, got=(want.astype(np.float64), want),
                             want=(want, want))], names=("dq", "dk"))
    assert ("`dq` holds the right values, in float64 where float32 is expected: an array made "
            "without a dtype is float64") in text, text
    # another float format (a cast to the wrong one) is not told as a missing dtype
    text = evidence([outcome(1, WRONG, got=want.astype(np.float16), want=want)])
    assert "made without a dtype" not in text
