"""compressed-tensors (what llm-compressor writes and vLLM serves): one module for both directions.

``config.json`` gets a ``quantization_config`` with ``quant_method: "compressed-tensors"``, one
config group per config (targeting ``Linear`` when the model has one; its ``weights`` /
``input_activations`` QuantizationArgs and ``format``) and ``ignore`` (every Linear kept in high
precision). The format comes from what the weight's scheme is (`ct_format`). Per quantized layer
``<p>``:

====================  ==========================================================================
format                tensors
====================  ==========================================================================
float-quantized       ``<p>.weight`` float8_e4m3fn (N, K); ``<p>.weight_scale`` float32, the
                      decode scale (value = code × scale): (N, 1) per channel, (1,) per tensor,
                      (⌈N/128⌉, ⌈K/128⌉) per 128×128 block, a partial last block padded by the
                      readers; ``<p>.input_scale`` (1,) when static
mxfp8-quantized       ``<p>.weight`` float8_e4m3fn; ``<p>.weight_scale`` uint8 E8M0 (N, K/32),
                      2^(code − 127)
mxfp4-pack-quantized  ``<p>.weight_packed`` uint8 (N, K/2), the even column in the low nibble;
                      ``<p>.weight_scale`` uint8 E8M0 (N, K/32)
mxfp6-pack-quantized  ``<p>.weight_packed`` uint8 (N, 3K/4), E2M3, four codes little-endian in
                      three bytes; ``<p>.weight_scale`` uint8 E8M0
nvfp4-pack-quantized  ``<p>.weight_packed`` uint8 (N, K/2); ``<p>.weight_scale`` float8_e4m3fn
                      (N, K/16); ``<p>.weight_global_scale`` float32 (1,), stored inverted: the
                      encode scale S = 448·6 / amax, value = code × scale / S;
                      ``<p>.input_global_scale`` likewise for the calibrated input
====================  ==========================================================================

Group scales (MX, NVFP4) need K a multiple of the group: compressed-tensors reshapes K into whole
groups, so a layer with a partial group is refused, naming it (minifloat itself runs it). Reading
back, a group matches a named config by its QuantizationArgs, else the schemes they describe
(a hand-built config's checkpoint reads back as well as a named one's); minifloat's own
checkpoints name their configs, so a choice the format does not record (Four Over Six's input
scaling) comes back with them.
"""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.checkpoints.tensors import FLOATS, CheckpointTensors, codes
from minifloat.infer.ptq.config import QUANT_CONFIGS, QuantConfig
from minifloat.quant import QuantizedTensor
from minifloat.scaling import rules
from minifloat.scaling.schemes import SCHEMES, Scheme

NAME = "compressed-tensors"
QUANT_METHOD = "compressed-tensors"
SCALE_TENSOR = "weight_scale"  # a quantized layer's scale tensor, by which a reader recognises it
CONVERTS_OUTPUT_EMBEDDING = True  # the head is quantized when the config's targets name it

# compressed-tensors' element formats: 8-bit floats are E4M3, 6-bit E2M3 (its MXFP6), 4-bit E2M1
_CT_ELEMENTS = {8: "e4m3", 6: "e2m3", 4: "e2m1"}


def ct_format(scheme: Scheme) -> str | None:
    """The compressed-tensors format that holds weights in `scheme`, from what the scheme is
    (element format, scale format, granularity), or None where compressed-tensors has none:
    NVFP4 (E2M1, E4M3 block scales, FP32 tensor scale) is ``nvfp4-pack-quantized``; MX (E8M0
    block scales) ``mxfp8-quantized`` / ``mxfp6-pack-quantized`` / ``mxfp4-pack-quantized``; E4M3
    with FP32 scales per tensor, row or block ``float-quantized``."""
    e = scheme.element_format
    if _CT_ELEMENTS.get(e.bits) != e.name:
        return None
    if scheme.is_nvfp4:
        return "nvfp4-pack-quantized"
    if scheme.is_mx:
        return {8: "mxfp8-quantized", 6: "mxfp6-pack-quantized", 4: "mxfp4-pack-quantized"}[e.bits]
    return "float-quantized" if e.bits == 8 and scheme.scale_format == "fp32" else None


def ct_args(s: Scheme | None, role: str, static: bool = False) -> dict | None:
    """compressed-tensors QuantizationArgs (as JSON) of scheme `s` in `role` ("weights" or
    "input_activations"; `static`: a calibrated input scale)."""
    if s is None:
        return None
    bits = s.element_format.bits
    args: dict = {"num_bits": bits, "type": "float", "symmetric": True, "group_size": None}
    if s.is_nvfp4:
        args |= {"group_size": s.block[1], "strategy": "tensor_group", "scale_dtype": "torch.float8_e4m3fn"}
    elif s.is_mx:
        args |= {"group_size": s.block[1], "strategy": "group", "scale_dtype": "torch.uint8"}
    elif s.granularity == "tensor":
        args["strategy"] = "tensor"
    elif s.granularity == "row":
        args["strategy"] = "channel" if role == "weights" else "token"
    elif s.block[0] == 1:
        args |= {"group_size": s.block[1], "strategy": "group"}
    else:
        args |= {"strategy": "block", "block_structure": list(s.block)}
    if role == "weights":
        args["dynamic"] = False
    else:
        args["dynamic"] = "local" if (static and s.is_nvfp4) else (not static)
        if static:
            args["observer"] = "static_minmax"
    return args


