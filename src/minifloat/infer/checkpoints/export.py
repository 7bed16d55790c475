"""Serving checkpoints of a quantized transformers model: `export` writes, `load_quantized` reads.

Two formats, with the tensor names, dtypes, shapes and scale conventions of the libraries that
define them (read from their sources):

``compressed-tensors`` (what llm-compressor writes and vLLM serves). ``config.json`` gets a
``quantization_config`` with ``quant_method: "compressed-tensors"``, one config group targeting
``Linear`` (its ``weights`` / ``input_activations`` QuantizationArgs and ``format``) and ``ignore``
(every Linear kept in high precision). Per quantized layer ``<p>``:

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
groups, so a layer with a partial group is refused, naming it (minifloat itself runs it). A
partial 128×128 block is written in ``compressed-tensors`` (its readers pad) and refused in
``hf-fp8``: transformers' fine-grained FP8 loader dequantizes only whole blocks on a CPU.
`quantize_model(..., export_format=...)` keeps such layers in high precision instead.

``hf-fp8`` (DeepSeek-V3; transformers' fine-grained FP8, fp8-block only): ``quantization_config =
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
[128, 128], "modules_to_not_convert": [...]}``; ``<p>.weight`` float8_e4m3fn and
``<p>.weight_scale_inv`` float32 (⌈N/128⌉, ⌈K/128⌉), multiplied on dequantize despite its name.

A quantized LM head (`quantize_model(..., quantize_head=True)`) is a quantized layer like the
others, weight-only; its input embedding (a `QuantizedEmbedding`, tied or not) is written as the
exact values of its packed table in the embedding's dtype, since no reader looks tokens up in a
packed table, and ``tie_word_embeddings`` becomes false — as llm-compressor unties a quantized head.

Everything else (embeddings, norms, ignored layers) is written in its own dtype; the model's own
config fields are kept, the tokenizer files of the folder it came from copied. Shards of at
most `max_shard_bytes` with a ``model.safetensors.index.json``. The folder is written beside the
target under a hidden name and renamed into place when complete: a killed export leaves no
folder that looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.registry import E4M3
from minifloat.infer.modules.embedding import QuantizedEmbedding
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.config import QuantConfig
from minifloat.io.atomic import atomic_path, fsync_dir, make_dir_beside, new_file_mode, remove
from minifloat.quant import QuantizedTensor
from minifloat.scaling.schemes import Scheme

FORMATS = ("compressed-tensors", "hf-fp8")
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


def holds_hf_fp8(config: QuantConfig) -> bool:
    """Whether transformers' fine-grained FP8 (``hf-fp8``, DeepSeek-V3's) holds `config`: E4M3
    weights with FP32 scales per 128×128 block, inputs E4M3 per 1×128 group, each input's own."""
    w, a = config.weight_scheme, config.activation_scheme
    e4m3_blocks = lambda s, block: (  # noqa: E731
        s is not None and s.element == "e4m3" and s.granularity == "block" and tuple(s.block) == block
        and s.scale_format == "fp32"
    )  # fmt: skip
    return e4m3_blocks(w, (128, 128)) and e4m3_blocks(a, (1, 128)) and not config.static


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")  # fmt: skip
DEFAULT_SHARD_BYTES = 2 * 1024**3


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


