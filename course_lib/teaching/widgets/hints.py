"""Scaffolding a learner can choose for a large exercise: a hint ladder and a skeleton.

A large exercise (the whole NumPy forward, the whole Triton kernel, ...) is followed in the
notebook by one cell::

    from course_lib.teaching.widgets.hints import HintLadder
    HintLadder("Exercise 4.4", ch04.FA2_HINTS, skeleton=ch04.FA2_SKELETON)

It shows two buttons: "Show hint 1 of N" reveals the hints one at a time (each builds on the
previous, from "which loops" down to "the exact update"), and "Show skeleton" reveals the loop
structure with the interesting lines left as ``...`` to copy into the exercise cell. Nothing is
revealed until asked; the learner can also skip both and take the library's version (the check
falls back to it), as with every exercise.

Outside a notebook front end (tests, nbval) the widget works the same: clicking is calling
:meth:`HintLadder.next_hint` / :meth:`HintLadder.show_skeleton`, and ``revealed`` says what shows.
"""

from __future__ import annotations

import html
from typing import Sequence

from course_lib.teaching.widgets._display import CONTROL_WIDTH


class HintLadder:
    """Hidden hints revealed one at a time by a button, and an optional hidden skeleton.

    Args:
        exercise: e.g. ``"Exercise 4.4"``, shown on the buttons' box.
        hints: from the most general to the most specific; plain text or short Markdown-free HTML.
        skeleton: code with the key lines left as ``...`` (None: no skeleton button).
    """

    def __init__(self, exercise: str, hints: Sequence[str], skeleton: str | None = None):
        import ipywidgets as W

        if not hints:
            raise ValueError("hints must hold at least one hint")
        self.exercise = exercise
        self.hints = list(hints)
        self.skeleton = skeleton
        self.revealed = 0  # how many hints show
        self.skeleton_shown = False
        self.hint_button = W.Button(description=self._hint_label(), icon="lightbulb-o",
                                    layout=W.Layout(width="auto"))
        self.hint_button.on_click(lambda _: self.next_hint())
        self.skeleton_button = W.Button(description="Show skeleton", icon="code",
                                        layout=W.Layout(width="auto"))
        self.skeleton_button.on_click(lambda _: self.show_skeleton())
        self.hints_html = W.HTML(layout=W.Layout(width="100%"))
        self.skeleton_html = W.HTML(layout=W.Layout(width="100%"))
        buttons = [self.hint_button] + ([self.skeleton_button] if skeleton is not None else [])
        title = W.HTML(f"<b>{html.escape(exercise)}</b>: stuck? Reveal help one step at a time.",
                       layout=W.Layout(width=CONTROL_WIDTH))
        self.widget = W.VBox([W.HBox([title, *buttons]), self.hints_html, self.skeleton_html])

    def _hint_label(self) -> str:
        if self.revealed >= len(self.hints):
            return "All hints shown"
        return f"Show hint {self.revealed + 1} of {len(self.hints)}"

    def next_hint(self) -> str | None:
        """Reveal the next hint; return it (None when all are already shown)."""
        if self.revealed >= len(self.hints):
            return None
        self.revealed += 1
        items = "".join(f"<li>{hint}</li>" for hint in self.hints[: self.revealed])
        self.hints_html.value = f"<ol>{items}</ol>"
        self.hint_button.description = self._hint_label()
        self.hint_button.disabled = self.revealed >= len(self.hints)
        return self.hints[self.revealed - 1]

    def show_skeleton(self) -> str | None:
        """Reveal the skeleton code; return it (None when there is none)."""
        if self.skeleton is None:
            return None
        self.skeleton_shown = True
        self.skeleton_html.value = f"<pre>{html.escape(self.skeleton)}</pre>"
        self.skeleton_button.disabled = True
        return self.skeleton

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
