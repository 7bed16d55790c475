"""One way to look a preset up by name (formats' schemes, training recipes, PTQ configs, KV-cache
formats): case, the spaces around a name and the choice of ``-`` or ``_`` between its words do not
matter, so ``"fp8_block"``, ``"FP8-block"`` and ``"fp8-block"`` name one config; each table keeps
its own spelling, which is what reports print. An unknown name is an error that lists the known.

Example:
    >>> canonical({"fp8_rowwise": 1, "mxfp4": 2}, " FP8-Rowwise ", "scheme")
    'fp8_rowwise'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from minifloat.errors import MinifloatError

T = TypeVar("T")


def normalize(name: str) -> str:
    """The form names are compared in: stripped, lower case, words joined by ``-``."""
    return str(name).strip().lower().replace("_", "-")


def canonical(table: Mapping[str, object], name: str, what: str) -> str:
    """The key of `table` that `name` names (see the module docstring); `what` names the kind in
    the error."""
    if name in table:
        return name
    key = normalize(name)
    for k in table:
        if normalize(k) == key:
            return k
    raise MinifloatError(f"unknown {what} {name!r}; known: {', '.join(table)}")


def lookup(table: Mapping[str, T], name: str, what: str) -> T:
    """``table[canonical(table, name, what)]``."""
    return table[canonical(table, name, what)]
