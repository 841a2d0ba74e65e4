"""KV-cache memory calculator (chapter 08): how much memory the keys and values of generation take.

Controls: *Model* (a preset attention shape from :data:`course_lib.attention.kvcache.MODELS`), *Context
length N*, *Batch B*, *K/V heads* (the divisors of the model's query heads: all of them = MHA,
fewer = GQA, 1 = MQA), *Cache dtype*, *GPU* (from :data:`course_lib.platform.hardware.GPUS`) and *Reserve
the weights* (set the fp16/bf16 weights aside before the cache gets the rest).

The figure shows the cache of the chosen batch against the context length (log-log), for the
chosen K/V heads and, for comparison, with every head cached (MHA) and with one (MQA); the
horizontal lines are the GPU's memory and what is left for the cache; the dot is the chosen
context. A line of text gives the size, its share of the GPU, and the most tokens that fit
(batch × context): the largest batch at this context and the longest context at this batch.

The figure is rendered to PNG bytes in :attr:`image` (see ``_display``), so it looks the same in
JupyterLab and in tests. Without a browser: set a control's ``value``, then read
:attr:`cache_bytes`, :attr:`max_tokens`, :attr:`summary` ``.value`` or ``lines[...]``.

Usage::

    from course_lib.teaching.widgets.kvcache import KVCacheCalculator
    KVCacheCalculator()      # the last expression of a cell displays it
"""

from __future__ import annotations


import ipywidgets as widgets
import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

from course_lib.platform import hardware
from course_lib.attention import kvcache
from course_lib.attention.costmodel import format_bytes
from course_lib.teaching.widgets.memory import format_tokens
from course_lib.teaching.widgets._display import (SMALL_FONTSIZE, TITLE_FONTSIZE, FigureWidget,
                                        control_layout)

__all__ = ["KVCacheCalculator", "SEQ_LENS", "DTYPES", "MAX_BATCH"]

SEQ_LENS = [2**p for p in range(9, 21)]  # 512 … 1M tokens
MAX_BATCH = 256
DTYPES = (("float16 / bfloat16 (2 bytes)", "float16"), ("float32 (4 bytes)", "float32"),
          ("fp8 (1 byte)", "fp8"))
WEIGHT_BYTES_PER_PARAM = 2  # fp16/bf16 weights, the usual serving precision
_CURVE_N = np.array(SEQ_LENS, dtype=float)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


