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

- ``activations``: what autograd keeps between the forward and the backward of one micro-batch
  (batch × seq tokens) that is not a parameter — inputs, attention and MLP intermediates, the
  loss' log-probabilities, BF16 casts (autocast, a BF16 master's casts on use), a recipe Linear's
  packed input (and packed weight where the recipe reuses it). Counted on a fake model
  (`torch._subclasses.FakeTensorMode`: the model's own forward on tensors with shapes and no data,
  under the run's autocast), every saved tensor once; a recipe's Linears are counted by one
  probe layer of each shape on zeros, as their packing does not depend on the values.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minifloat import checkpoint
from minifloat.errors import MinifloatError
from minifloat.finetune.lora import PACKED_BASES
from minifloat.finetune.lora import base_policy as base_policy_rules
from minifloat.finetune.pretrained import decoder_layers
from minifloat.infer.ptq.config import get_quant_config
from minifloat.nn.convert import matches, rule_for
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
                  optimizer_states: str = "fp32", batch: int | None = None, seq: int | None = None,
                  base_keep: tuple[str, ...] | None = None, base_policy=None) -> dict[str, int]:  # fmt: skip
    """The planned bytes of each category (module docstring) and their ``total``; activations only
    with `batch` and `seq`; `base_keep`: layers of a packed base held in FP8 (``--base-keep``),
    `base_policy`: (glob, format) pairs for others (``--base-policy``)."""
    plan = _state_plan(path, precision=precision, lora_rank=lora_rank, base=base, quantize_head=quantize_head,
                       lora_targets=lora_targets, adapter_dtype=adapter_dtype, master=master, optimizer_states=optimizer_states,
                       base_keep=base_keep, base_policy=base_policy)  # fmt: skip
    if batch is not None and seq is not None:
        plan["activations"] = plan_activations(path, precision=precision, lora_rank=lora_rank, base=base, quantize_head=quantize_head,
                                               lora_targets=lora_targets, adapter_dtype=adapter_dtype, master=master,
                                               batch=batch, seq=seq)  # fmt: skip
    plan["total"] = sum(plan.values())
    return plan


def _state_plan(path, *, precision, lora_rank, base, quantize_head, lora_targets, adapter_dtype, master, optimizer_states,
                base_keep=None, base_policy=None) -> dict[str, int]:  # fmt: skip
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
            policy = base_policy_rules(base, base_keep, base_policy)
            for name, m in linears.items():
                if m is head and not quantize_head or min(m.in_features, m.out_features) < 16:
                    continue
                config = rule_for(name, policy)[1]
                frozen += _packed_bytes(tuple(m.weight.shape), config, cache)
                packed.add(id(m.weight))
        frozen += sum(p.numel() * rest_width for p in params.values() if id(p) not in packed)
        trained = sum(lora_rank * (linears[n].in_features + linears[n].out_features) for n in targets)
        width = 4 if adapter_dtype == "fp32" else 2
        plan = {"trained parameters": trained * width, "frozen base": frozen, "gradients": trained * width,
                "optimizer": 2 * trained * 4}  # fmt: skip
    return plan


