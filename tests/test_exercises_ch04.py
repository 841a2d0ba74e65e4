"""Chapter 04's checks: right answers pass, every wrong answer in the corpus is rejected with its
cause named, not-done stubs fall back to the library."""

from __future__ import annotations

import numpy as np
import pytest

from course_lib import iomodel, tiled
from course_lib.checks import ExerciseFailed
from course_lib.exercises import ch04

pytestmark = pytest.mark.ch04

CHECKS = [(ch04.check_fa2_forward, ch04.FORWARD_MISTAKES, tiled.flash_attention_numpy),
          (ch04.check_causal_skip_grid, ch04.SKIP_MISTAKES, iomodel.causal_skip_grid),
          (ch04.check_olm_traffic, ch04.TRAFFIC_MISTAKES, ch04.olm_traffic),
          (ch04.check_flash_forward, ch04.WHOLE_FORWARD_MISTAKES, tiled.flash_attention_numpy),
          (ch04.check_flash_forward_fa1, ch04.FA1_MISTAKES, tiled.flash_attention_numpy_fa1)]


@pytest.mark.parametrize("check,mistakes,right", CHECKS)
def test_right_answer_passes(check, mistakes, right, capsys):
    assert check(right) is right
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("check,mistakes,right", CHECKS)
def test_not_done_falls_back(check, mistakes, right, capsys):
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 4.x")
    assert check(stub) is not stub
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("check,cause,wrong", [
    (check, cause, wrong) for check, mistakes, _ in CHECKS for cause, wrong in mistakes.items()])
def test_each_mistake_is_rejected_and_named(check, cause, wrong):
    with pytest.raises(ExerciseFailed) as info:
        check(wrong)
    assert f"likely cause: {cause}" in str(info.value)


def test_at_least_three_mistakes_per_exercise():
    for _, mistakes, _ in CHECKS:
        assert len(mistakes) >= 3


