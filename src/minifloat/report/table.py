"""Table cells: one rule for how a figure is printed, in reports and on the terminal.

Example:
    >>> cell(1.23456, ".2f"), cell(None, ".2f"), cell(float("nan"), ".2f"), cell(2.5, ".1f", suffix="x")
    ('1.23', '—', 'nan', '2.5x')
"""

from __future__ import annotations

import math


def cell(v: float | None, spec: str, *, missing: str = "—", suffix: str = "") -> str:
    """`v` formatted by `spec` (with `suffix`); `missing` when there is no figure; a non-finite
    float as Python writes it (``nan``, ``inf``), which says more than a dash."""
    if v is None:
        return missing
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec) + suffix


def mib(n: int | None) -> str:
    """Bytes as MiB with two decimals."""
    return cell(None if n is None else n / 2**20, ".2f")


def markdown_table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A Markdown table with padded columns (readable as plain text too)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)])
