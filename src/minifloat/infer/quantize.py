"""Post-training quantization of a whole model: `calibrate`, then `quantize_model`.

`quantize_model` swaps every eligible Linear — ``torch.nn.Linear``, ``minifloat.nn.Linear``, the
Linears inside a Hugging Face transformers model — for a `QuantizedLinear`, in place, and returns
a `QuantizeSummary`: per layer the scheme, the bytes before and after (measured from the tensors
held), or why it stayed in high precision. A layer stays when its name matches ``ignore``, when
it is too small (a dimension below 16), or when calibration never reached it — never an
exception. A dimension that is not a multiple of the blocks gets a partial last block (the scale
grid is ceil-divided, as DeepSeek-V3's and compressed-tensors' readers expect): its scale is that
of the real values, the zero padding changes no amax and is never stored.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    >>> summary = quantize_model(model, "fp8-dynamic", ignore=())
    >>> [(layer.name, layer.scheme, layer.reason) for layer in summary.layers]
    [('0', 'fp8_rowwise', None), ('2', None, 'out_features=10 is below 16')]
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.checkpoints.export import unreadable
from minifloat.infer.modules.accounting import layer_bytes, model_bytes
from minifloat.infer.modules.embedding import QuantizedEmbedding
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.config import MIN_FEATURES, QuantConfig, get_quant_config, weight_only
from minifloat.infer.ptq.method import (
    PTQMethod,
    config_for,
    quantize_weight,
    refit_if_asymmetric,
    resolve_method,
)
from minifloat.infer.ptq.norm_tuning import TuningResult, tune_norms
from minifloat.infer.ptq.observers import AmaxObserver, observe
from minifloat.infer.ptq.outliers import choose_channels, condition, split
from minifloat.infer.ptq.rotation import HadamardRotation, parse_rotation
from minifloat.infer.ptq.rtn import Transform, WeightQuantizer, round_to_nearest, tensor_amax
from minifloat.infer.ptq.sequential import Group, run_sequential
from minifloat.infer.ptq.smoothing import Smoothing, fold_into_norm, smoothing_factors
from minifloat.models.conv1d import Conv1DLinear
from minifloat.nn.convert import matches, rule_for, swap_modules
from minifloat.quant import QuantizedTensor


@dataclass(frozen=True)
class LayerSummary:
    name: str
    shape: tuple[int, int]  # (out_features, in_features)
    scheme: str | None  # the weight's scheme; None: kept in high precision
    activation: str | None
    bytes_before: int
    bytes_after: int
    reason: str | None = None  # why it stayed in high precision
    config: str | None = None  # the config's name
    rule: str | None = None  # the policy pattern that chose it (a mapping of globs to configs)
    embedding: bool = False  # the input embedding (`quantize_head`), not a Linear
    note: str | None = None


@dataclass
class QuantizeSummary:
    """What `quantize_model` did; ``str()`` is a table."""

    config: QuantConfig | dict
    layers: list[LayerSummary] = field(default_factory=list)
    model_bytes_before: int = 0
    model_bytes_after: int = 0
    method: PTQMethod | None = None
    tuning: TuningResult | None = None  # what norm tuning did (the method's `norm_tuning`)

    @property
    def quantized(self) -> list[LayerSummary]:
        return [layer for layer in self.layers if layer.scheme is not None]

    @property
    def skipped(self) -> list[LayerSummary]:
        return [layer for layer in self.layers if layer.scheme is None]

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict() if isinstance(self.config, QuantConfig) else
                      {k: (None if v is None else v.name) for k, v in self.config.items()},
            "layers": [vars(layer) | {"shape": list(layer.shape)} for layer in self.layers],
            "model_bytes_before": self.model_bytes_before,
            "model_bytes_after": self.model_bytes_after,
            "method": None if self.method is None else self.method.to_dict(),
            "norm_tuning": None if self.tuning is None else vars(self.tuning),
        }

    def __str__(self) -> str:
        policy = not isinstance(self.config, QuantConfig)
        rows = [("layer", "shape", "config", "weight", "input", "bytes before", "bytes after", "note")]
        for s in self.layers:
            note = s.reason or s.note or (f"rule {s.rule!r}" if policy and s.rule else "")
            rows.append((s.name, "×".join(map(str, s.shape)), s.config or "—", s.scheme or "—", s.activation or "—",
                         f"{s.bytes_before:,}", f"{s.bytes_after:,}", note))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        ratio = self.model_bytes_before / self.model_bytes_after if self.model_bytes_after else float("nan")
        linears = [s for s in self.layers if not s.embedding]
        embedding = " and the input embedding" if any(s.embedding and s.scheme for s in self.layers) else ""
        lines.append(
            f"{self.config.name if isinstance(self.config, QuantConfig) else 'policy'}: "
            f"{sum(s.scheme is not None for s in linears)} of {len(linears)} Linears{embedding} quantized; model "
            f"{self.model_bytes_before:,} → {self.model_bytes_after:,} bytes ({ratio:.2f}× smaller)"
            + ("" if self.method is None or self.method.label == "rtn" else f"; method {self.method.label}")
        )
        if (t := self.tuning) is not None:
            stopped = t.asked and t.steps < t.asked
            steps = f"{t.steps} of {t.asked} steps" if stopped else f"{t.steps} steps"
            lines.append(f"norm tuning: {t.parameters:,} normalization values, {steps}, {t.seconds:.0f} s; KL to the "
                         f"unquantized model on its first training windows {t.kl_before:.4g} → {t.kl_after:.4g}"
                         + ("" if t.kept else f" (not lower{f' after {t.steps} steps, stopped' if stopped else ''}: the "
                                              "gains as they were before tuning are kept)"))  # fmt: skip
        return "\n".join(lines)


def why_not(linear: torch.nn.Linear, config: QuantConfig) -> str | None:
    """Why `linear` cannot be quantized with `config`, or None."""
    for attr in ("in_features", "out_features"):
        n = getattr(linear, attr)
        if n < MIN_FEATURES:
            return f"{attr}={n} is below {MIN_FEATURES}"
    if linear.weight.device.type == "meta":
        return "its weight is on the meta device (not loaded)"
    return None


class Calibration(dict):
    """Per layer name, the amax of its input (a float32 0-d tensor); see `calibrate`."""

    method: str = "max"


def calibrate(
    model: torch.nn.Module, batches: Iterable, *, method: str = "max", percentile: float = 99.99
) -> Calibration:
    """Run `model` on `batches` (token-id tensors, or dicts of model inputs) without gradients and
    record the amax of every Linear's input: ``"max"``, the largest |x| seen; ``"percentile"``,
    per batch the `percentile`-th percentile of |x|, the largest over batches (clips outliers).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32))
        >>> float(calibrate(model, [torch.ones(4, 32)])["0"])
        1.0
    """
    stats = observe(model, batches, {"amax": lambda: AmaxObserver(method, percentile)})
    result = Calibration({name: st["amax"] for name, st in stats.items()})
    result.method = method
    return result


def resolve_policy(config) -> QuantConfig | dict[str, QuantConfig | None]:
    """A config (name, `QuantConfig`, dict of its fields), or a policy: a mapping of layer-name
    globs to configs (or None: high precision), first match wins."""
    if isinstance(config, Mapping) and not ({"name", "weight"} <= set(config)):
        if not config:
            raise MinifloatError("a policy maps layer-name globs to configs; this one is empty")
        return {str(k): (None if v is None else get_quant_config(v)) for k, v in config.items()}
    return get_quant_config(config)


def _layer_config(name: str, policy) -> tuple[QuantConfig | None, str | None, str | None]:
    """(config, rule, reason it stays in high precision) of layer `name` under `policy`."""
    if isinstance(policy, QuantConfig):
        return policy, None, None
    pattern, c = rule_for(name, policy)
    if pattern is None:
        return None, None, "no rule of the policy matches it"
    return c, pattern, None if c is not None else f"rule {pattern!r} keeps it in high precision"


def quantize_model(
    model: torch.nn.Module,
    config,
    *,
    calibration: Mapping[str, torch.Tensor] | Iterable | None = None,
    ignore: Sequence[str] = ("lm_head",),
    backend: str = "auto",
    method: str | PTQMethod = "rtn",
    weight_quantizer: WeightQuantizer | None = None,
    transform: Transform | None = None,
    export_format: str | None = None,
    quantize_head: bool = False,
    tuning: Sequence[torch.Tensor] | None = None,
) -> QuantizeSummary:
    """Replace every eligible Linear of `model` (in place) by a `QuantizedLinear` in `config`.

    `config`: a config (name, `QuantConfig`), or a policy mapping layer-name globs to configs
    (None: high precision; first match wins; the summary shows each layer's rule), e.g.
    ``{"*.attn.*": "fp8-dynamic", "*.mlp.*": "nvfp4", "lm_head": None}``.
    `calibration`: what `calibrate` returned, or batches to calibrate on (method ``"max"``);
    configs with a calibrated input scale (``fp8-static``, ``nvfp4``) need it. `ignore`: globs of
    layer names kept in high precision.
    `method`: ``"rtn"`` (round to nearest, the default), ``"gptq"`` (the config's recommended
    pipeline, `minifloat.infer.ptq.method.recommended`) or a `PTQMethod` (`resolve_method` overrides
    its parts: observer, rotation, smoothing). GPTQ, a rotation or smoothing calibrate layer by
    layer (`minifloat.infer.ptq.sequential`) and need the calibration batches, not a `Calibration`.
    `weight_quantizer` and `transform` (`minifloat.infer.ptq.rtn`) replace the method's stages for
    round to nearest: the observer kinds they list in a ``needs`` attribute (e.g. ``("hessian",)``)
    are measured on the calibration batches in one pass over the model and handed to them per layer.
    `export_format` (``"compressed-tensors"``, ``"hf-fp8"``): keep in high precision the layers
    that format's readers could not load (`minifloat.infer.checkpoints.export.unreadable` names why).
    `quantize_head`: quantize the LM head too (``ignore`` does not keep it), weight-only with the
    config's weight scheme (`weight_only`), and the input embedding with it: a tied embedding
    becomes a `QuantizedEmbedding` reading the head's packed table (one table, as before), an
    untied one gets its own packed table in the same scheme (round to nearest).
    `tuning`: the token windows (B, T + 1) a method with `norm_tuning` distills on (default: the
    calibration batches, cut into its `rows`); the full-precision model it distills from is a copy
    taken before any layer is quantized.
    Returns the `QuantizeSummary`."""
    if not isinstance(model, torch.nn.Module):
        raise MinifloatError(f"quantize_model takes a torch.nn.Module, got {type(model).__name__}")
    policy = resolve_policy(config)
    configs = [policy] if isinstance(policy, QuantConfig) else [c for c in policy.values() if c is not None]
    method = resolve_method(method, configs[0] if configs else "fp8-dynamic")
    if method.sequential and (weight_quantizer is not None or transform is not None):
        raise MinifloatError(f"method {method.label!r} has its own stages: pass weight_quantizer= / transform= only with method='rtn'")
    if isinstance(ignore, str):
        ignore = (ignore,)
    static = [c.name for c in configs if c.needs_calibration]
    needs = sorted({*getattr(weight_quantizer, "needs", ()), *getattr(transform, "needs", ())})
    if (static or needs or method.sequential) and calibration is None:
        what = (f"config {static[0]!r} quantizes inputs with calibrated scales" if static else
                f"the PTQ stages need {needs}" if needs else f"method {method.label!r} calibrates layer by layer")  # fmt: skip
        raise MinifloatError(f"{what}: pass calibration= (minifloat.infer.calibrate(model, batches), or the batches themselves)")
    if method.sequential and isinstance(calibration, Mapping):
        raise MinifloatError(f"method {method.label!r} calibrates layer by layer on the inputs the quantized layers "
                             f"before produce: pass the calibration batches, not a Calibration of amaxes")  # fmt: skip
    if method.norm_tuning is not None and calibration is not None and not isinstance(calibration, Mapping):
        calibration = list(calibration)  # read twice: calibration, then the tuning's default windows
    tuning = _tuning_batches(method, calibration, tuning)
    teacher = _teacher(model) if method.norm_tuning is not None else None
    stats: dict[str, dict] = {}
    if method.sequential:
        calibration = list(calibration)
    elif needs:
        if isinstance(calibration, Mapping):
            raise MinifloatError(f"the PTQ stages need {needs} of every layer's input: pass the calibration batches, "
                                 f"not a Calibration of amaxes")  # fmt: skip
        stats = observe(model, calibration, [*needs, *(["amax"] if static else [])])
        calibration = Calibration({n: st["amax"] for n, st in stats.items() if st.get("amax") is not None})
    elif static and not isinstance(calibration, Mapping):
        calibration = calibrate(model, calibration)
    summary = QuantizeSummary(policy, model_bytes_before=model_bytes(model))
    head = output_head(model) if quantize_head else None
    plan: dict[str, tuple[torch.nn.Linear, QuantConfig, str | None]] = {}
    rows: dict[str, LayerSummary] = {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or not name:
            continue
        c, rule, reason = _layer_config(name, policy)
        if m is head and c is not None:
            c = weight_only(c)  # the head: weight-only, whatever `ignore` says of it
        elif (p := matches(name, ignore)) is not None:
            reason = f"ignored (matches {p!r})"
        if reason is None and c is not None:
            if isinstance(policy, QuantConfig) or c.weight_scheme.is_nvfp4:  # a policy's other formats: minmax
                c = config_for(c, method)
            reason = why_not(m, c)
            if reason is None and export_format is not None:
                why = unreadable(c.weight_scheme, m.out_features, m.in_features, export_format)
                if isinstance(m, Conv1DLinear) and export_format != "gguf":  # GGUF holds them as (out, in) rows
                    why = "GPT-2's Conv1D: its readers quantize nn.Linear layers only"
                reason = None if why is None else f"{export_format}: {why}"
        before = layer_bytes(m)
        rows[name] = LayerSummary(name, tuple(m.weight.shape), None, None, before, before, reason, rule=rule)
        if reason is None:
            plan[name] = (m, c, rule)
    done: dict[str, QuantizedLinear] = {}
    by_old: dict[int, QuantizedLinear] = {}
    notes: dict[str, str] = {}  # what a quantized layer's summary row says of it (a rarely routed expert)
    amaxes: dict[str, torch.Tensor] = {}  # the calibrated input amaxes the sequential path measured
    if method.sequential:
        # a head whose table the embedding shares is not rotated: the lookup reads the stored rows as they are
        tied = head is not None and (emb := _input_embedding(model, head)) is not None and emb[1].weight is head.weight
        plain = {n for n, (m, _, _) in plan.items() if tied and m is head}
        unreached = _quantize_sequential(model, plan, calibration, method, backend, done, plain=plain, notes=notes,
                                         amaxes=amaxes)  # fmt: skip
        plain_method = dataclasses.replace(method, method="rtn", rotation=None, smooth=None, keep_channels=0)
        siblings = expert_amaxes(amaxes)
        for name in unreached:
            m, c, _ = plan[name]
            amax = siblings.get(EXPERT.sub(".experts.*.", name)) if c.needs_calibration else None
            if EXPERT.search(name) and (amax is not None or not c.needs_calibration):  # an expert its router never chose
                done[name] = q = QuantizedLinear.from_linear(m, c, input_amax=amax, backend=backend,
                                                             weight_quantizer=functools.partial(quantize_weight, method=plain_method))  # fmt: skip
                swap_modules(model, [name], lambda old, q=q: q)
                notes[name] = "its router sent it no calibration token: round to nearest" + (
                    ", the input scale of its sibling experts" if amax is not None else "")  # fmt: skip
            else:
                rows[name] = dataclasses.replace(rows[name], reason="calibration never reached it")
        by_old = {id(plan[n][0]): q for n, q in done.items()}
    else:
        wq = weight_quantizer or (round_to_nearest if method == PTQMethod() else functools.partial(quantize_weight, method=method))
        siblings = expert_amaxes(calibration) if isinstance(calibration, Mapping) else {}
        for name, (m, c, _) in plan.items():
            amax = None
            if needs and name not in stats:
                rows[name] = dataclasses.replace(rows[name], reason="calibration never reached it")
                continue
            if c.needs_calibration:
                amax = calibration.get(name)
                sibling = siblings.get(EXPERT.sub(".experts.*.", name)) if EXPERT.search(name) else None
                if (amax is None or not float(amax) > 0) and sibling is not None:
                    amax, notes[name] = sibling, "its router sent it no calibration token: the input scale of its sibling experts"
                if amax is None or not float(amax) > 0:
                    why = "calibration never reached it" if amax is None else f"its calibrated input amax is {float(amax)}"
                    rows[name] = dataclasses.replace(rows[name], reason=why)
                    continue
            done[name] = by_old[id(m)] = QuantizedLinear.from_linear(
                m, c, input_amax=amax, backend=backend, weight_quantizer=wq, stats=stats.get(name, {}), transform=transform)
        swap_modules(model, list(done), lambda old: by_old[id(old)])
    for name, q in done.items():
        c = q.config
        rows[name] = dataclasses.replace(rows[name], scheme=c.weight, activation=c.activation, bytes_after=layer_bytes(q),
                                         config=c.name, note=notes.get(name))  # fmt: skip
    summary.layers.extend(rows.values())
    if head is not None and id(head) in by_old:
        summary.layers.append(_quantize_embedding(model, head, by_old[id(head)]))
    if teacher is not None and done:
        summary.tuning = _tune(model, teacher, done, tuning, method)
    summary.model_bytes_after = model_bytes(model)
    summary.method = method
    return summary


def _tuning_batches(method: PTQMethod, calibration, tuning) -> list[torch.Tensor] | None:
    """The windows norm tuning distills on, cut into `rows` a step; checked before any work."""
    if method.norm_tuning is None:
        return None
    if tuning is None:
        if calibration is None or isinstance(calibration, Mapping):
            raise MinifloatError(f"method {method.label!r} tunes norms on token windows: pass tuning= (or the "
                                 f"calibration batches, not a Calibration of amaxes)")  # fmt: skip
        tuning = calibration
    windows = [b for b in tuning if isinstance(b, torch.Tensor) and b.dim() == 2 and b.shape[1] > 1]
    if len(windows) != len(tuning) or not windows:
        raise MinifloatError("norm tuning distills on token windows: tensors (batch, tokens + 1) of token ids")
    rows = method.norm_tuning.rows
    return [w for b in windows for w in b.split(rows)]


def _teacher(model: torch.nn.Module) -> torch.nn.Module:
    """The full-precision model norm tuning distills from: a copy, before anything is quantized."""
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise MinifloatError("norm tuning distills from the full-precision model: quantize an unquantized model")
    return copy.deepcopy(model).eval().requires_grad_(False)


def _tune(model, teacher, done: dict[str, QuantizedLinear], batches, method: PTQMethod) -> TuningResult:
    """`tune_norms` on `model` with each quantized layer as its `DifferentiableLinear`, swapped back after."""
    names = [n for n, q in done.items() if model.get_submodule(n) is q]
    swap_modules(model, names, lambda old: old.differentiable())
    try:
        return tune_norms(model, teacher, batches, method.norm_tuning)
    finally:
        for n in names:
            swap_modules(model, [n], lambda old, q=done[n]: q)


def _quantize_sequential(model, plan, batches, method: PTQMethod, backend: str, done: dict, *,
                         plain: set[str] = frozenset(), notes: dict | None = None, amaxes: dict | None = None) -> set[str]:  # fmt: skip
    """GPTQ / rotation / smoothing / kept channels: `plan`'s layers quantized block by block
    (`run_sequential`); the layers `plain` get no rotation and keep no channels. A layer GPTQ saw fewer than `MIN_GPTQ_ROWS` tokens of (a
    MoE expert its router rarely chose) is rounded to nearest, said in `notes`; `amaxes` gets the
    calibrated input amaxes."""
    notes = {} if notes is None else notes
    amaxes = {} if amaxes is None else amaxes
    rotation = parse_rotation(method.rotation)
    configs = {n: c for n, (_, c, _) in plan.items()}
    kinds = ["hessian", "rows"] if method.method == "gptq" else ["hessian"] if method.keep_channels else []
    if any(c.needs_calibration for c in configs.values()):
        kinds.append("amax")
    smoothing = method.smooth is not None and any(c.activation is not None for c in configs.values())
    for name, (m, _, _) in plan.items():  # a rotation that does not fit: an error before any work
        if rotation is not None and name not in plain:
            HadamardRotation(rotation).check(m.in_features, name)

    def prepare(group: Group) -> dict:
        weights = {n: m.weight.detach().float() for n, m in zip(group.names, group.modules, strict=True)}
        factors, folded = None, False
        if smoothing and all(configs[n].activation is not None for n in group.names):
            factors = smoothing_factors(group.stats[group.names[0]]["channel_amax"], list(weights.values()), method.smooth)
            folded = group.producer is not None and fold_into_norm(group.producer, factors)
            weights = {n: w * factors for n, w in weights.items()}
            if folded:  # the full-precision model's input, as the folded norm now divides it
                group.reference_transforms = {n: Smoothing(factors) for n in group.names}
        transforms = {}
        for n in group.names:
            steps = [] if factors is None or folded else [Smoothing(factors)]
            if rotation is not None and n not in plain:
                r = HadamardRotation(rotation)
                steps.append(r)
                weights[n] = r.fold(weights[n])
            transforms[n] = None if not steps else steps[0] if len(steps) == 1 else torch.nn.Sequential(*steps)
        group.weights = weights
        group.amax = tensor_amax(list(weights.values()), configs[group.names[0]])
        return transforms

    def quantize(name, m, stats, transform, group):
        c = configs[name]
        amax = None
        if c.needs_calibration:
            amax = stats.get("amax")
            if amax is None or not float(amax) > 0:
                raise MinifloatError(f"{name}: its calibrated input amax is {None if amax is None else float(amax)}; "
                                     f"calibrate on text that reaches it, or ignore it")  # fmt: skip
            amaxes[name] = amax
        shared = group.amax if len({configs[n].weight_scheme for n in group.names}) == 1 else None
        how = method
        if method.method == "gptq" and stats.get("rows", MIN_GPTQ_ROWS) < MIN_GPTQ_ROWS:  # a rarely routed expert
            how = dataclasses.replace(method, method="rtn")
            notes[name] = f"GPTQ saw {stats['rows']} calibration tokens (< {MIN_GPTQ_ROWS}): round to nearest"
        kept = None
        if method.keep_channels and name not in plain:  # a tied head's table is the embedding's rows, whole
            w, kept = _quantize_keeping(group, name, c, stats, how, shared, m.weight.dtype)
        else:
            w = quantize_weight(group.weights[name], c, stats, how, amax=shared, name=name, dtype=m.weight.dtype)
        q = QuantizedLinear(w, m.bias, c, input_amax=amax, backend=backend, input_transform=transform,
                            kept_index=None if kept is None else kept[0], kept_weight=None if kept is None else kept[1])
        done[name] = q
        return q

    def swap(name, new):
        swap_modules(model, [name], lambda old: new)

    targets = {n: m for n, (m, _, _) in plan.items()}
    return run_sequential(model, batches, targets, kinds=kinds, prepare=prepare, quantize=quantize, swap=swap,
                          before=["channel_amax"] if smoothing else [],
                          reference=method.method == "gptq" and method.gptq.asymmetric is not None)  # fmt: skip


def _quantize_keeping(group: Group, name: str, config: QuantConfig, stats: dict, method: PTQMethod,
                      shared: torch.Tensor | None, dtype: torch.dtype) -> tuple[QuantizedTensor, tuple | None]:
    """The layer `name` of `group` quantized with its `method.keep_channels` input channels of
    largest calibration mean square kept out (`minifloat.infer.ptq.outliers`): the packed weight
    with their columns zero, and (kept index, their BF16 columns — GPTQ's compensation included);
    (packed weight, None) where its input never reached any channel."""
    w, h = group.weights[name], stats["hessian"]
    kept = choose_channels(h, method.keep_channels)
    if not len(kept):
        return quantize_weight(w, config, stats, method, amax=shared, name=name, dtype=dtype), None
    w = refit_if_asymmetric(w, stats, method, name)  # on the whole weight, then split
    stats = {k: v for k, v in stats.items() if k != "reference"}
    rest = split(w, kept)
    if shared is not None:  # NVFP4's tensor amax, shared by the group: over the quantized parts only
        shared = tensor_amax([split(x, kept) for x in group.weights.values()], config)
    gain = None
    if method.method == "gptq":
        stats["hessian"], gain = condition(h, kept, method.gptq.damp)
    q = quantize_weight(rest, config, stats, method, amax=shared, name=name, dtype=dtype)
    cols = w.float()[:, kept]
    if gain is not None:  # the kept columns take the error GPTQ left on the rest's outputs
        err = rest - q.dequantize(torch.float32)[: rest.shape[0], : rest.shape[1]]
        cols = (cols.double() + err.double() @ gain).float()
    return q, (kept, cols)


EXPERT = re.compile(r"\.experts\.\d+\.")  # a MoE expert's Linear (`minifloat.models.experts`): experts.N.<name>
MIN_GPTQ_ROWS = 16  # fewer calibration tokens than this: GPTQ's Hessian says little, round to nearest instead


def expert_amaxes(amaxes: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per expert Linear role (``…experts.*.w1``), the largest calibrated input amax over its
    layer's experts: the input scale an expert the router never chose takes."""
    out: dict[str, torch.Tensor] = {}
    for n, a in amaxes.items():
        if EXPERT.search(n) and a is not None and float(a) > 0:
            key, a = EXPERT.sub(".experts.*.", n), torch.as_tensor(a, dtype=torch.float32)
            out[key] = torch.maximum(out[key], a) if key in out else a
    return out


def output_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's LM head: transformers' output embeddings, else the Linear named ``lm_head``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, torch.nn.Linear):
        return head
    return next((m for n, m in model.named_modules() if n.rpartition(".")[2] == "lm_head" and isinstance(m, torch.nn.Linear)), None)


def _input_embedding(model: torch.nn.Module, head: torch.nn.Linear) -> tuple[str, torch.nn.Embedding] | None:
    """(name, module) of the input embedding: transformers' input embeddings, else the
    ``nn.Embedding`` tied to `head`."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding) and (m is emb or (emb is None and m.weight is head.weight)):
            return name, m
    return None


def _quantize_embedding(model: torch.nn.Module, old_head: torch.nn.Linear, head: QuantizedLinear) -> LayerSummary:
    """Swap the input embedding for a `QuantizedEmbedding`: reading the head's table when the two
    were tied, else its own table in the head's scheme. Its row of the summary."""
    found = _input_embedding(model, old_head)
    if found is None:
        return LayerSummary("(input embedding)", (0, 0), None, None, 0, 0, "the model has no nn.Embedding input embedding",
                            embedding=True)  # fmt: skip
    name, emb = found
    shape, before = tuple(emb.weight.shape), emb.weight.nbytes
    if emb.weight is old_head.weight and head.beyond_weight() is None:
        new = QuantizedEmbedding(tied_to=head, dtype=emb.weight.dtype, padding_idx=emb.padding_idx)
        before, note = 0, "tied to the LM head: one packed table (counted there)"
    else:
        table = round_to_nearest(emb.weight.detach(), head.config, {})
        new = QuantizedEmbedding(table, dtype=emb.weight.dtype, padding_idx=emb.padding_idx)
        note = None
        if emb.weight is old_head.weight:  # the shared float table was counted with the head
            before, note = 0, "its own table: the head's input is transformed, its table is not the embedding's"
    swap_modules(model, [name], lambda old: new)
    return LayerSummary(name, shape, head.config.weight, None, before, new.packed_nbytes(), config=head.config.name,
                        embedding=True, note=note)  # fmt: skip