class KVCacheCalculator(FigureWidget):
    """KV-cache size of a model at a context length and batch, against a GPU's memory.

    Attributes:
        model, seq_len, batch, kv_heads, dtype, gpu, reserve_weights: the controls.
        summary: the text line (HTML); image: the rendered figure (PNG bytes in ``.value``).
        fig, ax, lines: the matplotlib figure, its axes and the named Line2D objects
            (``"chosen"``, ``"mha"``, ``"mqa"``, ``"gpu"``, ``"available"``, ``"point"``).
        cache_bytes, available_bytes, max_tokens, max_batch, max_context: the current numbers.
    """

    def __init__(self, model: str = kvcache.DEFAULT_MODEL, seq_len: int = 4096, batch: int = 8,
                 kv_heads: int | None = None, dtype: str = "float16",
                 gpu: str = "H100 SXM", reserve_weights: bool = True):
        if model not in kvcache.MODELS:
            raise ValueError(f"model must be one of {', '.join(kvcache.MODELS)}; got {model!r}")
        if seq_len not in SEQ_LENS:
            raise ValueError(f"seq_len must be a power of two from {SEQ_LENS[0]} to "
                             f"{SEQ_LENS[-1]}, got {seq_len!r}")
        if not (isinstance(batch, int) and 1 <= batch <= MAX_BATCH):
            raise ValueError(f"batch must be an int from 1 to {MAX_BATCH}, got {batch!r}")
        dtype_values = [value for _, value in DTYPES]
        if dtype not in dtype_values:
            raise ValueError(f"dtype must be one of {', '.join(dtype_values)}, got {dtype!r}")
        shape = kvcache.MODELS[model]
        kv_heads = shape.n_kv_heads if kv_heads is None else kv_heads
        if kv_heads not in _divisors(shape.n_heads):
            raise ValueError(f"kv_heads must divide the model's {shape.n_heads} query heads, "
                             f"got {kv_heads!r}")
        gpu = hardware.get_gpu(gpu).name

        self.model = widgets.Dropdown(options=list(kvcache.MODELS), value=model,
                                      description="Model", **control_layout())
        self.seq_len = widgets.SelectionSlider(options=[(format_tokens(n), n) for n in SEQ_LENS],
                                               value=seq_len, description="Context length N",
                                               continuous_update=False, **control_layout())
        self.batch = widgets.IntSlider(value=batch, min=1, max=MAX_BATCH,
                                       description="Batch B (sequences)",
                                       continuous_update=False, **control_layout())
        self.kv_heads = widgets.SelectionSlider(options=_divisors(shape.n_heads), value=kv_heads,
                                                description="K/V heads",
                                                continuous_update=False, **control_layout())
        self.dtype = widgets.Dropdown(options=DTYPES, value=dtype, description="Cache dtype",
                                      **control_layout())
        self.gpu = widgets.Dropdown(options=hardware.gpu_names(), value=gpu, description="GPU",
                                    **control_layout())
        # a checkbox's label sits right of the box and takes the width it needs
        self.reserve_weights = widgets.Checkbox(
            value=reserve_weights, description="Reserve the weights (fp16) before the cache",
            **control_layout(description_width="initial"))
        self.summary = widgets.HTML()

        self.ax = ax = self._new_figure().add_subplot()
        self.lines = {
            "mha": ax.plot([], [], color="tab:red", lw=1.5, ls="--", zorder=3,  # on top when equal
                           label="every head cached (MHA)")[0],
            "chosen": ax.plot([], [], color="tab:blue", lw=2.5, label="chosen K/V heads")[0],
            "mqa": ax.plot([], [], color="tab:green", lw=1.5, ls=":",
                           label="one K/V head (MQA)")[0],
            "gpu": ax.axhline(1, color="tab:purple", lw=1.5, ls="--", label="GPU memory"),
            "available": ax.axhline(1, color="tab:purple", lw=1, ls=":",
                                    label="left for the cache"),
            "point": ax.plot([], [], "o", color="black", ms=7, label="chosen N")[0],
        }
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_tokens(x)))
        ax.yaxis.set_major_locator(LogLocator(base=4))  # 256 MiB, 1 GiB, 4 GiB, …
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: format_bytes(y).replace(".00", "")))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("context length N (tokens per sequence)")
        ax.set_ylabel("KV-cache size")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="upper left", fontsize=SMALL_FONTSIZE)

        self._syncing = False
        self.model.observe(self._on_model, names="value")
        for control in self.controls:
            if control is not self.model:
                control.observe(self._on_change, names="value")
        self.update()

    @property
    def controls(self):
        return [self.model, self.seq_len, self.batch, self.kv_heads, self.dtype, self.gpu,
                self.reserve_weights]

    @property
    def shape(self) -> kvcache.ModelShape:
        return kvcache.MODELS[self.model.value]

    def _on_model(self, change) -> None:
        """A new model: offer its head divisors and start from its own number of K/V heads."""
        self._syncing = True
        self.kv_heads.options = _divisors(self.shape.n_heads)
        self.kv_heads.value = self.shape.n_kv_heads
        self._syncing = False
        self.update()

    def _on_change(self, change) -> None:
        if not self._syncing:
            self.update()

    def _cache(self, seq_len, kv_heads=None) -> float:
        return float(self.shape.kv_bytes(int(seq_len), self.batch.value, self.dtype.value,
                                          kv_heads=kv_heads or self.kv_heads.value))

    def _curve(self, kv_heads=None) -> np.ndarray:
        """Cache bytes at every context length of the slider, ``(len(SEQ_LENS),)``."""
        return np.array([self._cache(n, kv_heads) for n in _CURVE_N])

    def update(self) -> None:
        """Recompute the numbers for the controls' values and redraw."""
        shape, spec = self.shape, hardware.get_gpu(self.gpu.value)
        n, batch, kv_heads = self.seq_len.value, self.batch.value, self.kv_heads.value
        self.weight_bytes = (shape.weight_bytes(WEIGHT_BYTES_PER_PARAM)
                             if self.reserve_weights.value else 0.0)
        self.available_bytes = max(0.0, spec.memory_bytes - self.weight_bytes)
        self.cache_bytes = self._cache(n)
        self.per_token_bytes = kvcache.kv_cache_bytes_per_token(
            layers=shape.layers, kv_heads=kv_heads, head_dim=shape.head_dim, dtype=self.dtype.value)
        self.max_tokens = kvcache.max_cached_tokens(
            spec.memory_bytes, layers=shape.layers, kv_heads=kv_heads, head_dim=shape.head_dim,
            dtype=self.dtype.value, reserved_bytes=self.weight_bytes)
        self.max_batch = self.max_tokens // n  # at the chosen context
        self.max_context = self.max_tokens // batch  # at the chosen batch

        self.lines["chosen"].set_data(_CURVE_N, self._curve())
        self.lines["mha"].set_data(_CURVE_N, self._curve(shape.n_heads))
        self.lines["mqa"].set_data(_CURVE_N, self._curve(1))
        self.lines["gpu"].set_ydata([spec.memory_bytes] * 2)
        self.lines["available"].set_ydata([max(self.available_bytes, 1.0)] * 2)
        self.lines["point"].set_data([n], [self.cache_bytes])
        curves = np.concatenate([self.lines[k].get_ydata() for k in ("chosen", "mha", "mqa")])
        self.ax.set_xlim(SEQ_LENS[0] / 1.3, SEQ_LENS[-1] * 1.3)
        self.ax.set_ylim(curves.min() / 2, max(curves.max(), spec.memory_bytes) * 2)
        self.ax.set_title(f"{shape.name}\n{shape.layers} layers, {shape.n_heads} query heads, "
                          f"{kv_heads} K/V heads, d = {shape.head_dim}; batch {batch}, "
                          f"{self.dtype.value} cache; {spec.name}", fontsize=TITLE_FONTSIZE)
        self.summary.value = self._summary_text(spec)
        self._render()

    def _summary_text(self, spec) -> str:
        fits = self.cache_bytes <= self.available_bytes
        verdict = ("fits" if fits else '<span style="color:red">does not fit</span>')
        weights = (f" after {self.weight_bytes / hardware.GB:.1f} GB of weights"
                   if self.weight_bytes else "")
        if self.weight_bytes >= spec.memory_bytes:
            weights += (" — the weights alone do not fit on one GPU (serving splits such a model "
                        "over several; untick the weights to see the cache alone)")
        share = self.cache_bytes / spec.memory_bytes
        return (f"Cache at N = {self.seq_len.value:,}, batch {self.batch.value}: "
                f"<b>{self.cache_bytes / hardware.GB:.2f} GB</b> "
                f"({format_bytes(self.cache_bytes)}; {format_bytes(self.per_token_bytes)} per "
                f"token) = {share:.0%} of {spec.name}'s {spec.memory_gb:g} GB — {verdict}"
                f"{weights}.<br>At most <b>{self.max_tokens:,} tokens</b> (batch × context) "
                f"fit: batch ≤ <b>{self.max_batch:,}</b> at this context, or context ≤ "
                f"<b>{self.max_context:,}</b> at this batch.")

    def widget(self):
        """The controls, the summary and the figure, as one ipywidgets box."""
        return widgets.VBox([
            widgets.HBox([widgets.VBox([self.model, self.seq_len, self.batch, self.kv_heads]),
                          widgets.VBox([self.dtype, self.gpu, self.reserve_weights])]),
            self.summary, self.image])

