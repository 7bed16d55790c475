"""Inference: post-training quantization of trained models, the checkpoints serving tools read,
generation with packed KV caches, and the figures that say what a format costs. Rooms, bottom up:

- `ptq/`: the algorithms, each a function from a layer's weight and statistics to quantized
  parts: `QuantConfig` and its named configs (`config`), observers, scale searches (`scales`),
  round to nearest (`rtn`), GPTQ, rotations, smoothing, the sequential calibrator, `method`.
- `modules/`: `QuantizedLinear`, `QuantizedEmbedding`, and the bytes they hold (`accounting`).
- `checkpoints/`: one module per format (compressed-tensors, hf-fp8), `export`, `load_quantized`, `load_model`.
- `quantize`: `calibrate` and `quantize_model`, the driver that walks a model and swaps layers.
- `generation/`: `KVCache`, decoding and speculative decoding, the transformers cache bridge.
- `evaluation/`: `evaluate` and `Quality` (perplexity, KL, top-1); the quantize / eval jobs.

The models themselves (the built-in GPT, the adapters, their loaders) live in `minifloat.models`,
the text in `minifloat.data`.
"""

from minifloat.data.text import token_batches
from minifloat.infer.checkpoints.export import export
from minifloat.infer.checkpoints.load import load_quantized
from minifloat.infer.checkpoints.loaders import load_model
from minifloat.infer.evaluation.metrics import Quality, evaluate
from minifloat.infer.generation.cache import kv_bytes
from minifloat.infer.generation.decoding import Generation, calibrate_kv, generate
from minifloat.infer.generation.kvcache import KV_FORMATS, KVCache
from minifloat.infer.modules.accounting import (
    bits_per_weight,
    layer_bytes,
    linear_weight_bytes,
    model_bytes,
)
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.config import QUANT_CONFIGS, QuantConfig, get_quant_config
from minifloat.infer.quantize import (
    Calibration,
    LayerSummary,
    QuantizeSummary,
    calibrate,
    quantize_model,
)
from minifloat.models.loading import load_gpt
from minifloat.models.opt import gpt_to_transformers

__all__ = [
    "QUANT_CONFIGS",
    "QuantConfig",
    "get_quant_config",
    "QuantizedLinear",
    "Calibration",
    "LayerSummary",
    "QuantizeSummary",
    "calibrate",
    "model_bytes",
    "quantize_model",
    "export",
    "load_quantized",
    "load_model",
    "load_gpt",
    "gpt_to_transformers",
    "evaluate",
    "token_batches",
    "Quality",
    "linear_weight_bytes",
    "layer_bytes",
    "bits_per_weight",
    "kv_bytes",
    "KV_FORMATS",
    "KVCache",
    "Generation",
    "generate",
    "calibrate_kv",
]
