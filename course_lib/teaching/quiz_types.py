"""The question types of the concept checks: plain data, checked when made, graded without a
widget.

* :class:`MultipleChoice` — ``prompt``, ``choices``, ``answer`` (index of the right choice) and
  ``explanations`` (one per choice, saying why it is right or wrong);
* :class:`Numeric` — ``prompt``, ``answer``, ``unit``, ``rel_tol``, ``explanation`` (why the
  answer is what it is), ``hint`` (for a wrong answer) and ``wrong_answers`` (common wrong
  numbers, each a :class:`WrongAnswer` with its own explanation).

A bad definition raises ValueError naming the problem. Text is plain (HTML-escaped when shown):
use Unicode for N², ×, ≤. :mod:`course_lib.teaching.concept_questions` writes each chapter's questions
with these types and :mod:`course_lib.teaching.widgets.quiz` shows them. The questions need only this
module (no widget library), so the widget module can import the questions without an import
cycle.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

__all__ = ["MultipleChoice", "Numeric", "WrongAnswer", "Feedback", "Question", "MAX_CHOICE_CHARS",
           "DEFAULT_REL_TOL", "RIGHT_MARK", "WRONG_MARK"]

# A radio button's label is one line of the quiz widget's choice column (~750 px): at ~7.5 px a
# character, 95 characters fit with room to spare. Longer choices are refused.
MAX_CHOICE_CHARS = 95
DEFAULT_REL_TOL = 0.02  # 2 %: room for a learner's rounding of intermediate results
TEXT_LINE_HEIGHT = 1.4  # of prompts and feedback: wrapped lines read as one paragraph
RIGHT_MARK, WRONG_MARK = "✓", "✗"
_RIGHT_COLOUR, _WRONG_COLOUR = "#1a7f37", "#cf222e"  # green and red readable on white and grey


def _text(owner: str, name: str, value) -> str:
    """A non-empty string, or ValueError naming the field."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{owner}: {name} must be a non-empty string, got {value!r}")
    return value


def paragraph(content: str) -> str:
    """HTML ``content`` as a paragraph whose wrapped lines sit close together (an HTML widget's
    own line height is a control's height, 28 px, too loose for text that wraps)."""
    return f'<div style="line-height:{TEXT_LINE_HEIGHT}">{content}</div>'


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class Feedback:
    """What a check says: right or wrong, and why (plain text)."""

    correct: bool
    explanation: str

    def html(self) -> str:
        """One line: a green ✓ or red ✗, then the explanation, escaped."""
        mark, word, colour = ((RIGHT_MARK, "Right.", _RIGHT_COLOUR) if self.correct
                              else (WRONG_MARK, "Not quite.", _WRONG_COLOUR))
        return paragraph(f'<span style="color:{colour}"><b>{mark} {word}</b></span> '
                          f"{html.escape(self.explanation)}")


@dataclass(frozen=True)
class MultipleChoice:
    """A question with one right choice; every choice explains why it is right or wrong.

    Args:
        prompt: the question. choices: at least two, distinct, each at most
            :data:`MAX_CHOICE_CHARS` characters. answer: index of the right choice.
        explanations: one per choice, in the same order.
    """

    prompt: str
    choices: tuple[str, ...]
    answer: int
    explanations: tuple[str, ...]

    def __post_init__(self):
        owner = f"MultipleChoice {_short(str(self.prompt))!r}"
        _text(owner, "prompt", self.prompt)
        object.__setattr__(self, "choices", tuple(self.choices))
        object.__setattr__(self, "explanations", tuple(self.explanations))
        if len(self.choices) < 2:
            raise ValueError(f"{owner}: needs at least two choices, got {len(self.choices)}")
        for i, choice in enumerate(self.choices):
            _text(owner, f"choice {i}", choice)
            if len(choice) > MAX_CHOICE_CHARS:
                raise ValueError(f"{owner}: choice {i} is {len(choice)} characters long, more "
                                 f"than the {MAX_CHOICE_CHARS} that fit on one line: "
                                 f"{_short(choice)!r}")
        if len(set(self.choices)) != len(self.choices):
            raise ValueError(f"{owner}: two choices have the same text")
        if len(self.explanations) != len(self.choices):
            missing = ", ".join(f"{i} ({_short(c)!r})" for i, c in enumerate(self.choices)
                                if i >= len(self.explanations))
            raise ValueError(f"{owner}: every choice needs an explanation: "
                             f"{len(self.choices)} choices, {len(self.explanations)} explanations"
                             + (f"; choice {missing} has none" if missing else ""))
        for i, explanation in enumerate(self.explanations):
            _text(owner, f"the explanation of choice {i}", explanation)
        if isinstance(self.answer, bool) or not isinstance(self.answer, int):
            raise ValueError(f"{owner}: answer must be the index (int) of the right choice, "
                             f"got {self.answer!r}")
        if not 0 <= self.answer < len(self.choices):
            raise ValueError(f"{owner}: answer index {self.answer} is out of range for "
                             f"{len(self.choices)} choices (0 to {len(self.choices) - 1})")

    def grade(self, choice: int | None) -> Feedback:
        """Feedback for the choice at index ``choice`` (None: nothing picked yet)."""
        if choice is None:
            return Feedback(False, "Pick one of the answers first.")
        if not 0 <= choice < len(self.choices):
            raise ValueError(f"choice must be 0 to {len(self.choices) - 1}, got {choice}")
        return Feedback(choice == self.answer, self.explanations[choice])