def _codes(q: QuantizedTensor) -> torch.Tensor:
    """The packed codes cropped to the tensor's shape (rows, packed columns)."""
    n, k = q.shape
    return q.data[:n, : k * q.scheme.element_format.bits // 8].contiguous()


def layer_tensors(prefix: str, layer: QuantizedLinear, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized layer in `fmt` (see the module docstring)."""
    if layer.input_transform is not None:
        raise MinifloatError(f"layer {prefix!r} transforms its input before the GEMM ({type(layer.input_transform).__name__}); "
                             f"no {fmt} reader applies such a transform: quantize without it to export")  # fmt: skip
    q, c = layer.checkpoint_weight(), layer.config
    s = q.scheme
    n, k = q.shape
    if (why := unreadable(s, n, k, fmt)) is not None:
        raise MinifloatError(f"layer {prefix!r} {why}: keep it in high precision (ignore=[{prefix!r}]; "
                             f"quantize_model(..., export_format={fmt!r}) does so itself)")  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    if fmt == "hf-fp8":
        if not holds_hf_fp8(c):
            raise MinifloatError(f"format 'hf-fp8' holds fp8-block layers (E4M3 weights in 128×128 blocks, inputs in "
                                 f"dynamic 1×128 groups); {prefix} is {c.name} ({c.weight}, input {c.activation}): "
                                 f"use 'compressed-tensors'")  # fmt: skip
        out[f"{prefix}.weight"] = _codes(q).view(torch.float8_e4m3fn)
        out[f"{prefix}.weight_scale_inv"] = q.scale.contiguous()
    elif s.element_format.bits == 8:
        out[f"{prefix}.weight"] = _codes(q).view(torch.float8_e4m3fn)
        if s.is_mx:
            out[f"{prefix}.weight_scale"] = q.scale[:n].contiguous()
        elif s.granularity == "tensor":
            out[f"{prefix}.weight_scale"] = q.scale.reshape(1).contiguous()
        elif s.granularity == "row":
            out[f"{prefix}.weight_scale"] = q.scale[:n].reshape(n, 1).contiguous()
        else:
            out[f"{prefix}.weight_scale"] = q.scale.contiguous()
    else:
        out[f"{prefix}.weight_packed"] = _codes(q)
        out[f"{prefix}.weight_scale"] = (
            q.scale[:n].contiguous().view(torch.float8_e4m3fn if s.is_nvfp4 else torch.uint8)
        )
        if s.is_nvfp4:
            out[f"{prefix}.weight_global_scale"] = _inverted(q.tensor_scale)
    if layer.input_amax is not None:
        a = c.activation_scheme
        if a.is_nvfp4:
            from minifloat.scaling.rules import nvfp4_global_scale

            out[f"{prefix}.input_global_scale"] = nvfp4_global_scale(layer.input_amax).reshape(1)
        else:
            out[f"{prefix}.input_scale"] = (layer.input_amax / a.element_format.max).float().reshape(1)
    if layer.bias is not None:
        out[f"{prefix}.bias"] = layer.bias
    return out


def unreadable(s, n: int, k: int, fmt: str) -> str | None:
    """Why no reader of `fmt` loads an (n, k) weight in scheme `s`, or None: a partial group along
    K (compressed-tensors' group and tensor-group strategies reshape K into whole groups and raise
    otherwise; its block strategy pads a partial 128×128 block, transformers' CPU loader of
    ``hf-fp8`` does not), or a row of sub-byte codes that is not whole bytes."""
    if k * s.element_format.bits % 8:
        return f"a row of {k} {s.element} codes is not whole bytes, as {fmt} stores rows"
    if fmt == "compressed-tensors" and ct_format(s) is None:
        return (f"is {s.name} ({s.element} with {s.scale_format} scales), which compressed-tensors has no format for "
                f"(its 8-bit floats are E4M3, 6-bit E2M3, 4-bit E2M1)")  # fmt: skip
    if fmt == "hf-fp8" and s.granularity == "block" and (n % s.block[0] or k % s.block[1]):
        return (f"({n}×{k}) has a partial 128×128 block, which transformers' fine-grained FP8 loader does not "
                f"dequantize on a CPU (format 'compressed-tensors' pads it)")  # fmt: skip
    if s.granularity == "block" and s.block[0] == 1 and k % s.block[1]:
        return (f"in_features={k} is not a multiple of the {s.block[1]}-value groups of {s.name}: compressed-tensors "
                f"reads group scales of whole groups only")  # fmt: skip
    return None


def _inverted(tensor_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4's encode scale S from the decode scale 1/S that minifloat keeps."""
    return (1.0 / tensor_scale.double()).float().reshape(1)


def _dense_tensors(model: torch.nn.Module, quantized: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every other tensor of the state dict; a tensor that two names share (tied embeddings)
    once, under its first name, as transformers saves them."""
    skip = tuple(f"{p}." for p in quantized)
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if name.startswith(skip):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out


def _quantization_config(fmt: str, layers: dict[str, QuantConfig], ignore: list[str]) -> dict:
    """The ``quantization_config``: one config group per config (targeting ``Linear`` when the
    whole model has one, else its layers by name; ``format`` "mixed-precision" then)."""
    configs = list(dict.fromkeys(layers.values()))
    if fmt == "hf-fp8":
        if len(configs) != 1:
            raise MinifloatError(f"format 'hf-fp8' holds one config; this model mixes {[c.name for c in configs]}")
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": ignore}  # fmt: skip
    groups = {}
    for i, c in enumerate(configs):
        targets = ["Linear"] if len(configs) == 1 else [n for n, lc in layers.items() if lc == c]
        weights, inputs = config_args(c)
        groups[f"group_{i}"] = {"targets": targets, "weights": weights, "input_activations": inputs,
                                "output_activations": None, "format": ct_format(c.weight_scheme)}  # fmt: skip
    formats = {g["format"] for g in groups.values()}
    return {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed", "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "producer": {"name": "minifloat", "configs": [c.name for c in configs]}}  # fmt: skip


def export(
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    format: str = "compressed-tensors",
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    kv_scales: dict[int, tuple[float, float]] | None = None,
) -> Path:
    """Write the quantized transformers `model` (after `quantize_model`) to `out_dir` in `format`.

    Tokenizer files come from `tokenizer_dir`, else from the folder the model was loaded from.
    `kv_scales` (`minifloat.infer.generation.hf_cache.calibrate_kv`'s K and V amax per layer) add an FP8 KV
    cache as vLLM reads it: ``kv_cache_scheme`` (FP8 per tensor, static) and per attention module
    ``k_scale`` / ``v_scale`` (amax / 448, shape (1,), the model's dtype)."""
    from safetensors.torch import save_file

    if format not in FORMATS:
        raise MinifloatError(f"unknown export format {format!r}; use one of {', '.join(FORMATS)}")
    hf_config = getattr(model, "config", None)
    if hf_config is None or not hasattr(hf_config, "to_dict"):
        raise MinifloatError("export writes transformers models (a .config with to_dict()); got "
                             f"{type(model).__name__}")  # fmt: skip
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if not quantized:
        raise MinifloatError(
            "the model has no QuantizedLinear: run minifloat.quantize_model(model, config) first"
        )
    if max_shard_bytes < 1:
        raise MinifloatError(f"max_shard_bytes must be ≥ 1, got {max_shard_bytes}")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise MinifloatError(
            f"{out} exists; pass overwrite=True (--overwrite) to replace it, or choose another folder"
        )
    ignore = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    embeddings = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedEmbedding)}
    tensors = _dense_tensors(model, quantized | embeddings)
    for prefix, emb in embeddings.items():  # no reader looks embeddings up in a packed table: its exact values
        tensors[f"{prefix}.weight"] = emb.weight.dequantize(emb.dtype)
    for prefix, layer in quantized.items():
        tensors.update(layer_tensors(prefix, layer, format))
    config = hf_config.to_dict()
    if embeddings:  # the head is packed and the embedding written dense: no longer one tensor
        config["tie_word_embeddings"] = False
    config["quantization_config"] = _quantization_config(format, {n: m.config for n, m in quantized.items()}, ignore)
    if kv_scales is not None:
        if format != "compressed-tensors":
            raise MinifloatError("calibrated KV scales are written in the compressed-tensors format (kv_cache_scheme)")
        tensors.update(_kv_scale_tensors(model, kv_scales))
        config["quantization_config"]["kv_cache_scheme"] = {
            "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
            "dynamic": False, "observer": "minmax"}  # fmt: skip
    config.setdefault("torch_dtype", str(next(iter(tensors.values())).dtype).removeprefix("torch."))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_dir_beside(out, "export-tmp-")
    try:
        _write_shards(tensors, tmp, max_shard_bytes, save_file)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        source = (
            Path(tokenizer_dir)
            if tokenizer_dir
            else Path(str(getattr(hf_config, "_name_or_path", "") or "."))
        )
        if source.is_dir() and (tokenizer_dir or str(getattr(hf_config, "_name_or_path", ""))):
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copyfile(source / name, tmp / name)
        mode = new_file_mode(tmp)  # safetensors writes 0600: the umask's mode, as for any file the user writes
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fchmod(fh.fileno(), mode)
                os.fsync(fh.fileno())
        if out.exists():
            remove(out)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _kv_scale_tensors(model: torch.nn.Module, kv_scales: dict[int, tuple[float, float]]) -> dict[str, torch.Tensor]:
    attention = {m.layer_idx: name for name, m in model.named_modules()
                 if name.endswith("self_attn") and isinstance(getattr(m, "layer_idx", None), int)}  # fmt: skip
    missing = sorted(set(attention) - set(kv_scales))
    if missing or not attention:
        raise MinifloatError(f"kv_scales must hold every attention layer of the model; missing {missing or 'all'}")
    dtype = next(model.parameters()).dtype
    out = {}
    for i, name in attention.items():
        for kind, amax in zip(("k_scale", "v_scale"), kv_scales[i], strict=True):
            out[f"{name}.{kind}"] = torch.tensor([amax / E4M3.max], dtype=torch.float32).to(dtype)
    return out


def _write_shards(tensors: dict[str, torch.Tensor], folder: Path, max_bytes: int, save_file) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    with atomic_path(folder / "model.safetensors.index.json") as t:
        t.write_text(json.dumps(index, indent=2) + "\n")
