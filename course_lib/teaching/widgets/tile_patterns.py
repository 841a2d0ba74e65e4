"""Tile-pattern picker (chapter 10): which tiles a mask makes the kernel compute, skip or mask.

Controls: *Pattern* (full, causal, sliding window, document, block-sparse, random block),
*Sequence length N*, *Tile size* (BLOCK_M = BLOCK_N), *Head dim d*, and the pattern's own
parameter: the window ``W`` (sliding window), the number of documents (document: equal
documents packed in one sequence, each causal), the density of the random block layout.

The figure shows the ``(T_r, T_c)`` grid of tile classes — skipped (light), partial (orange,
computed with the element mask), full (blue, computed without one). The text line gives the
counts, the density (visited tiles ÷ all tiles), the forward FLOPs of the visited tiles against
dense attention (every visited tile costs a full tile's matmuls, partial or not), and the time
measured on an H100 (``tools/bench_masks.py``, read by :mod:`course_lib.measure.mask_results`): the
recorded cell of the same pattern kind at the same N in float16 whose fraction of visited tiles
is closest to the picture's, forward and forward + backward, ours and FlexAttention. When no such
cell is recorded (block-sparse: local + global is not in the benchmark, nor are N = 1k and 2k)
it says so.

Tile classes come from indices (as a kernel decides them), never from an ``N × N`` mask, so the
picker stays fast at N = 32k. Without a browser: set a control's ``value``, then read
:attr:`classes`, :attr:`counts`, :attr:`flops`, :attr:`summary` ``.value``.

Usage::

    from course_lib.teaching.widgets.tile_patterns import TilePatterns
    TilePatterns()
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np

from course_lib.attention import costmodel, masks
from course_lib.measure import mask_results
from course_lib.attention.iomodel import num_blocks
from course_lib.attention.tiled import tile_bounds
from course_lib.teaching.widgets._display import TITLE_FONTSIZE, FigureWidget, control_layout

__all__ = ["TilePatterns", "PATTERNS", "BENCH_PATTERNS", "SEQ_LENS", "BLOCKS", "pattern_classes"]

PATTERNS = (("full (no mask)", "full"), ("causal", "causal"),
            ("sliding window", "sliding_window"), ("document (causal, packed)", "document"),
            ("block-sparse: local + global", "block_sparse"),
            ("random block layout", "random_block"))
# the benchmark's pattern kind for each of the picker's (None: not benchmarked)
BENCH_PATTERNS = {"full": "full", "causal": "causal", "sliding_window": "window",
                  "document": "documents", "block_sparse": None, "random_block": "random"}
SEQ_LENS = [2**p for p in range(10, 16)]  # 1k … 32k tokens
BLOCKS = (32, 64, 128)
HEAD_DIMS = (64, 128)
RANDOM_SEED = 10  # the random layout is the same for the same sizes and density


def _combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The classes of the logical *and* of two masks (exact when one of them is FULL or SKIP on
    each tile; otherwise a partial tile, which a kernel masks anyway)."""
    out = np.full(a.shape, masks.PARTIAL)
    out[(a == masks.SKIP) | (b == masks.SKIP)] = masks.SKIP
    out[(a == masks.FULL) & (b == masks.FULL)] = masks.FULL
    return out


