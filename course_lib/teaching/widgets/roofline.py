"""Chapter 02 widget: an arithmetic-intensity calculator with a roofline plot.

Pick N, d, the dtype and the GPU. The left panel is the GPU's roofline (attainable FLOP/s =
``min(peak, intensity × bandwidth)``, log-log) with each of the five kernels of standard attention
placed on it as a labelled point, red when memory-bound (left of the balance point) and green
when compute-bound. The right panel shows each kernel's time as the roofline predicts it, split
into the time its bytes need and the time its FLOPs need: for the memory-bound steps the first bar
dwarfs the second.

Testable without a browser::

    w = RooflineWidget()
    w.seq_len.value = 16384
    w.points["softmax"]            # (intensity, attainable FLOP/s)
    w.memory_bound["softmax"]      # True

The figure is rendered to PNG in ``w.image`` after every change (see ``_display``).
"""

from __future__ import annotations

import numpy as np

from course_lib.attention import costmodel
from course_lib.platform import hardware
from course_lib.teaching.widgets._display import (SMALL_FONTSIZE, TITLE_FONTSIZE, FigureWidget,
                                        control_layout)

__all__ = ["RooflineWidget", "SEQ_LENS", "HEAD_DIMS", "REFERENCE_MATMUL", "label_collides"]

SEQ_LENS = [2**p for p in range(7, 18)]  # 128 … 131,072
HEAD_DIMS = [32, 64, 80, 96, 128, 256]
DTYPES = ["float16", "bfloat16", "float32"]
REFERENCE_MATMUL = 8192  # the reading's "large matmul" (8192 × 8192) · (8192 × 8192)
_INTENSITY_RANGE = (0.05, 1e4)  # FLOP/byte shown on the x axis
MEMORY_COLOR, COMPUTE_COLOR = "tab:red", "tab:green"
# Where a point's label may go, in order of preference: (offset in points, ha, va). Points on the
# slope read best with the label below-right of them (under the roof, clear of the balance line);
# points on the flat roof with it above (over the roof) or below-right. The first place that
# touches no line, axis, marker or other label is taken (see RooflineWidget._place_labels).
_SLOPE_PLACES = (((8, -5), "left", "top"), ((-8, 5), "right", "bottom"),
                 ((8, -16), "left", "top"), ((-8, 16), "right", "bottom"),
                 ((0, -10), "center", "top"), ((0, 10), "center", "bottom"))
_ROOF_PLACES = (((0, 8), "center", "bottom"), ((8, -6), "left", "top"),
                ((-8, 8), "right", "bottom"), ((0, -10), "center", "top"),
                ((8, -20), "left", "top"), ((-8, -6), "right", "top"),
                ((0, -30), "center", "top"), ((-8, -26), "right", "top"))
_CLEARANCE_PX = 3  # a label keeps this far from lines, axes and other labels
_MARKER_RADIUS_PX = 6  # a point's marker (ms=8 points) with its edge, at 100 dpi


def _fmt(intensity: float) -> str:
    return f"{intensity:,.0f}" if intensity >= 100 else f"{intensity:.3g}"


# Decimal prefixes for the table's columns, as datasheets quote them: GFLOP and GB, or MFLOP
# and MB when the largest entry is below one G (small N).
_PREFIXES = ((1e9, "G"), (1e6, "M"))


def _unit(largest: float, base: str) -> tuple[str, float]:
    """The unit a table column is shown in: GFLOP / GB, or MFLOP / MB for small sizes."""
    for scale, prefix in _PREFIXES:
        if largest >= scale:
            return prefix + base, scale
    return _PREFIXES[-1][1] + base, _PREFIXES[-1][0]


def _num(x: float) -> str:
    """A table number: thousands separators, three significant digits below 100."""
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if x >= 0.01 else f"{x:.2e}"


