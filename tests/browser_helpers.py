"""Drive the course's JupyterLab in headless Chromium (Playwright's sync API): the browser test's helpers.

The browser is Debian's ``/usr/bin/chromium`` (``make test`` installs it); Playwright downloads
none. Everything here works on what a learner sees: menus by their names, widgets by their
labels and button texts, figures by their ``<img>``. Nothing reaches into JupyterLab's internals.

The page never writes to the repository: :func:`block_saves` answers every save (Ctrl-S or
JupyterLab's two-minute autosave) with the file as it is on disk, so running a learner notebook
in the browser cannot store its outputs in ``notebooks/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from contextlib import contextmanager
from pathlib import Path

from lab_server import stop_process_group

CHROMIUM = Path("/usr/bin/chromium")
# Chromium as root in a container, on a machine with no outside network (FACTS.md, "A real browser").
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1400, "height": 1000}  # a laptop screen
BROWSER_START_TIMEOUT_S = 30
LAB_LOAD_TIMEOUT_MS = 90_000  # first JupyterLab load on a busy 2-core machine
KERNEL_IDLE_TIMEOUT_S = 60  # kernel start after the notebook opened
POLL_S = 0.05

# What ipywidgets and JupyterLab print in place of a widget that failed to render.
WIDGET_ERROR_TEXTS = ("Error displaying widget", "Error rendering", "Model not found")
# IPython's error output always contains one of these.
TRACEBACK_RE = re.compile(r"Traceback \(most recent call last\)|^\s*Cell In\[\d+\], line \d+", re.M)
PROMPT_DONE_RE = re.compile(r"^\[\d+\]:$")

# Every code cell's prompt ("[3]:", "[*]:", "[ ]:") and the kernel indicator, in one round trip.
_NOTEBOOK_STATE_JS = """
(panel) => {
  const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
      .map(p => p.textContent.trim());
  const indicator = panel.querySelector('.jp-Notebook-ExecutionIndicator');
  return {prompts, status: indicator ? indicator.getAttribute('data-status') : null};
}
"""


@contextmanager
def chromium_process(log_path: Path | None = None):
    """Start headless Chromium ourselves (so we hold its PID); yield ``(cdp_url, pid)``; stop it by PID.

    Playwright attaches to it with ``connect_over_cdp``. Chromium runs in its own session with a
    throw-away profile; at the end its whole process group (renderers, GPU/zygote helpers) gets
    SIGTERM, then SIGKILL if it lingers.
    """
    profile = Path(tempfile.mkdtemp(prefix="course-chromium-"))
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(
        [str(CHROMIUM), "--headless", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
         f"--user-data-dir={profile}", *CHROMIUM_ARGS, "about:blank"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        port_file = profile / "DevToolsActivePort"  # Chromium writes its port here once it listens
        deadline = time.monotonic() + BROWSER_START_TIMEOUT_S
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"Chromium exited with code {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Chromium did not open its DevTools port in "
                                   f"{BROWSER_START_TIMEOUT_S} s; see {log_path}")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        stop_process_group(proc, timeout=10)
        log.close()
        shutil.rmtree(profile, ignore_errors=True)


def block_saves(page) -> None:
    """Answer the page's writes to the contents API without touching the disk.

    A save (PUT) is answered with the file's current model and a new checkpoint (POST, made when
    a notebook opens) with a made-up one, so JupyterLab believes both worked and shows no error;
    any other write (rename, delete, restore) is refused.
    """
    def handle(route, request):
        path = request.url.split("?", 1)[0]
        if request.method in ("GET", "HEAD"):
            route.continue_()
        elif request.method == "PUT":
            route.fulfill(response=route.fetch(method="GET", url=f"{path}?content=0"))
        elif request.method == "POST" and path.endswith("/checkpoints"):
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            route.fulfill(status=201, content_type="application/json",
                          body=json.dumps({"id": "checkpoint", "last_modified": now}))
        else:
            route.abort()

    page.route("**/api/contents/**", handle)


def notebook_url(base: str, relpath: str, workspace: str) -> str:
    """URL that opens one notebook in a fresh, named JupyterLab workspace.

    A named workspace with ``?reset`` opens exactly this notebook (no tabs restored from an
    earlier run) and leaves the learner's default workspace alone.
    """
    return f"{base}/lab/workspaces/{workspace}/tree/{urllib.parse.quote(relpath)}?reset"


def open_notebook(page, base: str, relpath: str, workspace: str):
    """Open ``relpath`` (relative to the course root); return the notebook panel's locator."""
    page.goto(notebook_url(base, relpath, workspace), timeout=LAB_LOAD_TIMEOUT_MS)
    name = Path(relpath).name
    panel = page.locator(".jp-NotebookPanel").filter(
        has=page.locator(".jp-Notebook")).last
    panel.wait_for(state="visible", timeout=LAB_LOAD_TIMEOUT_MS)
    page.get_by_role("tab", name=re.compile(re.escape(name))).first.wait_for(
        timeout=LAB_LOAD_TIMEOUT_MS)
    wait_for_kernel_idle(page, panel, base, relpath, KERNEL_IDLE_TIMEOUT_S)
    fail_on_dialog(page)
    assert_no_news_prompt(page)
    return panel


