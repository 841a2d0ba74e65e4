"""Tiling simulator (chapter 04): step through FlashAttention's tiles and count the HBM traffic.

Controls: *Sequence length* N (queries = keys), *BLOCK_M* (B_r, query rows per tile), *BLOCK_N*
(B_c, key rows per tile), *Head dim* d, the loop order (FA2: outer loop over Q tiles; FA1: outer
loop over K/V tiles), *Causal*, *Step* / *Play* / *Reset*, and *Play speed*.

A step is one thing the kernel does: a tile computed, or a Q block's output stored. Tiles the
causal mask hides are never loaded, so they cost no step: a step that passes over them marks them
skipped (dark) at once and says so in the status line. *Play speed* sets how many steps a second
Play shows (the fast settings advance several steps per frame, so a 64 × 64-tile run takes
seconds, not minutes).

The figure shows

* left — the ``N × N`` score matrix cut into its ``T_r × T_c`` tiles, each drawn with its real size
  (the last row and column of tiles are narrower when N is not a multiple of the block): the tile
  now in SRAM (orange), tiles done (blue), tiles skipped by the causal mask (dark grey), tiles not
  reached yet (light grey); the strips on its left and top show which Q block and which K/V block
  are resident in SRAM;
* right — HBM reads and writes so far (solid bars) against the run's total (pale bars) and
  against standard attention at the same size (black ticks), on a linear scale so that a bar's
  length is its share of the total, each with its numbers written above it;

and a line of text gives the step and the counters, FLOPs included.

The event list comes from :func:`course_lib.attention.iomodel.tile_events`, a dry run that only adds up
counts (the tests check it against the real NumPy run's counter), so a grid of 64 × 64 tiles
takes a few milliseconds to prepare; each step redraws one ``imshow`` array per panel and renders
the figure to PNG into :attr:`image` (see ``_display``). The widget works without a browser: call
:meth:`step`, :meth:`reset`, set ``play.value`` or a slider's ``value`` and read :attr:`position`,
:meth:`grid_state`, :meth:`tile_rectangles` or the artists' data.

Usage::

    from course_lib.teaching.widgets.tiling import TilingSimulator
    TilingSimulator()         # the last expression of a cell displays it
"""

from __future__ import annotations


import ipywidgets as widgets
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from course_lib.attention import iomodel
from course_lib.teaching.widgets._display import (PANEL_TITLE_FONTSIZE, SMALL_FONTSIZE, FigureWidget,
                                        control_layout)


def playing_trait(play) -> str:
    """The name of a ``Play`` widget's "is playing" trait: ``playing`` in ipywidgets 8,
    ``_playing`` in ipywidgets 7 (Google Colab's widget frontend runs ipywidgets 7)."""
    return "playing" if play.has_trait("playing") else "_playing"


# Play speeds: (label, (milliseconds between frames, steps per frame)). A frame costs a redraw
# (~0.05-0.2 s at 64 × 64 tiles), so the fast speeds take several steps per frame, not shorter frames.
PLAY_SPEEDS = (("1 step/s", (1000, 1)), ("4 steps/s", (250, 1)), ("10 steps/s", (100, 1)),
               ("40 steps/s", (250, 10)), ("200 steps/s", (250, 50)))
DEFAULT_PLAY_SPEED = (250, 1)  # four steps a second
PLAY_INTERVAL_MS = DEFAULT_PLAY_SPEED[0]
MAX_TICKS = 8  # per axis
IO_MAX_TICKS = 5  # on the traffic panel's count axis
IO_HEADROOM = 1.08  # the traffic axis ends a little past the largest bar or tick
BAR_HEIGHT = 0.45  # of the traffic bars, rows one apart
BUTTON_WIDTH = "130px"  # of the loop-order buttons: their labels fit

