"""Reports: Markdown, plots (matplotlib, a core dependency) and table cells."""

from __future__ import annotations

from pathlib import Path

from minifloat.errors import MinifloatError
from minifloat.io.atomic import atomic_path


def require_matplotlib():
    """Import matplotlib with the Agg backend, or say how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise MinifloatError(
            "plots need matplotlib, an optional extra of minifloat that is not installed here; install it with: "
            "pip install 'minifloat[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, plt) -> None:
    """Lay out `fig`, write it as a PNG atomically to `path`, and close it."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
