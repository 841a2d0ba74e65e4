"""The hint ladder reveals nothing until asked, then one hint per click, then the skeleton."""

from __future__ import annotations

import pytest

from course_lib.teaching.widgets.hints import HintLadder

pytestmark = [pytest.mark.ch00]


def test_hints_are_revealed_one_at_a_time():
    ladder = HintLadder("Exercise 9.9", ["first <i>idea</i>", "second", "third"], skeleton="for i in ...:\n    ...")
    assert ladder.revealed == 0 and ladder.hints_html.value == "" and ladder.skeleton_html.value == ""
    assert ladder.hint_button.description == "Show hint 1 of 3"
    ladder.hint_button.click()
    assert ladder.revealed == 1 and "first <i>idea</i>" in ladder.hints_html.value
    assert "second" not in ladder.hints_html.value
    assert ladder.next_hint() == "second" and ladder.next_hint() == "third"
    assert ladder.hint_button.disabled and ladder.hint_button.description == "All hints shown"
    assert ladder.next_hint() is None


def test_skeleton_is_hidden_until_asked_and_escaped():
    ladder = HintLadder("Exercise 9.9", ["h"], skeleton="if a < b:\n    ...")
    assert not ladder.skeleton_shown
    ladder.skeleton_button.click()
    assert ladder.skeleton_shown and "if a &lt; b:" in ladder.skeleton_html.value
    assert len(ladder.widget.children[0].children) == 3  # title, hint button, skeleton button


def test_no_skeleton_means_no_skeleton_button():
    ladder = HintLadder("Exercise 9.9", ["h"])
    assert ladder.show_skeleton() is None
    assert len(ladder.widget.children[0].children) == 2


def test_at_least_one_hint():
    with pytest.raises(ValueError, match="at least one hint"):
        HintLadder("Exercise 9.9", [])
