"""LoRA: low-rank adapters trained on a frozen base — QLoRA's idea on the FP grids.

A target Linear becomes a `LoRALinear`: ``y = base(x) + (α / r) · B(A(dropout(x)))`` with A
(r × in) and B (out × r) the only trained weights (PEFT's initialisation: A Kaiming-uniform, B zero,
so training starts from the base model's own logits). The base is frozen and held

- as plain weights (``fp32``, or ``bf16``: the whole frozen model in BF16), or
- **packed** (``fp8``, ``mxfp8``, ``mxfp6``, ``nvfp4``, ``mxfp4``): the PTQ `QuantizedLinear` of
  the weight-only config of that format, quantized by round to nearest or GPTQ; the other frozen
  weights (embedding, norms) in BF16, the head too unless it is quantized as well (a tied table
  then stays one packed table). Layers may be packed in other formats than the base's
  (`base_policy`: ``--base-keep`` globs in FP8, ``--base-policy`` a per-layer assignment such as
  the one `minifloat adapt` chooses within a bit budget).

A packed layer's forward is its own weight-only GEMM; its backward computes the input gradient
``g · W`` from the packed weight, dequantized for that product alone (`PackedMatmul`) — no
dequantized copy is kept between the passes, and the base gets no gradient. A layer packed behind
a Hadamard rotation T (GPTQ's recommended pipeline, ``x T`` online, ``Q_T ≈ W T`` stored) gives
``(g · Q_T) Tᵀ``, and merges as ``Q_T Tᵀ``.

The adapters start as PEFT's (B = 0), or, on a packed base, as the calibrated correction of its
quantization error (`minifloat.finetune.residual_init`).

`save_adapter` writes the adapters as a PEFT adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``, keys ``base_model.model.<module>.lora_A.weight``), which
``peft.PeftModel.from_pretrained`` loads onto the base model; `merged_state_dict` folds them into
the base weights (``W + (α / r) · B · A``) for a plain transformers model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.gemm.support import native_bf16_cpu
from minifloat.infer.modules.embedding import QuantizedEmbedding
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.rotation import HadamardRotation
from minifloat.io.atomic import atomic_path
from minifloat.nn.convert import matches
from minifloat.quant.hadamard import hadamard_matrix
from minifloat.train.config import PACKED_FORMATS

# the weight-only PTQ config that holds a packed base of each format (`TrainConfig.precision` names it)
PACKED_BASES = {f: f"{f}-weight-only" for f in PACKED_FORMATS}
ADAPTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_dtype(name: str) -> torch.dtype:
    """The dtype a packed base computes in (`TrainConfig.base_compute`): ``auto`` is BF16 where this
    CPU multiplies BF16 natively (AVX512-BF16, AMX: a BF16 base's products there run at twice FP32's
    rate; SmolLM2's NVFP4-base LoRA step 3.29 → 2.16 s, the BF16 base's 1.96), else FP32 (BF16 would be
    emulated, slower)."""
    if name == "auto":
        return torch.bfloat16 if native_bf16_cpu() else torch.float32
    return ADAPTER_DTYPES[name]


def base_policy(base: str, keep: Sequence[str] | None = None, policy: Sequence[tuple[str, str]] | None = None) -> dict[str, str]:
    """The PTQ policy (glob → weight-only config, first match wins) of a packed base in format
    `base`: the `keep` globs in FP8, then the `policy` pairs (glob, format), then every other layer
    in `base`."""
    rules = dict.fromkeys(keep or (), PACKED_BASES["fp8"])
    for glob, fmt in [*(policy or ()), ("*", base)]:  # a glob already given keeps its first rule
        rules.setdefault(glob, PACKED_BASES[fmt])
    return rules


def effective_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The (out, in) FP32 weight a frozen layer multiplies its input by: a Linear's own, a packed
    layer's dequantized (times Tᵀ where it rotates its input: ``(x T) Q_Tᵀ = x (Q_T Tᵀ)ᵀ``)."""
    if isinstance(layer, QuantizedLinear):
        w = layer.weight.dequantize(torch.float32)[: layer.out_features, : layer.in_features]
        if layer.kept_index is not None:  # the kept input channels' BF16 columns, beside the packed ones
            w = w.index_copy(1, layer.kept_index, layer.kept_weight.float())
        return _unrotate(layer, w)
    return layer.weight.detach().float()


