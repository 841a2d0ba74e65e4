"""Interactive widgets (ipywidgets + matplotlib), one module per widget."""
