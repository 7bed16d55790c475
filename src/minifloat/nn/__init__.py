"""Low-precision training modules: `Linear`, `convert`, `autocast`."""

from minifloat.nn.autocast import autocast
from minifloat.nn.convert import convert
from minifloat.nn.linear import Linear

__all__ = ["Linear", "convert", "autocast"]
