"""Chapter 01 widget: how much memory naive attention needs as the sequence grows.

Sliders for N, d, heads and batch; dropdowns for the dtype and the GPU. A log-log plot shows
the quadratic term (the ``N × N`` score matrices), the linear term (Q, K, V and O), their sum,
the GPU's memory as a horizontal line, and the largest N that still fits.

Usable without a browser (that is how the tests drive it)::

    w = MemoryWidget()
    w.heads.value = 32          # observers fire synchronously and redraw
    w.max_n                     # largest N that fits on the chosen GPU
    w.lines["quadratic"].get_ydata()
    w.widget()                  # the ipywidgets box to display in a notebook

The figure is rendered to PNG in ``w.image`` after every change (see ``_display``).
"""

from __future__ import annotations

import numpy as np

from course_lib.attention import costmodel
from course_lib.platform import hardware
from course_lib.teaching.widgets._display import (SMALL_FONTSIZE, TITLE_FONTSIZE, FigureWidget,
                                        control_layout)

__all__ = ["MemoryWidget", "SEQ_LENS", "HEAD_DIMS", "format_tick"]

SEQ_LENS = [2**p for p in range(8, 21)]  # 256 … 1,048,576 tokens
HEAD_DIMS = [32, 64, 80, 96, 128, 256]
DTYPES = ["float16", "bfloat16", "float32"]
MAX_HEADS, MAX_BATCH = 128, 64
READOUT_FORMAT = ",d"  # 8,192 in the read-outs, as in the summary and the title
BYTES_PER_TICK = 1024  # y ticks at KiB, MiB, GiB, ...: the axis ends on one at both ends
# The curve is drawn over a wider range than the slider so the crossing is visible off-slider too.
_CURVE_N = np.logspace(np.log2(SEQ_LENS[0]), np.log2(4 * SEQ_LENS[-1]), 200, base=2)


