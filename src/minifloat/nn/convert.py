"""`minifloat.convert`: swap a model's `torch.nn.Linear` layers for minifloat Linears in place.

By default every layer with both dimensions ≥ 16 is converted; the others stay in high
precision, with a log line each. A dimension that is not a multiple of the recipe's blocks gets a
partial last block (zero-padded: the padding changes no amax and is cropped from every result),
and the native GEMMs pad their operands to the alignment they need.
``filter(fqn, module) -> bool`` replaces that rule (e.g. to keep the LM head, or the last
blocks, in high precision as the NVFP4 recipe advises). ``nn.MultiheadAttention``'s
``out_proj`` is never converted: the attention calls ``F.linear`` on its weights itself.

Example:
    >>> import minifloat
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    >>> model = minifloat.convert(model, "mxfp8")
    >>> [type(m).__module__ for m in model if isinstance(m, torch.nn.Linear)]
    ['minifloat.nn.linear', 'torch.nn.modules.linear']
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from minifloat.errors import MinifloatError
from minifloat.nn.linear import Linear
from minifloat.recipes import Recipe, get_recipe

log = logging.getLogger("minifloat")
MIN_FEATURES = 16


def _why_not(module: torch.nn.Linear, recipe: Recipe) -> str | None:
    for name in ("in_features", "out_features"):
        n = getattr(module, name)
        if n < MIN_FEATURES:
            return f"{name}={n} is below {MIN_FEATURES}"
    return None


def _policy(recipe) -> Recipe | dict[str, Recipe | None]:
    """A recipe, or a mapping of module-name globs to recipes (None: high precision)."""
    if isinstance(recipe, Mapping) and "recipe" not in recipe:  # a dict with "recipe" describes one recipe
        if not recipe:
            raise MinifloatError("a policy maps module-name globs to recipes; this one is empty")
        return {str(k): (None if v is None else get_recipe(v)) for k, v in recipe.items()}
    return get_recipe(recipe)


def matches(name: str, patterns: Sequence[str]) -> str | None:
    """The first of `patterns` (globs) that `name` matches, whole or as its last components."""
    for p in patterns:
        if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"*.{p}"):
            return p
    return None


def rule_for(fqn: str, policy: Mapping[str, object]) -> tuple[str | None, object]:
    """(the first glob of `policy` that `fqn` `matches`, its value); (None, None) when none does."""
    for pattern, value in policy.items():
        if matches(fqn, [pattern]) is not None:
            return pattern, value
    return None, None


def convert(
    model: torch.nn.Module,
    recipe: str | Recipe | Mapping[str, str | Recipe | None],
    *,
    filter: Callable[[str, torch.nn.Module], bool] | None = None,
    backend: str = "auto",
) -> torch.nn.Module:
    """Swap every eligible ``nn.Linear`` of `model` (in place) for a `minifloat.nn.Linear`
    sharing its Parameters, and return `model`. Already converted layers get the new recipe.

    `recipe` may be a policy: a mapping of module-name globs to recipes (None: high precision),
    first match wins, e.g. ``{"*.attn.*": "fp8", "*.mlp.*": "nvfp4", "lm_head": None}``; a layer
    no rule matches stays in high precision. Each layer's rule is logged. A recipe's own
    ``high_precision_first`` / ``high_precision_last`` blocks (`kept_blocks`) stay in high
    precision, except under a policy, which names its layers itself."""
    if not isinstance(model, torch.nn.Module):
        raise MinifloatError(f"convert() takes a torch.nn.Module, got {type(model).__name__}")
    policy = _policy(recipe)
    if isinstance(policy, dict):
        given = {str(k): v for k, v in recipe.items()}
        chosen: dict[str, Recipe] = {}
        for fqn, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and fqn:
                pattern, r = rule_for(fqn, policy)
                why = None if r is None or filter is not None else _why_not(module, r)
                log.info("minifloat.convert: %s gets rule %r → %s%s", fqn, pattern, given.get(pattern) or "high precision",
                         f" (kept in high precision: {why})" if why else "")  # fmt: skip
                if r is not None and why is None and (filter is None or filter(fqn, module)):
                    chosen[fqn] = r
        for r in {id(r): r for r in chosen.values()}.values():
            group = {f for f, x in chosen.items() if x is r}
            # the policy names its layers: a recipe's kept blocks (mxfp4's first) do not override it
            _convert_layers(model, r, (), lambda f, m, group=group: f in group, backend)
        return model
    return _convert_layers(model, policy, kept_blocks(model, policy), filter, backend)


def _convert_layers(model: torch.nn.Module, recipe: Recipe, kept: tuple[str, ...],
                    filter: Callable[[str, torch.nn.Module], bool] | None, backend: str) -> torch.nn.Module:  # fmt: skip
    """`convert` with one recipe: its Linears but those under the `kept` block prefixes and those
    `filter` refuses (or, with no filter, those the recipe cannot quantize)."""
    targets = []
    # nn.MultiheadAttention passes out_proj's Parameters to F.multi_head_attention_forward and
    # never calls its forward: converting it would quantize nothing while saying it does
    unused = {f"{fqn}.out_proj" if fqn else "out_proj" for fqn, m in model.named_modules()
              if isinstance(m, torch.nn.MultiheadAttention)}  # fmt: skip
    for fqn, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if fqn in unused:
            log.info("minifloat.convert: keeping %s in high precision (nn.MultiheadAttention never calls its forward)", fqn)
            continue
        if f"{fqn}.".startswith(kept):  # inside a kept block, or the block itself (a list of Linears)
            keep_high, reason = True, f"the recipe keeps blocks {', '.join(k.rstrip('.') for k in kept)}"
        elif filter is not None:
            keep_high = not filter(fqn, module)
            reason = "filter"
        else:
            reason = _why_not(module, recipe)
            keep_high = reason is not None
        if keep_high:
            log.info("minifloat.convert: keeping %s %s in high precision (%s)", fqn or "<root>", tuple(module.weight.shape), reason)
            continue
        targets.append(fqn)
    if "" in targets:
        raise MinifloatError("convert() replaces Linear layers inside a model; wrap a bare Linear with Linear.from_linear")
    swap_modules(model, targets, lambda old: Linear.from_linear(old, recipe, backend=backend))
    return model


def block_lists(model: torch.nn.Module, every_child: bool = False) -> list[tuple[str, torch.nn.ModuleList]]:
    """The ``nn.ModuleList``s of `model` that hold Linears (in `every_child` with `every_child`),
    each with its name, but those inside another such list's entries (the experts of a MoE block
    are not the model's blocks, however many there are)."""
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) and (
        all(any(isinstance(x, torch.nn.Linear) for x in child.modules()) for child in m) if every_child
        else any(isinstance(x, torch.nn.Linear) for x in m.modules()))]  # fmt: skip
    return [(fqn, m) for fqn, m in lists if not any(fqn.startswith(f"{outer}.") or not outer and fqn != outer
                                                    for outer, _ in lists if outer != fqn)]  # fmt: skip


