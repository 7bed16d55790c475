"""Reports: Markdown, plots (matplotlib, a core dependency) and table cells."""

from __future__ import annotations

from minifloat.errors import MinifloatError


def require_matplotlib():
    """Import matplotlib with the Agg backend, or say how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise MinifloatError(
            "plots need matplotlib, a dependency of minifloat that is missing here; install it with: pip install matplotlib"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
