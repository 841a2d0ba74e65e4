"""Online-softmax stepper (chapter 03): fold a row of scores into (m, l) one tile at a time.

Controls: an input-row selector and a *New random row* button, a *Block size* slider, *Next tile*
and *Reset* buttons. After each tile the figure shows

* top left — the scores, the tiles seen so far, the current tile, and the running max ``m``;
* bottom left — the current weights ``exp(x_j - m) / l`` of the scores seen so far (bars) against
  the true softmax of the whole row (black ticks): they agree once the last tile is in;
* right — the running sum ``l`` and the correction factor ``exp(m_old - m_new)`` after each tile;

and a line of text gives the numbers of the last update. The widget works without a browser:
``click()`` the buttons or set ``slider.value`` and read :attr:`tiles_done`, :attr:`m`, :attr:`l`,
:meth:`current_weights` or the figure's artists. The figure is rendered to PNG into
:attr:`image` after every change (see ``_display``).

Usage::

    from course_lib.teaching.widgets.softmax_stepper import SoftmaxStepper
    SoftmaxStepper()          # the last expression of a cell displays it
"""

from __future__ import annotations


import ipywidgets as widgets
import numpy as np

from course_lib.attention.softmax import safe_softmax, trace_online_softmax
from course_lib.teaching.widgets._display import (PANEL_TITLE_FONTSIZE, SMALL_FONTSIZE, FigureWidget,
                                        control_layout)

RANDOM_LENGTH = 12  # scores in a random row
RANDOM_SCALE = 2.0  # standard deviation of random scores: enough spread for visible weights
LARGE_LOGIT = 1000.0  # where the "large logits" row sits: exp(1000) overflows even float64
MAX_LABELLED_POSITIONS = 16  # label every position on the x axis up to this row length
BAR_SQUASH_RATIO = 5.0  # draw score bars from near the data when 0 is this many spreads away

# The worked examples of the reading (chapter 00 names the articles).
READING_ROW = "CS 229s notes: [1.0, 2.0, 0.5, 0.1]"
READING_SCORES = "memory-wall article: [2, 5, 3]"
RANDOM = "random (New random row)"
RISING = "rising (every tile raises the max)"
LARGE = "large logits (about 1000)"
PRESETS = (READING_ROW, READING_SCORES, RANDOM, RISING, LARGE)

SEEN_COLOUR, CURRENT_COLOUR, UNSEEN_COLOUR = "tab:blue", "tab:orange", "0.85"


def preset_row(name: str, seed: int = 0) -> np.ndarray:
    """The scores of one of :data:`PRESETS` (float64, 1-D); ``seed`` drives the random ones."""
    rng = np.random.default_rng(seed)
    if name == READING_ROW:
        return np.array([1.0, 2.0, 0.5, 0.1])
    if name == READING_SCORES:
        return np.array([2.0, 5.0, 3.0])
    if name == RANDOM:
        return np.round(rng.normal(0.0, RANDOM_SCALE, RANDOM_LENGTH), 2)
    if name == RISING:  # increasing trend with a wiggle: each new tile holds a new max
        i = np.arange(RANDOM_LENGTH)
        return np.round(0.5 * i + 0.3 * (-1.0) ** i, 2)
    if name == LARGE:
        return np.round(LARGE_LOGIT + rng.normal(0.0, RANDOM_SCALE, RANDOM_LENGTH), 2)
    raise ValueError(f"preset must be one of {PRESETS}, got {name!r}")


def _bar_base(row: np.ndarray) -> float:
    """Where score bars start: 0, unless that would squash them (scores far from 0, e.g. 1000)."""
    finite = row[np.isfinite(row)]  # masked (-inf) scores get no bar
    if finite.size == 0:
        return 0.0
    spread = max(float(finite.max() - finite.min()), 1.0)
    low = min(0.0, float(finite.min()))
    if finite.min() - low > BAR_SQUASH_RATIO * spread:
        low = float(finite.min()) - 0.5 * spread
    return low


