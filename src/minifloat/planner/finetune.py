"""The training state of a fine-tune of a pretrained transformers model, planned from its shapes
alone (the model is built on the ``meta`` device: no weight is read), for a full fine-tune or
LoRA on each base format — what `minifloat memory MODEL` prints, and checks against a measured
run (`minifloat.train.loop.state_bytes`, the tensors counted) with ``--measure``.

Categories (bytes):

- ``trained parameters``: every weight of a full fine-tune (FP32, or BF16 with a BF16 master),
  the adapters of a LoRA run (r · (in + out) per adapted layer, in the adapter dtype);
- ``frozen base``: a full fine-tune's recipe state (delayed scaling's amax histories); a LoRA run's base — packed Linear layers at their codes' and scales' bytes
  (each shape quantized once, `minifloat.quantize`, so padding and scales are exact), the rest
  in BF16 (FP32 for an FP32 base); a tied table once;
- ``gradients``: one per trained parameter, in its dtype;
- ``optimizer``: AdamW's two moments per trained parameter (FP32, BF16, or FP8 with a scale per
  128) and a BF16 master's remainder (``bf16+remainder``: 2 bytes a weight).

Activations are not planned here (they follow batch × sequence; `minifloat memory --params`
plans them for a transformer's shape).
"""

from __future__ import annotations

from pathlib import Path

import torch

from minifloat import checkpoint
from minifloat.errors import MinifloatError
from minifloat.finetune.lora import PACKED_BASES
from minifloat.finetune.pretrained import decoder_layers
from minifloat.infer.ptq.config import get_quant_config
from minifloat.nn.convert import matches
from minifloat.quant.api import quantize

MOMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1 + 4 / 128, "fp8-dre": 1 + 8 / 128}  # per weight, each moment


def meta_model(path: str | Path) -> torch.nn.Module:
    """The transformers model at `path` (a folder, a .gguf, a fine-tune's output) built on the meta device."""
    from minifloat.models.loading import require_transformers

    transformers = require_transformers()
    path = Path(path)
    path = checkpoint.run_model(path) or path
    try:
        if path.is_file() and path.suffix.lower() == ".gguf":
            config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        else:
            config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise MinifloatError(f"{path}: no transformers config to plan from ({type(err).__name__}: {str(err)[:160]})") from None
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _packed_bytes(shape: tuple[int, int], config: str, cache: dict) -> int:
    if (shape, config) not in cache:
        q = quantize(torch.zeros(shape), get_quant_config(config).weight_scheme)
        cache[shape, config] = q.nbytes
    return cache[shape, config]


def plan_finetune(path: str | Path, *, precision: str = "bf16", lora_rank: int = 0, base: str = "bf16", quantize_head: bool = False,
                  lora_targets: tuple[str, ...] | None = None, adapter_dtype: str = "fp32", master: str = "fp32",
                  optimizer_states: str = "fp32") -> dict[str, int]:  # fmt: skip
    """The planned bytes of each category (module docstring) and their ``total``."""
    model = meta_model(path)
    prefix, _ = decoder_layers(model)
    params = {id(p): p for p in model.parameters()}  # a tied weight once
    if not lora_rank:
        n = sum(p.numel() for p in params.values())
        width = 4 if master == "fp32" else 2
        plan = {"trained parameters": n * width, "frozen base": _recipe_state(model, prefix, precision, quantize_head), "gradients": n * width,
                "optimizer": int(2 * n * MOMENT_BYTES[optimizer_states]) + (2 * n if master == "bf16+remainder" else 0)}  # fmt: skip
    else:
        head = model.get_output_embeddings()
        linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        targets = [n for n in linears if n.startswith(prefix + ".") and (lora_targets is None or matches(n, lora_targets))]
        rest_width = 4 if base == "fp32" else 2
        packed, cache, frozen = set(), {}, 0
        if base in PACKED_BASES:
            config = PACKED_BASES[base]
            for m in linears.values():
                if m is head and not quantize_head or min(m.in_features, m.out_features) < 16:
                    continue
                frozen += _packed_bytes(tuple(m.weight.shape), config, cache)
                packed.add(id(m.weight))
        frozen += sum(p.numel() * rest_width for p in params.values() if id(p) not in packed)
        trained = sum(lora_rank * (linears[n].in_features + linears[n].out_features) for n in targets)
        width = 4 if adapter_dtype == "fp32" else 2
        plan = {"trained parameters": trained * width, "frozen base": frozen, "gradients": trained * width,
                "optimizer": 2 * trained * 4}  # fmt: skip
    plan["total"] = sum(plan.values())
    return plan


def _recipe_state(model: torch.nn.Module, prefix: str, precision: str, quantize_head: bool) -> int:
    """The bytes of the recipe's own state (delayed scaling's amax histories) over the converted Linears."""
    from minifloat.nn.linear import Linear
    from minifloat.recipes import RECIPES

    if precision not in RECIPES:
        return 0
    head = model.get_output_embeddings()
    converted = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                 and (n.startswith(prefix + ".") or m is head and quantize_head)]  # fmt: skip
    one = sum(b.nbytes for b in Linear(16, 16, recipe=precision).buffers())  # the same for every shape
    return one * len(converted)


# the measured run's categories (`minifloat.train.loop.state_bytes`) that each planned one counts
MEASURED = {"trained parameters": ("trained_parameters",), "frozen base": ("frozen_parameters", "buffers"),
            "gradients": ("gradients",), "optimizer": ("optimizer",), "total": ("total",)}  # fmt: skip
