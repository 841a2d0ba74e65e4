"""Concept checks: a few short questions at the end of a chapter, each answer explained.

A chapter ends with one cell::

    from course_lib.teaching.widgets.quiz import concept_check
    concept_check("04")

which shows that chapter's questions (:mod:`course_lib.teaching.concept_questions`). Each question has a
"Check" button; pressing it shows ✓ or ✗ and says *why*: every choice of a multiple-choice
question carries its own explanation, and a numeric question explains the right answer, gives a
hint for a wrong one, and recognises common wrong numbers (a factor of 2, bits for bytes, ...)
with an explanation of that mistake.

The question types (:class:`MultipleChoice`, :class:`Numeric`, :class:`WrongAnswer`, the
:class:`Feedback` a check gives) live in :mod:`course_lib.teaching.quiz_types`, which both this module
and :mod:`course_lib.teaching.concept_questions` import (they are re-exported here); a bad definition
raises ValueError naming the problem.

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
from typing import Sequence

from course_lib.teaching import concept_questions
from course_lib.teaching.quiz_types import (DEFAULT_REL_TOL, MAX_CHOICE_CHARS, RIGHT_MARK, WRONG_MARK,
                                            Feedback, MultipleChoice, Numeric, Question, WrongAnswer)
from course_lib.teaching.quiz_types import paragraph as _paragraph
from course_lib.teaching.widgets._display import FIGURE_WIDTH, LABEL_WIDTH, control_layout

__all__ = ["MultipleChoice", "Numeric", "WrongAnswer", "Feedback", "ConceptCheck",
           "QuestionView", "concept_check", "MAX_CHOICE_CHARS", "DEFAULT_REL_TOL", "RIGHT_MARK",
           "WRONG_MARK"]

QUIZ_WIDTH = FIGURE_WIDTH  # as wide as the other widgets' figures: prompts wrap inside it
ANSWER_LABEL = "Your answer"
# Everything under a prompt sits in the controls' column, right of the labels' LABEL_WIDTH
# (plus the 4 px margin ipywidgets puts between a description and its control).
_LABEL_GAP = "4px"
_COLUMN_MARGIN = f"2px 0 2px calc({LABEL_WIDTH} + {_LABEL_GAP})"
_COLUMN_WIDTH = f"calc({QUIZ_WIDTH} - {LABEL_WIDTH} - {_LABEL_GAP})"
_LABEL_MARGIN = f"0 {_LABEL_GAP} 0 0"


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
    """The concept check of ``chapter`` (``"01"`` … ``"09"``), ready to display.

    Raises ValueError naming the chapter and listing those that have questions.
    """
    return ConceptCheck(concept_questions.questions(chapter),
                        title=f"Check your understanding, chapter {chapter}")