def news_prompt(page):
    """JupyterLab's "Would you like to get notified about official Jupyter news?" toast."""
    return page.locator(".Toastify__toast").filter(has_text="Jupyter news")


def watch_for_news_prompt(page) -> list[str]:
    """Record every time the news toast shows (the course's lab must never show it: `make lab`
    sets ``fetchNews`` to "false", see course_lib/platform/lab.py), closing it so that the test goes on
    and fails at the end with the evidence. Returns the list the sightings are appended to.

    It is closed (×), not answered: "No" would be stored in the user's JupyterLab settings.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    seen: list[str] = []

    def close(toast):
        seen.append(" ".join(toast.inner_text().split())[:120])
        try:
            toast.get_by_title("Hide notification").click(timeout=3_000)
        except PlaywrightTimeoutError:
            pass  # it went away by itself while we reached for it

    page.add_locator_handler(news_prompt(page), close)
    return seen


def assert_no_news_prompt(page) -> None:
    """The news toast is not showing now (checked before every screenshot)."""
    assert not news_prompt(page).count(), (
        "JupyterLab shows its news pop-up; the course's lab should have fetchNews = \"false\" "
        "(course_lib/platform/lab.py install_settings)")


def fail_on_dialog(page) -> None:
    """A modal dialog (load or save error, kernel died, ...) means the run went wrong: say which."""
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        raise AssertionError("JupyterLab shows a dialog: " + " | ".join(dialog.all_inner_texts()))


def notebook_state(panel) -> dict:
    return panel.evaluate(_NOTEBOOK_STATE_JS)


def kernel_state(page, base: str, relpath: str) -> str | None:
    """The server's view of the notebook's kernel: "starting", "idle", "busy", or None (none yet)."""
    for session in json.loads(page.request.get(f"{base}/api/sessions").text()):
        if session.get("path") == relpath and session.get("kernel"):
            return session["kernel"].get("execution_state")
    return None


def wait_for_kernel_idle(page, panel, base: str, relpath: str, timeout_s: float) -> None:
    """Wait until the notebook's kernel has started and both the server and the page say idle.

    (The page's indicator says "idle" before any kernel exists; Run All at that moment opens
    the "Select Kernel" dialog.)
    """
    deadline = time.monotonic() + timeout_s
    while True:
        fail_on_dialog(page)
        server = kernel_state(page, base, relpath)
        if server == "idle" and notebook_state(panel)["status"] == "idle":
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the kernel of {relpath} was not idle after {timeout_s} s "
                                 f"(server: {server!r}, page: {notebook_state(panel)['status']!r})")
        page.wait_for_timeout(250)


def run_all_cells(page, panel, timeout_s: float) -> float:
    """Run → Run All Cells, as a learner does; wait until it stops; return the seconds it took.

    Done means: no cell is queued or running (``[*]``), the kernel is idle, and either every code
    cell has an execution number or the run stopped (JupyterLab stops at the first error).
    """
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    start = time.monotonic()
    started = False
    quiet_since = None
    while True:
        fail_on_dialog(page)
        state = notebook_state(panel)
        busy = any(p == "[*]:" for p in state["prompts"]) or state["status"] != "idle"
        started = started or busy or all(PROMPT_DONE_RE.match(p) for p in state["prompts"])
        if started and not busy:
            # idle for a moment: the kernel may go idle between two queued cells
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 1.0:
                return time.monotonic() - start
        else:
            quiet_since = None
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"Run All Cells had not finished after {timeout_s} s; "
                                 f"prompts: {state['prompts']}")
        page.wait_for_timeout(250)


def code_cell(panel, text: str):
    """The first code cell whose source contains ``text``."""
    return panel.locator(".jp-CodeCell").filter(
        has=panel.page.locator(".jp-InputArea", has_text=text)).first


def cell_source(cell) -> str:
    """A code cell's source as its editor shows it (CodeMirror draws one ``.cm-line`` a line)."""
    # an empty line's element holds a <br>, which reads as "\n"
    return "\n".join(t.rstrip("\n") for t in cell.locator(".jp-InputArea .cm-line").all_inner_texts())