# Slider ranges: the largest grid is MAX_SEQ_LEN / MIN_BLOCK = 64 tiles per side.
MIN_SEQ_LEN, MAX_SEQ_LEN, SEQ_LEN_STEP = 16, 1024, 8
MIN_BLOCK, MAX_BLOCK, BLOCK_STEP = 16, 256, 8
HEAD_DIMS = (32, 64, 128)
ORDERS = (("FA2 (outer Q)", "fa2"), ("FA1 (outer K/V)", "fa1"))  # (label, value)
ORDER_TOOLTIPS = ("FA2: outer loop over Q tiles, inner loop over K/V tiles",
                  "FA1: outer loop over K/V tiles, inner loop over Q tiles")

# Tile states, the values of the grid array (and indices into the colour map).
TODO, DONE, SKIPPED, CURRENT = 0, 1, 2, 3
TILE_COLOURS = ListedColormap(["0.90", "tab:blue", "0.35", "tab:orange"])
# Block strips: not in SRAM, in SRAM now, finished (its o written: FA2 Q blocks only).
OUT, RESIDENT, FINISHED = 0, 1, 2
STRIP_COLOURS = ListedColormap(["0.90", "tab:orange", "tab:blue"])

_KIND_CODE = {"compute": DONE, "skip": SKIPPED, "store": -1, "finish": -1}


