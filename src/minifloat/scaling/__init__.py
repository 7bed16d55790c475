"""How scaled quantization is defined: schemes, block geometry, the amax → scale rules of
every scale format, and amax histories. Pure definitions and formulas: the quantizers that
apply them are `minifloat.kernels` (the reference and the fast paths)."""

from minifloat.scaling.history import AMAX_ALGOS, WINDOW_ALGOS, AmaxHistory, reduce_amax_window
from minifloat.scaling.layout import Layout, ceil_to, layout_for, part_specs, to_grid
from minifloat.scaling.rules import (
    as_float32,
    canonical_nan,
    decode_scales,
    e8m0_exponent,
    finite_amax,
    fp32_scale,
    fp32_scale_scalar,
    nvfp4_block_scale_codes,
    nvfp4_global_scale,
    nvfp4_global_scale_scalar,
    scale_from_amax,
)
from minifloat.scaling.schemes import SCHEMES, Scheme, get_scheme, named

__all__ = [
    "Scheme", "SCHEMES", "get_scheme", "named",
    "Layout", "layout_for", "part_specs", "to_grid", "ceil_to",
    "finite_amax", "canonical_nan", "fp32_scale", "fp32_scale_scalar", "e8m0_exponent", "nvfp4_global_scale",
    "nvfp4_global_scale_scalar", "nvfp4_block_scale_codes", "decode_scales", "as_float32", "scale_from_amax",
    "AmaxHistory", "reduce_amax_window", "AMAX_ALGOS", "WINDOW_ALGOS",
]  # fmt: skip
