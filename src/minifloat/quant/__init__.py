"""Quantized tensors: `quantize` / `dequantize` / `fake_quantize`, `QuantizedTensor`, the
random Hadamard transform, and `save` / `load` (safetensors, no pickle)."""

from minifloat.quant.api import QUANTIZE_DTYPES, BlockScales, block_scales, dequantize, fake_quantize, quantize  # noqa: I001
from minifloat.quant.api import quantize_with_scales
from minifloat.quant.hadamard import hadamard_matrix, hadamard_signs, rht
from minifloat.quant.serialization import CorruptFileError, load, save
from minifloat.quant.tensor import QuantizedTensor, check_parts, dequantize_rows

__all__ = [
    "quantize", "dequantize", "fake_quantize", "BlockScales", "block_scales", "quantize_with_scales", "QuantizedTensor", "check_parts", "dequantize_rows", "QUANTIZE_DTYPES",
    "rht", "hadamard_signs", "hadamard_matrix", "save", "load", "CorruptFileError",
]  # fmt: skip
