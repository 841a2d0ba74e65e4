"""Every chapter's concept check: 3–6 well-formed questions, numeric answers recomputed here by hand."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from course_lib.teaching import concept_questions
from course_lib.teaching.widgets.quiz import MultipleChoice, Numeric

# Every chapter with a notebook (01 onwards; 00 is the set-up) has a concept check.
SOLUTIONS = Path(__file__).parents[1] / "solutions"
EXPECTED_CHAPTERS = tuple(sorted({p.name[:2] for p in SOLUTIONS.glob("*.ipynb")} - {"00"}))


def chapter_params():
    return [pytest.param(ch, id=f"ch{ch}", marks=getattr(pytest.mark, f"ch{ch}"))
            for ch in EXPECTED_CHAPTERS]


def numeric(chapter: str, words: str) -> Numeric:
    """The numeric question of ``chapter`` whose prompt contains ``words``."""
    found = [q for q in concept_questions.questions(chapter)
             if isinstance(q, Numeric) and words in q.prompt]
    assert len(found) == 1, f"chapter {chapter}: {len(found)} numeric questions mention {words!r}"
    return found[0]


def test_every_chapter_has_questions():
    assert concept_questions.CHAPTERS == EXPECTED_CHAPTERS
    assert set(concept_questions.all_questions()) == set(EXPECTED_CHAPTERS)


@pytest.mark.parametrize("chapter", chapter_params())
def test_chapter_has_3_to_6_well_formed_questions(chapter):
    questions = concept_questions.questions(chapter)
    assert 3 <= len(questions) <= 6, f"chapter {chapter} has {len(questions)} questions"
    assert len({q.prompt for q in questions}) == len(questions), "a prompt is repeated"
    for q in questions:
        assert isinstance(q, (MultipleChoice, Numeric))
        if isinstance(q, MultipleChoice):
            assert len(q.explanations) == len(q.choices)
            assert all(e.strip() for e in q.explanations)
            assert 0 <= q.answer < len(q.choices)
        else:
            assert math.isfinite(q.answer) and q.answer != 0
            assert q.explanation.strip() and q.hint.strip()
            assert q.accepts(q.answer)
            assert all(not q.accepts(w.value) for w in q.wrong_answers)


@pytest.mark.parametrize("chapter", chapter_params())
def test_right_answers_are_not_always_in_the_same_place(chapter):
    positions = [q.answer for q in concept_questions.questions(chapter)
                 if isinstance(q, MultipleChoice)]
    if len(positions) >= 2:
        assert len(set(positions)) > 1, f"chapter {chapter}: every right answer is at {positions[0]}"


def test_the_right_choice_is_explained_as_right():
    """_move_answer keeps each explanation with its choice: the first source choice stays right."""
    q = concept_questions.questions("03")[0]
    right = q.choices[q.answer]
    assert right.startswith("Exactly 1")
    assert "exp(0) = 1" in q.explanations[q.answer]


def test_building_is_deterministic():
    assert concept_questions.all_questions() == concept_questions.all_questions()


def test_unknown_chapter():
    with pytest.raises(ValueError, match="chapter must be one of 01, 02, .* got '1'"):
        concept_questions.questions("1")


# ------------------------------------------------------------------ numbers, recomputed by hand

def test_ch01_numbers():
    assert numeric("01", "how many MiB").answer == 16_384**2 * 2 / 2**20  # 512 MiB
    assert numeric("01", "how many times larger").answer == pytest.approx(1024 / (3 * 64))
    # 2·N² + 4·N·d·2 bytes = 80e9: the positive root of the quadratic
    a, c, mem = 2, 4 * 64 * 2, 80e9
    n_max = (-c + math.sqrt(c * c + 4 * a * mem)) / (2 * a)
    assert numeric("01", "largest N").answer == pytest.approx(n_max, abs=1)


def test_ch02_numbers():
    assert numeric("02", "balance point").answer == pytest.approx(312e12 / 1935e9)
    assert numeric("02", "softmax kernel").answer == pytest.approx(5 / (2 * 2))  # 1.25


def test_ch03_numbers():
    row = np.array([1.0, 2.0, 0.5, 0.1])
    expected = np.exp(row - row.max()).sum()  # the two-pass answer: 1.7406
    assert numeric("03", "running sum").answer == pytest.approx(expected)
    assert expected == pytest.approx(1.741, abs=1e-3)  # the reading's worked example


def test_ch04_numbers():
    assert numeric("04", "how many times is each element").answer == math.ceil(4096 / 128)
    assert numeric("04", "M doubles").answer == pytest.approx(0.5)


def test_ch05_numbers():
    assert numeric("05", "programs").answer == math.ceil(10_000 / 1024)  # 10
    q = next(q for q in concept_questions.questions("05") if "781 columns" in q.prompt)
    assert q.choices[q.answer].startswith("1024")


def test_ch06_numbers():
    assert numeric("06", "exp2").answer == pytest.approx(1 / math.log(2))
    t = 1024 // 128
    assert numeric("06", "how many does the kernel compute").answer == t * (t + 1) // 2  # 36


def test_ch07_numbers():
    assert numeric("07", "KiB per head").answer == 16_384 * 4 / 1024  # 64 KiB
    assert numeric("07", "matmul FLOPs").answer == pytest.approx(1 + 5 / 2)


def test_ch08_numbers():
    assert numeric("08", "How many GiB").answer == pytest.approx(2 * 32 * 32 * 128 * 4096 * 2 / 2**30)
    assert numeric("08", "GQA").answer == pytest.approx(32 / 8)


def test_ch09_numbers():
    # exp at 3.9 TFLOP/s (FA3) against 4·d matmul FLOPs per score at 989.4 TFLOP/s
    assert numeric("09", "fraction of the matmuls").answer == pytest.approx(989.4 / (3.9 * 4 * 128))
    assert numeric("09", "one outlier of 100").answer == pytest.approx(100 / math.sqrt(128))


def test_ch10_numbers():
    assert numeric("10", "sliding window").answer == pytest.approx(
        100 * (sum(range(1, 33)) + (512 - 32) * 33) / 512**2)
    assert numeric("10", "Padded to").answer == pytest.approx(3 * 32**2 / (8**2 + 2**2 + 32**2))


def test_ch11_numbers():
    assert numeric("11", "How many MiB").answer == 2 * 32 * 8192 * 128 * 2 / 2**20
    assert numeric("11", "tokens per rank").answer == pytest.approx((989.4e12 / 2) / 450e9)


def test_ch12_numbers():
    assert numeric("12", "materialises").answer == 16 * 16384**2 * 2 / 2**30


@pytest.mark.parametrize("chapter", chapter_params())
def test_every_numeric_answer_is_checked_here(chapter):
    """A new numeric question needs its own independent computation above."""
    checked = {"01": 3, "02": 2, "03": 1, "04": 2, "05": 1, "06": 2, "07": 2, "08": 2, "09": 2, "10": 2,
               "11": 2, "12": 1}
    count = sum(isinstance(q, Numeric) for q in concept_questions.questions(chapter))
    assert count == checked[chapter], (f"chapter {chapter} has {count} numeric questions; "
                                       f"{checked[chapter]} are recomputed in this file")


def test_the_questions_import_no_widget_module():
    """No import cycle: the questions need only the question types (course_lib.teaching.quiz_types); the
    quiz widget imports the questions, never the other way round."""
    import subprocess
    import sys

    code = ("import sys; import course_lib.teaching.concept_questions as cq; "
            "assert 'course_lib.teaching.widgets.quiz' not in sys.modules, 'widget module imported'; "
            "assert 'ipywidgets' not in sys.modules, 'ipywidgets imported'; "
            "from course_lib.teaching.widgets import quiz; "
            "assert quiz.MultipleChoice is cq.MultipleChoice; "
            "assert len(quiz.concept_check('08').views) == len(cq.questions('08'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