def replace_cell_source(page, cell, source: str) -> None:
    """Replace a code cell's source, as a learner does: click into it, select all, type.

    The text is inserted in one go (as a paste does), so the editor's auto-indent and bracket
    closing do not change it; the cell is *not* run.
    """
    cell.scroll_into_view_if_needed()
    cell.locator(".jp-InputArea .cm-content").click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(source)
    shown = cell_source(cell)
    assert _lines(shown) == _lines(source), f"the cell shows {shown!r}, not what was typed"


def _lines(text: str) -> list[str]:
    """Lines without trailing spaces, trailing blank lines dropped (an empty ``.cm-line`` reads
    as a newline)."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def cell_prompt(cell) -> str:
    return cell.locator(".jp-InputArea-prompt").inner_text().strip()


def run_one_cell(page, panel, cell, base: str, relpath: str, timeout_s: float) -> None:
    """Run only ``cell`` (Ctrl+Enter in it: run, stay) and wait until it has a new execution
    number and the kernel is idle again."""
    before = cell_prompt(cell)
    cell.scroll_into_view_if_needed()
    cell.locator(".jp-InputArea .cm-content").click()
    page.keyboard.press("Control+Enter")
    deadline = time.monotonic() + timeout_s
    while True:
        fail_on_dialog(page)
        prompt = cell_prompt(cell)
        if PROMPT_DONE_RE.match(prompt) and prompt != before \
                and notebook_state(panel)["status"] == "idle":
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the cell had not run after {timeout_s} s (prompt {prompt!r})")
        page.wait_for_timeout(250)


def cell_output_text(cell) -> str:
    return "\n".join(cell.locator(".jp-OutputArea-output").all_inner_texts())


def unexecuted_cells(panel) -> list[int]:
    """Indexes (0-based, code cells only) of cells with no execution number."""
    return [i for i, p in enumerate(notebook_state(panel)["prompts"]) if not PROMPT_DONE_RE.match(p)]


def output_texts(panel) -> list[str]:
    return panel.locator(".jp-OutputArea-output").all_inner_texts()


def error_outputs(panel) -> list[str]:
    """Outputs that show a Python traceback (the first lines of each)."""
    return ["\n".join(t.splitlines()[:12]) for t in output_texts(panel) if TRACEBACK_RE.search(t)]


def widget_error_texts(panel) -> list[str]:
    text = panel.inner_text()
    return [e for e in WIDGET_ERROR_TEXTS if e.lower() in text.lower()]


def exactly(text: str) -> re.Pattern:
    """Match an element's whole text (``has_text`` alone matches substrings)."""
    return re.compile(rf"^\s*{re.escape(text)}\s*$")


def button(page, within, text: str):
    """A widget button by its text (its accessible name also holds the icon's glyph, so
    ``get_by_role(name=...)`` would not match it exactly)."""
    return within.locator("button").filter(has_text=exactly(text))


def widget_output(page, panel, label: str):
    """The cell output area of the first displayed widget that has a control labelled ``label``
    (a slider's or dropdown's description, or a button's text)."""
    control = page.locator(".widget-label", has_text=exactly(label)).or_(
        page.locator("button").filter(has_text=exactly(label)))
    return panel.locator(".jp-Cell-outputArea").filter(has=control).first


def slider_handle(page, output, label: str):
    """The keyboard-focusable handle of the slider whose description is ``label``."""
    slider = output.locator(".widget-slider").filter(
        has=page.locator(".widget-label", has_text=exactly(label)))
    return slider.locator("[role=slider]").first


def dropdown(page, output, label: str):
    """The ``<select>`` of the dropdown whose description is ``label``."""
    return output.locator(".widget-dropdown").filter(
        has=page.locator(".widget-label", has_text=exactly(label))).locator("select")


def figure(output):
    """The widget's figure: the first ``<img>`` in its output (matplotlib PNG or ipywidgets Image)."""
    return output.locator("img").first


def image_info(img) -> dict:
    """Loaded? natural and rendered size, and the src (a data: or blob: URL that changes on redraw)."""
    return img.evaluate("""(el) => ({src: el.currentSrc || el.src, complete: el.complete,
        naturalWidth: el.naturalWidth, naturalHeight: el.naturalHeight,
        width: el.getBoundingClientRect().width, height: el.getBoundingClientRect().height})""")


def wait_for_new_src(page, img, old_src: str, timeout_s: float) -> float:
    """Seconds until the figure's src differs from ``old_src`` and the new image has loaded."""
    start = time.monotonic()
    while True:
        try:
            info = image_info(img)
            if info["src"] != old_src and info["complete"] and info["naturalWidth"] > 0:
                return time.monotonic() - start
        except Exception:  # the <img> is being replaced (Output widget's clear_output(wait=True))
            pass
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"the figure did not change within {timeout_s} s")
        page.wait_for_timeout(POLL_S * 1000)


