"""Errors raised for user mistakes.

Every error names the offending value and the fix. All derive from `MinifloatError`, which
is a `ValueError`, so callers can catch either. `assert` is kept for internal invariants.
"""

from __future__ import annotations


class MinifloatError(ValueError):
    """Base class of every error minifloat raises for bad input."""


class UnknownFormatError(MinifloatError):
    """A format name (or dtype) that is not in the registry."""


class DTypeError(MinifloatError, TypeError):
    """A tensor of a dtype the operation does not accept."""


class CodeRangeError(MinifloatError):
    """Codes that do not fit the format's bit width."""


class PackingError(MinifloatError):
    """Packed data whose size or dtype does not match what was asked for."""


class RoundingError(MinifloatError):
    """An unknown rounding mode."""
