"""Flags take their defaults from the library call they configure, so each is defined once."""

from __future__ import annotations

import inspect


def keyword_defaults(fn) -> dict:
    """The defaults of `fn`'s parameters (a function, or a dataclass such as `TrainConfig`).

    Example:
        >>> keyword_defaults(lambda rows, cols=8, reps=9: None)
        {'cols': 8, 'reps': 9}
    """
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def print_result(metrics: dict, table: str, out, as_json: bool) -> None:
    """What a report-writing command prints last: ``metrics`` as JSON, or the table and where
    the report and metrics went."""
    from minifloat.io import jsonio

    if as_json:
        print(jsonio.dumps(metrics, indent=2))
    else:
        print(f"\n{table}\n\nreport: {out}/report.md   metrics: {out}/metrics.json")