class SoftmaxStepper(FigureWidget):
    """Tile-by-tile online softmax of one row, with buttons, a slider and a live figure.

    Args:
        preset: the starting row, one of :data:`PRESETS`.
        block_size: the starting tile width.
        seed: seed of the first random row (*New random row* increments it).
        row: a custom 1-D row of scores; overrides ``preset`` until another preset is chosen.
    """

    def __init__(self, preset: str = READING_ROW, block_size: int = 2, seed: int = 0, row=None):
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
        self.seed = seed
        self.row = preset_row(preset, seed) if row is None else self._as_row(row)
        self.tiles_done = 0
        self._syncing = False

        self.preset = widgets.Dropdown(options=PRESETS, value=preset, description="Input row",
                                       **control_layout())
        self.new_row_button = widgets.Button(description="New random row", icon="random")
        self.block_slider = self._new_slider(1, len(self.row))
        self.next_button = widgets.Button(description="Next tile", icon="step-forward",
                                          button_style="primary")
        self.reset_button = widgets.Button(description="Reset", icon="undo")
        self.status = widgets.HTML()
        self._new_figure(layout=None)  # the axes are placed by hand below
        self._slider_box = widgets.HBox([self.block_slider, self.next_button, self.reset_button])
        self.widget = widgets.VBox([
            widgets.HBox([self.preset, self.new_row_button]),
            self._slider_box,
            self.status, self.image])

        grid = self.fig.add_gridspec(2, 2, width_ratios=(1.7, 1.0), left=0.08, right=0.98,
                                     bottom=0.11, top=0.94, wspace=0.18, hspace=0.12)
        self.ax_scores = self.fig.add_subplot(grid[0, 0])
        self.ax_weights = self.fig.add_subplot(grid[1, 0], sharex=self.ax_scores)
        self.ax_state = self.fig.add_subplot(grid[:, 1])

        self._set_slider(block_size)
        self.preset.observe(lambda change: self._on_preset(change["new"]), names="value")
        self.next_button.on_click(lambda button: self.step())
        self.reset_button.on_click(lambda button: self.reset())
        self.new_row_button.on_click(lambda button: self.new_random_row())
        self.reset()

    # -- state ---------------------------------------------------------------------------------

    @staticmethod
    def _as_row(row) -> np.ndarray:
        row = np.asarray(row, dtype=np.float64)
        if row.ndim != 1 or row.size == 0:
            raise ValueError(f"row must be a non-empty 1-D sequence of scores, got shape {row.shape}")
        return row

    @property
    def block_size(self) -> int:
        return self.block_slider.value

    @property
    def steps(self):
        """The full per-tile trace of the current row and block size (see ``TileStep``)."""
        return self._steps

    @property
    def n_tiles(self) -> int:
        return len(self._steps)

    @property
    def done(self) -> bool:
        return self.tiles_done == self.n_tiles

    @property
    def m(self) -> float:
        """Running max after the tiles done so far (``-inf`` before the first)."""
        return self._steps[self.tiles_done - 1].m_new if self.tiles_done else -np.inf

    @property
    def l(self) -> float:
        """Running sum after the tiles done so far (0 before the first)."""
        return self._steps[self.tiles_done - 1].l_new if self.tiles_done else 0.0

    @property
    def seen(self) -> int:
        """How many scores (from the left) the tiles done so far cover."""
        return self._steps[self.tiles_done - 1].stop if self.tiles_done else 0

    def true_softmax(self) -> np.ndarray:
        return safe_softmax(self.row)

    def current_weights(self) -> np.ndarray:
        """``exp(x_j - m) / l`` for the scores seen so far, 0 for the rest: ``(N,)``."""
        w = np.zeros_like(self.row)
        if self.tiles_done:
            w[:self.seen] = np.exp(self.row[:self.seen] - self.m) / self.l
        return w

    # -- actions -------------------------------------------------------------------------------

    def step(self) -> None:
        """Fold the next tile into the state (does nothing after the last tile)."""
        if not self.done:
            self.tiles_done += 1
        self.redraw()

    def run_to_end(self) -> None:
        self.tiles_done = self.n_tiles
        self.redraw()

    def reset(self) -> None:
        """Back to the empty state (m = -inf, l = 0) for the current row and block size."""
        self._steps = trace_online_softmax(self.row, self.block_size)
        self.tiles_done = 0
        self.redraw()

    def set_row(self, row) -> None:
        """Use a custom row of scores and reset."""
        self.row = self._as_row(row)
        self._set_slider(self.block_size)
        self.reset()

    def new_random_row(self) -> None:
        """Draw a fresh random row (next seed) and show it."""
        self.seed += 1
        if self.preset.value == RANDOM:
            self.set_row(preset_row(RANDOM, self.seed))
        else:
            self.preset.value = RANDOM  # the observer loads the row

    def _on_preset(self, name: str) -> None:
        self.set_row(preset_row(name, self.seed))

    def _on_block_size(self) -> None:
        if not self._syncing:
            self.reset()

    def _new_slider(self, value: int, top: int):
        slider = widgets.IntSlider(value=value, min=1, max=top, description="Block size",
                                   continuous_update=False, **control_layout())
        slider.observe(lambda change: self._on_block_size(), names="value")
        return slider

    def _set_slider(self, block_size: int) -> None:
        """Fit the slider's range to the row (1 to N) without triggering a reset per change.

        A new row of another length gets a new slider: JupyterLab's slider keeps parts of the
        range it was first drawn with (its End key and the far end of a drag went to the old N,
        e.g. 4 on a 12-score row), so changing ``max`` of the one on the page is not enough.
        """
        top = max(len(self.row), 1)
        value = int(min(max(block_size, 1), top))
        if self.block_slider.max != top:
            old = self.block_slider
            self.block_slider = self._new_slider(value, top)
            if hasattr(self, "_slider_box"):
                self._slider_box.children = (self.block_slider, *self._slider_box.children[1:])
            old.close()
            return
        self._syncing = True
        try:
            self.block_slider.value = value
        finally:
            self._syncing = False

    # -- drawing -------------------------------------------------------------------------------

    def _status_text(self) -> str:
        head = (f"<b>Tile {self.tiles_done} of {self.n_tiles}</b> (block size {self.block_size}, "
                f"N = {len(self.row)})")
        if not self.tiles_done:
            return f"{head} — empty state: m = −inf, l = 0. Press <i>Next tile</i>."
        s = self._steps[self.tiles_done - 1]
        m_old = "−inf" if np.isinf(s.m_old) else f"{s.m_old:.3f}"
        text = (f"{head}: x[{s.start}:{s.stop}] — m: {m_old} → {s.m_new:.3f}; "
                f"correction exp(m_old − m_new) = {s.correction:.4f}; "
                f"l = {s.l_old:.4f} × {s.correction:.4f} + {s.tile_sum:.4f} = {s.l_new:.4f}")
        if self.done:
            err = np.max(np.abs(self.current_weights() - self.true_softmax()))
            text += f"<br>All tiles in: max |weights − softmax| = {err:.1e}"
        return text

    def redraw(self) -> None:
        """Redraw the figure and the status line from the current state."""
        self.next_button.disabled = self.done
        self.status.value = self._status_text()
        x = np.arange(len(self.row))
        current = self._steps[self.tiles_done - 1] if self.tiles_done else None
        colours = [UNSEEN_COLOUR] * len(self.row)
        for j in range(self.seen):
            colours[j] = CURRENT_COLOUR if current and j >= current.start else SEEN_COLOUR

        ax = self.ax_scores
        ax.clear()
        low = _bar_base(self.row)
        heights = np.where(np.isfinite(self.row), self.row - low, 0.0)
        ax.bar(x, heights, bottom=low, color=colours, edgecolor="0.4")
        for s in self._steps[1:]:
            ax.axvline(s.start - 0.5, color="0.5", linestyle=":", linewidth=1)
        if self.tiles_done:
            ms = np.array([s.m_new for s in self._steps[:self.tiles_done]])
            edges = [self._steps[0].start - 0.5] + [s.stop - 0.5 for s in self._steps[:self.tiles_done]]
            ax.stairs(ms, edges, baseline=None, color="tab:red", linewidth=2,
                      label="running max m")
            ax.legend(loc="best", fontsize=SMALL_FONTSIZE)
        ax.set_ylabel("score x")
        ax.set_title("scores: seen (blue), current tile (orange), not yet read (grey)",
                     fontsize=PANEL_TITLE_FONTSIZE)
        ax.tick_params(labelbottom=False)

        ax = self.ax_weights
        ax.clear()
        ax.bar(x, self.current_weights(), color=colours, edgecolor="0.4",
               label="current exp(x − m) / l")
        ax.scatter(x, self.true_softmax(), marker="_", s=300, color="black", linewidths=2,
                   label="true softmax", zorder=3)
        ax.set_ylim(0, 1.05)
        if len(self.row) <= MAX_LABELLED_POSITIONS:
            ax.set_xticks(x)
        ax.set_xlabel("position j in the row")
        ax.set_ylabel("weight")
        ax.legend(loc="best", fontsize=SMALL_FONTSIZE)

        ax = self.ax_state
        ax.clear()
        tiles = np.arange(1, self.tiles_done + 1)
        ax.plot(tiles, [s.l_new for s in self._steps[:self.tiles_done]], "o-", color="tab:green",
                label="running sum l")
        # the first tile has no old state to rescale (its factor, exp(-inf) = 0, is not drawn)
        corrections = [np.nan] + [s.correction for s in self._steps[1:self.tiles_done]]
        ax.plot(tiles, corrections[:self.tiles_done], "s--",
                color="tab:purple", label="correction exp(m_old − m_new)")
        ax.set_xlim(0.5, self.n_tiles + 0.5)
        ax.set_xticks(np.arange(1, self.n_tiles + 1))
        top = max([s.l_new for s in self._steps] + [1.0])
        ax.set_ylim(0, 1.1 * top)
        ax.set_xlabel("after tile")
        ax.set_title("state after each tile", fontsize=PANEL_TITLE_FONTSIZE)
        ax.legend(loc="best", fontsize=SMALL_FONTSIZE)
        self._render()
