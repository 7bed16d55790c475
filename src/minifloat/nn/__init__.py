"""Low-precision training modules: `Linear`, `convert`, `autocast`, delayed scaling, the
rounded high-precision baselines, `monitor` and `LossScaler`."""

from minifloat.nn.autocast import autocast
from minifloat.nn.convert import convert
from minifloat.nn.linear import Linear
from minifloat.nn.loss_scaling import LossScaler
from minifloat.nn.monitor import Monitor, monitor

__all__ = ["Linear", "convert", "autocast", "LossScaler", "Monitor", "monitor"]
