"""What every course widget shares: turning its matplotlib figure into pixels, and displaying itself.

Two ways of showing a figure are used: as PNG bytes in an ``ipywidgets.Image`` (the same in the
browser, in tests and in exported notebooks), or by ``display``-ing the figure into an
``ipywidgets.Output`` (only inside IPython).
"""

from __future__ import annotations

import io


def figure_png(fig, dpi: int) -> bytes:
    """The figure rendered as PNG bytes (for an ``ipywidgets.Image``)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def show_in_output(output, fig) -> None:
    """Replace what ``output`` shows by ``fig``; a no-op outside IPython (tests keep the figure)."""
    from IPython import get_ipython
    from IPython.display import display

    if get_ipython() is None:
        return
    with output:
        output.clear_output(wait=True)
        display(fig)


class DisplaysAsWidget:
    """Mixin: an object with a ``widget`` (a box, or a method returning one) displays as that box."""

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget() if callable(self.widget) else self.widget)
