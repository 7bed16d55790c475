"""The models inference works on: minifloat's built-in GPT (a `minifloat train` output folder or
one of its checkpoints) and transformers causal LMs (a local model folder, quantized or not).

The built-in GPT is GPT-2's architecture with ``nn.Linear`` layers; `gpt_to_transformers` writes
the same network as a transformers ``OPTForCausalLM`` (pre-norm LayerNorm blocks, exact GELU,
learned positions, tied embeddings; its fused qkv split into q_proj / k_proj / v_proj), whose
logits equal the GPT's. That is the model the serving checkpoints hold: every reader of OPT
(transformers, vLLM) can run it.

Example:
    >>> from minifloat.train.model import GPT, GPTConfig
    >>> gpt = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=64)).eval()
    >>> opt = gpt_to_transformers(gpt)
    >>> ids = torch.randint(0, 256, (1, 8))
    >>> bool((opt(ids).logits - gpt(ids)).abs().max() < 1e-5)
    True
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.load import load_quantized
from minifloat.train import checkpoint
from minifloat.train.model import GPT, GPTConfig, get_config


def is_transformers(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers model (it has a config that serialises)."""
    return hasattr(getattr(model, "config", None), "to_dict") and hasattr(model, "can_generate")


def logits_of(output) -> torch.Tensor:
    """The logits of a forward's output: the built-in GPT returns them, transformers wraps them."""
    return output if isinstance(output, torch.Tensor) else output.logits


def _transformers():
    try:
        import transformers
    except ImportError:  # pragma: no cover - an optional integration
        raise MinifloatError("this needs transformers: pip install transformers") from None
    return transformers


def gpt_to_transformers(gpt: GPT) -> torch.nn.Module:
    """The built-in GPT as a transformers ``OPTForCausalLM`` with the same weights (copies)."""
    transformers = _transformers()
    c: GPTConfig = gpt.config
    cfg = transformers.OPTConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, num_hidden_layers=c.n_layer, ffn_dim=4 * c.n_embd,
        num_attention_heads=c.n_head, max_position_embeddings=c.block_size, do_layer_norm_before=True,
        word_embed_proj_dim=c.n_embd, activation_function="gelu", dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, enable_bias=True, layer_norm_elementwise_affine=True,
        tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    dtype = gpt.wte.weight.dtype
    opt = transformers.OPTForCausalLM(cfg).to(dtype)
    g, C = {k: v.detach() for k, v in gpt.state_dict().items()}, c.n_embd
    sd = {
        "model.decoder.embed_tokens.weight": g["wte.weight"],
        # OPT's learned positions start at index 2 (its offset for padding); rows 0-1 are never read
        "model.decoder.embed_positions.weight": torch.cat([torch.zeros(2, C, dtype=dtype), g["wpe.weight"]]),
        "model.decoder.final_layer_norm.weight": g["ln_f.weight"],
        "model.decoder.final_layer_norm.bias": g["ln_f.bias"],
    }
    pairs = [("ln1", "self_attn_layer_norm"), ("ln2", "final_layer_norm"), ("attn.proj", "self_attn.out_proj"),
             ("mlp.fc", "fc1"), ("mlp.proj", "fc2")]  # fmt: skip
    for i in range(c.n_layer):
        src, dst = f"blocks.{i}.", f"model.decoder.layers.{i}."
        for a, b in pairs:
            for t in ("weight", "bias"):
                sd[f"{dst}{b}.{t}"] = g[f"{src}{a}.{t}"]
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):  # qkv's rows: q, then k, then v
            for t in ("weight", "bias"):
                sd[f"{dst}self_attn.{name}.{t}"] = g[f"{src}attn.qkv.{t}"][j * C : (j + 1) * C]
    missing, unexpected = opt.load_state_dict(sd, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)  # lm_head is tied
    opt.tie_weights()
    return opt.eval()


def load_gpt(path: str | os.PathLike[str]) -> GPT:
    """The built-in GPT of a `minifloat train` output folder (its latest checkpoint) or of a
    checkpoint folder, with its FP32 master weights; in eval mode."""
    path = Path(path)
    ckpt = checkpoint.latest_checkpoint(path / "checkpoints") if (path / "checkpoints").is_dir() else path
    if ckpt is None or not (ckpt / "manifest.json").is_file():
        raise MinifloatError(f"{path}: no checkpoint (a `minifloat train` output folder, or a ckpt-* folder in it)")
    manifest, weights, _ = checkpoint.load_checkpoint(ckpt)
    model = GPT(get_config(manifest["config"]["model"]))
    missing, _ = model.load_state_dict(weights, strict=False)  # extra entries: a converted Linear's buffers
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise MinifloatError(f"{ckpt}: the checkpoint lacks {missing[:5]}")
    return model.eval()