def _unrotate(layer: QuantizedLinear, v: torch.Tensor) -> torch.Tensor:
    """``v Tᵀ`` for the rows of `v` where `layer` rotates its input by T (a Hadamard rotation,
    `minifloat.infer.ptq.rotation`), else `v`: T is orthogonal, so this undoes it."""
    t = layer.input_transform
    if t is None:
        return v
    if not isinstance(t, HadamardRotation):  # online smoothing: a LoRA base holds weights, not activation scales
        raise MinifloatError(f"a LoRA base takes a packed layer as is or behind a Hadamard rotation, not behind {type(t).__name__}")
    m = hadamard_matrix(t.size, t.seed).to(v.dtype)
    return (v.reshape(*v.shape[:-1], -1, t.size) @ m.T).reshape(v.shape)


def _packed_product(x: torch.Tensor, layer: QuantizedLinear, compute: torch.dtype) -> torch.Tensor:
    """``layer(x)`` with its weight dequantized to `compute` for this product (QLoRA's compute
    dtype: BF16 where the CPU multiplies BF16 natively, as a BF16 base computes): BF16 operands
    summed in FP32, the product rounded to BF16 as a BF16 GEMM returns it (a BF16 model's
    activations are BF16 anyway); float32 is the layer's own forward."""
    if compute == torch.float32:
        return layer(x)
    x2 = x.reshape(-1, layer.in_features)
    if layer.input_transform is not None:
        x2 = layer.input_transform(x2)
    w = layer.weight.dequantize(compute)[: layer.out_features, : layer.in_features]
    y = (x2.to(compute) @ w.T).float()
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)


class PackedMatmul(torch.autograd.Function):
    """``layer(x)`` for a frozen packed `layer`, whose backward gives x its gradient ``g · W`` with
    W dequantized (to `compute`) for that product only (the forward keeps nothing: the product is
    linear in x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantizedLinear, compute: torch.dtype) -> torch.Tensor:
        ctx.layer, ctx.compute = layer, compute
        with torch.no_grad():
            return _packed_product(x, layer, compute)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layer, compute = ctx.layer, ctx.compute
        w = layer.weight.dequantize(compute)[: layer.out_features, : layer.in_features]
        g = (grad.to(compute).reshape(-1, layer.out_features) @ w).float()
        g = _unrotate(layer, g)  # (g Q_T) Tᵀ: the rotation's own gradient
        return g.to(grad.dtype).reshape(*grad.shape[:-1], layer.in_features), None, None


class FrozenPacked(torch.nn.Module):
    """A frozen packed layer that passes gradients to its input (`PackedMatmul`): the quantized
    head of a LoRA run, and the base of each adapter; its products in `compute` (`_packed_product`)."""

    def __init__(self, layer: QuantizedLinear, compute: torch.dtype = torch.float32) -> None:
        super().__init__()
        if layer.kept_index is not None:  # the packed products below read the packed weight alone
            raise MinifloatError(f"a LoRA base takes packed layers without kept input channels; this one {layer.beyond_weight()}: "
                                 f"quantize the base with keep_channels=0")  # fmt: skip
        self.layer, self.compute = layer, compute
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return PackedMatmul.apply(x, self.layer, self.compute)
        return _packed_product(x, self.layer, self.compute)


class LoRALinear(torch.nn.Module):
    """A frozen `base_layer` plus a trained low-rank update (see the module docstring)."""

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 dtype: torch.dtype = torch.float32, compute: torch.dtype = torch.float32) -> None:  # fmt: skip
        super().__init__()
        if isinstance(base, QuantizedLinear):
            base = FrozenPacked(base, compute)
        for p in base.parameters():
            p.requires_grad_(False)
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.lora_dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.lora_A = torch.nn.Linear(self.in_features, rank, bias=False, dtype=dtype)
        self.lora_B = torch.nn.Linear(rank, self.out_features, bias=False, dtype=dtype)
        torch.nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default
        torch.nn.init.zeros_(self.lora_B.weight)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if isinstance(base, torch.nn.Linear) and x.dtype != base.weight.dtype:
            return base(x.to(base.weight.dtype))
        return base(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        a = self.lora_A.weight
        update = self.lora_B(self.lora_A(self.lora_dropout(x.to(a.dtype)))) * self.scaling
        return (y.float() + update.float()).to(y.dtype) if y.dtype != update.dtype else y + update

    def delta(self) -> torch.Tensor:
        """(α / r) · B · A in FP32: what merging adds to the base weight."""
        return self.scaling * (self.lora_B.weight.detach().float() @ self.lora_A.weight.detach().float())

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


def target_names(model: torch.nn.Module, layers_prefix: str, globs: Sequence[str] | None) -> list[str]:
    """The Linear (or packed) layers of the decoder layers under `layers_prefix` that `globs` name
    (every one of them when `globs` is None)."""
    names = [n for n, m in model.named_modules()
             if n.startswith(layers_prefix + ".") and isinstance(m, torch.nn.Linear | QuantizedLinear)]  # fmt: skip
    if globs is not None:
        names = [n for n in names if matches(n, globs) is not None]
        if not names:
            raise MinifloatError(f"--lora-targets {','.join(globs)} matches no Linear of the decoder layers; "
                                 "name them as the model does (e.g. q_proj,v_proj or '*.mlp.*')")  # fmt: skip
    if not names:
        raise MinifloatError(f"no Linear layer under {layers_prefix}: nothing to put adapters on")
    return names


def attach(model: torch.nn.Module, names: Sequence[str], rank: int, alpha: float, dropout: float,
           dtype: torch.dtype, compute: torch.dtype = torch.float32) -> dict[str, LoRALinear]:  # fmt: skip
    """Freeze `model` and put adapters on the layers `names` (in place); a packed layer no adapter
    takes (the head) becomes a `FrozenPacked`, so gradients pass through it. Packed layers compute
    their products in `compute` (`_packed_product`)."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = {}
    for name in names:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        adapters[name] = LoRALinear(getattr(holder, child), rank, alpha, dropout, dtype, compute)
        setattr(holder, child, adapters[name])
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantizedLinear) and not name.endswith(".layer"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, FrozenPacked(m, compute))
    return adapters


