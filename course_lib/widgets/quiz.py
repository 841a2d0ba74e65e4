"""Concept checks: a few short questions at the end of a chapter, each answer explained.

A chapter ends with one cell::

    from course_lib.widgets.quiz import concept_check
    concept_check("04")

which shows that chapter's questions (:mod:`course_lib.concept_questions`). Each question has a
"Check" button; pressing it shows ✓ or ✗ and says *why*: every choice of a multiple-choice
question carries its own explanation, and a numeric question explains the right answer, gives a
hint for a wrong one, and recognises common wrong numbers (a factor of 2, bits for bytes, ...)
with an explanation of that mistake.

Two question types, checked when they are made (a bad definition raises ValueError naming the
problem):

* :class:`MultipleChoice` — ``prompt``, ``choices``, ``answer`` (index of the right choice) and
  ``explanations`` (one per choice, saying why it is right or wrong);
* :class:`Numeric` — ``prompt``, ``answer``, ``unit``, ``rel_tol``, ``explanation`` (why the
  answer is what it is), ``hint`` (for a wrong answer) and ``wrong_answers`` (common wrong
  numbers, each a :class:`WrongAnswer` with its own explanation).

Text is plain (it is HTML-escaped when shown): use Unicode for N², ×, ≤.

Outside a notebook front end (tests, nbval) the widget works the same: set a question's
``control.value``, call its ``check_button.click()``, and ``feedback.value`` / ``result`` say
what the learner would see::

    quiz = ConceptCheck(questions)
    view = quiz.views[0]
    view.control.value = view.control.options[1]    # a radio button's label
    view.check_button.click()
    view.result.correct, view.feedback.value
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Sequence

from course_lib.widgets._display import FIGURE_WIDTH, LABEL_WIDTH, control_layout

__all__ = ["MultipleChoice", "Numeric", "WrongAnswer", "Feedback", "ConceptCheck",
           "QuestionView", "concept_check", "MAX_CHOICE_CHARS", "DEFAULT_REL_TOL", "RIGHT_MARK",
           "WRONG_MARK"]

QUIZ_WIDTH = FIGURE_WIDTH  # as wide as the other widgets' figures: prompts wrap inside it
# A radio button's label is one line of the choice column (QUIZ_WIDTH less LABEL_WIDTH, ~750 px):
# at ~7.5 px a character, 95 characters fit with room to spare. Longer choices are refused.
MAX_CHOICE_CHARS = 95
DEFAULT_REL_TOL = 0.02  # 2 %: room for a learner's rounding of intermediate results
ANSWER_LABEL = "Your answer"
# Everything under a prompt sits in the controls' column, right of the labels' LABEL_WIDTH
# (plus the 4 px margin ipywidgets puts between a description and its control).
_LABEL_GAP = "4px"
_COLUMN_MARGIN = f"2px 0 2px calc({LABEL_WIDTH} + {_LABEL_GAP})"
_COLUMN_WIDTH = f"calc({QUIZ_WIDTH} - {LABEL_WIDTH} - {_LABEL_GAP})"
_LABEL_MARGIN = f"0 {_LABEL_GAP} 0 0"
TEXT_LINE_HEIGHT = 1.4  # of prompts and feedback: wrapped lines read as one paragraph
RIGHT_MARK, WRONG_MARK = "✓", "✗"
_RIGHT_COLOUR, _WRONG_COLOUR = "#1a7f37", "#cf222e"  # green and red readable on white and grey


def _text(owner: str, name: str, value) -> str:
    """A non-empty string, or ValueError naming the field."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{owner}: {name} must be a non-empty string, got {value!r}")
    return value


