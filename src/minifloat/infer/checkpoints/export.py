"""`export`: a quantized transformers model as a serving checkpoint, in one of `FORMATS` — each a
module that knows its own tensors and ``quantization_config`` both ways (`compressed_tensors`:
what llm-compressor writes and vLLM serves; `hf_fp8`: transformers' fine-grained FP8) — or as
one GGUF file llama.cpp runs (`gguf_file`, ``format="gguf"``: FP4 blocks ggml holds exactly). This
module holds what they share: which layers a format's readers cannot load (`unreadable`), the
dense rest of the model, shards, tokenizer files, and the atomic write.

A layer a format's readers cannot load is refused, naming it; `quantize_model(...,
export_format=...)` keeps such layers in high precision instead.

A quantized LM head (`quantize_model(..., quantize_head=True)`) is a quantized layer like the
others, weight-only; its input embedding (a `QuantizedEmbedding`, tied or not) is written as the
exact values of its packed table in the embedding's dtype, since no reader looks tokens up in a
packed table, and ``tie_word_embeddings`` becomes false — as llm-compressor unties a quantized head.

Everything else (embeddings, norms, ignored layers) is written in its own dtype; the model's own
config fields are kept, the tokenizer files of the folder it came from copied. Shards of at
most `max_shard_bytes` with a ``model.safetensors.index.json``. The folder is written beside the
target under a hidden name and renamed into place when complete: a killed export leaves no
folder that looks like a checkpoint; its files get the mode the umask gives.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.registry import E4M3
from minifloat.infer.checkpoints import compressed_tensors, gguf_file, hf_fp8
from minifloat.infer.modules.embedding import QuantizedEmbedding
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.io.atomic import atomic_path, make_dir_beside, replace_dir
from minifloat.scaling.schemes import Scheme

FORMATS = {m.NAME: m for m in (compressed_tensors, hf_fp8)}
"""The checkpoint formats by name, each a module: ``unreadable``, ``layer_tensors``,
``quantization_config`` to write; ``QUANT_METHOD``, ``SCALE_TENSOR``, ``CONVERTS_OUTPUT_EMBEDDING``,
``configs``, ``ignored``, ``read_scales``, ``read_input_amax`` to read."""
EXPORT_FORMATS = (*FORMATS, gguf_file.NAME)
"""What `export` writes: the checkpoint folders of `FORMATS` and GGUF files."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")  # fmt: skip
DEFAULT_SHARD_BYTES = 2 * 1024**3


def layer_tensors(prefix: str, layer: QuantizedLinear, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized layer in `fmt` (its format module's, and the bias)."""
    if (why := layer.beyond_weight()) is not None:
        raise MinifloatError(f"layer {prefix!r} {why}; no {fmt} reader applies that: quantize without it to export")
    q = layer.checkpoint_weight()
    n, k = q.shape
    if (why := unreadable(q.scheme, n, k, fmt)) is not None:
        raise MinifloatError(f"layer {prefix!r} {why}: keep it in high precision (ignore=[{prefix!r}]; "
                             f"quantize_model(..., export_format={fmt!r}) does so itself)")  # fmt: skip
    out = FORMATS[fmt].layer_tensors(prefix, q, layer.config, layer.input_amax)
    if layer.bias is not None:
        out[f"{prefix}.bias"] = layer.bias
    return out


def unreadable(s: Scheme, n: int, k: int, fmt: str) -> str | None:
    """Why no reader of `fmt` loads an (n, k) weight in scheme `s`, or None: a row of sub-byte
    codes that is not whole bytes (every format stores rows), or what the format's module says."""
    if k * s.element_format.bits % 8:
        return f"a row of {k} {s.element} codes is not whole bytes, as {fmt} stores rows"
    if fmt == gguf_file.NAME:
        return gguf_file.unreadable(s, n, k)
    return FORMATS[fmt].unreadable(s, n, k)


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


def export(
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    format: str = "compressed-tensors",
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    kv_scales: dict[int, tuple[float, float]] | None = None,
    gguf_source: str | os.PathLike[str] | None = None,
    gguf_rest: str = "q8_0",
) -> Path:
    """Write the quantized transformers `model` (after `quantize_model`) to `out_dir` in `format`.

    ``format="gguf"`` writes one file, `out_dir`, with llama.cpp's metadata, tokenizer and tensor
    names taken from `gguf_source`, the GGUF or transformers folder the model was loaded from, the
    dense rest in `gguf_rest` (`minifloat.infer.checkpoints.gguf_file`).

    Tokenizer files come from `tokenizer_dir`, else from the folder the model was loaded from.
    `kv_scales` (`minifloat.infer.generation.hf_cache.calibrate_kv`'s K and V amax per layer) add an FP8 KV
    cache as vLLM reads it: ``kv_cache_scheme`` (FP8 per tensor, static) and per attention module
    ``k_scale`` / ``v_scale`` (amax / 448, shape (1,), the model's dtype)."""
    from safetensors.torch import save_file

    if format == gguf_file.NAME:
        if kv_scales is not None:
            raise MinifloatError("calibrated KV scales are written in the compressed-tensors format (kv_cache_scheme); "
                                 "llama.cpp sets its own KV cache type (--cache-type-k)")  # fmt: skip
        if gguf_source is None:
            raise MinifloatError("format='gguf' takes llama.cpp's metadata and tokenizer from the GGUF or transformers "
                                 "folder the model was loaded from: pass gguf_source=")  # fmt: skip
        return gguf_file.write(model, out_dir, source=gguf_source, rest=gguf_rest, overwrite=overwrite)
    if format not in FORMATS:
        raise MinifloatError(f"unknown export format {format!r}; use one of {', '.join(EXPORT_FORMATS)}")
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
    config["quantization_config"] = FORMATS[format].quantization_config({n: m.config for n, m in quantized.items()}, ignore)
    if kv_scales is not None:
        if format != compressed_tensors.NAME:
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
        replace_dir(tmp, out)  # safetensors writes 0600: the umask's mode, as for any file the user writes
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
