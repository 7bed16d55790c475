"""Sequential calibration: a model quantized block by block, each Linear's statistics measured on
the inputs that the already-quantized layers before it produce (what GPTQ needs).

The repeated blocks are the longest ``nn.ModuleList`` whose every child holds a Linear (a
transformers decoder's ``layers``, the built-in GPT's ``blocks``; a model without one is one
block). The inputs of the first block are captured once (the positional and keyword arguments
it is called with, per calibration batch); then per block:

1. one run on the first batch finds its *groups*: the Linears that read the same input tensor
   (q/k/v, gate/up), in the order they run, and the module whose output that tensor is (a norm
   that smoothing may fold into);
2. per group, a run of the block over every batch, stopped once the group has seen its input,
   feeds the group's observers (`minifloat.infer.ptq.observers`) — on the input as the layer will
   transform it (a rotation, smoothing) — and the group is quantized and swapped in at once;
3. a last run gives the block's outputs, which are the next block's inputs.

The Linears outside the blocks (an LM head) are observed after, in one run of the whole model.

With `reference` (asymmetric GPTQ) the full-precision model runs beside: each block's
unquantized copy, before any of its layers is swapped, on the full-precision outputs of the block
before, gives each layer's input as the full-precision model computes it (`reference_inputs`),
which a `ReferenceObserver` sets against the input the quantized model feeds it, row by row. A
layer fed a subset of the tokens (a MoE expert: the two models' routers may choose differently)
or outside the blocks (an LM head) gets no reference, and so GPTQ's own objective.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.ptq.observers import OBSERVERS, ReferenceObserver, eval_mode
from minifloat.nn.convert import block_lists

Inputs = tuple[tuple, dict]


class _Stop(Exception):
    """Raised by a hook to end a run once what it needs was seen."""


@dataclass
class Group:
    """Linears that read one input tensor: their names and modules, in the order they run, and
    the module that produced the input (None when it is not a module's output)."""

    names: list[str]
    modules: list[torch.nn.Module]
    producer: torch.nn.Module | None = None
    stats: dict[str, dict] = field(default_factory=dict)
    key: int = 0  # the id of the input tensor, while the groups are found
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # the weights to quantize (transformed), by name
    amax: torch.Tensor | None = None  # NVFP4: the tensor amax the group shares
    # what turns the full-precision model's input into this one's where a transform was folded
    # into the producer (smoothing's 1/s), by name: applied to the reference before `transforms`
    reference_transforms: dict[str, torch.nn.Module] = field(default_factory=dict)


def find_blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The longest ModuleList whose every child holds a Linear (not one inside another's
    entries: a MoE layer's experts), or None."""
    lists = block_lists(model, every_child=True)
    return max((m for _, m in lists), key=len) if lists else None


def _model_kwargs(model: torch.nn.Module) -> dict:
    """Keyword arguments of a calibration run: no KV cache for a transformers model."""
    return {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}


def _as_inputs(model: torch.nn.Module, batch) -> Inputs:
    kw = _model_kwargs(model)
    return ((), {**batch, **kw}) if isinstance(batch, Mapping) else ((batch,), kw)


def capture_inputs(model: torch.nn.Module, block: torch.nn.Module, batches: Iterable) -> list[Inputs]:
    """The (args, kwargs) `block` is called with, per batch (each run stopped there)."""
    seen: list[Inputs] = []

    def record(module, args, kwargs):
        seen.append((tuple(args), dict(kwargs)))
        raise _Stop

    handle = block.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad(), eval_mode(model):
            for batch in batches:
                args, kwargs = _as_inputs(model, batch)
                try:
                    model(*args, **kwargs)
                except _Stop:
                    pass
    finally:
        handle.remove()
    if not seen:
        raise MinifloatError("calibration got no batches (or none reached the model's blocks); pass token-id batches")
    return seen


def _hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _input_hidden(inp: Inputs) -> torch.Tensor:
    """The hidden states of `inp`: the first positional argument, else ``hidden_states``."""
    args, kwargs = inp
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(inp: Inputs, hidden: torch.Tensor) -> Inputs:
    """`inp` with its hidden states (the first positional argument, else ``hidden_states``) replaced."""
    args, kwargs = inp
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _run(block: torch.nn.Module, inputs: list[Inputs], hooks: Callable[[], list] | None = None) -> list:
    """Run `block` on every input (a `_Stop` ends a run early); its outputs (None for stopped runs)."""
    handles = hooks() if hooks is not None else []
    outs = []
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                try:
                    outs.append(block(*args, **kwargs))
                except _Stop:
                    outs.append(None)
    finally:
        for h in handles:
            h.remove()
    return outs


def find_groups(block: torch.nn.Module, inp: Inputs, targets: Mapping[torch.nn.Module, str],
                opaque: Iterable[torch.nn.Module] = ()) -> list[Group]:  # fmt: skip
    """The groups of `block`'s Linears among `targets` (module → name), from one run on `inp`. A
    group's producer is kept only when no module outside the group (and its parents) reads it.
    The modules inside `opaque` ones (which hold no target) are not watched: the run keeps every
    tensor it watches, so a whole model's run watches its decoder layers as wholes."""
    inputs: dict[int, Group] = {}
    keep = []  # the tensors seen, so that no id is reused during the run
    produced: dict[int, torch.nn.Module] = {}
    readers: dict[int, list[torch.nn.Module]] = {}
    done: set[int] = set()

    def pre(module, args):
        x = args[0] if args else None
        if not torch.is_tensor(x):
            return
        keep.append(x)
        readers.setdefault(id(x), []).append(module)
        if module not in targets or id(module) in done:
            return
        done.add(id(module))
        g = inputs.setdefault(id(x), Group([], [], produced.get(id(x))))
        g.names.append(targets[module])
        g.modules.append(module)
        g.key = id(x)

    def post(module, args, out):
        if torch.is_tensor(out):
            keep.append(out)
            produced[id(out)] = module

    def hooks():
        hidden = {id(m) for o in opaque for m in o.modules() if m is not o}
        mods = [m for m in block.modules() if m is not block and id(m) not in hidden]
        return [m.register_forward_pre_hook(pre) for m in mods] + [m.register_forward_hook(post) for m in mods]

    _run(block, [inp], hooks)
    groups = list(inputs.values())
    for g in groups:
        inside = {id(x) for m in g.modules for x in _ancestors(block, m)}
        if any(id(r) not in inside for r in readers.get(g.key, [])):
            g.producer = None
    return groups


def _ancestors(root: torch.nn.Module, module: torch.nn.Module) -> list[torch.nn.Module]:
    """`module` and every module of `root` that holds it."""
    return [m for m in root.modules() if any(c is module for c in m.modules())]


def reference_inputs(block: torch.nn.Module, inputs: list[Inputs], targets: Mapping[torch.nn.Module, str]
                     ) -> tuple[dict[str, list[torch.Tensor]], list[Inputs]]:  # fmt: skip
    """An unquantized copy of `block` run on `inputs` (the full-precision model's): per layer of
    `targets` (module → name) that reads every token of every batch, its input per batch; and the
    copy's outputs as the next block's inputs."""
    twin = copy.deepcopy(block)
    names = {c: targets[m] for m, c in zip(block.modules(), twin.modules(), strict=True) if m in targets}
    seen: dict[str, list] = {n: [] for n in names.values()}
    tokens = 0

    def hook(name):
        def record(module, args):
            x = args[0].detach()
            seen[name].append(x if x.numel() // max(x.shape[-1], 1) == tokens else None)

        return record

    outs = []
    handles = [m.register_forward_pre_hook(hook(n)) for m, n in names.items()]
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                h = _input_hidden((args, kwargs))
                tokens = h.numel() // h.shape[-1]
                outs.append(twin(*args, **kwargs))
    finally:
        for h in handles:
            h.remove()
    refs = {n: v for n, v in seen.items() if len(v) == len(inputs) and all(x is not None for x in v)}
    return refs, [_with_hidden(inp, _hidden(out)) for inp, out in zip(inputs, outs, strict=True)]


def observe_group(block: torch.nn.Module, inputs: list[Inputs], group: Group, kinds: Mapping[str, Callable[[], object]],
                  transforms: Mapping[str, torch.nn.Module | None],
                  references: Mapping[str, list[torch.Tensor]] | None = None) -> dict[str, dict]:  # fmt: skip
    """Per layer of `group`, the results of observers of `kinds` fed its input (transformed by its
    entry of `transforms`) over every run of `block` on `inputs`, each run stopped once every
    layer of the group saw its input; with `references` (per layer, the full-precision model's
    inputs per batch), a ``"reference"`` result too (`ReferenceObserver`; None where not aligned)."""
    obs = {name: {k: f() for k, f in kinds.items()} for name in group.names}
    for name in group.names:
        if references is not None and name in references:
            steps = [f for f in (group.reference_transforms.get(name), transforms.get(name)) if f is not None]
            chain = None if not steps else steps[0] if len(steps) == 1 else torch.nn.Sequential(*steps)
            obs[name]["reference"] = ReferenceObserver(references[name], chain)
    pending: set[str] = set()

    def hook(name):
        def record(module, args):
            if name not in pending:
                return
            x = args[0]
            t = transforms.get(name)
            x = t(x.reshape(-1, x.shape[-1])) if t is not None else x
            for o in obs[name].values():
                o.observe(x, name)
            pending.discard(name)
            if not pending:
                raise _Stop

        return record

    def hooks():  # every run of the block starts with the whole group pending
        start = block.register_forward_pre_hook(lambda module, args: pending.update(group.names))
        return [start] + [m.register_forward_pre_hook(hook(n)) for n, m in zip(group.names, group.modules, strict=True)]

    _run(block, inputs, hooks)
    return {name: {k: o.result() for k, o in ob.items()} for name, ob in obs.items()}


def run_sequential(model: torch.nn.Module, batches: Iterable, targets: Mapping[str, torch.nn.Linear], *,
                   kinds: Iterable[str], prepare: Callable[[Group], dict[str, torch.nn.Module | None]],
                   quantize: Callable[[str, torch.nn.Linear, dict, torch.nn.Module | None, Group], torch.nn.Module],
                   swap: Callable[[str, torch.nn.Module], None], before: Iterable[str] = (),
                   reference: bool = False) -> set[str]:  # fmt: skip
    """Quantize the Linears `targets` (name → module) of `model` in order, on `batches`.

    Per group (module docstring): `before` observer kinds measured on the raw inputs (e.g.
    ``channel_amax`` for smoothing) go into ``group.stats``; ``prepare(group)`` then gives each
    layer's input transform (and may fold into ``group.producer``); `kinds` are measured on the
    transformed inputs; ``quantize(name, linear, stats, transform, group)`` makes the new module
    and ``swap(name, new)`` puts it in the model. With `reference`, the stats of a layer inside
    the blocks that reads every token hold ``"reference"`` too (module docstring). Returns the
    names calibration never reached."""
    kinds = {k: OBSERVERS[k] for k in kinds}
    before = {k: OBSERVERS[k] for k in before}
    by_module = {m: n for n, m in targets.items()}
    blocks = find_blocks(model)
    todo = dict(targets)
    with eval_mode(model):
        if blocks is not None:
            inputs = capture_inputs(model, blocks[0], batches)
            fp_inputs = list(inputs)  # the full-precision model's, with `reference`
            for block in blocks:
                inside = {m: n for m, n in by_module.items() if any(m is x for x in block.modules())}
                refs = None
                if reference:
                    refs, fp_inputs = reference_inputs(block, fp_inputs, inside)
                if inside:
                    for group in find_groups(block, inputs[0], inside):
                        _quantize_group(block, inputs, group, kinds, before, prepare, quantize, swap, todo, refs)
                inputs = [_with_hidden(inp, _hidden(out)) for inp, out in zip(inputs, _run(block, inputs), strict=True)]
        rest = {m: n for n, m in todo.items()}
        if rest:  # outside the blocks (or a model without blocks): the whole model is the block
            whole = [_as_inputs(model, b) for b in batches]
            held = set() if blocks is None else {id(m) for m in blocks.modules()}
            opaque = () if blocks is None or any(id(m) in held for m in rest) else blocks
            for group in find_groups(model, whole[0], rest, opaque):
                _quantize_group(model, whole, group, kinds, before, prepare, quantize, swap, todo)
    return set(todo)


def _quantize_group(block, inputs, group: Group, kinds, before, prepare, quantize, swap, todo, references=None) -> None:
    if before:
        group.stats = observe_group(block, inputs, group, before, {})
    transforms = prepare(group)
    stats = observe_group(block, inputs, group, kinds, transforms, references)
    for name, module in zip(group.names, group.modules, strict=True):
        new = quantize(name, module, stats[name] | group.stats.get(name, {}), transforms.get(name), group)
        swap(name, new)
        todo.pop(name, None)
