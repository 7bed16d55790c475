"""JSON that strict parsers read: a non-finite float (a diverged loss, an undefined ratio) is
written as the string Python's ``str`` gives it (``"nan"``, ``"inf"``, ``"-inf"``), which
``float()`` reads back, instead of the bare ``NaN`` / ``Infinity`` tokens that Python's own
``json`` writes by default and JavaScript, jq or Go refuse.

Example:
    >>> dumps({"loss": float("nan"), "steps": [1.5, float("-inf")]})
    '{"loss": "nan", "steps": [1.5, "-inf"]}'
    >>> loads('{"loss": "nan", "steps": [1.5, "-inf"]}')
    {'loss': nan, 'steps': [1.5, -inf]}
"""

from __future__ import annotations

import json
import math


def strict(obj):
    """`obj` with every non-finite float replaced by its ``str`` (dicts, lists, tuples walked)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def dumps(obj, **kwargs) -> str:
    """``json.dumps`` of ``strict(obj)``; refuses any NaN it would still have to write."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def restore(obj):
    """Inverse of `strict`: the strings ``"nan"``, ``"inf"``, ``"-inf"`` become floats again."""
    if isinstance(obj, str):
        return _NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: restore(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [restore(v) for v in obj]
    return obj


def loads(text: str):
    """``json.loads`` of what `dumps` wrote (older files' bare ``NaN`` tokens read too)."""
    return restore(json.loads(text))
