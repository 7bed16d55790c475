"""minifloat: bit-exact FP8 / FP6 / FP4 formats and low-precision training tools for PyTorch.

Example:
    >>> import torch, minifloat
    >>> codes = minifloat.encode(torch.tensor([0.1, 1.0, 500.0]), "e4m3")
    >>> minifloat.decode(codes, "e4m3").tolist()
    [0.1015625, 1.0, 448.0]
"""

import os as _os

# PyTorch's CPU allocator backs large tensors with transparent huge pages when this is set:
# one page fault per 2 MiB instead of per 4 KiB of a fresh quantize / dequantize output (docs/benchmarks/cpu-kernels.md).
# Effective only if torch has not allocated yet; set it to 0 to opt out.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from minifloat.errors import (
    CodeRangeError,
    DTypeError,
    MinifloatError,
    PackingError,
    RoundingError,
    UnknownFormatError,
)
from minifloat.formats import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E4M3FNUZ,
    E5M2,
    E5M2FNUZ,
    E8M0,
    FORMATS,
    FloatFormat,
    NaNEncoding,
    decode,
    encode,
    get_format,
    pack,
    packed_nbytes,
    unpack,
    value_table,
)
from minifloat.infer import QuantizedLinear, calibrate, quantize_model
from minifloat.nn import Linear, LossScaler, Monitor, autocast, convert, monitor
from minifloat.quant import CorruptFileError, QuantizedTensor, dequantize, fake_quantize, load, quantize, save
from minifloat.recipes import (
    RECIPES,
    CurrentScaling,
    DelayedScaling,
    Float8BlockScaling,
    MXScaling,
    NVFP4BlockScaling,
    Recipe,
    get_recipe,
)
from minifloat.scaling import SCHEMES, AmaxHistory, Scheme, get_scheme, scale_from_amax

__version__ = "0.1.0"

__all__ = [
    # formats
    "FloatFormat",
    "NaNEncoding",
    "FORMATS",
    "get_format",
    "E4M3",
    "E5M2",
    "E3M2",
    "E2M3",
    "E2M1",
    "E8M0",
    "E4M3FNUZ",
    "E5M2FNUZ",
    # codecs and packing
    "encode",
    "decode",
    "value_table",
    "pack",
    "unpack",
    "packed_nbytes",
    # scaled quantization
    "Scheme",
    "SCHEMES",
    "get_scheme",
    "quantize",
    "dequantize",
    "fake_quantize",
    "QuantizedTensor",
    "AmaxHistory",
    "scale_from_amax",
    "save",
    "load",
    # training
    "Recipe",
    "RECIPES",
    "get_recipe",
    "DelayedScaling",
    "CurrentScaling",
    "Float8BlockScaling",
    "MXScaling",
    "NVFP4BlockScaling",
    "Linear",
    "convert",
    "autocast",
    "LossScaler",
    "monitor",
    "Monitor",
    # inference
    "quantize_model",
    "calibrate",
    "QuantizedLinear",
    # errors
    "MinifloatError",
    "UnknownFormatError",
    "DTypeError",
    "CodeRangeError",
    "PackingError",
    "RoundingError",
    "CorruptFileError",
]