def _paragraph(content: str) -> str:
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
        return _paragraph(f'<span style="color:{colour}"><b>{mark} {word}</b></span> '
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


class QuestionView:
    """One question on screen: its prompt, an input, a "Check" button and a feedback line.

    Attributes:
        question: the :class:`MultipleChoice` or :class:`Numeric` shown.
        control: ``RadioButtons`` (options are the choices, nothing picked at first) or
            ``FloatText``.
        check_button: grades the current input when clicked.
        feedback: ``HTML``, empty until the first check.
        result: the last :class:`Feedback`, or None before the first check.
        widget: the box holding all of it.
    """

    def __init__(self, question: Question, number: int):
        import ipywidgets as W

        self.question = question
        self.result: Feedback | None = None
        prompt = W.HTML(_paragraph(f"<b>{number}.</b> {html.escape(question.prompt)}"),
                        layout=W.Layout(width=QUIZ_WIDTH, margin="10px 0 2px 0"))
        if isinstance(question, MultipleChoice):
            # RadioButtons draws its description above the choices; a label of the shared width
            # beside them instead starts the choices where the number boxes start.
            label = W.HTML(f'<div style="text-align:right">{ANSWER_LABEL}</div>',
                           layout=W.Layout(width=LABEL_WIDTH, margin=_LABEL_MARGIN))
            self.control = W.RadioButtons(options=list(question.choices), value=None,
                                          layout=W.Layout(width=_COLUMN_WIDTH))
            answer_row = W.HBox([label, self.control])
        else:
            self.control = W.FloatText(value=0.0, description=ANSWER_LABEL, **control_layout())
            unit = W.HTML(html.escape(question.unit), layout=W.Layout(width="auto"))
            answer_row = W.HBox([self.control, unit])
        # under the answer, in the controls' column, as wide as its text (not the whole box)
        self.check_button = W.Button(description="Check", icon="check",
                                     layout=W.Layout(width="auto", align_self="flex-start",
                                                     margin=_COLUMN_MARGIN))
        self.check_button.on_click(lambda _: self.check())
        self.feedback = W.HTML(layout=W.Layout(width=_COLUMN_WIDTH, margin=_COLUMN_MARGIN))
        self.widget = W.VBox([prompt, answer_row, self.check_button, self.feedback])

    def _answer(self):
        """The current input as the question's grade() takes it."""
        if isinstance(self.question, MultipleChoice):
            value = self.control.value
            return None if value is None else list(self.question.choices).index(value)
        return self.control.value

    def check(self) -> Feedback:
        """Grade the current input, show the feedback line, and return it."""
        self.result = self.question.grade(self._answer())
        self.feedback.value = self.result.html()
        return self.result


class ConceptCheck:
    """Several questions, one under another, each with its own Check button and feedback.

    Args:
        questions: :class:`MultipleChoice` and :class:`Numeric` questions, at least one.
        title: shown above the questions.
    """

    def __init__(self, questions: Sequence[Question], title: str = "Check your understanding"):
        import ipywidgets as W

        questions = list(questions)
        if not questions:
            raise ValueError("ConceptCheck needs at least one question")
        for i, q in enumerate(questions):
            if not isinstance(q, (MultipleChoice, Numeric)):
                raise ValueError(f"question {i} must be a MultipleChoice or a Numeric, "
                                 f"got {type(q).__name__}")
        self.questions = questions
        self.views = [QuestionView(q, number) for number, q in enumerate(questions, start=1)]
        heading = W.HTML(_paragraph(f"<b>{html.escape(title)}</b>: pick or type an answer, "
                                    f"then press Check to see whether it is right, and why."),
                         layout=W.Layout(width=QUIZ_WIDTH))
        self.widget = W.VBox([heading, *(view.widget for view in self.views)])

    @property
    def score(self) -> int:
        """How many questions were last checked right."""
        return sum(1 for view in self.views if view.result is not None and view.result.correct)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def concept_check(chapter: str) -> ConceptCheck:
    """The concept check of ``chapter`` (``"01"`` … ``"08"``), ready to display.

    Raises ValueError naming the chapter and listing those that have questions.
    """
    from course_lib import concept_questions

    return ConceptCheck(concept_questions.questions(chapter),
                        title=f"Check your understanding, chapter {chapter}")