def _document_classes(n: int, documents: int, block: int) -> np.ndarray:
    """Classes of "token i sees token j when both are in the same document", ``documents``
    documents of (nearly) equal length packed in ``n`` tokens, from the tiles' first and last
    rows and columns."""
    doc = np.minimum(np.arange(n) * documents // n, documents - 1)  # document of each token
    (r0, r1), (c0, c1) = tile_bounds(n, n, block, block)  # (T_r, 1), (1, T_c)
    d_r0, d_r1, d_c0, d_c1 = doc[r0], doc[r1], doc[c0], doc[c1]
    skip = (d_c1 < d_r0) | (d_c0 > d_r1)
    full = (d_r0 == d_r1) & (d_c0 == d_c1) & (d_r0 == d_c0)
    return np.where(skip, masks.SKIP, np.where(full, masks.FULL, masks.PARTIAL))


def pattern_classes(pattern: str, n: int, block: int, *, window: int = 1024,
                    documents: int = 4, density: float = 0.25) -> np.ndarray:
    """``(T_r, T_c)`` tile classes (SKIP / PARTIAL / FULL) of ``pattern`` at ``n`` tokens.

    Args:
        pattern: one of the values of :data:`PATTERNS`.
        n: tokens (N_q = N_k = n). block: BLOCK_M = BLOCK_N.
        window: W of the sliding window (causal, query i sees keys i − W < j ≤ i).
        documents: how many equal documents the document mask packs (each causal).
        density: the fraction of tiles the random block layout keeps (the diagonal always).
    """
    names = [value for _, value in PATTERNS]
    if pattern not in names:
        raise ValueError(f"pattern must be one of {', '.join(names)}, got {pattern!r}")
    t = num_blocks(n, block)
    if pattern == "full":
        return np.full((t, t), masks.FULL)
    causal = masks.sliding_window_tile_classes(n, n, n, block, block)
    if pattern == "causal":
        return causal
    if pattern == "sliding_window":
        return masks.sliding_window_tile_classes(n, n, window, block, block)
    if pattern == "document":
        return _combine(_document_classes(n, documents, block), causal)
    i, j = np.indices((t, t))
    if pattern == "block_sparse":  # a tile, its left neighbour, and the first tile (global)
        layout = (j == 0) | (j == i) | (j == i - 1)
    else:  # random_block
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        layout = (np.random.default_rng(RANDOM_SEED).random((t, t)) < density) | (i == j)
    return np.where(layout, masks.FULL, masks.SKIP)


class TilePatterns(FigureWidget):
    """Computed / skipped / partial tiles of a mask pattern, its FLOPs and its recorded time.

    Attributes:
        pattern, seq_len, block, head_dim, window, documents, density: the controls.
        summary: the text (HTML); image: the rendered figure (PNG bytes in ``.value``).
        classes: the current ``(T_r, T_c)`` tile classes; counts: :func:`masks.tile_counts`;
        flops: ``{"visited": …, "dense": …}`` forward FLOPs; recorded: the H100 row shown (ours,
        forward), or None. results: the recorded data (None when not recorded).
    """

    def __init__(self, pattern: str = "causal", seq_len: int = 4096, block: int = 128,
                 head_dim: int = 64, window: int = 1024, documents: int = 4,
                 density: float = 0.25, results_path=mask_results.RECORDED_FILE):
        self.results = mask_results.recorded(results_path)
        self.pattern = widgets.Dropdown(options=PATTERNS, value=pattern, description="Pattern",
                                        **control_layout())
        self.seq_len = widgets.SelectionSlider(options=SEQ_LENS, value=seq_len,
                                               description="Sequence length N", **control_layout())
        self.block = widgets.ToggleButtons(options=BLOCKS, value=block, description="Tile size",
                                           **control_layout(button_width="60px"))
        self.head_dim = widgets.ToggleButtons(options=HEAD_DIMS, value=head_dim,
                                              description="Head dim d",
                                              **control_layout(button_width="60px"))
        self.window = widgets.SelectionSlider(options=[2**p for p in range(7, 15)], value=window,
                                              description="Window W", **control_layout())
        self.documents = widgets.IntSlider(value=documents, min=1, max=16,
                                           description="Documents", **control_layout())
        self.density = widgets.FloatSlider(value=density, min=0.05, max=1.0, step=0.05,
                                           description="Random density", **control_layout())
        self.summary = widgets.HTML()
        fig = self._new_figure()
        self.ax = fig.add_subplot()
        for control in self.controls:
            control.observe(lambda _: self.update(), names="value")
        self.update()

    @property
    def controls(self):
        return (self.pattern, self.seq_len, self.block, self.head_dim, self.window,
                self.documents, self.density)

    def update(self) -> None:
        n, block, d = self.seq_len.value, self.block.value, self.head_dim.value
        self.classes = pattern_classes(self.pattern.value, n, block, window=self.window.value,
                                       documents=self.documents.value,
                                       density=self.density.value)
        self.counts = masks.tile_counts(self.classes)
        visited = self.counts["partial"] + self.counts["full"]
        tile_flops = costmodel.attention_flops(1, 1, 1, d) * block * block  # 4·d per score
        self.flops = {"visited": visited * tile_flops, "dense": self.counts["total"] * tile_flops}
        self.density_visited = visited / self.counts["total"]
        self.recorded = None
        kind = BENCH_PATTERNS[self.pattern.value]
        if self.results is not None and kind is not None:
            self.recorded = mask_results.time_for(self.results, kind, n,
                                                  tile_density=self.density_visited)
        self.window.layout.display = "" if self.pattern.value == "sliding_window" else "none"
        self.documents.layout.display = "" if self.pattern.value == "document" else "none"
        self.density.layout.display = "" if self.pattern.value == "random_block" else "none"
        self._draw()
        self.summary.value = self._summary_text()

    def _draw(self) -> None:
        import matplotlib.colors as mcolors

        ax = self.ax
        ax.clear()
        colours = mcolors.ListedColormap(["0.9", "tab:orange", "tab:blue"])
        ax.imshow(self.classes, cmap=colours, vmin=masks.SKIP, vmax=masks.FULL,
                  interpolation="nearest")
        c = self.counts
        ax.set_title(f"{dict((v, k) for k, v in PATTERNS)[self.pattern.value]}, N = "
                     f"{self.seq_len.value:,}, tiles of {self.block.value}: {c['full']:,} full "
                     f"(blue), {c['partial']:,} partial (orange), {c['skipped']:,} skipped",
                     fontsize=TITLE_FONTSIZE)
        ax.set_xlabel("K/V tile j")
        ax.set_ylabel("Q tile i")
        self._render()

    def _summary_text(self) -> str:
        f = self.flops
        text = (f"visited {self.density_visited:.1%} of the tiles: forward "
                f"{f['visited'] / 1e9:,.2f} GFLOP per head against {f['dense'] / 1e9:,.2f} "
                f"dense ({f['dense'] / max(f['visited'], 1):.1f}× fewer)")
        if self.results is None:
            return text + "<br>measured time: no H100 results are recorded yet for chapter 10"
        if self.recorded is None:
            return text + (f"<br>measured time: no H100 result recorded for this pattern at N = "
                           f"{self.seq_len.value:,}")
        r = self.recorded
        times = []
        for pass_ in mask_results.PASSES:
            ours = mask_results.cell(self.results, "course", {**r, "pass": pass_})
            flex = mask_results.cell(self.results, "flex", {**r, "pass": pass_})
            if ours is not None:
                times.append(f"{mask_results.PASS_NAMES[pass_]}: ours {ours['ms']:.3g} ms"
                             + (f", FlexAttention {flex['ms']:.3g} ms" if flex else ""))
        return text + (f"<br>measured on {self.results['meta']['gpu']}, nearest recorded mask "
                       f"\"{r['label']}\" ({r['tile_density']:.0%} of the tiles, {r['dtype']}, "
                       f"d = {r.get('d', '?')}): " + "; ".join(times))

    def widget(self):
        left = widgets.VBox([self.pattern, self.seq_len, self.block])
        right = widgets.VBox([self.head_dim, self.window, self.documents, self.density])
        return widgets.VBox([widgets.HBox([left, right]), self.image, self.summary])