def test_unmodelled_off_by_one_is_still_rejected():
    def off_by_one(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        o, lse = tiled.flash_attention_numpy(q, k, v, causal, scale, block_m, block_n)
        if causal:  # query 0 loses its only key
            o = o.copy()
            o[..., 0, :] = np.nan
        return o, lse
    with pytest.raises(ExerciseFailed, match="NaN"):
        ch04.check_fa2_forward(off_by_one)


@pytest.mark.parametrize("bad,match", [
    (lambda *a, **k: None, "None"),
    (lambda q, k, v, **kw: q, "tuple of 2"),
    (lambda *a, **k: 1 / 0, "ZeroDivisionError"),
])
@pytest.mark.parametrize("check", [ch04.check_fa2_forward, ch04.check_flash_forward,
                                   ch04.check_flash_forward_fa1])
def test_broken_learner_code_gets_one_clear_message(check, bad, match):
    with pytest.raises(ExerciseFailed, match=match):
        check(bad)


def test_wrong_dtype_of_skip_grid():
    with pytest.raises(ExerciseFailed, match="dtype"):
        ch04.check_causal_skip_grid(lambda *a: iomodel.causal_skip_grid(*a).astype(int))


# ---- Exercises 4.4 and 4.5: the whole forward, FA2 and FA1 loop orders -----------------------

WHOLE = [(ch04.check_flash_forward, tiled.flash_attention_numpy, ch04.WHOLE_FORWARD_MISTAKES),
         (ch04.check_flash_forward_fa1, tiled.flash_attention_numpy_fa1, ch04.FA1_MISTAKES)]


def visits_every_tile(library):
    """A wrong answer with the right numbers: every tile loaded and computed, the causal mask
    applied to all of them, none skipped."""
    def forward(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        return library(q, k, v, scale=scale, block_m=block_m, block_n=block_n,
                       rule=ch04._ExerciseMask(causal))
    return forward


def drops_ragged_q_tile(fill):
    """range(N_q // BLOCK_M): the last, ragged Q tile is never computed; its rows keep what
    `o` and `lse` were created with (zeros, or garbage from np.empty)."""
    def forward(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        o, lse = tiled.flash_attention_numpy(q, k, v, causal, scale, block_m, block_n)
        full = q.shape[-2] // block_m * block_m
        o[..., full:, :], lse[..., full:] = fill, fill
        return o, lse
    return forward


def reads_q_twice(q, k, v, **kwargs):
    """Right numbers, but q is also scanned whole once more (e.g. a max over it)."""
    np.abs(q).max()
    return tiled.flash_attention_numpy(q, k, v, **kwargs)


def fa1_loads_unseen_kv_tiles(q, k, v, **kwargs):
    """FA1 order that loads the K/V tiles past N_q, which no causal query sees."""
    if kwargs.get("causal"):
        k[..., q.shape[-2]:, :], v[..., q.shape[-2]:, :]
    return tiled.flash_attention_numpy_fa1(q, k, v, **kwargs)


@pytest.mark.parametrize("check,cause,wrong", [
    (check, cause, wrong) for check, _, mistakes in WHOLE for cause, wrong in mistakes.items()])
def test_whole_forward_diagnosis_gives_row_tile_and_one_cause(check, cause, wrong):
    with pytest.raises(ExerciseFailed) as info:
        check(wrong)
    message = str(info.value)
    assert "wrong answer on case" in message and "first bad query row" in message
    assert message.count("likely cause:") == 1


def test_at_least_five_mistakes_per_whole_forward():
    for _, _, mistakes in WHOLE:
        assert len(mistakes) >= 5


def test_whole_forward_stub_says_not_done_only(capsys):
    def stub(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        raise NotImplementedError("Exercise 4.5")
    ch04.check_flash_forward_fa1(stub)
    out = capsys.readouterr().out
    assert "not done yet" in out and "passed" not in out


@pytest.mark.parametrize("check,library,mistakes", WHOLE)
def test_visiting_tiles_right_of_the_diagonal_is_caught(check, library, mistakes):
    with pytest.raises(ExerciseFailed) as info:
        check(visits_every_tile(library))
    message = str(info.value)
    assert "right numbers, too much work on case 2" in message
    assert f"likely cause: {ch04.NO_SKIP}" in message


@pytest.mark.parametrize("fill", [0.0, np.nan])
def test_dropped_ragged_q_tile_is_named(fill):
    with pytest.raises(ExerciseFailed) as info:
        ch04.check_flash_forward(drops_ragged_q_tile(fill))
    message = str(info.value)
    assert "first bad query row: 32 (wrong in o and lse), in Q tile 2 = rows 32–36" in message
    assert f"likely cause: {ch04.RAGGED_Q_DROPPED}" in message


@pytest.mark.parametrize("check,wrong", [(ch04.check_flash_forward, reads_q_twice),
                                         (ch04.check_flash_forward_fa1, fa1_loads_unseen_kv_tiles)])
def test_extra_loads_are_caught(check, wrong):
    with pytest.raises(ExerciseFailed) as info:
        check(wrong)
    assert f"likely cause: {ch04.EXTRA_LOADS}" in str(info.value)


def test_causal_left_for_later_is_not_done_not_a_pass(capsys):
    def causal_todo(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        if causal:
            raise NotImplementedError("causal: later")
        return tiled.flash_attention_numpy(q, k, v, False, scale, block_m, block_n)
    assert ch04.check_flash_forward(causal_todo) is tiled.flash_attention_numpy
    out = capsys.readouterr().out
    assert "not done yet" in out and "passed" not in out


def test_whole_forward_crash_gets_one_clear_message():
    def crashes(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        return q @ k  # (..., N_q, d) @ (..., N_k, d): shapes do not line up
    with pytest.raises(ExerciseFailed, match="your function raised"):
        ch04.check_flash_forward(crashes)


def test_counted_array_counts_tiles_and_whole_array_operations():
    x = ch04._counted(np.ones((2, 10, 3)))
    tiled.load_tile(x, 8, 4)       # two real rows of each of 2 heads: 2·2·3 elements
    assert x.reads[0] == 12
    (x * 2.0).sum()                # one whole pass
    assert x.reads[0] == 12 + 60
    np.swapaxes(x, -1, -2)[..., :, 0:5]  # a view shares the count
    assert x.reads[0] == 12 + 60 + 30
    np.zeros_like(x)[..., 0:5, :]  # a new array does not
    assert x.reads[0] == 102