def overflow(output) -> dict:
    """How far the widget sticks out of its output area (px), the element that sticks out most,
    and how far the area itself scrolls sideways."""
    return output.evaluate("""(area) => {
        const box = area.getBoundingClientRect();
        let worst = {overflow_px: 0, element: null};
        for (const el of area.querySelectorAll('*')) {
          const r = el.getBoundingClientRect();
          if (r.width === 0) continue;
          const over = r.right - box.right;
          if (over > worst.overflow_px + 1)
            worst = {overflow_px: Math.round(over), element: el.className || el.tagName};
        }
        worst.scroll_overflow_px = area.scrollWidth - area.clientWidth;
        return worst;
    }""")


def truncated_texts(output) -> list[str]:
    """Labels, buttons, read-outs and radio-button choices whose text does not fit (cut off,
    often with an ellipsis)."""
    return output.evaluate("""(area) => {
        const cut = [];
        for (const el of area.querySelectorAll(
            '.widget-label, .widget-readout, button, .widget-toggle-button, .widget-label-basic, '
            + '.widget-radio-box label')) {
          if (el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1 && el.textContent.trim())
            cut.push(`${el.textContent.trim()} (${el.clientWidth}px shown of ${el.scrollWidth}px)`);
        }
        return cut;
    }""")


def wait_until_still(page, img, quiet_s: float, timeout_s: float) -> float:
    """Seconds until the figure last changed, once it has not changed for ``quiet_s``."""
    start = time.monotonic()
    last_src, last_change = None, start
    while time.monotonic() - last_change < quiet_s:
        try:
            src = image_info(img)["src"]
        except Exception:  # being replaced
            src = None
        if src != last_src:
            last_src, last_change = src, time.monotonic()
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"the figure was still changing after {timeout_s} s")
        page.wait_for_timeout(POLL_S * 1000)
    return last_change - start


def drag_slider(page, handle, distance_px: float, steps: int = 8) -> None:
    """Drag a slider's handle to the right with the mouse, as a learner does."""
    handle.scroll_into_view_if_needed()
    box = handle.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    for i in range(1, steps + 1):
        page.mouse.move(x + distance_px * i / steps, y)
        page.wait_for_timeout(40)
    page.mouse.up()


def unlabelled_controls(output) -> list[str]:
    """Sliders, dropdowns and text boxes with an empty description, and buttons with no text."""
    return output.evaluate("""(area) => {
        const bad = [];
        for (const el of area.querySelectorAll('.widget-slider, .widget-dropdown, .widget-text')) {
          const label = el.querySelector('.widget-label');
          if (!label || !label.textContent.trim() || getComputedStyle(label).display === 'none')
            bad.push(el.className);
        }
        for (const b of area.querySelectorAll('button')) {
          if (!b.textContent.trim() && !b.getAttribute('title') && !b.getAttribute('aria-label')
              && !b.closest('.widget-play'))
            bad.push('button ' + b.className);
        }
        return bad;
    }""")


def screenshot_notebook(page, panel, path: Path, max_height: int = 16_000) -> None:
    """Screenshot the whole notebook, top to bottom.

    JupyterLab scrolls the notebook inside its panel, so a "full page" screenshot shows only one
    screen; the viewport is made as tall as the notebook for the shot, then put back.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    scroller = panel.locator(".jp-WindowedPanel-outer").first
    content_h = scroller.evaluate("(el) => el.scrollHeight")
    visible_h = scroller.evaluate("(el) => el.clientHeight")
    extra = max(0, min(content_h - visible_h, max_height - VIEWPORT["height"]))
    page.set_viewport_size({"width": VIEWPORT["width"], "height": VIEWPORT["height"] + extra})
    try:
        scroller.evaluate("(el) => { el.scrollTop = 0; }")
        page.wait_for_timeout(500)  # let JupyterLab lay out and paint the cells now in view
        page.screenshot(path=str(path))
    finally:
        page.set_viewport_size(VIEWPORT)


def delete_workspace(page, base: str, workspace: str) -> None:
    """Remove the named workspace the test created (JupyterLab stores it in the user's settings)."""
    xsrf = next((c["value"] for c in page.context.cookies() if c["name"] == "_xsrf"), "")
    page.request.delete(f"{base}/lab/api/workspaces/{workspace}", headers={"X-XSRFToken": xsrf})


def shut_down_kernels(page, base: str, relpath: str) -> None:
    """Stop the kernel(s) of ``relpath``'s sessions, so chapters do not pile up kernels."""
    xsrf = next((c["value"] for c in page.context.cookies() if c["name"] == "_xsrf"), "")
    sessions = json.loads(page.request.get(f"{base}/api/sessions").text())
    for s in sessions:
        if s.get("path") == relpath:
            page.request.delete(f"{base}/api/sessions/{s['id']}", headers={"X-XSRFToken": xsrf})
