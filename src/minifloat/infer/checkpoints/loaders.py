"""`load_model` for inference: the loaders of `minifloat.models.loading` (the built-in GPT, GGUF
files, transformers model folders) and the quantized checkpoints minifloat exports
(`load_quantized`, their QuantizedLinear layers packed as they were written), GGUF files with
FP4 blocks among them (`gguf_file.load`).

A quantized checkpoint is also a transformers folder; tried before the transformers loader, it
loads into minifloat's own modules rather than transformers' dequantizing reader.
"""

from __future__ import annotations

import os

import torch

from minifloat.infer.checkpoints import gguf_file
from minifloat.infer.checkpoints.load import load_quantized
from minifloat.models.loading import Loader, gguf_header, hf_config
from minifloat.models.loading import load_model as load_unquantized

QUANTIZED = Loader("quantized", lambda p: bool((hf_config(p) or {}).get("quantization_config")), load_quantized,
                   "a quantized checkpoint (config.json with quantization_config)")  # fmt: skip

GGUF_FP4 = Loader("gguf-fp4", lambda p: gguf_header(p) and gguf_file.fp4_tensors(p), gguf_file.load,
                  "a GGUF file with MXFP4 / NVFP4 blocks (read with the codes intact)")  # fmt: skip


def load_model(path: str | os.PathLike[str]) -> torch.nn.Module:
    """The model at `path`: a quantized checkpoint (`load_quantized`), a `minifloat train` output
    or checkpoint (the built-in GPT), a GGUF file, or a transformers model folder."""
    return load_unquantized(path, specific=(GGUF_FP4, QUANTIZED))