def kept_blocks(model: torch.nn.Module, recipe: Recipe) -> tuple[str, ...]:
    """The name prefixes (``"blocks.0."``) of the blocks `recipe` keeps in high precision (its
    ``high_precision_first`` / ``high_precision_last``): entries of the model's longest
    ``nn.ModuleList`` of modules holding Linears — a transformer's layers."""
    first, last = getattr(recipe, "high_precision_first", 0), getattr(recipe, "high_precision_last", 0)
    if not first and not last:
        return ()
    lists = block_lists(model)
    if not lists:  # a warning, not an error: `mxfp4` keeps its first block by default, and a plain model has none
        log.warning("minifloat.convert: the recipe keeps its first %d / last %d blocks in high precision, but this %s has "
                    "no nn.ModuleList of blocks: every Linear is quantized (choose the layers with convert(filter=...))",
                    first, last, type(model).__name__)  # fmt: skip
        return ()
    fqn, blocks = max(lists, key=lambda item: len(item[1]))
    n = len(blocks)
    if first + last >= n:
        log.warning("minifloat.convert: the recipe keeps its first %d / last %d blocks in high precision: all %d blocks of %s",
                    first, last, n, fqn or "the model")  # fmt: skip
    return tuple(f"{fqn}.{i}." if fqn else f"{i}." for i in range(n) if i < first or i >= n - last)


def swap_modules(model: torch.nn.Module, fqns: list[str], make: Callable[[torch.nn.Module], torch.nn.Module]) -> None:
    """Replace each submodule of `model` named in `fqns` (not the root) by ``make(old)``, in place."""
    for fqn in fqns:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child)))
