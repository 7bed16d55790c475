"""Loading the models minifloat works on: its built-in GPT (a `minifloat train` output folder or
one of its checkpoints), transformers causal LMs (a local model folder) and GGUF files (through
transformers' GGUF reader). `load_model` tries `LOADERS` in order; `minifloat.infer.load_model`
adds the quantized checkpoints minifloat exports in front of them.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from minifloat import checkpoint
from minifloat.errors import MinifloatError
from minifloat.models.conv1d import linears_from_conv1d
from minifloat.models.experts import unfuse_experts
from minifloat.models.gpt import GPT, get_config


def is_transformers(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers model (it has a config that serialises)."""
    return hasattr(getattr(model, "config", None), "to_dict") and hasattr(model, "can_generate")


def logits_of(output) -> torch.Tensor:
    """The logits of a forward's output: the built-in GPT returns them, transformers wraps them."""
    return output if isinstance(output, torch.Tensor) else output.logits


def require_transformers():
    try:
        import transformers
    except ImportError:  # pragma: no cover - an optional integration
        raise MinifloatError("this needs transformers: pip install transformers") from None
    return transformers


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


def hf_config(path: Path) -> dict | None:
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
    transformers = require_transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(what, **kwargs).eval()
        linears_from_conv1d(model)  # GPT-2's Conv1D as the nn.Linear every walk over Linears sees
        unfuse_experts(model)  # fused 3-D expert parameters as one nn.Linear per expert weight
        return model
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


def gguf_header(path: Path) -> bool:
    """Whether `path` is a .gguf file that starts as GGUF does and the gguf package can read it."""
    if not _is_gguf(path) or importlib.util.find_spec("gguf") is None:
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


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
    transformers = require_transformers()
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
    return _from_pretrained(path.parent, gguf_file=path.name, config=gguf_config(path))


# What transformers' GGUF reader leaves at its config's default though the file says it (its key
# map has no entry): per architecture, the GGUF key under the architecture and the config field.
GGUF_MISSED_KEYS = {"qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
                    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}}  # fmt: skip
# What llama.cpp's graph of the architecture computes whatever the file says: Qwen3-MoE's renormalizes
# the top-k routing weights (build_moe_ffn's norm_w), Qwen2-MoE's does not, so a file of either is that model.
GGUF_GRAPH_FIELDS = {"qwen3moe": {"norm_topk_prob": True}, "qwen2moe": {"norm_topk_prob": False}}


def gguf_config(path: str | os.PathLike[str]):
    """transformers' config of the GGUF file at `path`, with what its reader misses
    (`GGUF_MISSED_KEYS`, `GGUF_GRAPH_FIELDS`) taken from the file."""
    from gguf import GGUFReader

    transformers = require_transformers()
    path = Path(path)
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    fields = GGUFReader(path).fields
    arch = fields["general.architecture"].contents()
    for key, attr in GGUF_MISSED_KEYS.get(arch, {}).items():
        if (field := fields.get(f"{arch}.{key}")) is not None:
            setattr(config, attr, int(field.contents()))
    for attr, value in GGUF_GRAPH_FIELDS.get(arch, {}).items():
        setattr(config, attr, value)
    return config


LOADERS: list[Loader] = [
    Loader("gguf", _is_gguf, load_gguf, "a GGUF file (.gguf) of a causal LM"),
    Loader("minifloat-finetune", lambda p: checkpoint.run_model(p) is not None,
           lambda p: _load_transformers(checkpoint.run_model(p)), "a `minifloat train MODEL` output (model/ or merged/)"),
    Loader("minifloat-gpt", lambda p: (p / "checkpoints").is_dir() or (p / "manifest.json").is_file(), load_gpt,
           "a `minifloat train` output (checkpoints/) or checkpoint (manifest.json)"),
    Loader("transformers", lambda p: hf_config(p) is not None, _load_transformers,
           "a transformers model folder (config.json with model_type)"),
]  # fmt: skip
"""The loaders `load_model` tries, first match wins (`register_loader` adds one in front)."""


def register_loader(name: str, detect: Callable[[Path], bool], load: Callable[[Path], torch.nn.Module], what: str) -> None:
    """Let `load_model` take another kind of model path (tried before the built-in ones)."""
    LOADERS.insert(0, Loader(name, detect, load, what))


def load_model(path: str | os.PathLike[str], *, specific: Sequence[Loader] = ()) -> torch.nn.Module:
    """The model at `path`, by the first of `LOADERS` that recognises it: a GGUF file, a
    `minifloat train` output or checkpoint (the built-in GPT), a transformers model folder.
    `specific` loaders are tried first: the transformers one takes any folder with a config.json
    (a quantized checkpoint is one) and the GGUF one any .gguf (`minifloat.infer.load_model` puts
    its readers of quantized checkpoints and FP4 GGUF files here)."""
    path = Path(path)
    if not path.exists():
        raise MinifloatError(f"{path}: no such model folder or file")
    loaders = [*specific, *LOADERS]
    for loader in loaders:
        if loader.detect(path):
            return loader.load(path)
    kinds = "; ".join(loader.what for loader in loaders)
    raise MinifloatError(f"{path}: not a model minifloat loads ({kinds})")
