"""The concept-check widget: every answer gets ✓ or ✗ and its own explanation; bad questions fail early."""

from __future__ import annotations

import math

import pytest

from course_lib.teaching.widgets.quiz import (MAX_CHOICE_CHARS, RIGHT_MARK, WRONG_MARK, ConceptCheck,
                                              MultipleChoice, Numeric, WrongAnswer, concept_check)

CHOICES = ("four times", "twice", "the same")
EXPLANATIONS = ("N² pairs: (2N)² = 4N².", "Only Q, K, V double; S grows as N².",
                "S grows with N; it is not fixed.")


def make_mc(**changes) -> MultipleChoice:
    fields = dict(prompt="Doubling N multiplies S's memory by?", choices=CHOICES, answer=0,
                  explanations=EXPLANATIONS)
    fields.update(changes)
    return MultipleChoice(**fields)


def make_numeric(**changes) -> Numeric:
    fields = dict(prompt="Softmax intensity in bf16?", answer=1.25, unit="FLOP/byte",
                  explanation="5 FLOPs over 4 bytes.", hint="Count a read and a write.",
                  rel_tol=0.02, wrong_answers=(WrongAnswer(2.5, "You left out the write."),))
    fields.update(changes)
    return Numeric(**fields)


def choose(view, index: int) -> None:
    view.control.value = view.control.options[index]
    view.check_button.click()


# ------------------------------------------------------------------ multiple choice

def test_right_choice_shows_a_tick_and_its_explanation():
    quiz = ConceptCheck([make_mc()])
    view = quiz.views[0]
    assert view.feedback.value == "" and view.result is None  # nothing shown before a check
    choose(view, 0)
    assert view.result.correct
    assert RIGHT_MARK in view.feedback.value and "(2N)² = 4N²." in view.feedback.value
    assert WRONG_MARK not in view.feedback.value
    assert quiz.score == 1


@pytest.mark.parametrize("index", [1, 2])
def test_each_wrong_choice_shows_a_cross_and_that_choices_explanation(index):
    view = ConceptCheck([make_mc()]).views[0]
    choose(view, index)
    assert not view.result.correct
    assert WRONG_MARK in view.feedback.value and RIGHT_MARK not in view.feedback.value
    assert EXPLANATIONS[index] in view.feedback.value
    others = [e for i, e in enumerate(EXPLANATIONS) if i != index]
    assert not any(e in view.feedback.value for e in others)


def test_checking_with_nothing_picked_asks_for_a_pick():
    view = ConceptCheck([make_mc()]).views[0]
    assert view.control.value is None  # no choice is preselected
    view.check_button.click()
    assert not view.result.correct and "Pick one" in view.feedback.value


def test_feedback_follows_a_changed_answer():
    view = ConceptCheck([make_mc()]).views[0]
    choose(view, 1)
    choose(view, 0)
    assert view.result.correct and EXPLANATIONS[1] not in view.feedback.value


def test_text_is_escaped():
    mc = make_mc(prompt="Is 1 < 2 & 3 > 2?", explanations=("<b>yes</b>", *EXPLANATIONS[1:]))
    view = ConceptCheck([mc]).views[0]
    choose(view, 0)
    assert "&lt;b&gt;yes&lt;/b&gt;" in view.feedback.value
    assert "1 &lt; 2 &amp; 3 &gt; 2" in view.widget.children[0].value


# ------------------------------------------------------------------ numeric

@pytest.mark.parametrize("value", [1.25, 1.25 * 1.019, 1.25 * 0.981])
def test_numeric_within_tolerance_is_right(value):
    view = ConceptCheck([make_numeric()]).views[0]
    view.control.value = value
    view.check_button.click()
    assert view.result.correct
    assert RIGHT_MARK in view.feedback.value and "5 FLOPs over 4 bytes." in view.feedback.value


@pytest.mark.parametrize("value", [1.25 * 1.03, 1.0, -1.25, 0.0])
def test_numeric_outside_tolerance_gets_the_hint(value):
    view = ConceptCheck([make_numeric()]).views[0]
    view.control.value = value
    view.check_button.click()
    assert not view.result.correct
    assert WRONG_MARK in view.feedback.value and "Count a read and a write." in view.feedback.value
    assert "5 FLOPs over 4 bytes." not in view.feedback.value  # the answer is not given away


def test_recognised_wrong_number_gets_its_own_explanation():
    view = ConceptCheck([make_numeric()]).views[0]
    view.control.value = 2.5 * 1.01  # within the tolerance of the known wrong answer
    view.check_button.click()
    assert not view.result.correct
    assert "You left out the write." in view.feedback.value
    assert "Count a read and a write." not in view.feedback.value


