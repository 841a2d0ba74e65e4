"""Assertions shared by the exercise tests' corpora of learner-written answers (issue 19)."""

from __future__ import annotations

import pytest

from course_lib.teaching.checks import ExerciseFailed


def assert_cause(message: str, mistakes, cause: str | None) -> None:
    """The diagnosis names exactly ``cause`` (one of ``mistakes``), or, when ``cause`` is None,
    names none and offers no undecided pair: never a wrong cause."""
    named = [c for c in mistakes if f"likely cause: {c}" in message]
    if cause is None:
        assert not named and "likely cause" not in message, message
        assert "two known mistakes reproduce" not in message, message
    else:
        assert named == [cause], message


def one(mistakes, start: str) -> str:
    """The one cause of ``mistakes`` that starts with ``start``."""
    found = [c for c in mistakes if c.startswith(start)]
    assert len(found) == 1, start
    return found[0]


def assert_rejected(check, fn, cause: str | None) -> str:
    """The check raises ExerciseFailed with a diagnosis, not a traceback; when ``cause`` is
    given, the message names it as the likely cause; when None, it names no cause at all (never
    a wrong one). Returns the message."""
    with pytest.raises(ExerciseFailed) as info:
        check(fn)
    message = str(info.value)
    if cause is not None:
        assert "likely cause" in message and cause in message, message
    else:
        assert "likely cause" not in message and "two known mistakes" not in message, message
    assert "Traceback" not in message
    return message
