"""`load_quantized`: a compressed-tensors or hf-fp8 checkpoint (`minifloat.infer.checkpoints.export`'s formats,
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
from minifloat.infer.checkpoints.export import config_args, ct_args, ct_format
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.config import QUANT_CONFIGS, QuantConfig
from minifloat.nn.convert import swap_modules
from minifloat.quant import QuantizedTensor
from minifloat.scaling import rules
from minifloat.scaling.layout import layout_for
from minifloat.scaling.schemes import SCHEMES

_ARG_KEYS = ("num_bits", "type", "strategy", "group_size", "block_structure", "dynamic")


def _norm(args: dict | None) -> tuple | None:
    if args is None:
        return None
    d = {k: args.get(k) for k in _ARG_KEYS}
    d["block_structure"] = tuple(d["block_structure"]) if d["block_structure"] else None
    d["dynamic"] = str(d["dynamic"]).lower()
    if d["strategy"] in ("tensor", "channel", "token", "block"):
        d["group_size"] = None
    return tuple(d.values())


def _scheme_of(args: dict | None, role: str, static: bool) -> str | None:
    """The scheme (a `SCHEMES` name) whose QuantizationArgs in `role` are `args`, or None."""
    want = _norm(args)
    return next((name for name, s in SCHEMES.items() if _norm(ct_args(s, role, static)) == want), None)


def _config_of_group(group: dict) -> QuantConfig:
    """The named config a group's QuantizationArgs describe, or one built from the schemes they
    describe: a checkpoint of a hand-built config reads back as well as a named one's."""
    if group.get("output_activations"):
        raise MinifloatError("the checkpoint quantizes output activations; load_quantized does not")
    want = (_norm(group.get("weights")), _norm(group.get("input_activations")))
    for c in QUANT_CONFIGS.values():
        if tuple(_norm(a) for a in config_args(c)) == want:
            return c
    inputs = group.get("input_activations")
    static = bool(inputs) and str(inputs.get("dynamic")).lower() in ("false", "local")
    weight = _scheme_of(group.get("weights"), "weights", False)
    activation = _scheme_of(inputs, "input_activations", static) if inputs else None
    if weight is not None and (activation is not None or not inputs):
        return QuantConfig(name=f"{weight}+{activation or 'weight-only'}", weight=weight, activation=activation, static=static)
    raise MinifloatError(
        f"no minifloat scheme matches the checkpoint's scheme (weights {group.get('weights')}, input "
        f"{group.get('input_activations')}); known configs: {', '.join(QUANT_CONFIGS)}"
    )


def configs_from_quantization_config(qc: dict) -> list[tuple[list[str], QuantConfig]]:
    """(targets, `QuantConfig`) of each config group a checkpoint's ``quantization_config``
    describes; targets are ``Linear``, layer names, or ``re:`` patterns."""
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3" or list(qc.get("weight_block_size") or []) != [128, 128]:
            raise MinifloatError(f"hf-fp8 checkpoint with fmt={qc.get('fmt')!r}, weight_block_size="
                                 f"{qc.get('weight_block_size')!r}: minifloat reads e4m3 with [128, 128] blocks")  # fmt: skip
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise MinifloatError(f"hf-fp8 activation_scheme={qc.get('activation_scheme')!r}: only 'dynamic' is read")
        return [(["Linear"], QUANT_CONFIGS["fp8-block"])]
    if method != "compressed-tensors":
        raise MinifloatError(f"quant_method={method!r}: load_quantized reads 'compressed-tensors' and 'fp8' checkpoints")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise MinifloatError("the checkpoint's quantization_config has no config_groups")
    found = [(list(g.get("targets") or ["Linear"]), _config_of_group(g)) for g in groups.values()]
    # minifloat's own checkpoints name their configs (group i ↔ configs[i]): a choice the format
    # does not record (Four Over Six's input scaling) comes back with them
    producer = qc.get("producer") or {}
    names = producer.get("configs") if producer.get("name") == "minifloat" else None
    if isinstance(names, list) and len(names) == len(found):
        for i, (g, name) in enumerate(zip(groups.values(), names, strict=True)):
            c = QUANT_CONFIGS.get(name)
            if c is not None and ct_format(c.weight_scheme) == g.get("format") and c.weight_scheme.element == found[i][1].weight_scheme.element:
                found[i] = (found[i][0], c)
    return found


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


