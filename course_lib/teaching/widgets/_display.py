"""What every course widget shares: its figure's size, its controls' layout, and one way of drawing.

Every widget draws into a plain :class:`matplotlib.figure.Figure` (not registered with pyplot, so
it is never shown twice) and shows it as PNG bytes in an :class:`ipywidgets.Image`: the same in
JupyterLab, in tests (no IPython needed) and in exported notebooks. A widget subclasses
:class:`FigureWidget`, calls :meth:`~FigureWidget._new_figure` once and
:meth:`~FigureWidget._render` after every change; its labelled controls take
``**control_layout()`` so that their labels share one width and their tracks start at one x.
"""

from __future__ import annotations

import io

FIGSIZE = (9.0, 4.5)  # inches: the figure spans the controls' two columns, wide but not tall
DPI = 100  # pixels per inch of the PNG: a figure is drawn 900 × 450 px, one PNG pixel a screen px
FIGURE_WIDTH = f"{FIGSIZE[0] * DPI:.0f}px"  # the Image's width on the page: the PNG unscaled
LABEL_WIDTH = "150px"  # every control's label: fits "Batch B (sequences)" at ~7.5 px a character
CONTROL_WIDTH = "440px"  # label, track and read-out of one control; two columns fit side by side
TITLE_FONTSIZE = 10  # points: a figure's or a wide panel's title
PANEL_TITLE_FONTSIZE = 9  # the title of one of several panels, where titles are long for the width
SMALL_FONTSIZE = 8  # legends and labels inside the axes, which must not hide the data


def control_layout(**style) -> dict:
    """Keyword arguments for a labelled ipywidgets control: the shared label and control widths.

    Args:
        style: extra ``style`` entries, e.g. ``button_width`` for ToggleButtons.
    Returns:
        ``{"style": {...}, "layout": Layout}`` to pass as ``W.IntSlider(..., **control_layout())``.
    """
    import ipywidgets as W

    return {"style": {"description_width": LABEL_WIDTH, **style},
            "layout": W.Layout(width=CONTROL_WIDTH)}


def figure_png(fig) -> bytes:
    """The figure rendered as PNG bytes at :data:`DPI` (for an ``ipywidgets.Image``)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


class FigureWidget:
    """Base of the course widgets: one figure, shown as PNG in ``self.image``; displays as its box.

    A subclass sets ``widget`` (a box, or a method returning one) and calls :meth:`_new_figure`
    once and :meth:`_render` after every change.
    """

    def _new_figure(self, layout: str | None = "constrained"):
        """Create ``self.fig`` (:data:`FIGSIZE`, :data:`DPI`, drawn by Agg) and ``self.image``.

        Args:
            layout: the figure's layout engine; None where the widget places its axes itself.
        Returns:
            ``self.fig``.
        """
        import ipywidgets as W
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=FIGSIZE, dpi=DPI, layout=layout)
        FigureCanvasAgg(self.fig)  # a canvas to draw on and measure text with, no window
        self.image = W.Image(format="png", layout=W.Layout(width=FIGURE_WIDTH))
        return self.fig

    def _render(self) -> None:
        """Show the figure as it is now: render it to PNG into ``self.image``."""
        self.image.value = figure_png(self.fig)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget() if callable(self.widget) else self.widget)
