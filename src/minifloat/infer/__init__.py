"""Inference: post-training quantization of trained models, and the checkpoints serving tools read.

- `config`: `QuantConfig` and the named configs (``fp8-dynamic``, ``fp8-block``, ``nvfp4`` …).
- `linear`: `QuantizedLinear`, a Linear whose weight is a packed `QuantizedTensor`.
- `ptq`: `calibrate` and `quantize_model`, with its per-layer `QuantizeSummary`.
- `export` / `load`: compressed-tensors and hf-fp8 checkpoints (`export`, `load_quantized`).
- `models`: the built-in GPT and transformers models (`load_model`, `gpt_to_transformers`).
- `kvcache` / `decoding`: packed KV caches, decoding, speculative decoding with an FP4 draft.
- `metrics`: `evaluate` and `Quality`: perplexity, KL and top-1 against the reference, tokens/s.
- `accounting`: bytes of models, layers and KV caches; bits per weight over an explicit scope.
- `adapter`: what each kind of model (built-in GPT, transformers) is to inference.
- `observers` / `rtn`: the PTQ stages: calibration statistics, round-to-nearest.
"""

from minifloat.infer.accounting import (
    bits_per_weight,
    kv_bytes,
    layer_bytes,
    linear_weight_bytes,
    model_bytes,
)
from minifloat.infer.config import QUANT_CONFIGS, QuantConfig, get_quant_config
from minifloat.infer.decoding import Generation, calibrate_kv, generate
from minifloat.infer.export import export
from minifloat.infer.kvcache import KV_FORMATS, KVCache
from minifloat.infer.linear import QuantizedLinear
from minifloat.infer.load import load_quantized
from minifloat.infer.metrics import Quality, evaluate, token_batches
from minifloat.infer.models import gpt_to_transformers, load_gpt, load_model
from minifloat.infer.ptq import (
    Calibration,
    LayerSummary,
    QuantizeSummary,
    calibrate,
    quantize_model,
)

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