class _Tensors:
    """The checkpoint's tensors by name, read lazily from its safetensors files."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise MinifloatError(f"{folder} has no model.safetensors nor model.safetensors.index.json")
        self.where: dict[str, object] = {}
        self._handles = []
        for f in files:
            if not (folder / f).is_file():
                raise MinifloatError(f"{folder / f}: listed in the index but missing")
            h = safe_open(str(folder / f), framework="pt", device="cpu")
            self._handles.append(h)
            for k in h.keys():
                self.where[k] = h
        self.used: set[str] = set()

    def dtype(self, name: str) -> torch.dtype:
        return self.where[name].get_tensor(name).dtype

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(
        self, name: str, dtype: torch.dtype | tuple[torch.dtype, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        if name not in self.where:
            raise MinifloatError(f"checkpoint tensor {name!r} is missing")
        t = self.where[name].get_tensor(name)
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in dtypes:
            raise MinifloatError(
                f"checkpoint tensor {name!r} is {t.dtype}; expected {' or '.join(map(str, dtypes))}"
            )
        if tuple(t.shape) != tuple(shape):
            raise MinifloatError(
                f"checkpoint tensor {name!r} has shape {tuple(t.shape)}; expected {tuple(shape)}"
            )
        self.used.add(name)
        return t


def _quantized_layer(
    p: str, linear: torch.nn.Linear, c: QuantConfig, fmt: str, ts: _Tensors
) -> QuantizedLinear:
    s = c.weight_scheme
    n, k = linear.out_features, linear.in_features
    lay = layout_for((n, k), s)
    bits = s.element_format.bits
    if bits == 8:
        codes = ts.get(f"{p}.weight", torch.float8_e4m3fn, (n, k)).view(torch.uint8)
    else:
        codes = ts.get(f"{p}.weight_packed", torch.uint8, (n, k * bits // 8))
    grid = (lay.rows_pad // lay.block_rows, lay.cols_pad // lay.block_cols)
    tensor_scale = None
    if fmt == "hf-fp8":
        scale = ts.get(f"{p}.weight_scale_inv", (torch.float32, torch.bfloat16, torch.float16), grid).float()
    elif s.is_mx:
        scale = ts.get(f"{p}.weight_scale", torch.uint8, grid)
    elif s.is_nvfp4:
        scale = ts.get(f"{p}.weight_scale", torch.float8_e4m3fn, grid).view(torch.uint8)
        g = ts.get(f"{p}.weight_global_scale", torch.float32, (1,))
        tensor_scale = (1.0 / g.double()).float().reshape(())
    else:
        shape = {"tensor": (1,), "row": (n, 1)}.get(s.granularity, grid)
        scale = (
            ts.get(f"{p}.weight_scale", (torch.float32, torch.bfloat16, torch.float16), shape)
            .float()
            .reshape(grid)
        )
    data = torch.zeros(lay.rows_pad, lay.cols_pad * bits // 8, dtype=torch.uint8)
    data[:n, : codes.shape[1]] = codes
    weight = QuantizedTensor(data, scale.contiguous(), tensor_scale, (n, k), s, linear.weight.dtype)
    amax = None
    if c.static:
        a = c.activation_scheme
        if a.is_nvfp4:
            g = ts.get(f"{p}.input_global_scale", torch.float32, (1,))
            amax = torch.tensor(rules.NVFP4_GLOBAL_NUMERATOR) / g.reshape(())
        else:
            amax = (
                ts.get(f"{p}.input_scale", (torch.float32, torch.bfloat16, torch.float16), (1,))
                .float()
                .reshape(())
                * a.element_format.max
            )
    bias = (
        ts.get(f"{p}.bias", linear.bias.dtype, tuple(linear.bias.shape)) if linear.bias is not None else None
    )
    return QuantizedLinear(weight, bias, c, input_amax=amax)


def load_quantized(path: str | os.PathLike[str]) -> torch.nn.Module:
    """The transformers causal LM saved at `path` in a quantized format, its quantized Linears as
    `QuantizedLinear` modules holding the checkpoint's codes and scales; in eval mode."""
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
    groups = configs_from_quantization_config(qc)
    fmt = "hf-fp8" if qc.get("quant_method") == "fp8" else "compressed-tensors"
    ignore = list(qc.get("modules_to_not_convert") or []) if fmt == "hf-fp8" else list(qc.get("ignore") or [])
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
    ts = _Tensors(folder)
    swaps: dict[str, torch.nn.Module] = {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or _ignored(name, ignore):
            continue
        if not any(f"{name}.{t}" in ts for t in ("weight_packed", "weight_scale", "weight_scale_inv")):
            if f"{name}.weight" in ts and ts.dtype(f"{name}.weight") not in (torch.float32, torch.bfloat16, torch.float16):
                scale = "weight_scale_inv" if fmt == "hf-fp8" else "weight_scale"
                raise MinifloatError(f"checkpoint tensor {name + '.' + scale!r} is missing ({name}.weight is "
                                     f"{ts.dtype(name + '.weight')}, codes without their scale)")  # fmt: skip
            # transformers' fine-grained FP8 (hf-fp8) never converts the output embedding, listed or not
            implicit = fmt == "hf-fp8" and m is model.get_output_embeddings()
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
