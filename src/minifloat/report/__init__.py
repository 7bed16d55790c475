"""Reports: plots, Markdown and JSON writers. Plots need the `plot` extra (matplotlib)."""

from __future__ import annotations

from minifloat.errors import MinifloatError


def require_matplotlib():
    """Import matplotlib with the Agg backend, or say how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise MinifloatError(
            "plots need matplotlib; install it with: pip install 'minifloat[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