def _fmt(n: float) -> str:
    """A count with an SI suffix: 1.23 M, 45.6 k."""
    for size, suffix in ((1e12, " T"), (1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(n) >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.0f}"


class TilingSimulator(FigureWidget):
    """Replays the tile schedule of FA1 or FA2 on an ``N × N`` score matrix.

    Args:
        seq_len: N. block_m, block_n: tile sizes. head_dim: d. order: ``"fa2"`` or ``"fa1"``.
        causal: skip the tiles above the diagonal.
    """

    def __init__(self, seq_len: int = 200, block_m: int = 64, block_n: int = 32,
                 head_dim: int = 64, order: str = "fa2", causal: bool = False):
        self.seq_len = widgets.IntSlider(value=seq_len, min=MIN_SEQ_LEN, max=MAX_SEQ_LEN,
                                         step=SEQ_LEN_STEP, description="Sequence length N",
                                         continuous_update=False, **control_layout())
        self.block_m = widgets.IntSlider(value=block_m, min=MIN_BLOCK, max=MAX_BLOCK,
                                         step=BLOCK_STEP, description="BLOCK_M (B_r)",
                                         continuous_update=False, **control_layout())
        self.block_n = widgets.IntSlider(value=block_n, min=MIN_BLOCK, max=MAX_BLOCK,
                                         step=BLOCK_STEP, description="BLOCK_N (B_c)",
                                         continuous_update=False, **control_layout())
        self.head_dim = widgets.Dropdown(options=HEAD_DIMS, value=head_dim,
                                         description="Head dim d", **control_layout())
        self.order = widgets.ToggleButtons(options=ORDERS, value=order, description="Loop order",
                                           tooltips=ORDER_TOOLTIPS,
                                           **control_layout(button_width=BUTTON_WIDTH))
        # ipywidgets stacks a ToggleButtons' label above its buttons; the class the sliders and
        # dropdowns carry puts it inline and right-aligned like theirs
        self.order.add_class("widget-inline-hbox")
        self.causal = widgets.Checkbox(value=causal, description="Causal (skip hidden tiles)")
        self.step_button = widgets.Button(description="Step",
                                          button_style="primary")
        self.reset_button = widgets.Button(description="Reset")
        self.play = widgets.Play(value=0, min=0, max=1, step=DEFAULT_PLAY_SPEED[1],
                                 interval=DEFAULT_PLAY_SPEED[0], description="Play",
                                 show_repeat=False)
        self.speed = widgets.Dropdown(options=PLAY_SPEEDS, value=DEFAULT_PLAY_SPEED,
                                      description="Play speed", **control_layout())
        self.status = widgets.HTML()
        self._new_figure()
        self.widget = widgets.VBox([
            widgets.HBox([self.seq_len, self.head_dim]),
            widgets.HBox([self.block_m, self.block_n]),
            widgets.HBox([self.order, self.causal]),
            widgets.HBox([self.step_button, self.play, self.reset_button]),
            self.speed,
            self.status, self.image])

        grid = self.fig.add_gridspec(2, 3, width_ratios=(0.06, 1.0, 0.95),
                                     height_ratios=(0.06, 1.0))
        self.ax_grid = self.fig.add_subplot(grid[1, 1])
        self.ax_q = self.fig.add_subplot(grid[1, 0], sharey=self.ax_grid)
        self.ax_kv = self.fig.add_subplot(grid[0, 1], sharex=self.ax_grid)
        self.ax_io = self.fig.add_subplot(grid[:, 2])

        self.position = 0
        self._syncing = False
        for control in (self.seq_len, self.block_m, self.block_n, self.head_dim, self.order,
                        self.causal):
            control.observe(lambda change: self.rebuild(), names="value")
        self.play.observe(self._on_play, names="value")
        self.play.observe(self._on_play_stopped, names=playing_trait(self.play))
        self.speed.observe(self._on_speed, names="value")
        self.step_button.on_click(lambda button: self.step())
        self.reset_button.on_click(lambda button: self.reset())
        self.rebuild()

    # -- the schedule ---------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        """``(T_r, T_c)``: the tile grid."""
        n = self.seq_len.value
        return iomodel.num_blocks(n, self.block_m.value), iomodel.num_blocks(n, self.block_n.value)

    @property
    def n_events(self) -> int:
        return len(self.events)

    @property
    def n_steps(self) -> int:
        """Steps from start to end (Step presses, Play frames at 1 step a frame): one per tile
        computed or output stored; skipped tiles cost none."""
        return len(self._stops) - 1

    @property
    def done(self) -> bool:
        return self.position >= self.n_events

    def rebuild(self) -> None:
        """Recompute the event list and the totals for the current controls; go back to step 0."""
        n, d = self.seq_len.value, self.head_dim.value
        bm, bn, causal, order = self.block_m.value, self.block_n.value, self.causal.value, self.order.value
        self.events = iomodel.tile_events(n, n, d, bm, bn, causal, order)
        self._kind = np.array([_KIND_CODE[e.kind] for e in self.events])  # (E,)
        self._qi = np.array([-1 if e.q_block is None else e.q_block for e in self.events])
        self._kj = np.array([-1 if e.kv_block is None else e.kv_block for e in self.events])
        self._counts = np.array([(e.reads, e.writes, e.flops) for e in self.events])  # (E, 3)
        # Where a step stops: after every event that is not a skip (a skipped tile is never
        # loaded, so it is shown together with the next thing the kernel does), and at the end.
        ends = [p for p in range(1, self.n_events + 1) if self._kind[p - 1] != SKIPPED]
        if not ends or ends[-1] != self.n_events:
            ends.append(self.n_events)
        self._stops = np.array([0] + ends)  # (steps + 1,) event positions
        self.total = iomodel.io_counts(order, n, n, d, bm, bn, causal)
        self.standard = iomodel.standard_io(n, n, d)
        self._init_artists()
        self._syncing = True
        self.play.max = self.n_steps
        self.play.value = 0
        self._syncing = False
        # Lay the figure out once per setting; steps only change data, so they keep that layout
        # (re-running constrained layout would double the cost of every frame).
        self.fig.set_layout_engine("constrained")
        self.goto(0)
        self.fig.set_layout_engine("none")

    # -- moving through it ----------------------------------------------------------------------

    def goto(self, position: int) -> None:
        """Show the state after ``position`` events (0 = nothing done yet)."""
        self.position = int(np.clip(position, 0, self.n_events))
        step = self.step_index
        if self.play.value != step:
            self._syncing = True
            self.play.value = step
            self._syncing = False
        self.redraw()

    @property
    def step_index(self) -> int:
        """Steps taken so far: the last stop at or before :attr:`position`."""
        return int(np.searchsorted(self._stops, self.position, side="right")) - 1

    def step(self) -> None:
        """Advance one step: to the next tile computed (passing, and marking, the hidden tiles
        before it) or the next output stored."""
        if not self.done:
            self.goto(self._stops[self.step_index + 1])

    def reset(self) -> None:
        """Back to the start, with the same settings."""
        self.goto(0)

    def _on_play(self, change) -> None:
        if not self._syncing:
            self.goto(self._stops[int(np.clip(change["new"], 0, self.n_steps))])

    def _on_play_stopped(self, change) -> None:
        # Play stops when its next frame would pass the end; with several steps a frame that
        # leaves up to (steps per frame - 1) steps undone, so finish them.
        play = self.play
        if not change["new"] and play.value < play.max and play.value + play.step > play.max:
            self.goto(self.n_events)

    def _on_speed(self, change) -> None:
        self.play.interval, self.play.step = change["new"]

    # -- what is drawn --------------------------------------------------------------------------

    def counts(self) -> tuple[int, int, int]:
        """``(reads, writes, flops)`` so far, elements and FLOPs."""
        if self.position == 0:
            return 0, 0, 0
        return tuple(int(x) for x in self._counts[self.position - 1])

    def current_event(self):
        """The last event replayed, or None at the start."""
        return self.events[self.position - 1] if self.position else None

    def grid_state(self) -> np.ndarray:
        """``(T_r, T_c)`` int array of TODO / DONE / SKIPPED / CURRENT after :attr:`position`."""
        state = np.full(self.shape, TODO, dtype=int)
        tiles = self._kind[:self.position] >= 0  # compute and skip events name a tile
        state[self._qi[:self.position][tiles], self._kj[:self.position][tiles]] = \
            self._kind[:self.position][tiles]
        event = self.current_event()
        if event is not None and event.kind == "compute":
            state[event.q_block, event.kv_block] = CURRENT
        return state

    def resident_blocks(self) -> tuple[int | None, int | None]:
        """``(q_block, kv_block)`` in SRAM now (None when none is)."""
        event = self.current_event()
        if event is None or event.kind == "finish":
            return None, None
        if event.kind == "store":
            return None, None
        if event.kind == "skip":  # FA2 keeps its Q tile; FA1 keeps its K/V tile
            return (event.q_block, None) if self.order.value == "fa2" else (None, event.kv_block)
        return event.q_block, event.kv_block

    def strip_states(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q_strip (T_r,), kv_strip (T_c,))`` of OUT / RESIDENT / FINISHED."""
        t_r, t_c = self.shape
        q_strip, kv_strip = np.full(t_r, OUT), np.full(t_c, OUT)
        if self.order.value == "fa2":
            stored = self._qi[:self.position][self._kind[:self.position] == -1]
            q_strip[stored[stored >= 0]] = FINISHED
        q_block, kv_block = self.resident_blocks()
        if q_block is not None:
            q_strip[q_block] = RESIDENT
        if kv_block is not None:
            kv_strip[kv_block] = RESIDENT
        return q_strip, kv_strip

    def tile_edges(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q_edges (T_r + 1,), kv_edges (T_c + 1,))``: where the tiles start and end, in rows of
        Q and of K/V; the last tile ends at N, so a ragged one is drawn narrower."""
        n = self.seq_len.value
        q_edges = np.minimum(np.arange(self.shape[0] + 1) * self.block_m.value, n)
        kv_edges = np.minimum(np.arange(self.shape[1] + 1) * self.block_n.value, n)
        return q_edges, kv_edges

    def tile_rectangles(self) -> tuple[np.ndarray, np.ndarray]:
        """``(heights (T_r,), widths (T_c,))`` of the tiles as drawn, read back from the figure's
        mesh (in query rows and key columns)."""
        corners = self.grid_image.get_coordinates()  # (T_r + 1, T_c + 1, 2): x, y of each corner
        return np.diff(corners[:, 0, 1]), np.diff(corners[0, :, 0])

    def _init_artists(self) -> None:
        t_r, t_c = self.shape
        n = self.seq_len.value
        for ax in (self.ax_grid, self.ax_q, self.ax_kv, self.ax_io):
            ax.clear()
        q_edges, kv_edges = self.tile_edges()
        # one rectangle per tile, in query/key positions: a ragged last tile has its real size
        self.grid_image = self.ax_grid.pcolormesh(kv_edges, q_edges, np.zeros((t_r, t_c)),
                                                  cmap=TILE_COLOURS, vmin=0, vmax=CURRENT,
                                                  edgecolors="white" if max(t_r, t_c) <= 32 else "none",
                                                  linewidth=0.8)
        self.ax_grid.set_xlim(0, n)
        self.ax_grid.set_ylim(n, 0)  # query 0 at the top, as in a matrix
        self.ax_grid.set_xlabel(f"K/V block j (BLOCK_N = {self.block_n.value}; T_c = {t_c})")
        self.ax_q.set_ylabel(f"Q block i (BLOCK_M = {self.block_m.value}; T_r = {t_r})")
        self.q_image = self.ax_q.pcolormesh([0, 1], q_edges, np.zeros((t_r, 1)),
                                            cmap=STRIP_COLOURS, vmin=0, vmax=FINISHED)
        self.kv_image = self.ax_kv.pcolormesh(kv_edges, [0, 1], np.zeros((1, t_c)),
                                              cmap=STRIP_COLOURS, vmin=0, vmax=FINISHED)
        # ticks name the blocks, at their centres; few of them (tick labels cost drawing time)
        for axis, edges in ((self.ax_grid.xaxis, kv_edges), (self.ax_grid.yaxis, q_edges)):
            blocks = np.arange(len(edges) - 1)[::max(1, -(-(len(edges) - 1) // MAX_TICKS))]
            axis.set_ticks((edges[blocks] + edges[blocks + 1]) / 2, [str(b) for b in blocks])
        self.ax_q.set_xticks([])
        self.ax_kv.set_yticks([])
        self.ax_kv.tick_params(labelbottom=False)
        self.ax_grid.tick_params(labelleft=False)
        self.ax_q.tick_params(labelleft=True)
        self.ax_kv.set_title("score tiles: in SRAM now (orange), done (blue), skipped (dark), "
                             "to do (light)", fontsize=PANEL_TITLE_FONTSIZE)

        # Linear scale: a bar's length is its share, so 11 k of 1.45 M reads looks like 1%.
        y = np.arange(2)  # row 0 (reads) at the top: the axis is inverted
        total = (self.total.reads, self.total.writes)
        standard = (self.standard.reads, self.standard.writes)
        algo = self._algo_name()
        self.ax_io.barh(y, total, BAR_HEIGHT, color="tab:blue", alpha=0.25)
        self.io_bars = self.ax_io.barh(y, [0, 0], BAR_HEIGHT, color="tab:blue")
        self.standard_marks = self.ax_io.vlines(standard, y - 0.7 * BAR_HEIGHT,
                                                y + 0.7 * BAR_HEIGHT, color="black",
                                                linewidth=2.5, zorder=3)
        # the numbers above each bar: "<so far> of <total>; standard attention <its total>"
        self.io_texts = [self.ax_io.annotate("", (0, row - BAR_HEIGHT / 2), xytext=(4, 3),
                                             textcoords="offset points", fontsize=SMALL_FONTSIZE,
                                             va="bottom", ha="left") for row in y]
        self.ax_io.set_yticks(y, ["HBM\nreads", "HBM\nwrites"])
        self.ax_io.set_ylim(len(y) - 0.5, -0.8)  # inverted, with room above row 0 for its text
        self.ax_io.set_xlim(0, IO_HEADROOM * max(*total, *standard))
        self.ax_io.xaxis.set_major_locator(MaxNLocator(IO_MAX_TICKS))
        self.ax_io.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _fmt(x)))
        self.ax_io.set_xlabel("elements moved (linear scale)")
        self.ax_io.set_title(f"HBM traffic, N = {self.seq_len.value}, d = {self.head_dim.value}",
                             fontsize=PANEL_TITLE_FONTSIZE)
        # legend from proxies: the ticks' own artists would draw a giant marker in the legend
        handles = [Patch(color="tab:blue", label=f"{algo} so far"),
                   Patch(color="tab:blue", alpha=0.25, label=f"{algo} total"),
                   Line2D([], [], color="black", marker="|", linestyle="none", markersize=10,
                          markeredgewidth=2.5, label="standard attention total")]
        self.ax_io.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                          fontsize=SMALL_FONTSIZE, ncol=2, frameon=False)

    def _skipped_this_step(self) -> int:
        """How many skipped tiles the last step passed over (they are shown with it)."""
        if self.position == 0:
            return 0
        kinds = self._kind[:self.position - 1][::-1]  # the events before the current one, newest first
        run = np.flatnonzero(kinds != SKIPPED)
        return int(run[0]) if run.size else len(kinds)

    def _algo_name(self) -> str:
        return self.order.value.upper()

    def _status_text(self) -> str:
        event = self.current_event()
        reads, writes, flops = self.counts()
        passed = self._skipped_this_step()
        if event is None:
            what = "Press Step or Play."
        elif event.kind == "compute":
            what = f"Tile (i={event.q_block}, j={event.kv_block}) computed in SRAM."
        elif event.kind == "skip":
            what = f"Tile (i={event.q_block}, j={event.kv_block}) skipped: the causal mask hides it."
        elif event.kind == "store":
            what = f"Q block {event.q_block} finished: o and lse written to HBM."
        else:
            what = "All tiles done; last pass wrote lse = m + log l."
        if passed and event is not None and event.kind != "skip":
            what += (f" On the way, {passed} tile{'s' if passed > 1 else ''} skipped (the causal "
                     f"mask hides {'them' if passed > 1 else 'it'}: never loaded, no step spent).")
        std = self.standard
        return (f"<b>Step {self.step_index} / {self.n_steps}</b> — {what}<br>"
                f"{self._algo_name()} so far: reads {_fmt(reads)}, writes {_fmt(writes)}, "
                f"FLOPs {_fmt(flops)} &nbsp;|&nbsp; {self._algo_name()} total: "
                f"{_fmt(self.total.reads)} / {_fmt(self.total.writes)} / {_fmt(self.total.flops)}"
                f" &nbsp;|&nbsp; standard attention: {_fmt(std.reads)} / {_fmt(std.writes)} / "
                f"{_fmt(std.flops)}")

    def redraw(self) -> None:
        """Update the arrays and bars for :attr:`position` and render the figure."""
        self.step_button.disabled = self.done
        self.status.value = self._status_text()
        self.grid_image.set_array(self.grid_state())
        q_strip, kv_strip = self.strip_states()
        self.q_image.set_array(q_strip[:, None])
        self.kv_image.set_array(kv_strip[None, :])
        reads, writes, _ = self.counts()
        totals = (self.total.reads, self.total.writes)
        standard = (self.standard.reads, self.standard.writes)
        for bar, text, so_far, total, std in zip(self.io_bars, self.io_texts, (reads, writes),
                                                 totals, standard):
            bar.set_width(so_far)
            text.set_text(f"{_fmt(so_far)} of {_fmt(total)}  (standard attention: {_fmt(std)})")
        self._render()
