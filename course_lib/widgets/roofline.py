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
"""

from __future__ import annotations

import numpy as np

from course_lib import costmodel, hardware

__all__ = ["RooflineWidget", "SEQ_LENS", "HEAD_DIMS", "FIGSIZE", "REFERENCE_MATMUL"]

FIGSIZE = (9, 4.5)
SEQ_LENS = [2**p for p in range(7, 18)]  # 128 … 131,072
HEAD_DIMS = [32, 64, 80, 96, 128, 256]
DTYPES = ["float16", "bfloat16", "float32"]
REFERENCE_MATMUL = 8192  # the reading's "large matmul" (8192 × 8192) · (8192 × 8192)
_INTENSITY_RANGE = (0.05, 1e4)  # FLOP/byte shown on the x axis
MEMORY_COLOR, COMPUTE_COLOR = "tab:red", "tab:green"
_LABELS_LEFT = ("mask", "matmul", "qk", "pv")  # labelled on the left of their point


def _fmt(intensity: float) -> str:
    return f"{intensity:,.0f}" if intensity >= 100 else f"{intensity:.3g}"


class RooflineWidget:
    """Roofline of a GPU with the five kernels of standard attention on it.

    Attributes:
        seq_len, head_dim, dtype, gpu: the ipywidgets controls.
        costs: ``{step: StepCost}`` for the current controls (per head).
        points: ``{step: (intensity FLOP/byte, attainable FLOP/s)}``; also ``"matmul 8192³"``.
        memory_bound: ``{step: bool}``.
        balance: the GPU's balance point for the dtype, FLOP/byte.
        fig, ax, ax_time; ``markers[step]`` the Line2D of each point; ``roof`` the roof line.
    """

    def __init__(self, seq_len: int = 1024, head_dim: int = 64, dtype: str = "float16",
                 gpu: str = hardware.DEFAULT_GPU):
        import ipywidgets as W
        import matplotlib.pyplot as plt

        if seq_len not in SEQ_LENS:
            raise ValueError(f"seq_len must be a power of two from {SEQ_LENS[0]} to "
                             f"{SEQ_LENS[-1]}, got {seq_len!r}")
        style = {"description_width": "initial"}
        self.seq_len = W.SelectionSlider(options=SEQ_LENS, value=seq_len,
                                         description="sequence length N", style=style)
        self.head_dim = W.SelectionSlider(options=HEAD_DIMS, value=head_dim,
                                          description="head dim d", style=style)
        self.dtype = W.Dropdown(options=DTYPES, value=hardware.normalize_dtype(dtype),
                                description="dtype", style=style)
        self.gpu = W.Dropdown(options=hardware.gpu_names(), value=hardware.get_gpu(gpu).name,
                              description="GPU", style=style)
        self.table = W.HTML()
        self.output = W.Output()

        with plt.ioff():
            self.fig, (self.ax, self.ax_time) = plt.subplots(
                1, 2, figsize=FIGSIZE, layout="constrained", gridspec_kw={"width_ratios": [3, 2]})
        plt.close(self.fig)
        ax = self.ax
        self.roof = ax.plot([], [], color="black", lw=2, label="roofline")[0]
        self.balance_line = ax.axvline(1, color="tab:gray", ls="--", lw=1)
        self.memory_region = None
        self.markers, self.labels = {}, {}
        for name in (*costmodel.STEPS, "matmul"):
            self.markers[name] = ax.plot([], [], "o", ms=8, mec="black")[0]
            left = name in _LABELS_LEFT
            self.labels[name] = ax.annotate("", (1, 1), textcoords="offset points",
                                            xytext=(-9, 2) if left else (9, -9), fontsize=8,
                                            ha="right" if left else "left")
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
                          f"red = memory-bound, green = compute-bound", fontsize=10)
        self._draw_times(spec, dtype)
        self._fill_table(spec, dtype)
        self._redraw()

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
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title(f"N={self.seq_len.value:,}, d={self.head_dim.value}", fontsize=10)
        self.times = times

    def _fill_table(self, spec, dtype) -> None:
        rows = "".join(
            f"<tr><td>{c.label}</td><td>{c.flops:.3g}</td><td>{c.bytes:.3g}</td>"
            f"<td>{c.intensity:.3g}</td><td>{'memory' if self.memory_bound[n] else 'compute'}"
            f"</td></tr>" for n, c in self.costs.items())
        self.table.value = ("<table><tr><th>step</th><th>FLOPs</th><th>bytes</th>"
                            "<th>FLOP/byte</th><th>bound by</th></tr>" + rows + "</table>")

    def _redraw(self) -> None:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is None:  # plain Python (tests): keep the figure, show nothing
            return
        with self.output:
            self.output.clear_output(wait=True)
            display(self.fig)

    def widget(self):
        """Controls, figure and a per-step table, as one ipywidgets box."""
        import ipywidgets as W

        return W.VBox([W.HBox([W.VBox(self.controls[:2]), W.VBox(self.controls[2:])]),
                       self.output, self.table])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget())
