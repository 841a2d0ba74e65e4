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
          (ch04.check_olm_traffic, ch04.TRAFFIC_MISTAKES, ch04.olm_traffic)]


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
def test_broken_learner_code_gets_one_clear_message(bad, match):
    with pytest.raises(ExerciseFailed, match=match):
        ch04.check_fa2_forward(bad)


def test_wrong_dtype_of_skip_grid():
    with pytest.raises(ExerciseFailed, match="dtype"):
        ch04.check_causal_skip_grid(lambda *a: iomodel.causal_skip_grid(*a).astype(int))