def plan_activations(path: str | Path, *, precision: str = "bf16", lora_rank: int = 0, base: str = "bf16", quantize_head: bool = False,
                     lora_targets: tuple[str, ...] | None = None, adapter_dtype: str = "fp32", master: str = "fp32",
                     batch: int = 1, seq: int = 128) -> int:  # fmt: skip
    """Bytes autograd keeps for the backward of one batch × seq micro-batch (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from minifloat.finetune import lora
    from minifloat.models.loading import logits_of, require_transformers
    from minifloat.nn import rounded
    from minifloat.optim import bf16_parameters
    from minifloat.recipes import RECIPES
    from minifloat.train.task import cross_entropy

    config = meta_model(path).config
    mode = FakeTensorMode()
    transformers = require_transformers()
    with mode:
        # a LoRA run's frozen rest is BF16 (but for an FP32 base); built so, as a fake model cannot be cast in place
        frozen = torch.bfloat16 if lora_rank and base != "fp32" else torch.float32
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=frozen)
        model.config.use_cache = False
        prefix, _ = decoder_layers(model)
        head = model.get_output_embeddings()
        converted: set[torch.nn.Module] = set()
        if lora_rank:
            names = lora.target_names(model, prefix, lora_targets)
            # a packed layer saves nothing (`PackedMatmul`); as a frozen plain Linear it saves only its weight
            lora.attach(model, names, lora_rank, 16.0, 0.0, lora.ADAPTER_DTYPES[adapter_dtype])
            autocast = base  # the run's precision names its base
        else:
            def keep(fqn: str, m: torch.nn.Module) -> bool:  # the Linears a full fine-tune converts
                return fqn.startswith(prefix + ".") or m is head and quantize_head

            if precision in RECIPES:
                converted = {m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and keep(n, m)}
            else:
                rounded.to_high_precision(model, precision, keep)
            if master != "fp32":
                bf16_parameters(model)
            autocast = precision
        ids = torch.zeros(batch, seq, dtype=torch.long)
    params = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}
    calls: list[tuple[int, int, int]] = []  # (in, out, rows) of each converted Linear's forward
    inside: list[torch.nn.Module] = []

    def pack(t):
        root = t._base if t._base is not None else t
        if not inside and id(root) not in params and not isinstance(root, torch.nn.Parameter):
            saved[id(root)] = root.numel() * root.element_size()
            alive.append(root)  # kept until counted: no id is reused
        return t

    def enter(m, args):
        inside.append(m)
        calls.append((m.in_features, m.out_features, args[0].numel() // m.in_features))

    def leave(m, args, out) -> None:  # returns None: the output stays the module's
        inside.pop()

    alive: list[torch.Tensor] = []
    handles = [m.register_forward_pre_hook(enter) for m in converted]
    handles += [m.register_forward_hook(leave) for m in converted]
    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rounded.autocast(autocast):
            cross_entropy(logits_of(model(input_ids=ids, use_cache=False)), ids)
    finally:
        for h in handles:
            h.remove()
    cache: dict[tuple[int, int, int], int] = {}
    return sum(saved.values()) + sum(_recipe_saved(shape, precision, cache) for shape in calls)


def _recipe_saved(shape: tuple[int, int, int], precision: str, cache: dict) -> int:
    """Bytes a recipe Linear of (in, out) keeps for the backward of `rows` input rows: its packed
    input (and packed weight), from one probe layer on zeros."""
    from minifloat.nn.linear import Linear

    if shape not in cache:
        k, n, rows = shape
        layer = Linear(k, n, bias=False, recipe=precision)
        out = layer(torch.zeros(rows, k, requires_grad=True))
        node = out.grad_fn
        while node is not None and getattr(node, "xt", None) is None and node.next_functions:
            node = node.next_functions[0][0]
        cache[shape] = sum(t.nbytes for t in (getattr(node, "xt", None), getattr(node, "wq", None)) if t is not None)
    return cache[shape]


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
            "gradients": ("gradients",), "optimizer": ("optimizer",), "activations": ("activations",),
            "total": ("total", "activations")}  # fmt: skip


def measured_activations(c, *, seed: int = 0) -> int:
    """What one real micro-batch of the fine-tune `c` (a `TrainConfig`) keeps for its backward
    (`minifloat.planner.memory.saved_for_backward`: the packed weights a recipe reuses included)."""
    from minifloat.finetune import PretrainedTask
    from minifloat.nn import rounded
    from minifloat.planner.memory import saved_for_backward

    task = PretrainedTask()
    task.prepare(c)
    model = task.build_model(c).train()
    batch = task.batch(c, torch.Generator().manual_seed(seed))

    def forward():
        with rounded.autocast(c.precision):
            return task.loss(model, batch)

    _, activations, copies = saved_for_backward(model, forward)
    return activations + copies