def test_numeric_shows_its_unit_and_grades_non_finite_as_no_answer():
    quiz = ConceptCheck([make_numeric()])
    row = quiz.views[0].widget.children[1]
    assert "FLOP/byte" in row.children[1].value
    q = make_numeric()
    assert not q.grade(math.nan).correct and "Type a number" in q.grade(None).explanation


def test_exact_tolerance_accepts_only_the_answer():
    q = make_numeric(answer=10, rel_tol=0, wrong_answers=(WrongAnswer(9, "rounded down"),))
    assert q.grade(10).correct and not q.grade(10.5).correct
    assert q.grade(9).explanation == "rounded down"


# ------------------------------------------------------------------ the widget

def test_several_questions_are_numbered_and_checked_independently():
    quiz = ConceptCheck([make_mc(), make_numeric()], title="Check")
    assert len(quiz.views) == 2
    assert "<b>1.</b>" in quiz.views[0].widget.children[0].value
    assert "<b>2.</b>" in quiz.views[1].widget.children[0].value
    choose(quiz.views[0], 0)
    assert quiz.views[1].feedback.value == ""
    assert quiz.score == 1
    quiz.views[1].control.value = 1.25
    quiz.views[1].check_button.click()
    assert quiz.score == 2


def test_concept_check_loads_a_chapter():
    quiz = concept_check("01")
    assert 3 <= len(quiz.views) <= 6
    assert "chapter 01" in quiz.widget.children[0].value


def test_unknown_chapter_is_named():
    with pytest.raises(ValueError, match=r"chapter must be one of 01, 02, .*, got '99'"):
        concept_check("99")


# ------------------------------------------------------------------ bad definitions

@pytest.mark.parametrize("changes, message", [
    (dict(answer=3), r"answer index 3 is out of range for 3 choices \(0 to 2\)"),
    (dict(answer=-1), r"answer index -1 is out of range"),
    (dict(answer=True), r"answer must be the index \(int\)"),
    (dict(explanations=EXPLANATIONS[:2]),
     r"every choice needs an explanation: 3 choices, 2 explanations; choice 2 \('the same'\) has none"),
    (dict(explanations=(*EXPLANATIONS[:2], " ")), r"the explanation of choice 2 must be a non-empty"),
    (dict(choices=("only one",), explanations=("x",)), r"needs at least two choices, got 1"),
    (dict(choices=("a", "a", "b")), r"two choices have the same text"),
    (dict(choices=("x" * (MAX_CHOICE_CHARS + 1), "b", "c")),
     rf"choice 0 is {MAX_CHOICE_CHARS + 1} characters long"),
    (dict(prompt=""), r"prompt must be a non-empty string"),
])
def test_bad_multiple_choice_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        make_mc(**changes)


@pytest.mark.parametrize("changes, message", [
    (dict(answer=math.inf), r"answer must be a finite, non-zero number, got inf"),
    (dict(answer=0), r"answer must be a finite, non-zero number"),
    (dict(answer="1.25"), r"answer must be a finite, non-zero number"),
    (dict(rel_tol=1.5), r"rel_tol must be in \[0, 1\), got 1.5"),
    (dict(hint=""), r"hint must be a non-empty string"),
    (dict(explanation=None), r"explanation must be a non-empty string"),
    (dict(wrong_answers=(WrongAnswer(1.26, "close"),)),
     r"wrong answer 1.26 is within rel_tol 0.02 of the right answer 1.25"),
    (dict(wrong_answers=(WrongAnswer(2.5, ""),)), r"the explanation of wrong answer 2.5"),
    (dict(wrong_answers=((2.5, "a tuple"),)), r"wrong_answers must hold WrongAnswer"),
    (dict(wrong_answers=(WrongAnswer(math.nan, "nan"),)), r"wrong answer nan is not finite"),
])
def test_bad_numeric_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        make_numeric(**changes)


def test_a_concept_check_needs_questions_of_the_known_types():
    with pytest.raises(ValueError, match="at least one question"):
        ConceptCheck([])
    with pytest.raises(ValueError, match="question 1 must be a MultipleChoice or a Numeric, got str"):
        ConceptCheck([make_mc(), "What is attention?"])


def test_question_types_are_re_exported_from_quiz_types():
    from course_lib.teaching import quiz_types
    from course_lib.teaching.widgets import quiz

    for name in ("MultipleChoice", "Numeric", "WrongAnswer", "Feedback", "MAX_CHOICE_CHARS",
                 "DEFAULT_REL_TOL", "RIGHT_MARK", "WRONG_MARK"):
        assert getattr(quiz, name) is getattr(quiz_types, name), name
