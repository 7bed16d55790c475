"""`load_quantized`: a checkpoint in one of `minifloat.infer.checkpoints.export.FORMATS` (compressed-tensors, hf-fp8,
written by minifloat or by other tools, such as DeepSeek-V3's FP8 weights) into a transformers
model whose quantized Linears are `QuantizedLinear`, without dequantizing.

Every tensor is checked against what its layer needs (name, dtype, shape) before any is used: a
malformed checkpoint is a `MinifloatError` naming the tensor. An NVFP4 global scale S that is not
a power of two (other tools' checkpoints) is kept as its float32 inverse 1/S, so that minifloat's
decode (× 1/S) can differ from a reader's (÷ S) by one float32 rounding; minifloat writes powers
of two, which agree exactly.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.checkpoints.export import FORMATS
from minifloat.infer.checkpoints.tensors import CheckpointTensors
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.config import QuantConfig
from minifloat.models.conv1d import linears_from_conv1d
from minifloat.models.experts import unfuse_experts
from minifloat.nn.convert import swap_modules
from minifloat.quant import QuantizedTensor
from minifloat.scaling.layout import layout_for


def format_of(qc: dict):
    """The format module whose ``quant_method`` a ``quantization_config`` names."""
    method = qc.get("quant_method")
    for fmt in FORMATS.values():
        if fmt.QUANT_METHOD == method:
            return fmt
    methods = " and ".join(repr(f.QUANT_METHOD) for f in FORMATS.values())
    raise MinifloatError(f"quant_method={method!r}: load_quantized reads {methods} checkpoints")


def configs_from_quantization_config(qc: dict) -> list[tuple[list[str], QuantConfig]]:
    """(targets, `QuantConfig`) of each config group a checkpoint's ``quantization_config``
    describes; targets are ``Linear``, layer names, or ``re:`` patterns."""
    return format_of(qc).configs(qc)


def config_from_quantization_config(qc: dict) -> QuantConfig:
    """The `QuantConfig` of a checkpoint with one config group."""
    found = configs_from_quantization_config(qc)
    if len(found) != 1:
        raise MinifloatError(f"the checkpoint has {len(found)} config groups; use configs_from_quantization_config")
    return found[0][1]


def _config_for(name: str, module, groups: list[tuple[list[str], QuantConfig]]) -> QuantConfig | None:
    for targets, c in groups:
        for t in targets:
            if t == name or t == type(module).__name__ or (t.startswith("re:") and re.match(t[3:], name)):
                return c
    return None


def _ignored(name: str, ignore: list[str]) -> bool:
    for p in ignore:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p:
            return True
    return False


def _quantized_layer(p: str, linear: torch.nn.Linear, c: QuantConfig, fmt, ts: CheckpointTensors) -> QuantizedLinear:
    s = c.weight_scheme
    n, k = linear.out_features, linear.in_features
    lay = layout_for((n, k), s)
    bits = s.element_format.bits
    if bits == 8:
        codes = ts.get(f"{p}.weight", torch.float8_e4m3fn, (n, k)).view(torch.uint8)
    else:
        codes = ts.get(f"{p}.weight_packed", torch.uint8, (n, k * bits // 8))
    grid = (lay.rows_pad // lay.block_rows, lay.cols_pad // lay.block_cols)
    scale, tensor_scale = fmt.read_scales(p, c, n, grid, ts)
    data = torch.zeros(lay.rows_pad, lay.cols_pad * bits // 8, dtype=torch.uint8)
    data[:n, : codes.shape[1]] = codes
    weight = QuantizedTensor(data, scale.contiguous(), tensor_scale, (n, k), s, linear.weight.dtype)
    amax = fmt.read_input_amax(p, c, ts)
    bias = (
        ts.get(f"{p}.bias", linear.bias.dtype, tuple(linear.bias.shape)) if linear.bias is not None else None
    )
    return QuantizedLinear(weight, bias, c, input_amax=amax)


def load_quantized(path: str | os.PathLike[str]) -> torch.nn.Module:
    """The transformers causal LM saved at `path` in a quantized format, its quantized Linears as
    `QuantizedLinear` modules holding the checkpoint's codes and scales; in eval mode. A GGUF
    file's MXFP4 / NVFP4 blocks likewise (`minifloat.infer.checkpoints.gguf_file.load`)."""
    if Path(path).is_file() and Path(path).suffix.lower() == ".gguf":
        from minifloat.infer.checkpoints import gguf_file

        return gguf_file.load(path)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:  # pragma: no cover - transformers is a test extra / optional integration
        raise MinifloatError("load_quantized builds transformers models: pip install transformers") from None
    folder = Path(path)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise MinifloatError(f"{folder}: no config.json; not a model folder")
    raw = json.loads(cfg_path.read_text())
    qc = raw.pop("quantization_config", None)
    if not qc:
        raise MinifloatError(f"{cfg_path}: no quantization_config; load it with transformers directly")
    fmt = format_of(qc)
    groups = fmt.configs(qc)
    ignore = fmt.ignored(qc)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise MinifloatError(f"{cfg_path}: no model_type")
    hf_config = AutoConfig.for_model(model_type, **raw)
    dtype = getattr(
        torch, str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch."), None
    )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise MinifloatError(
            f"{cfg_path}: torch_dtype {raw.get('torch_dtype')!r} is not a floating-point dtype"
        )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:  # on the CPU, not the meta device: non-persistent buffers (rotary frequencies) need their values
        model = AutoModelForCausalLM.from_config(hf_config)
    finally:
        torch.set_default_dtype(previous)
    linears_from_conv1d(model)  # the modules the export was written from: Conv1D as Linear, one Linear per expert
    unfuse_experts(model)
    ts = CheckpointTensors(folder)
    swaps: dict[str, torch.nn.Module] = {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or _ignored(name, ignore):
            continue
        if not any(f"{name}.{t}" in ts for t in ("weight_packed", "weight_scale", "weight_scale_inv")):
            if f"{name}.weight" in ts and ts.dtype(f"{name}.weight") not in (torch.float32, torch.bfloat16, torch.float16):
                scale = fmt.SCALE_TENSOR
                raise MinifloatError(f"checkpoint tensor {name + '.' + scale!r} is missing ({name}.weight is "
                                     f"{ts.dtype(name + '.weight')}, codes without their scale)")  # fmt: skip
            implicit = not fmt.CONVERTS_OUTPUT_EMBEDDING and m is model.get_output_embeddings()
            if f"{name}.weight" in ts and _config_for(name, m, groups) is not None and not implicit:
                raise MinifloatError(
                    f"{folder}: checkpoint tensor {name + '.weight'!r} is a dense {ts.dtype(name + '.weight')} tensor "
                    f"without scales, but the quantization_config quantizes {name} (no ignore entry names it): the "
                    f"config and the tensors disagree; re-export the checkpoint, or list {name} in its ignore"
                )
            continue  # written dense (an ignore pattern names it)
        config = _config_for(name, m, groups)
        if config is None:
            raise MinifloatError(f"checkpoint layer {name!r} holds quantized tensors but no config group targets it")
        swaps[name] = _quantized_layer(name, m, config, fmt, ts)
    by_old = {id(model.get_submodule(n)): q for n, q in swaps.items()}
    swap_modules(model, list(swaps), lambda old: by_old[id(old)])
    dense = {k: h.get_tensor(k) for k, h in ts.where.items() if k not in ts.used}
    missing, unexpected = model.load_state_dict(dense, strict=False)
    quantized = tuple(f"{n}." for n in swaps)
    missing = [k for k in missing if not k.startswith(quantized)]
    if getattr(hf_config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise MinifloatError(
            f"{folder}: tensors missing from the checkpoint: {missing[:5]}; not used: {unexpected[:5]}"
        )
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()
