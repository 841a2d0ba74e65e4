"""Ring stepper (chapter 11): step the ring of ranks and watch who holds what.

Controls: *Ranks W* slider, *Layout* (contiguous or zig-zag shards), *Causal* checkbox, *Next
step* and *Reset* buttons. After each step the figure shows

* left — the ``N × N`` (query, key) grid of the whole sequence: each pair coloured by the rank
  whose queries it belongs to, dark where it was computed at the step just done, light where
  computed at an earlier step, grey where not yet, white where the causal mask hides it;
* right — the ring: each rank with the chunks of the sequence it holds, the K/V shard it just
  used, and an arrow to the next rank labelled with the shard in flight while it computed;

and a table gives, for the last query row of each rank's shard, the running softmax state
``(m, l)`` after the steps done (chapter 03's :func:`course_lib.attention.softmax.online_update` on the
scores of the blocks seen so far): after the last step ``m + log l`` is the row's log-sum-exp.

Drive it without a browser: ``click()`` the buttons or set the controls, then read
:attr:`steps_done`, :meth:`held`, :meth:`in_flight`, :meth:`running_state`, :meth:`computed`.
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np

from course_lib.integrations import ring
from course_lib.attention import softmax
from course_lib.teaching.widgets._display import (PANEL_TITLE_FONTSIZE, SMALL_FONTSIZE, FigureWidget,
                                        control_layout)

TOKENS_PER_RANK = 4  # two zig-zag chunks of 2: small enough to see every pair on the grid
MAX_WORLD = 8
HIDDEN, NOT_YET = -2, -1  # grid codes; 0 … W-1: computed at that step
NOT_YET_GREY = "0.85"  # pairs of later steps
# One colour per rank: tab10 without its grey (index 7), which would read as "a later step".
RANK_COLOURS = tuple(i for i in range(10) if i != 7)
EARLIER_ALPHA = 0.35  # pairs computed at earlier steps: the rank's colour, light
RING_RADIUS = 1.0  # the ranks sit on this circle (data units of the right panel)
RANK_MARKER_SIZE = 900  # points²: a circle 30 points across
LABEL_OFFSET_POINTS = 24  # a rank's label starts this far from its centre, outwards: off the circle
ARROW_RADIUS = 0.8  # the arrows between neighbours, inside the ring of ranks
ARROW_LABEL_RADIUS = 0.45  # their labels: inside the arrows' arcs, half-way between two ranks


class RingStepper(FigureWidget):
    """The ring of ``world`` ranks, one step at a time.

    Args:
        world: number of ranks (2 … :data:`MAX_WORLD`).
        layout: ``"contiguous"`` or ``"zigzag"`` (:data:`course_lib.integrations.ring.LAYOUTS`).
        causal: the causal mask over the whole sequence.
        seed: seed of the random queries and keys whose scores feed the running ``(m, l)``.
    """

    def __init__(self, world: int = 4, layout: str = "zigzag", causal: bool = True, seed: int = 0):
        if layout not in ring.LAYOUTS:
            raise ValueError(f"layout must be one of {ring.LAYOUTS}, got {layout!r}")
        if isinstance(world, bool) or not isinstance(world, int) or not 2 <= world <= MAX_WORLD:
            raise ValueError(f"world must be an int from 2 to {MAX_WORLD}, got {world!r}")
        self.seed = seed
        self.steps_done = 0
        self.world_slider = widgets.IntSlider(value=world, min=2, max=MAX_WORLD,
                                              description="Ranks W", continuous_update=False,
                                              **control_layout())
        self.layout_buttons = widgets.ToggleButtons(options=ring.LAYOUTS, value=layout,
                                                    description="Layout", **control_layout())
        self.causal_box = widgets.Checkbox(value=causal, description="Causal")
        self.next_button = widgets.Button(description="Next step", icon="step-forward",
                                          button_style="primary")
        self.reset_button = widgets.Button(description="Reset", icon="undo")
        self.status = widgets.HTML()
        self._new_figure()
        self.ax_grid, self.ax_ring = self.fig.subplots(1, 2, width_ratios=(1.0, 1.25))
        self.widget = widgets.VBox([
            widgets.HBox([self.world_slider, self.layout_buttons]),
            widgets.HBox([self.causal_box, self.next_button, self.reset_button]),
            self.status, self.image])
        for control in (self.world_slider, self.layout_buttons, self.causal_box):
            control.observe(lambda change: self.reset(), names="value")
        self.next_button.on_click(lambda button: self.step())
        self.reset_button.on_click(lambda button: self.reset())
        self.reset()

    # -- state ---------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        return self.world_slider.value

    @property
    def layout(self) -> str:
        return self.layout_buttons.value

    @property
    def causal(self) -> bool:
        return self.causal_box.value

    @property
    def n(self) -> int:
        return TOKENS_PER_RANK * self.world

    @property
    def done(self) -> bool:
        return self.steps_done == self.world

    def positions(self, rank: int) -> np.ndarray:
        """The sequence positions of ``rank``'s shard, in the order it stores them."""
        bounds = ring.chunk_bounds(self.n, self.world, self.layout)
        return np.concatenate([np.arange(*bounds[c]) for c in ring.rank_chunks(self.world, self.layout)[rank]])

    def held(self, step: int | None = None) -> list[int]:
        """Whose K/V shard each rank uses at ``step`` (default: the step just done)."""
        step = max(self.steps_done - 1, 0) if step is None else step
        return [ring.ring_source(r, step, self.world) for r in range(self.world)]

    def in_flight(self) -> list[tuple[int, int, int]]:
        """``(from, to, shard)`` sent while the step just done computed (none at the last step)."""
        if self.steps_done == 0 or self.steps_done == self.world:
            return []
        held = self.held()
        return [(r, (r + 1) % self.world, held[r]) for r in range(self.world)]

    def _grid(self) -> np.ndarray:
        """``(N, N)``: the step at which each (query, key) pair is computed, or HIDDEN."""
        grid = np.full((self.n, self.n), HIDDEN)
        chunks = ring.rank_chunks(self.world, self.layout)
        lengths = ring.shard_chunk_lengths([TOKENS_PER_RANK] * self.world, self.layout)
        for r in range(self.world):
            for step in range(self.world):
                src = ring.ring_source(r, step, self.world)
                plan = ring.block_plan(chunks[r], chunks[src], self.causal, lengths[r], lengths[src])
                if plan is None:
                    continue
                rows, cols = self.positions(r)[plan.rows], self.positions(src)[plan.cols]
                visible = np.ones((len(rows), len(cols)), dtype=bool)
                if plan.causal:
                    visible = np.tril(visible)
                block = grid[np.ix_(rows, cols)]
                grid[np.ix_(rows, cols)] = np.where(visible, step, block)
        return grid

    def computed(self) -> np.ndarray:
        """``(N, N)`` bool: the pairs computed in the steps done so far."""
        grid = self._grid()
        return (grid >= 0) & (grid < self.steps_done)

    def running_state(self) -> list[tuple[float, float]]:
        """``(m, l)`` of the last query row of each rank's shard after the steps done."""
        states = []
        grid = self._grid()
        for r in range(self.world):
            row = self.positions(r)[-1]
            m, l = np.float64(-np.inf), np.float64(0.0)
            for step in range(self.steps_done):
                seen = grid[row] == step
                if seen.any():
                    m, l = softmax.online_update(m, l, self.scores[row, seen])
            states.append((float(m), float(l)))
        return states

    # -- actions -------------------------------------------------------------------------------

    def reset(self) -> None:
        rng = np.random.default_rng(self.seed)
        q, k = rng.normal(size=(2, self.n, 4))
        self.scores = q @ k.T  # (N, N) the scores the running (m, l) folds in
        self.steps_done = 0
        self.redraw()

    def step(self) -> None:
        """Do the next ring step (nothing after the last)."""
        if not self.done:
            self.steps_done += 1
        self.redraw()

    def run_to_end(self) -> None:
        self.steps_done = self.world
        self.redraw()

    # -- drawing -------------------------------------------------------------------------------

    def idle(self) -> list[bool]:
        """Which ranks computed nothing at the step just done (the causal mask hid the block)."""
        if self.steps_done == 0:
            return [False] * self.world
        step = self.steps_done - 1
        chunks = ring.rank_chunks(self.world, self.layout)
        lengths = ring.shard_chunk_lengths([TOKENS_PER_RANK] * self.world, self.layout)
        return [ring.block_plan(chunks[r], chunks[src], self.causal, lengths[r], lengths[src]) is None
                for r, src in enumerate(self.held(step))]

    def step_title(self) -> str:
        """The steps done, numbered from 0 as in the chapter's table of who holds what."""
        if self.steps_done == 0:
            return f"Before step 0 (steps 0 to {self.world - 1})"
        return f"Step {self.steps_done - 1} done (steps 0 to {self.world - 1})"

    def _status_text(self) -> str:
        head = (f"<b>{self.step_title()}</b> — {self.world} ranks, "
                f"{self.layout} shards of {TOKENS_PER_RANK} tokens, "
                f"{'causal' if self.causal else 'no mask'}")
        rows = "".join(
            f"<tr><td>rank {r}</td><td>{'−inf' if np.isinf(m) else f'{m:.3f}'}</td>"
            f"<td>{l:.4f}</td></tr>" for r, (m, l) in enumerate(self.running_state()))
        table = (f"<table><tr><th>last query row of</th><th>running max m</th>"
                 f"<th>running sum l</th></tr>{rows}</table>")
        return f"{head}<br>{table}"

    def redraw(self) -> None:
        from matplotlib.colors import to_rgba
        import matplotlib

        self.next_button.disabled = self.done
        self.status.value = self._status_text()
        tab10 = matplotlib.colormaps["tab10"]

        def colours(r):
            return tab10(RANK_COLOURS[r % len(RANK_COLOURS)])

        grid = self._grid()
        image = np.ones((self.n, self.n, 4))
        for r in range(self.world):
            for row in self.positions(r):
                for col in range(self.n):
                    s = grid[row, col]
                    if s == HIDDEN:
                        continue
                    if s >= self.steps_done:
                        image[row, col] = to_rgba(NOT_YET_GREY)
                    else:
                        alpha = 1.0 if s == self.steps_done - 1 else EARLIER_ALPHA
                        image[row, col] = to_rgba(colours(r), alpha)
        ax = self.ax_grid
        ax.clear()
        ax.imshow(image, interpolation="nearest")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ax.set_title("pairs computed (colour: the rank of the query)", fontsize=PANEL_TITLE_FONTSIZE)

        ax = self.ax_ring
        ax.clear()
        angles = np.pi / 2 - 2 * np.pi * np.arange(self.world) / self.world
        xy = RING_RADIUS * np.stack([np.cos(angles), np.sin(angles)], axis=1)
        chunks = ring.rank_chunks(self.world, self.layout)
        held = self.held() if self.steps_done else [None] * self.world
        idle = self.idle()
        for src, dst, shard in self.in_flight():
            start, end = xy[src] * ARROW_RADIUS, xy[dst] * ARROW_RADIUS
            ax.annotate("", xy=end, xytext=start,
                        arrowprops=dict(arrowstyle="->", color="0.3", connectionstyle="arc3,rad=-0.25"))
            between = angles[src] - np.pi / self.world  # half-way to the next rank, clockwise
            ax.text(*(ARROW_LABEL_RADIUS * np.array([np.cos(between), np.sin(between)])),
                    f"K/V {shard}", ha="center", va="center", fontsize=SMALL_FONTSIZE,
                    gid="in flight")
        for r in range(self.world):
            ax.scatter(*xy[r], s=RANK_MARKER_SIZE, color=colours(r), alpha=0.8, gid=f"rank {r}")
            ax.text(*xy[r], str(r), ha="center", va="center", fontsize=10, color="white",
                    weight="bold")
            if held[r] is None:
                used = "—"
            elif idle[r]:
                used = f"holds K/V {held[r]}, idle (masked)"
            else:
                used = f"used K/V {held[r]}"
            direction = np.array([np.cos(angles[r]), np.sin(angles[r])])
            ha = "center" if abs(direction[0]) < 0.3 else ("left" if direction[0] > 0 else "right")
            va = "center" if abs(direction[1]) < 0.3 else ("bottom" if direction[1] > 0 else "top")
            ax.annotate(f"chunks {', '.join(map(str, chunks[r]))}\n{used}", xy[r],
                        xytext=tuple(direction * LABEL_OFFSET_POINTS), textcoords="offset points",
                        ha=ha, va=va, fontsize=SMALL_FONTSIZE, gid=f"label {r}")
        ax.set_xlim(-2.0, 2.0)
        ax.set_ylim(-1.6, 1.6)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title("the ring: shards held and K/V in flight", fontsize=PANEL_TITLE_FONTSIZE)
        self._render()