def format_tokens(n: float) -> str:
    """Axis label for a token count: 256, 1K, 64K, 1M."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}"


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def format_tick(y: float) -> str:
    """Y tick label: "1 GiB" at a power of 1024 (where the ticks are), else format_bytes."""
    tick, unit = 1, 0
    while tick < y and unit < len(_BINARY_UNITS) - 1:
        tick, unit = tick * BYTES_PER_TICK, unit + 1
    return f"1 {_BINARY_UNITS[unit]}" if tick == y else costmodel.format_bytes(y)


def _tick_below(y: float) -> float:
    """The largest power of 1024 ≤ y, at least 1 (exact: no floating-point logarithm)."""
    tick = 1
    while tick * BYTES_PER_TICK <= y:
        tick *= BYTES_PER_TICK
    return float(tick)


def _tick_above(y: float) -> float:
    """The smallest power of 1024 ≥ y."""
    tick = 1
    while tick < y:
        tick *= BYTES_PER_TICK
    return float(tick)


class MemoryWidget(FigureWidget):
    """Memory of naive attention (one layer's forward: Q, K, V, O and the N×N matrices) vs N.

    Attributes:
        seq_len, head_dim, heads, batch, dtype, gpu: the ipywidgets controls.
        fig, ax: the matplotlib figure and axes; ``lines`` maps ``"quadratic"``, ``"linear"``,
            ``"total"``, ``"gpu"``, ``"limit"``, ``"current"`` to their Line2D.
        summary: the text line (HTML); image: the rendered figure (PNG bytes in ``.value``).
        memory: the :class:`~course_lib.attention.costmodel.MemoryBreakdown` at the current N.
        max_n: the largest N whose total fits in the GPU's memory.
    """

    def __init__(self, seq_len: int = 4096, head_dim: int = 64, heads: int = 16, batch: int = 1,
                 dtype: str = "float16", gpu: str = hardware.DEFAULT_GPU,
                 score_matrices: int = 1):
        import ipywidgets as W
        from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

        if seq_len not in SEQ_LENS:
            raise ValueError(f"seq_len must be one of {SEQ_LENS[0]}, {SEQ_LENS[1]}, …, "
                             f"{SEQ_LENS[-1]} (powers of two), got {seq_len!r}")
        gpu = hardware.get_gpu(gpu).name
        self.score_matrices = score_matrices
        # (label, value) options: the read-out shows 8,192, the value stays the int 8192
        self.seq_len = W.SelectionSlider(options=[(f"{n:,}", n) for n in SEQ_LENS],
                                         value=seq_len, description="sequence length N",
                                         continuous_update=False, **control_layout())
        self.head_dim = W.SelectionSlider(options=HEAD_DIMS, value=head_dim,
                                          description="head dim d", **control_layout())
        self.heads = W.IntSlider(value=heads, min=1, max=MAX_HEADS, description="heads H",
                                 readout_format=READOUT_FORMAT, continuous_update=False,
                                 **control_layout())
        self.batch = W.IntSlider(value=batch, min=1, max=MAX_BATCH, description="batch B",
                                 readout_format=READOUT_FORMAT, continuous_update=False,
                                 **control_layout())
        self.dtype = W.Dropdown(options=DTYPES, value=hardware.normalize_dtype(dtype),
                                description="dtype", **control_layout())
        self.gpu = W.Dropdown(options=hardware.gpu_names(), value=gpu, description="GPU",
                              **control_layout())
        self.summary = W.HTML()

        self.ax = ax = self._new_figure().add_subplot()
        self.lines = {
            "quadratic": ax.plot([], [], color="tab:red", lw=2.5, label="N×N score matrices")[0],
            "linear": ax.plot([], [], color="tab:cyan", lw=2.5, label="Q, K, V, O")[0],
            "total": ax.plot([], [], color="black", lw=1, ls=":", label="total")[0],
            "gpu": ax.axhline(1, color="tab:purple", lw=1.5, ls="--", label="GPU memory"),
            "limit": ax.axvline(1, color="tab:purple", lw=1, ls=":"),
            "current": ax.plot([], [], "o", color="black", ms=7, label="chosen N")[0],
        }
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_tokens(x)))
        ax.yaxis.set_major_locator(LogLocator(base=BYTES_PER_TICK))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: format_tick(y)))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_ylabel("memory")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="upper left", fontsize=SMALL_FONTSIZE)

        for control in self.controls:
            control.observe(self._on_change, names="value")
        self.update()

    @property
    def controls(self):
        return [self.seq_len, self.head_dim, self.heads, self.batch, self.dtype, self.gpu]

    def _memory(self, n) -> costmodel.MemoryBreakdown:
        return costmodel.attention_memory(
            int(n), self.head_dim.value, self.dtype.value, batch=self.batch.value,
            heads=self.heads.value, score_matrices=self.score_matrices)

    def _on_change(self, _change=None):
        self.update()

    def update(self) -> None:
        """Recompute the model for the controls' values and redraw."""
        spec = hardware.get_gpu(self.gpu.value)
        curves = [self._memory(n) for n in _CURVE_N]
        quadratic = np.array([m.score_bytes for m in curves], dtype=float)
        linear = np.array([m.linear_bytes for m in curves], dtype=float)
        self.lines["quadratic"].set_data(_CURVE_N, quadratic)
        self.lines["linear"].set_data(_CURVE_N, linear)
        self.lines["total"].set_data(_CURVE_N, quadratic + linear)
        self.lines["gpu"].set_ydata([spec.memory_bytes] * 2)
        self.max_n = costmodel.max_seq_len(
            spec.memory_bytes, self.head_dim.value, self.dtype.value, batch=self.batch.value,
            heads=self.heads.value, score_matrices=self.score_matrices)
        self.lines["limit"].set_xdata([max(self.max_n, 1)] * 2)
        self.memory = self._memory(self.seq_len.value)
        self.lines["current"].set_data([self.seq_len.value], [self.memory.total_bytes])

        self.ax.set_xlim(_CURVE_N[0], _CURVE_N[-1])
        # Both ends on a tick (a power of 1024), so the lowest and highest tick labels always
        # show, whatever the heads, batch or GPU.
        low = _tick_below(linear.min())
        high = _tick_above(max(quadratic.max(), spec.memory_bytes))
        self.ax.set_ylim(low, high)
        fits = self.memory.total_bytes <= spec.memory_bytes
        verdict = "fits in" if fits else '<span style="color:red">does not fit in</span>'
        heads = self.heads.value
        self.ax.set_title(
            f"batch {self.batch.value} × {heads} head{'s' if heads > 1 else ''}, "
            f"d = {self.head_dim.value}, "
            f"{self.dtype.value}: naive attention runs out of {spec.name} memory at "
            f"N ≈ {self.max_n:,}", fontsize=TITLE_FONTSIZE)
        self.summary.value = (
            f"At N = {self.seq_len.value:,}: score matrices "
            f"<b>{costmodel.format_bytes(self.memory.score_bytes)}</b>, Q/K/V/O "
            f"<b>{costmodel.format_bytes(self.memory.linear_bytes)}</b> — "
            f"{verdict} "
            f"{spec.name}'s {spec.memory_gb:g} GB.")
        self._render()

    def widget(self):
        """The controls, a one-line summary and the figure, as one ipywidgets box."""
        import ipywidgets as W

        return W.VBox([W.HBox([W.VBox(self.controls[:4]), W.VBox(self.controls[4:])]),
                       self.summary, self.image])