def config_args(c: QuantConfig) -> tuple[dict, dict | None]:
    """The QuantizationArgs of `c`'s weights and inputs."""
    return ct_args(c.weight_scheme, "weights"), ct_args(c.activation_scheme, "input_activations", c.static)


def _inverted(tensor_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4's encode scale S from the decode scale 1/S that minifloat keeps."""
    return (1.0 / tensor_scale.double()).float().reshape(1)


def unreadable(s: Scheme, n: int, k: int) -> str | None:
    """Why compressed-tensors' readers cannot load an (n, k) weight in `s`, or None."""
    if ct_format(s) is None:
        return (f"is {s.name} ({s.element} with {s.scale_format} scales), which compressed-tensors has no format for "
                f"(its 8-bit floats are E4M3, 6-bit E2M3, 4-bit E2M1)")  # fmt: skip
    if s.granularity == "block" and s.block[0] == 1 and k % s.block[1]:
        return (f"in_features={k} is not a multiple of the {s.block[1]}-value groups of {s.name}: compressed-tensors "
                f"reads group scales of whole groups only")  # fmt: skip
    return None


def layer_tensors(prefix: str, q: QuantizedTensor, config: QuantConfig, input_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The tensors of one quantized layer's weight `q` and calibrated input (see the module docstring)."""
    s = q.scheme
    n, _ = q.shape
    out: dict[str, torch.Tensor] = {}
    if s.element_format.bits == 8:
        out[f"{prefix}.weight"] = codes(q).view(torch.float8_e4m3fn)
        if s.is_mx:
            out[f"{prefix}.weight_scale"] = q.scale[:n].contiguous()
        elif s.granularity == "tensor":
            out[f"{prefix}.weight_scale"] = q.scale.reshape(1).contiguous()
        elif s.granularity == "row":
            out[f"{prefix}.weight_scale"] = q.scale[:n].reshape(n, 1).contiguous()
        else:
            out[f"{prefix}.weight_scale"] = q.scale.contiguous()
    else:
        out[f"{prefix}.weight_packed"] = codes(q)
        out[f"{prefix}.weight_scale"] = (
            q.scale[:n].contiguous().view(torch.float8_e4m3fn if s.is_nvfp4 else torch.uint8)
        )
        if s.is_nvfp4:
            out[f"{prefix}.weight_global_scale"] = _inverted(q.tensor_scale)
    if input_amax is not None:
        a = config.activation_scheme
        if a.is_nvfp4:
            out[f"{prefix}.input_global_scale"] = rules.nvfp4_global_scale(input_amax).reshape(1)
        else:
            out[f"{prefix}.input_scale"] = (input_amax / a.element_format.max).float().reshape(1)
    return out


def quantization_config(layers: dict[str, QuantConfig], ignore: list[str]) -> dict:
    """The ``quantization_config``: one config group per config (targeting ``Linear`` when the
    whole model has one, else its layers by name; ``format`` "mixed-precision" then)."""
    configs = list(dict.fromkeys(layers.values()))
    groups = {}
    for i, c in enumerate(configs):
        targets = ["Linear"] if len(configs) == 1 else [n for n, lc in layers.items() if lc == c]
        weights, inputs = config_args(c)
        groups[f"group_{i}"] = {"targets": targets, "weights": weights, "input_activations": inputs,
                                "output_activations": None, "format": ct_format(c.weight_scheme)}  # fmt: skip
    formats = {g["format"] for g in groups.values()}
    return {"quant_method": QUANT_METHOD, "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed", "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "producer": {"name": "minifloat", "configs": [c.name for c in configs]}}  # fmt: skip


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


def configs(qc: dict) -> list[tuple[list[str], QuantConfig]]:
    """(targets, `QuantConfig`) of each config group of a compressed-tensors ``quantization_config``."""
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


def ignored(qc: dict) -> list[str]:
    """The layers (names or ``re:`` patterns) the checkpoint keeps in high precision."""
    return list(qc.get("ignore") or [])


def read_scales(p: str, c: QuantConfig, n: int, grid: tuple[int, int], ts: CheckpointTensors):
    """A layer's weight scales (the layout's grid) and NVFP4 tensor scale (or None)."""
    s = c.weight_scheme
    if s.is_mx:
        return ts.get(f"{p}.weight_scale", torch.uint8, grid), None
    if s.is_nvfp4:
        scale = ts.get(f"{p}.weight_scale", torch.float8_e4m3fn, grid).view(torch.uint8)
        g = ts.get(f"{p}.weight_global_scale", torch.float32, (1,))
        return scale, (1.0 / g.double()).float().reshape(())
    shape = {"tensor": (1,), "row": (n, 1)}.get(s.granularity, grid)
    return ts.get(f"{p}.weight_scale", FLOATS, shape).float().reshape(grid), None


def read_input_amax(p: str, c: QuantConfig, ts: CheckpointTensors) -> torch.Tensor | None:
    """A static config's calibrated input amax, from its stored scale; None for dynamic inputs."""
    if not c.static:
        return None
    a = c.activation_scheme
    if a.is_nvfp4:
        g = ts.get(f"{p}.input_global_scale", torch.float32, (1,))
        return torch.tensor(rules.NVFP4_GLOBAL_NUMERATOR) / g.reshape(())
    return ts.get(f"{p}.input_scale", FLOATS, (1,)).float().reshape(()) * a.element_format.max
