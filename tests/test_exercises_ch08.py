"""Chapter 08 checks: the reference passes, a stub is "not done yet", and every known mistake is
rejected with its cause named."""

from __future__ import annotations

import numpy as np
import pytest

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
