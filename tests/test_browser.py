"""The course in a real browser: JupyterLab in headless Chromium, every widget chapter run and played with.

A learner meets the widgets in JupyterLab, not in pytest: a widget that works in Python but shows
"Error displaying widget" in the page is broken for them. For each widget chapter this test opens
the *learner* notebook (``notebooks/NN_*.ipynb``) in the course's own JupyterLab (the server
``make lab`` starts), runs Run → Run All Cells, checks that the widget rendered with its figure
and with no error text, moves a slider / presses Step or Next and checks that the figure changed.

Screenshots for a human to look at go to ``test-artifacts/screenshots/``:
``chNN_notebook.png`` (the whole notebook after Run All), ``chNN_widget.png`` (the widget as
first drawn) and ``chNN_widget_after_<k>_<action>.png`` (after each interaction). Chapter 01's
concept check (the quiz every chapter ends with) is answered too: ``ch01_quiz.png`` and
``ch01_quiz_after_check.png``. The time each interaction took to redraw the figure is printed
(``pytest -s -m browser`` shows it).

Needs Debian's Chromium at /usr/bin/chromium (``make test`` installs it); skips, saying so,
without it. Run alone with ``pytest -m browser``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import browser_helpers as bh
from lab_server import running_lab

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
LOGS = ROOT / "test-artifacts" / "logs"

SLIDER_DRAG_PX = 80  # a short drag: a few positions on every slider of the course
RUN_ALL_TIMEOUT_S = 240  # generous: 3-6 s each today on 2 CPU cores, far more on a loaded CI box
REDRAW_TIMEOUT_S = 20  # a control's change must reach the figure within this
SLOW_REDRAW_S = 2.0  # slower than this is reported as a slow control (not a failure)
MIN_FIGURE_WIDTH_PX = 500  # a plot narrower than this on a 1400-px screen is too small to read

pytestmark = pytest.mark.browser
needs_chromium = pytest.mark.skipif(
    not bh.CHROMIUM.exists(),
    reason=f"needs Debian's Chromium at {bh.CHROMIUM} "
           "(`make test` installs it with apt-get when it can; see README)")


@dataclass(frozen=True)
class Action:
    """One thing a learner does to a widget: ``kind`` is "slider" (press ArrowRight ``times``),
    "drag" (drag the slider's handle right with the mouse), "button" (click ``times``) or
    "dropdown" (pick the next option); ``label`` is the control's description or the button's text."""
    kind: str
    label: str
    times: int = 1


@dataclass(frozen=True)
class WidgetChapter:
    chapter: str
    stem: str  # file-name prefix: the notebook is notebooks/<stem>*.ipynb
    what: str
    anchor: str  # a control label that identifies the widget's output
    actions: tuple[Action, ...] = field(default_factory=tuple)


WIDGET_CHAPTERS = [
    WidgetChapter("01", "01_", "memory-vs-N slider (course_lib/teaching/widgets/memory.py)",
                  anchor="sequence length N",
                  actions=(Action("slider", "sequence length N"), Action("slider", "heads H", 3),
                           Action("drag", "heads H"), Action("dropdown", "GPU"))),
    WidgetChapter("02", "02_", "arithmetic-intensity calculator and roofline "
                  "(course_lib/teaching/widgets/roofline.py)",
                  anchor="sequence length N",
                  actions=(Action("slider", "sequence length N"), Action("slider", "head dim d"),
                           Action("drag", "sequence length N"), Action("dropdown", "GPU"))),
    WidgetChapter("03", "03_", "online-softmax stepper (course_lib/teaching/widgets/softmax_stepper.py)",
                  anchor="Next tile",
                  actions=(Action("button", "Next tile", 2), Action("button", "Reset"),
                           Action("slider", "Block size"))),
    WidgetChapter("04", "04_", "tiling simulator (course_lib/teaching/widgets/tiling.py)",
                  anchor="Step",
                  actions=(Action("button", "Step", 3), Action("button", "Reset"),
                           Action("slider", "BLOCK_M (B_r)"), Action("drag", "Sequence length N"))),
    WidgetChapter("08", "08_", "KV-cache memory calculator (course_lib/teaching/widgets/kvcache.py)",
                  anchor="Context length N",
                  actions=(Action("slider", "Context length N"), Action("slider", "Batch B (sequences)"),
                           Action("dropdown", "GPU"))),
]


def chapter_notebook(prefix: str) -> Path | None:
    found = sorted(NOTEBOOKS.glob(f"{prefix}*.ipynb"))
    return found[0] if found else None


def _widget_cases():
    """One case per widget chapter whose learner notebook exists (see test_all_widget_chapters_exist)."""
    for spec in WIDGET_CHAPTERS:
        if chapter_notebook(spec.stem) is not None:
            yield pytest.param(spec, id=f"ch{spec.chapter}",
                               marks=getattr(pytest.mark, f"ch{spec.chapter}"))


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def lab():
    """The course's JupyterLab (same command as `make lab`, no token, free loopback port)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    with running_lab(LOGS / "jupyterlab.log") as (base, pid):
        yield base


@pytest.fixture(scope="module")
def browser():
    """Headless Debian Chromium, started and stopped by PID, driven through Playwright."""
    from playwright.sync_api import sync_playwright

    LOGS.mkdir(parents=True, exist_ok=True)
    with bh.chromium_process(LOGS / "chromium.log") as (cdp_url, pid), sync_playwright() as pw:
        chromium = pw.chromium.connect_over_cdp(cdp_url)
        try:
            yield chromium
        finally:
            chromium.close()  # disconnects; chromium_process then stops the browser by its PID


@dataclass
class RanNotebook:
    """A learner notebook opened in its own page and run once with Run All (``seconds``)."""
    page: object
    panel: object
    seconds: float


@pytest.fixture(scope="module")
def ran_notebook(lab, browser):
    """``ran_notebook(path)``: the notebook opened in a fresh page and run with Run All, once per
    module — the tests of one notebook share its page and kernel in the order they run (a Run All
    with its kernel's start is ~10 s of two cores). Afterwards: each kernel stopped, each workspace
    dropped, each page closed, and no notebook written and no news pop-up seen."""
    opened: dict[Path, tuple] = {}

    def ran(path: Path) -> RanNotebook:
        if path not in opened:
            context = browser.new_context(viewport=bh.VIEWPORT)
            page = context.new_page()
            page.set_default_timeout(30_000)
            bh.block_saves(page)
            news = bh.watch_for_news_prompt(page)
            relpath = path.relative_to(ROOT).as_posix()
            workspace = f"browser-test-{path.stem}"
            before = path.read_bytes()
            opened[path] = (context, news, relpath, workspace, before, None)
            panel = bh.open_notebook(page, lab, relpath, workspace)
            seconds = bh.run_all_cells(page, panel, RUN_ALL_TIMEOUT_S)
            print(f"\n{path.name}: Run All Cells took {seconds:.1f} s")
            opened[path] = (context, news, relpath, workspace, before, RanNotebook(page, panel, seconds))
        found = opened[path][-1]
        assert found is not None, f"{path.name}: its first opening failed (see the first test that used it)"
        return found

    yield ran
    problems = []
    for path, (context, news, relpath, workspace, before, _) in opened.items():
        try:
            page = context.pages[0]
            bh.shut_down_kernels(page, lab, relpath)
            bh.delete_workspace(page, lab, workspace)
        finally:
            context.close()
        if path.read_bytes() != before:  # a save slipped through block_saves: put the file back
            path.write_bytes(before)
            problems.append(f"the browser wrote to {relpath}; restored it")
        if news:
            problems.append(f"{relpath}: JupyterLab showed its news pop-up ({news[0]!r}): the course's lab "
                            "sets fetchNews = \"false\" (course_lib/platform/lab.py) so that it never shows")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- helpers

def clear_screenshots(chapter: str) -> None:
    """Drop a chapter's screenshots from an earlier run, so none is left over from old actions."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for old in SCREENSHOTS.glob(f"ch{chapter}_*.png"):
        old.unlink()


def assert_ran_cleanly(panel, name: str) -> None:
    errors = bh.error_outputs(panel)
    assert not errors, f"{name}: Run All Cells produced a traceback:\n" + "\n---\n".join(errors)
    not_run = bh.unexecuted_cells(panel)
    assert not not_run, (f"{name}: code cells {not_run} (0-based, code cells only) did not run; "
                         "Run All stops at the first error")
    widget_errors = bh.widget_error_texts(panel)
    assert not widget_errors, f"{name}: the page shows widget errors: {widget_errors}"


def act_once(page, output, action: Action) -> str:
    """Do ``action`` once (one key press, click or pick); return what was done, in words."""
    if action.kind == "slider":
        handle = bh.slider_handle(page, output, action.label)
        before = handle.get_attribute("aria-valuetext") or handle.get_attribute("aria-valuenow")
        handle.focus()
        handle.press("ArrowRight")
        after = handle.get_attribute("aria-valuetext") or handle.get_attribute("aria-valuenow")
        assert after != before, f"ArrowRight did not move the slider {action.label!r} ({before})"
        return f"slider {action.label!r} ArrowRight"
    if action.kind == "drag":
        handle = bh.slider_handle(page, output, action.label)
        before = handle.get_attribute("aria-valuetext") or handle.get_attribute("aria-valuenow")
        bh.drag_slider(page, handle, SLIDER_DRAG_PX)
        after = handle.get_attribute("aria-valuetext") or handle.get_attribute("aria-valuenow")
        assert after != before, f"dragging did not move the slider {action.label!r} ({before})"
        return f"slider {action.label!r} dragged {SLIDER_DRAG_PX} px"
    if action.kind == "button":
        bh.button(page, output, action.label).click()
        return f"button {action.label!r} click"
    if action.kind == "dropdown":
        select = bh.dropdown(page, output, action.label)
        options = select.locator("option").all_inner_texts()
        current = select.evaluate("(s) => s.options[s.selectedIndex].text")
        choice = options[(options.index(current) + 1) % len(options)]
        select.select_option(label=choice)
        return f"dropdown {action.label!r} {current!r} -> {choice!r}"
    raise ValueError(f"unknown action kind {action.kind!r}")


# --------------------------------------------------------------------------- tests

@needs_chromium
@pytest.mark.ch00
def test_setup_chapter_runs_in_the_browser(ran_notebook):
    path = chapter_notebook("00_")
    assert path is not None, "notebooks/00_*.ipynb is missing"
    clear_screenshots("00")
    ran = ran_notebook(path)
    page, panel = ran.page, ran.panel
    bh.assert_no_news_prompt(page)
    bh.screenshot_notebook(page, panel, SCREENSHOTS / "ch00_notebook.png")
    assert_ran_cleanly(panel, path.name)
    assert any("mode" in t.lower() for t in bh.output_texts(panel)), \
        "runtime.setup() printed no mode line"
    # Ctrl-S must not write the learner notebook (block_saves); the fixture checks the bytes
    page.keyboard.press("Control+s")
    page.wait_for_timeout(1000)


@needs_chromium
@pytest.mark.parametrize("spec", list(_widget_cases()))
def test_widget_chapter_in_the_browser(ran_notebook, spec: WidgetChapter):
    path = chapter_notebook(spec.stem)
    clear_screenshots(spec.chapter)
    ran = ran_notebook(path)
    page, panel = ran.page, ran.panel
    assert_ran_cleanly(panel, path.name)

    # the widget rendered: its controls and its figure are on the page
    output = bh.widget_output(page, panel, spec.anchor)
    output.scroll_into_view_if_needed()
    output.wait_for(state="visible")
    assert output.locator(".jupyter-widgets").first.is_visible(), f"{spec.what}: no widget"
    img = bh.figure(output)
    img.wait_for(state="visible", timeout=REDRAW_TIMEOUT_S * 1000)
    info = bh.image_info(img)
    assert info["complete"] and info["naturalWidth"] > 0, f"{spec.what}: the figure did not load"
    bh.assert_no_news_prompt(page)
    output.screenshot(path=str(SCREENSHOTS / f"ch{spec.chapter}_widget.png"))
    bh.screenshot_notebook(page, panel, SCREENSHOTS / f"ch{spec.chapter}_notebook.png")
    output.scroll_into_view_if_needed()

    # readable on a laptop screen: nothing sticks out or is cut off, every control is labelled
    # (checked here, asserted at the end so that the interactions run and are screenshotted too)
    problems = []
    if info["width"] < MIN_FIGURE_WIDTH_PX:
        problems.append(f"the figure is drawn {info['width']:.0f} px wide, too small to read "
                        f"(want ≥ {MIN_FIGURE_WIDTH_PX} px)")
    spill = bh.overflow(output)
    if spill["overflow_px"] > 0 or spill["scroll_overflow_px"] > 0:
        problems.append(f"the widget sticks out of the notebook by {spill['overflow_px']} px "
                        f"({spill['element']})")
    cut = bh.truncated_texts(output)
    if cut:
        problems.append("text cut off: " + "; ".join(cut))
    unlabelled = bh.unlabelled_controls(output)
    if unlabelled:
        problems.append(f"controls without a label: {unlabelled}")

    # play with it: every key press, drag, click or pick must redraw the figure
    for number, action in enumerate(spec.actions, start=1):
        for _ in range(action.times):
            old = bh.image_info(bh.figure(output))["src"]
            start = time.monotonic()
            done = act_once(page, output, action)
            try:
                bh.wait_for_new_src(page, bh.figure(output), old, REDRAW_TIMEOUT_S)
                first = time.monotonic() - start
                # a drag may queue several redraws: time until the figure stops changing
                settled = bh.wait_until_still(page, bh.figure(output), 0.8, REDRAW_TIMEOUT_S) \
                    if action.kind == "drag" else 0.0
            except AssertionError as e:
                raise AssertionError(f"{spec.what}: {done}: {e}") from None
            took = first + settled
            slow = f"  <- slow (> {SLOW_REDRAW_S} s)" if took > SLOW_REDRAW_S else ""
            print(f"ch{spec.chapter}: {done}: figure redrawn after {took:.2f} s{slow}")
        page.wait_for_timeout(200)  # let the PNG paint
        bh.assert_no_news_prompt(page)
        slug = re.sub(r"[^a-z0-9]+", "_", f"{action.kind} {action.label}".lower()).strip("_")
        output.screenshot(path=str(SCREENSHOTS / f"ch{spec.chapter}_widget_after_{number}_{slug}.png"))

    # nothing broke while playing (a callback's traceback lands in the widget's output)
    assert not bh.error_outputs(panel), f"{spec.what}: a traceback appeared after the interactions"
    assert not bh.widget_error_texts(panel), f"{spec.what}: widget errors after the interactions"
    assert not problems, (f"{spec.what}, on a {bh.VIEWPORT['width']}×{bh.VIEWPORT['height']} screen "
                          f"(see {SCREENSHOTS.relative_to(ROOT)}/ch{spec.chapter}_widget.png):\n  "
                          + "\n  ".join(problems))



@dataclass(frozen=True)
class StaleCheck:
    """An exercise whose stub is left as it is by Run All, then edited (not run) by the learner."""
    chapter: str
    exercise: str  # "Exercise 0.1"
    check: str  # text that identifies the check cell
    wrong_answer: str  # what the learner types into the exercise cell


STALE_CHECKS = [
    StaleCheck("00", "Exercise 0.1", "ch00.check_scaled_scores(",
               "import numpy as np\n\n"
               "# Exercise 0.1: scaled dot-product scores q kᵀ / sqrt(d)\n"
               "def scaled_scores(q, k):\n"
               "    return (q @ k.T) / q.shape[-1]   # wrong: divides by d, not sqrt(d)\n"),
    StaleCheck("03", "Exercise 3.3", "ch03.check_online_softmax(",
               "# Exercise 3.3: online softmax over whole rows, tile by tile\n"
               "def online_softmax(x, block_size):\n"
               "    return np.exp(x) / np.exp(x).sum(axis=-1)   # wrong: not tiled, no max, bad axis\n"),
]


@needs_chromium
@pytest.mark.parametrize("case", [pytest.param(c, id=f"ch{c.chapter}", marks=getattr(pytest.mark, f"ch{c.chapter}"))
                                  for c in STALE_CHECKS])
def test_no_false_pass_when_only_the_check_cell_is_rerun(ran_notebook, lab, case: StaleCheck):
    """Run All leaves the exercise "not done yet", so the check cell hands on the library's version
    under the exercise's name. A learner then types an answer (wrong here) but runs only the check
    cell: the check is handed the library's code again and must not say ✓; it must say to run the
    exercise cell."""
    path = chapter_notebook(f"{case.chapter}_")
    relpath = path.relative_to(ROOT).as_posix()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for old in SCREENSHOTS.glob(f"ch{case.chapter}_stale_check_*.png"):
        old.unlink()
    ran = ran_notebook(path)  # run once; the exercise cell is still the stub Run All left
    page, panel = ran.page, ran.panel
    assert_ran_cleanly(panel, path.name)

    exercise_cell = bh.code_cell(panel, f"# {case.exercise}:")
    check_cell = bh.code_cell(panel, case.check)
    check_cell.scroll_into_view_if_needed()  # an earlier test may have left the page elsewhere:
    check_cell.locator(".jp-OutputArea-output").first.wait_for(state="visible")  # drawn in view only
    first = bh.cell_output_text(check_cell)
    assert "not done yet" in first and "✓" not in first, \
        f"{case.exercise}: after Run All with the stub untouched the check said {first!r}"
    check_cell.scroll_into_view_if_needed()
    bh.assert_no_news_prompt(page)
    check_cell.screenshot(path=str(SCREENSHOTS / f"ch{case.chapter}_stale_check_1_run_all.png"))

    bh.replace_cell_source(page, exercise_cell, case.wrong_answer)  # typed, not run
    bh.run_one_cell(page, panel, check_cell, lab, relpath, REDRAW_TIMEOUT_S * 3)
    again = bh.cell_output_text(check_cell)
    print(f"\nch{case.chapter}: check cell re-run alone said: {again[:200]!r}")
    exercise_cell.scroll_into_view_if_needed()
    bh.assert_no_news_prompt(page)
    bh.screenshot_notebook(page, panel, SCREENSHOTS / f"ch{case.chapter}_stale_check_notebook.png")
    check_cell.scroll_into_view_if_needed()
    check_cell.screenshot(path=str(SCREENSHOTS / f"ch{case.chapter}_stale_check_2_check_rerun.png"))
    assert "✓" not in again, (f"{case.exercise}: re-running only the check cell after editing the "
                              f"exercise printed a pass for the library's code: {again!r}")
    assert re.search(r"run the exercise cell", again, re.I), \
        f"{case.exercise}: the check did not say to run the exercise cell: {again!r}"


@needs_chromium
@pytest.mark.ch03
def test_stepper_block_size_reaches_n_in_the_browser(ran_notebook):
    """Chapter 03's stepper starts on a 4-score row; on a 12-score row the Block size slider must
    reach 12 with the End key (the slider on the page once kept its first range: End gave 4)."""
    from course_lib.teaching.widgets import softmax_stepper as ws

    path = chapter_notebook("03_")
    ran = ran_notebook(path)
    page, panel = ran.page, ran.panel
    assert_ran_cleanly(panel, path.name)
    output = bh.widget_output(page, panel, "Next tile")
    output.scroll_into_view_if_needed()
    for preset in (ws.RANDOM, ws.RISING):
        n = len(ws.preset_row(preset))
        old = bh.image_info(bh.figure(output))["src"]
        bh.dropdown(page, output, "Input row").select_option(label=preset)
        bh.wait_for_new_src(page, bh.figure(output), old, REDRAW_TIMEOUT_S)
        handle = bh.slider_handle(page, output, "Block size")
        handle.focus()
        handle.press("End")
        page.wait_for_timeout(500)
        assert float(handle.get_attribute("aria-valuenow")) == n, \
            f"{preset}: End moved Block size to {handle.get_attribute('aria-valuenow')}, not N = {n}"
        bh.wait_until_still(page, bh.figure(output), 0.8, REDRAW_TIMEOUT_S)
        assert f"Tile 0 of 1 (block size {n}, N = {n})" in " ".join(output.inner_text().split())
    bh.assert_no_news_prompt(page)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    output.screenshot(path=str(SCREENSHOTS / "ch03_stepper_block_size_n.png"))


QUIZ_CHAPTER = "01"  # the concept check is tested in one chapter: every chapter's is the same widget
FEEDBACK_MARKS = ("✓", "✗")
POLL_MS = 100  # how often to look for a feedback line


def feedback_lines(output) -> list[str]:
    """The concept check's feedback lines now showing (HTML widgets that start with ✓ or ✗)."""
    texts = output.locator(".widget-html").all_inner_texts()
    return [" ".join(t.split()) for t in texts if t.strip().startswith(FEEDBACK_MARKS)]


def wait_for_feedback(page, output, predicate, what: str) -> str:
    """The first feedback line for which ``predicate(line)`` holds, waiting up to REDRAW_TIMEOUT_S."""
    deadline = time.monotonic() + REDRAW_TIMEOUT_S
    while True:
        lines = feedback_lines(output)
        found = [line for line in lines if predicate(line)]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"concept check: no feedback showing {what} after "
                                 f"{REDRAW_TIMEOUT_S} s; feedback lines: {lines}")
        page.wait_for_timeout(POLL_MS)