@dataclass(frozen=True)
class Loader:
    """A kind of model file or folder: `detect(path)` says whether `path` is one, `load(path)`
    loads it; `what` names it in the error for a path no loader takes."""

    name: str
    detect: Callable[[Path], bool]
    load: Callable[[Path], torch.nn.Module]
    what: str


def _config(path: Path) -> dict | None:
    try:
        raw = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else None
    except json.JSONDecodeError as err:
        raise MinifloatError(f"{path / 'config.json'}: not valid JSON ({err})") from None
    return raw if isinstance(raw, dict) and "model_type" in raw else None


def check_safetensors(folder: Path) -> None:
    """Open every safetensors file of `folder` (header and size), so that a truncated or damaged
    one is an error naming it before anything loads."""
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(f, "pt") as h:
                h.keys()
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error type
            raise MinifloatError(f"{f}: not a readable safetensors file ({str(err).splitlines()[0][:160]}); "
                                 f"it may be truncated: copy or export it again") from None  # fmt: skip


def _from_pretrained(what: Path, **kwargs) -> torch.nn.Module:
    """transformers' causal LM at `what`; a load that fails is one error naming the path."""
    transformers = _transformers()
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(what, **kwargs).eval()
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise MinifloatError(f"{what / kwargs.get('gguf_file', '')}: transformers could not load it as a causal LM "
                             f"({type(err).__name__}: {first})") from None  # fmt: skip


def _load_transformers(path: Path) -> torch.nn.Module:
    check_safetensors(path)
    return _from_pretrained(path)


GGUF_MAGIC = b"GGUF"


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def load_gguf(path: str | os.PathLike[str]) -> torch.nn.Module:
    """A GGUF file's causal LM through transformers' GGUF reader (the ``gguf`` package, an
    optional extra), its tensors dequantized to float32. A file that is not GGUF, or whose
    architecture transformers does not read as a causal LM, is refused naming it."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise MinifloatError(f"{path}: named .gguf but not a GGUF file (it does not start with 'GGUF')")
    if importlib.util.find_spec("gguf") is None:
        raise MinifloatError(f"{path}: reading GGUF needs the gguf package: pip install 'minifloat[gguf]'")
    transformers = _transformers()
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except (ValueError, OSError, IndexError) as err:
        raise MinifloatError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    causal = sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer", "t5", "umt5"))
    if arch not in causal:
        raise MinifloatError(f"{path}: a GGUF of architecture {arch!r}, not a causal LM transformers "
                             f"{transformers.__version__} reads from GGUF ({', '.join(causal)})")  # fmt: skip
    return _from_pretrained(path.parent, gguf_file=path.name)


LOADERS: list[Loader] = [
    Loader("gguf", _is_gguf, load_gguf, "a GGUF file (.gguf) of a causal LM"),
    Loader("minifloat-gpt", lambda p: (p / "checkpoints").is_dir() or (p / "manifest.json").is_file(), load_gpt,
           "a `minifloat train` output (checkpoints/) or checkpoint (manifest.json)"),
    Loader("quantized", lambda p: bool((_config(p) or {}).get("quantization_config")), load_quantized,
           "a quantized checkpoint (config.json with quantization_config)"),
    Loader("transformers", lambda p: _config(p) is not None, _load_transformers,
           "a transformers model folder (config.json with model_type)"),
]  # fmt: skip
"""The loaders `load_model` tries, first match wins (`register_loader` adds one in front)."""


def register_loader(name: str, detect: Callable[[Path], bool], load: Callable[[Path], torch.nn.Module], what: str) -> None:
    """Let `load_model` take another kind of model path (tried before the built-in ones)."""
    LOADERS.insert(0, Loader(name, detect, load, what))


def load_model(path: str | os.PathLike[str]) -> torch.nn.Module:
    """The model at `path`, by the first of `LOADERS` that recognises it: a `minifloat train`
    output or checkpoint (the built-in GPT), a quantized checkpoint (`load_quantized`), or a
    transformers model folder."""
    path = Path(path)
    if not path.exists():
        raise MinifloatError(f"{path}: no such model folder or file")
    for loader in LOADERS:
        if loader.detect(path):
            return loader.load(path)
    kinds = "; ".join(loader.what for loader in LOADERS)
    raise MinifloatError(f"{path}: not a model minifloat loads ({kinds})")