def label_collides(box, axes_box, balance_x: float, roof_px, markers_px, others) -> bool:
    """Whether a label's box (display pixels) leaves the axes or touches the balance line, the
    roof (its points ``roof_px``), a marker or another label's box."""
    pad = _CLEARANCE_PX
    if (box.x0 < axes_box.x0 + pad or box.x1 > axes_box.x1 - pad
            or box.y0 < axes_box.y0 + pad or box.y1 > axes_box.y1 - pad):
        return True
    if box.x0 - pad <= balance_x <= box.x1 + pad:
        return True
    grown = box.padded(pad)
    if grown.count_contains(roof_px):
        return True
    if box.padded(_MARKER_RADIUS_PX).count_contains(markers_px):
        return True
    return any(grown.overlaps(other) for other in others)


class RooflineWidget(FigureWidget):
    """Roofline of a GPU with the five kernels of standard attention on it.

    Attributes:
        seq_len, head_dim, dtype, gpu: the ipywidgets controls.
        costs: ``{step: StepCost}`` for the current controls (per head).
        points: ``{step: (intensity FLOP/byte, attainable FLOP/s)}``; also ``"matmul 8192³"``.
        memory_bound: ``{step: bool}``.
        balance: the GPU's balance point for the dtype, FLOP/byte.
        fig, ax, ax_time; ``markers[step]`` the Line2D of each point; ``roof`` the roof line.
        table: the per-step costs (HTML); image: the rendered figure (PNG bytes in ``.value``).
    """

    def __init__(self, seq_len: int = 1024, head_dim: int = 64, dtype: str = "float16",
                 gpu: str = hardware.DEFAULT_GPU):
        import ipywidgets as W

        if seq_len not in SEQ_LENS:
            raise ValueError(f"seq_len must be a power of two from {SEQ_LENS[0]} to "
                             f"{SEQ_LENS[-1]}, got {seq_len!r}")
        # (label, value) options: the read-out shows 131,072 like the titles; the value is the int
        self.seq_len = W.SelectionSlider(options=[(f"{n:,}", n) for n in SEQ_LENS],
                                         value=seq_len, description="sequence length N",
                                         **control_layout())
        self.head_dim = W.SelectionSlider(options=HEAD_DIMS, value=head_dim,
                                          description="head dim d", **control_layout())
        self.dtype = W.Dropdown(options=DTYPES, value=hardware.normalize_dtype(dtype),
                                description="dtype", **control_layout())
        self.gpu = W.Dropdown(options=hardware.gpu_names(), value=hardware.get_gpu(gpu).name,
                              description="GPU", **control_layout())
        self.table = W.HTML()

        self.ax, self.ax_time = self._new_figure().subplots(
            1, 2, gridspec_kw={"width_ratios": [3, 2]})
        ax = self.ax
        self.roof = ax.plot([], [], color="black", lw=2, label="roofline")[0]
        self.balance_line = ax.axvline(1, color="tab:gray", ls="--", lw=1)
        self.memory_region = None
        self.markers, self.labels = {}, {}
        for name in (*costmodel.STEPS, "matmul"):
            self.markers[name] = ax.plot([], [], "o", ms=8, mec="black")[0]
            self.labels[name] = ax.annotate("", (1, 1), textcoords="offset points",
                                            xytext=_SLOPE_PLACES[0][0],
                                            fontsize=SMALL_FONTSIZE)
            self.labels[name].set_in_layout(False)  # placed after the layout, not part of it
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte of HBM traffic)")
        ax.set_ylabel("attainable TFLOP/s")
        ax.grid(True, which="major", alpha=0.3)
        self.ax_time.set_xlabel("predicted time per head (µs)")

        for control in self.controls:
            control.observe(self._on_change, names="value")
        self.update()

    @property
    def controls(self):
        return [self.seq_len, self.head_dim, self.dtype, self.gpu]

    def _on_change(self, _change=None):
        self.update()

    def update(self) -> None:
        """Recompute the costs for the controls' values and redraw both panels."""
        spec = hardware.get_gpu(self.gpu.value)
        dtype = self.dtype.value
        peak = spec.peak_flops(dtype)
        bandwidth = spec.bandwidth_bytes_per_s
        self.balance = hardware.balance_point(spec, dtype)
        self.costs = costmodel.step_costs(self.seq_len.value, self.head_dim.value, dtype)
        big = REFERENCE_MATMUL
        matmul = costmodel.matmul_cost(big, big, big, dtype)

        x = np.logspace(*np.log10(_INTENSITY_RANGE), 200)
        roof = costmodel.attainable_flops(x, spec, dtype)
        self.roof.set_data(x, roof / hardware.TERA)
        self.balance_line.set_xdata([self.balance] * 2)
        if self.memory_region is not None:
            self.memory_region.remove()
        self.memory_region = self.ax.axvspan(_INTENSITY_RANGE[0], self.balance, color=MEMORY_COLOR,
                                             alpha=0.06, lw=0)

        self.points, self.memory_bound = {}, {}
        for name, cost in [*self.costs.items(), ("matmul", matmul)]:
            attainable = costmodel.attainable_flops(cost.intensity, spec, dtype)
            self.points[name] = (cost.intensity, attainable)
            self.memory_bound[name] = cost.intensity < self.balance
            color = MEMORY_COLOR if self.memory_bound[name] else COMPUTE_COLOR
            self.markers[name].set_data([cost.intensity], [attainable / hardware.TERA])
            self.markers[name].set_color(color)
            self.markers[name].set_markeredgecolor("black")
            label = f"matmul {big}³" if name == "matmul" else cost.label
            self.labels[name].set_text(f"{label}: {_fmt(cost.intensity)}")
            self.labels[name].xy = (cost.intensity, attainable / hardware.TERA)
            self.labels[name].set_visible(True)
        if np.isclose(self.points["qk"][0], self.points["pv"][0]):  # same point: one label
            self.labels["qk"].set_text(f"QKᵀ and PV: {_fmt(self.points['qk'][0])}")
            self.labels["pv"].set_visible(False)

        self.ax.set_xlim(*_INTENSITY_RANGE)
        self.ax.set_ylim(roof[0] / hardware.TERA / 2, peak / hardware.TERA * 3)
        self.ax.set_title(f"{spec.name}, {dtype}: balance point {self.balance:.0f} FLOP/byte\n"
                          f"red = memory-bound, green = compute-bound", fontsize=TITLE_FONTSIZE)
        self._draw_times(spec, dtype)
        self._place_labels()
        self._fill_table(spec, dtype)
        self._render()

    def _step_times(self, spec, dtype):
        """{step: (memory time s, compute time s)} as the roofline predicts, per head."""
        return {name: (c.bytes / spec.bandwidth_bytes_per_s, c.flops / spec.peak_flops(dtype))
                for name, c in self.costs.items()}

    def _draw_times(self, spec, dtype) -> None:
        ax = self.ax_time
        ax.clear()
        times = self._step_times(spec, dtype)
        names = list(times)[::-1]
        y = np.arange(len(names))
        memory_us = np.array([times[n][0] for n in names]) * 1e6
        compute_us = np.array([times[n][1] for n in names]) * 1e6
        height = 0.38
        ax.barh(y + height / 2, memory_us, height, color=MEMORY_COLOR, label="moving bytes")
        ax.barh(y - height / 2, compute_us, height, color=COMPUTE_COLOR, label="doing FLOPs")
        ax.set_yticks(y, [self.costs[n].label for n in names])
        ax.set_xlabel("predicted time per head (µs)")
        # below the axes: inside, it covered the bottom bars
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2,
                  fontsize=SMALL_FONTSIZE, frameon=False)
        ax.set_title(f"N={self.seq_len.value:,}, d={self.head_dim.value}",
                     fontsize=TITLE_FONTSIZE)
        self.times = times

    def _place_labels(self) -> None:
        """Put each point's label where it touches no line, axis, marker or other label.

        Runs the figure's layout first (labels are left out of it), so the positions measured
        here are the ones drawn.
        """
        self.fig.draw_without_rendering()
        renderer = self.fig.canvas.get_renderer()
        to_display = self.ax.transData.transform
        roof_px = to_display(np.column_stack(self.roof.get_data()))  # (200, 2)
        markers_px = to_display(np.array([[m.get_xdata()[0], m.get_ydata()[0]]
                                          for m in self.markers.values()]))
        balance_x = to_display([[self.balance, 1.0]])[0, 0]
        placed = []
        for name in sorted(self.labels, key=lambda n: self.points[n][0]):
            label = self.labels[name]
            if not label.get_visible():
                continue
            one_line = label.get_text()
            # one line anywhere if possible, else two lines ("name:" over the number), narrower
            tries = [(text, place) for text in (one_line, one_line.replace(": ", ":\n"))
                     for place in self._places(name)]
            for text, place in tries:
                label.set_text(text)
                self._set_place(name, place)
                box = label.get_window_extent(renderer)
                if not label_collides(box, self.ax.bbox, balance_x, roof_px, markers_px, placed):
                    break
            else:
                label.set_text(one_line)
                self._set_place(name, self._places(name)[0])
                box = label.get_window_extent(renderer)
            placed.append(box)

    def _places(self, name: str):
        return _SLOPE_PLACES if self.memory_bound[name] else _ROOF_PLACES

    def _set_place(self, name: str, place) -> None:
        offset, ha, va = place
        label = self.labels[name]
        label.xyann = offset
        label.set_horizontalalignment(ha)
        label.set_verticalalignment(va)

    def _fill_table(self, spec, dtype) -> None:
        """The per-step costs as an HTML table: units in the header, numbers right-aligned."""
        flop_unit, flop_scale = _unit(max(c.flops for c in self.costs.values()), "FLOP")
        byte_unit, byte_scale = _unit(max(c.bytes for c in self.costs.values()), "B")
        cell = "padding: 2px 12px; border-bottom: 1px solid #ddd;"
        num = cell + " text-align: right; font-variant-numeric: tabular-nums;"
        head = "padding: 2px 12px; border-bottom: 2px solid #999; text-align: {};"
        header = "".join(f'<th style="{head.format(align)}">{text}</th>' for text, align in (
            ("step", "left"), (f"FLOPs ({flop_unit})", "right"),
            (f"HBM traffic ({byte_unit})", "right"), ("intensity (FLOP/byte)", "right"),
            ("bound by", "left")))
        rows = "".join(
            f'<tr><td style="{cell}">{c.label}</td>'
            f'<td style="{num}">{_num(c.flops / flop_scale)}</td>'
            f'<td style="{num}">{_num(c.bytes / byte_scale)}</td>'
            f'<td style="{num}">{_num(c.intensity)}</td>'
            f'<td style="{cell}">{"memory" if self.memory_bound[n] else "compute"}</td></tr>'
            for n, c in self.costs.items())
        caption = (f"Per head, N = {self.seq_len.value:,}, d = {self.head_dim.value}, {dtype}, "
                   f"{spec.name} (balance point {self.balance:,.0f} FLOP/byte)")
        self.table.value = (
            '<table style="border-collapse: collapse; font-size: 13px; margin-top: 6px;">'
            f'<caption style="caption-side: top; text-align: left; padding-bottom: 4px;">'
            f"{caption}</caption><tr>{header}</tr>{rows}</table>")

    def widget(self):
        """Controls, figure and a per-step table, as one ipywidgets box."""
        import ipywidgets as W

        return W.VBox([W.HBox([W.VBox(self.controls[:2]), W.VBox(self.controls[2:])]),
                       self.image, self.table])