def shown(text: str, length: int = 60) -> str:
    """The start of an explanation as the page shows it (whitespace collapsed)."""
    return " ".join(text.split())[:length]


@needs_chromium
@pytest.mark.ch01
def test_concept_check_in_the_browser(ran_notebook):
    """Chapter 01's concept check renders, answers a wrong and a right choice and a number with
    ✗/✓ and the explanation, and nothing in it is cut off."""
    from course_lib.teaching import concept_questions
    from course_lib.teaching.widgets.quiz import MultipleChoice, Numeric

    path = chapter_notebook(f"{QUIZ_CHAPTER}_")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for old in SCREENSHOTS.glob(f"ch{QUIZ_CHAPTER}_quiz*.png"):
        old.unlink()
    ran = ran_notebook(path)
    page, panel = ran.page, ran.panel
    assert_ran_cleanly(panel, path.name)

    questions = concept_questions.questions(QUIZ_CHAPTER)
    output = bh.widget_output(page, panel, "Check")
    output.scroll_into_view_if_needed()
    output.wait_for(state="visible")
    checks = output.locator("button").filter(has_text=bh.exactly("Check"))
    assert checks.count() == len(questions), \
        f"concept check: {checks.count()} Check buttons for {len(questions)} questions"
    choices = output.locator(".widget-radio-box label")
    n_choices = sum(len(q.choices) for q in questions if isinstance(q, MultipleChoice))
    assert choices.count() == n_choices, f"concept check: {choices.count()} of {n_choices} choices shown"
    assert not feedback_lines(output), "concept check: feedback shows before any answer is checked"
    bh.assert_no_news_prompt(page)
    output.screenshot(path=str(SCREENSHOTS / f"ch{QUIZ_CHAPTER}_quiz.png"))

    problems = []
    spill = bh.overflow(output)
    if spill["overflow_px"] > 0 or spill["scroll_overflow_px"] > 0:
        problems.append(f"the quiz sticks out of the notebook by {spill['overflow_px']} px "
                        f"({spill['element']})")
    cut = bh.truncated_texts(output)
    if cut:
        problems.append("text cut off: " + "; ".join(cut))
    unlabelled = bh.unlabelled_controls(output)
    if unlabelled:
        problems.append(f"controls without a label: {unlabelled}")

    # a wrong choice, then the right one: ✗ and that choice's explanation, then ✓ and its own
    mc_at = next(i for i, q in enumerate(questions) if isinstance(q, MultipleChoice))
    mc = questions[mc_at]
    wrong = next(i for i in range(len(mc.choices)) if i != mc.answer)
    for index, mark in ((wrong, "✗"), (mc.answer, "✓")):
        choices.filter(has_text=bh.exactly(mc.choices[index])).click()
        checks.nth(mc_at).click()
        line = wait_for_feedback(page, output, lambda t: t.startswith(mark),
                                 f"{mark} for choice {index}")
        assert shown(mc.explanations[index]) in line, \
            f"concept check: choice {index} showed {line!r}, not its explanation"
        print(f"ch{QUIZ_CHAPTER} quiz: choice {index} -> {line[:70]}…")

    # a number: the right answer typed in the first numeric question gets ✓ and the explanation
    num_at = next(i for i, q in enumerate(questions) if isinstance(q, Numeric))
    number = questions[num_at]
    box = output.locator(".widget-text input").first
    box.fill(f"{number.answer:g}")
    box.press("Enter")
    checks.nth(num_at).click()
    line = wait_for_feedback(page, output, lambda t: t.startswith("✓") and
                             shown(number.explanation, 30) in t, "✓ for the numeric answer")
    print(f"ch{QUIZ_CHAPTER} quiz: {number.answer:g} -> {line[:70]}…")
    page.wait_for_timeout(200)  # let the feedback paint
    bh.assert_no_news_prompt(page)
    output.screenshot(path=str(SCREENSHOTS / f"ch{QUIZ_CHAPTER}_quiz_after_check.png"))

    # the feedback lines are in view too: check again now that they show
    spill = bh.overflow(output)
    if spill["overflow_px"] > 0 or spill["scroll_overflow_px"] > 0:
        problems.append(f"with feedback shown the quiz sticks out by {spill['overflow_px']} px "
                        f"({spill['element']})")
    assert not bh.error_outputs(panel), "concept check: a traceback appeared after checking"
    assert not problems, (f"concept check on a {bh.VIEWPORT['width']}×{bh.VIEWPORT['height']} "
                          f"screen (see {SCREENSHOTS.relative_to(ROOT)}/ch{QUIZ_CHAPTER}_quiz.png):"
                          "\n  " + "\n  ".join(problems))

def test_all_widget_chapters_exist():
    """Every widget chapter has its learner notebook (else its browser case is not collected)."""
    missing = [f"notebooks/{s.stem}*.ipynb ({s.what})" for s in WIDGET_CHAPTERS
               if chapter_notebook(s.stem) is None]
    assert not missing, "widget chapters missing, so not tested in the browser: " + ", ".join(missing)