def adapters_of(model: torch.nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def _target_modules(model: torch.nn.Module, names: list[str]) -> list[str] | str:
    """PEFT's ``target_modules``: the layers' last names where those pick exactly the adapted layers
    (PEFT matches a name as the end of a module's path), else a regex of their full paths."""
    short = sorted({n.rpartition(".")[2] for n in names})
    picked = {n for n, m in model.named_modules() if n.rpartition(".")[2] in short and not n.endswith(".base_layer")
              and (isinstance(m, torch.nn.Linear | LoRALinear | FrozenPacked | QuantizedLinear))}  # fmt: skip
    picked = {n for n in picked if not any(n.startswith(a + ".") for a in names)}
    return short if picked == set(names) else "^(" + "|".join(re.escape(n) for n in names) + ")$"


def save_adapter(model: torch.nn.Module, folder: str | Path, *, base_model: str | None = None) -> Path:
    """Write `model`'s adapters as a PEFT LoRA adapter folder (see the module docstring), atomically."""
    from safetensors.torch import save_file

    adapters = adapters_of(model)
    if not adapters:
        raise MinifloatError("the model has no LoRA adapters to save")
    first = next(iter(adapters.values()))
    tensors = {}
    for name, m in adapters.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.weight.detach().contiguous().clone()
        tensors[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.weight.detach().contiguous().clone()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.rank, "lora_alpha": first.alpha,
        "lora_dropout": first.lora_dropout.p if isinstance(first.lora_dropout, torch.nn.Dropout) else 0.0,
        "target_modules": _target_modules(model, list(adapters)), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "base_model_name_or_path": base_model,
    }  # fmt: skip
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / "adapter_model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    with atomic_path(folder / "adapter_config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=2))
    return folder


def merged_state_dict(model: torch.nn.Module, plain_keys: Sequence[str], dtype: torch.dtype = torch.float32) -> dict:
    """The plain model's state dict (its keys `plain_keys`, as before LoRA and packing) with every
    adapter folded into its base weight and every packed weight dequantized."""
    out: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name, m in modules.items():
        if isinstance(m, LoRALinear):
            base = m.base_layer.layer if isinstance(m.base_layer, FrozenPacked) else m.base_layer
            out[f"{name}.weight"] = effective_weight(base) + m.delta()
            bias = getattr(base, "bias", None)
            if bias is not None:
                out[f"{name}.bias"] = bias.detach().float()
        elif isinstance(m, FrozenPacked):
            out[f"{name}.weight"] = effective_weight(m.layer)
            if m.layer.bias is not None:
                out[f"{name}.bias"] = m.layer.bias.detach().float()
        elif isinstance(m, QuantizedEmbedding):
            out[f"{name}.weight"] = m.weight.dequantize(torch.float32)[: m.num_embeddings, : m.embedding_dim]
    for key, value in model.state_dict().items():
        if key in plain_keys and key not in out:
            out[key] = value.detach()
    missing = [k for k in plain_keys if k not in out]
    if missing:
        raise MinifloatError(f"merging the adapters lost {missing[:3]}: the model's layers were not all recognised")
    return {k: out[k].to(dtype).contiguous() for k in plain_keys}
