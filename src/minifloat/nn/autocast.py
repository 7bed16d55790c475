"""`minifloat.autocast`: change or disable the recipe of minifloat Linears for a region.

Like Transformer Engine's ``fp8_autocast``, the setting applies to forwards run inside the
``with`` block; their backward uses what the forward used, wherever it runs.

Example:
    >>> import minifloat
    >>> layer = minifloat.nn.Linear(32, 32, recipe="mxfp4")
    >>> x = torch.randn(4, 32)
    >>> with minifloat.autocast(enabled=False):  # evaluate in high precision
    ...     exact = layer(x)
    >>> torch.equal(exact, torch.nn.functional.linear(x, layer.weight, layer.bias))
    True
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch  # noqa: F401  (doctest namespace)

from minifloat.recipes import Recipe, get_recipe


@dataclass(frozen=True)
class AutocastState:
    enabled: bool = True
    recipe: Recipe | None = None  # None: each module's own recipe


_STATE: contextvars.ContextVar[AutocastState] = contextvars.ContextVar("minifloat_autocast", default=AutocastState())  # noqa: B039 (frozen)


def current() -> AutocastState:
    """The setting in force here."""
    return _STATE.get()


@contextlib.contextmanager
def autocast(recipe: str | Recipe | None = None, enabled: bool = True):
    """Within the block, minifloat Linears use `recipe` (None: their own), or run in high
    precision when ``enabled=False``. A delayed-scaling recipe given here, on a module
    converted with another recipe, scales each tensor from its own amax (the module keeps no
    history for it)."""
    token = _STATE.set(AutocastState(bool(enabled), None if recipe is None else get_recipe(recipe)))
    try:
        yield
    finally:
        _STATE.reset(token)