@dataclass(frozen=True)
class WrongAnswer:
    """A wrong number learners often reach, and the mistake that leads there."""

    value: float
    explanation: str


@dataclass(frozen=True)
class Numeric:
    """A question whose answer is a number, right within a relative tolerance.

    Args:
        prompt: the question (say which unit the answer is in). answer: the right number,
            finite and non-zero (the tolerance is relative to it).
        explanation: why the answer is what it is (shown when right).
        hint: shown for a wrong number that is not one of ``wrong_answers``; a nudge, not the
            answer.
        unit: shown next to the input box ("" for a pure number).
        rel_tol: accepted relative error, 0 ≤ rel_tol < 1 (default :data:`DEFAULT_REL_TOL`).
        wrong_answers: common wrong numbers, recognised within the same tolerance; none may lie
            within the tolerance of the right answer.
    """

    prompt: str
    answer: float
    explanation: str
    hint: str
    unit: str = ""
    rel_tol: float = DEFAULT_REL_TOL
    wrong_answers: tuple[WrongAnswer, ...] = ()

    def __post_init__(self):
        owner = f"Numeric {_short(str(self.prompt))!r}"
        _text(owner, "prompt", self.prompt)
        _text(owner, "explanation", self.explanation)
        _text(owner, "hint", self.hint)
        if not isinstance(self.unit, str):
            raise ValueError(f"{owner}: unit must be a string, got {self.unit!r}")
        if isinstance(self.answer, bool) or not isinstance(self.answer, (int, float)) \
                or not math.isfinite(self.answer) or self.answer == 0:
            raise ValueError(f"{owner}: answer must be a finite, non-zero number, "
                             f"got {self.answer!r}")
        if not (isinstance(self.rel_tol, (int, float)) and 0 <= self.rel_tol < 1):
            raise ValueError(f"{owner}: rel_tol must be in [0, 1), got {self.rel_tol!r}")
        object.__setattr__(self, "wrong_answers", tuple(self.wrong_answers))
        for wrong in self.wrong_answers:
            if not isinstance(wrong, WrongAnswer):
                raise ValueError(f"{owner}: wrong_answers must hold WrongAnswer(value, "
                                 f"explanation), got {wrong!r}")
            if not math.isfinite(wrong.value):
                raise ValueError(f"{owner}: wrong answer {wrong.value!r} is not finite")
            _text(owner, f"the explanation of wrong answer {wrong.value:g}", wrong.explanation)
            if self.accepts(wrong.value):
                raise ValueError(f"{owner}: wrong answer {wrong.value:g} is within rel_tol "
                                 f"{self.rel_tol:g} of the right answer {self.answer:g}")

    def _close(self, value: float, target: float) -> bool:
        return abs(value - target) <= self.rel_tol * abs(target)

    def accepts(self, value: float) -> bool:
        """True when ``value`` is the answer within the relative tolerance."""
        return math.isfinite(value) and self._close(value, self.answer)

    def grade(self, value: float | None) -> Feedback:
        """Feedback for the number ``value`` (None or not finite: asks for a number)."""
        if value is None or not math.isfinite(value):
            return Feedback(False, "Type a number first.")
        if self.accepts(value):
            return Feedback(True, self.explanation)
        for wrong in self.wrong_answers:
            if self._close(value, wrong.value):
                return Feedback(False, wrong.explanation)
        return Feedback(False, self.hint)


Question = MultipleChoice | Numeric


Question = MultipleChoice | Numeric
