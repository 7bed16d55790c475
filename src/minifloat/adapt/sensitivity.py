"""Per-layer sensitivity: what quantizing one layer alone costs, measured and estimated.

Measured: for every quantizable Linear and candidate config, that layer alone becomes a
`QuantizedLinear` and the model runs on the data: the mean per-token KL(reference ‖ quantized)
and the change of the mean next-token loss. Estimated from one backward pass (ModelOpt
AutoQuantize's score): with g the gradient of the loss with respect to the layer's output and Δy
the change of its output when the layer is quantized, ½ Σ g² Δy² per token — a diagonal-Fisher
approximation of that KL. How well the estimate ranks the measurements is the Spearman
correlation over all (layer, candidate) pairs.

Example:
    >>> from minifloat.models.gpt import GPT, GPTConfig
    >>> torch.manual_seed(0) and None
    >>> gpt = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=64)).eval()
    >>> data = [torch.randint(0, 256, (2, 17))]
    >>> s = sensitivity(gpt, data, ["fp8-dynamic", "mxfp4"])
    >>> s.layers
    ['blocks.0.attn.qkv', 'blocks.0.attn.proj', 'blocks.0.mlp.fc', 'blocks.0.mlp.proj']
    >>> s.kl["blocks.0.mlp.fc"]["mxfp4"] > s.kl["blocks.0.mlp.fc"]["fp8-dynamic"]
    True
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minifloat.errors import MinifloatError
from minifloat.infer.evaluation.metrics import Quality
from minifloat.infer.modules.accounting import layer_bytes
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.config import get_quant_config
from minifloat.infer.ptq.method import PTQMethod, resolve_method
from minifloat.infer.quantize import calibrate, matches, quantize_model, why_not
from minifloat.models.loading import logits_of

METHODS = ("rtn", "gptq")
DEFAULT_CANDIDATES = ("fp8-dynamic", "mxfp6", "mxfp4", "nvfp4", "nvfp4-4over6")  # the last: the heuristic's FP4


@dataclass
class Sensitivity:
    """`sensitivity`'s result; per layer name and candidate: ``kl``, ``dloss``, ``estimate``; per
    layer its weight count and each candidate's bits per weight (codes and scales, measured)."""

    layers: list[str]
    candidates: list[str]
    params: dict[str, int]
    bits: dict[str, dict[str, float]]
    kl: dict[str, dict[str, float]] = field(default_factory=dict)
    dloss: dict[str, dict[str, float]] = field(default_factory=dict)
    estimate: dict[str, dict[str, float]] = field(default_factory=dict)
    spearman: float = float("nan")
    measured: list[str] = field(default_factory=list)  # layers whose KL was measured; the others' is the scaled estimate
    method: str = "rtn"  # how each candidate's layers were quantized: rtn, or gptq (the model quantized whole, sequentially)
    labels: dict[str, str] = field(default_factory=dict)  # each candidate's PTQ method, as `PTQMethod.label` names it
    # what `refine` measures more layers with: each layer's quantized copies
    built: dict = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict:
        keys = ("layers", "candidates", "params", "bits", "kl", "dloss", "estimate", "spearman", "measured", "method", "labels")
        return {k: getattr(self, k) for k in keys}


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties).

    >>> spearman([1, 2, 3, 4], [10, 20, 30, 25])
    0.8
    """

    def ranks(v):
        t = torch.tensor(v, dtype=torch.float64)
        order = t.argsort()
        r = torch.empty_like(t)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        for x in t.unique():  # ties: their mean rank
            m = t == x
            r[m] = r[m].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = (ra.square().sum() * rb.square().sum()).sqrt()
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def quantizable(model: torch.nn.Module, candidates: Sequence[str], ignore: Sequence[str] = ("lm_head",)) -> list[str]:
    """The Linears every candidate can quantize (the others stay out of the search)."""
    configs = [get_quant_config(c) for c in candidates]
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n and not matches(n, ignore)
            and all(why_not(m, c) is None for c in configs)]  # fmt: skip


@contextlib.contextmanager
def swapped(model: torch.nn.Module, name: str, new: torch.nn.Module):
    """`model` with submodule `name` replaced by `new` for the block's duration."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    setattr(parent, child, new)
    try:
        yield
    finally:
        setattr(parent, child, old)


def _score(model: torch.nn.Module, batches, variants: dict[tuple[str, str], torch.nn.Module],
           done: Callable[[int], None] | None = None) -> tuple[float, dict]:  # fmt: skip
    """The model's own mean NLL on `batches`, and per (layer name, candidate) of `variants` (the
    module that replaces that layer) the model's NLL and KL against it — batch by batch: one
    batch's reference logits are held at a time, so memory does not grow with the batches."""
    ref_q = Quality()
    scores = {key: Quality() for key in variants}
    with torch.no_grad():
        for i, b in enumerate(batches):
            ref = logits_of(model(b[:, :-1])).float()
            ref_q.add(ref, b[:, 1:])
            for (name, c), new in variants.items():
                with swapped(model, name, new):
                    scores[name, c].add(logits_of(model(b[:, :-1])).float(), b[:, 1:], reference=ref)
            if done is not None:
                done(i + 1)
    return ref_q.result()["nll"], {k: q.result() for k, q in scores.items()}


def sensitivity(
    model: torch.nn.Module,
    data: Sequence[torch.Tensor],
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    *,
    ignore: Sequence[str] = ("lm_head",),
    estimate_batches: int = 2,
    measure: str | Sequence[str] = "all",
    progress: Callable[[str, int, int], None] | None = None,
    method: str = "rtn",
) -> Sensitivity:
    """Measure and estimate each quantizable layer's sensitivity to each candidate on `data`
    (token-id batches (B, T + 1), as `minifloat.infer.token_batches` cuts them).

    `measure`: ``"all"`` measures every layer's KL (a forward over `data` per layer and
    candidate); ``"none"`` only the one-backward Fisher estimate; a list of layer names measures
    those (`refine` adds more later). A layer not measured takes its estimate scaled by the median
    measured / estimated ratio (the estimate itself when nothing was measured). `progress(what,
    done, total)` is called as the work goes.

    `method`: ``"rtn"`` rounds each layer's weights to nearest; ``"gptq"`` quantizes the whole model
    with each candidate by GPTQ on `data` (layer by layer, each layer's inputs those of the layers
    before it quantized; no rotation or smoothing, so that any layer can be swapped in alone) and
    takes each layer's weights from there — the weights a user would ship."""
    if method not in METHODS:
        raise MinifloatError(f"method={method!r}: use one of {', '.join(METHODS)}")
    if not data:
        raise MinifloatError("sensitivity needs data: token-id batches (B, T + 1)")
    configs = {c: get_quant_config(c) for c in candidates}
    layers = quantizable(model, candidates, ignore)
    if not layers:
        raise MinifloatError(f"no layer of the model can take every candidate of {list(candidates)}")
    chosen = layers if measure == "all" else [] if measure == "none" else [n for n in layers if n in set(measure)]
    if isinstance(measure, str) and measure not in ("all", "none"):
        raise MinifloatError(f"measure={measure!r}: use 'all', 'none' or a list of layer names")
    was = model.training
    model.eval()
    calibration = calibrate(model, [b[:, :-1] for b in data]) if any(c.needs_calibration for c in configs.values()) else None
    try:
        labels = {c: candidate_method(cfg).label if method == "gptq" else "rtn" for c, cfg in configs.items()}
        res = Sensitivity(layers, list(candidates), {}, {}, method=method, labels=labels)
        built: dict[str, dict[str, QuantizedLinear]] = {}
        gptq = {c: gptq_layers(model, cfg, data, layers, ignore) for c, cfg in configs.items()} if method == "gptq" else {}
        for i, name in enumerate(layers):
            lin = model.get_submodule(name)
            res.params[name] = lin.weight.numel()
            built[name] = {}
            for c, cfg in configs.items():
                amax = calibration.get(name) if cfg.needs_calibration else None
                q = gptq[c][name] if gptq else QuantizedLinear.from_linear(lin, cfg, input_amax=amax)
                built[name][c] = q
                res.bits.setdefault(name, {})[c] = 8 * layer_bytes(q, bias=False) / res.params[name]
            if progress:
                progress("quantize", i + 1, len(layers))
        res.estimate = _fisher_estimate(model, data[:estimate_batches], built)
        if progress:
            progress("estimate", len(layers), len(layers))
        res.built = built
        refine(res, model, data, chosen, progress=progress)
    finally:
        model.train(was)
    return res


def candidate_method(config) -> PTQMethod:
    """How `gptq_layers` quantizes a candidate: `config`'s recommended GPTQ pipeline as a checkpoint
    holds it, without rotation, smoothing or norm tuning (each layer stands alone in the original model;
    tuned gains would be one candidate's, not the mix's)."""
    return resolve_method("gptq", config, export=True, rotation="none", smooth=-1, tune_norms=0)


def gptq_layers(model: torch.nn.Module, config, data: Sequence[torch.Tensor], layers: Sequence[str],
                ignore: Sequence[str] = ("lm_head",)) -> dict[str, QuantizedLinear]:  # fmt: skip
    """`layers` of a copy of `model` quantized whole with `config` by GPTQ on `data` as a checkpoint
    holds it (the recommended observer and, for FP4, asymmetric calibration; no rotation, no
    smoothing: each layer stands alone in the original model)."""
    q = copy.deepcopy(model)
    quantize_model(q, config, calibration=list(data), ignore=ignore, method=candidate_method(config))
    out = {n: q.get_submodule(n) for n in layers}
    missing = [n for n, m in out.items() if not isinstance(m, QuantizedLinear)]
    if missing:
        raise MinifloatError(f"GPTQ with {config.name} left {missing[:3]} unquantized; leave that candidate out")
    return out


def refine(s: Sensitivity, model: torch.nn.Module, data: Sequence[torch.Tensor], layers: Sequence[str], *,
           progress: Callable[[str, int, int], None] | None = None) -> Sensitivity:  # fmt: skip
    """Measure the KL of `layers` (every candidate) on the `data` `s` was made with, in place; the
    unmeasured layers' KL is then their estimate × the median measured / estimated ratio."""
    if not s.built:
        raise MinifloatError("refine needs the Sensitivity that `sensitivity` returned (with its quantized layers)")
    todo = [n for n in layers if n not in s.measured]
    was = model.training
    model.eval()
    try:
        def done(batches: int) -> None:  # the progress in layers, as each batch ends
            if progress:
                progress("measure", round(len(todo) * batches / len(data)), len(todo))

        variants = {(name, c): s.built[name][c] for name in todo for c in s.candidates}
        ref_loss, scores = _score(model, data, variants, done if todo else None)
        for name in todo:
            for c in s.candidates:
                s.kl.setdefault(name, {})[c] = scores[name, c]["kl"]
                s.dloss.setdefault(name, {})[c] = scores[name, c]["nll"] - ref_loss
            s.measured.append(name)
    finally:
        model.train(was)
    pairs = [(s.estimate[n][c], s.kl[n][c]) for n in s.measured for c in s.candidates]
    ratios = sorted(k / e for e, k in pairs if e > 0 and k > 0)
    scale = ratios[len(ratios) // 2] if ratios else 1.0
    for n in s.layers:
        if n not in s.measured:
            s.kl[n] = {c: s.estimate[n][c] * scale for c in s.candidates}
            s.dloss[n] = dict.fromkeys(s.candidates, float("nan"))
    s.spearman = spearman([p[0] for p in pairs], [p[1] for p in pairs]) if len(pairs) > 1 else float("nan")
    return s


def _fisher_estimate(model, batches, built: dict[str, dict[str, QuantizedLinear]]) -> dict[str, dict[str, float]]:
    """½ Σ g² Δy² per token, g the loss gradient at each layer's output (one backward per batch)."""
    saved: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in built}
    inputs: dict[str, torch.Tensor] = {}
    handles = []
    for name in built:
        m = model.get_submodule(name)

        def fwd(mod, args, out, name=name):
            inputs[name] = args[0].detach()
            out.register_hook(lambda g, name=name: saved[name].append((inputs[name], g.detach())))

        handles.append(m.register_forward_hook(fwd))
    tokens = 0
    try:
        for b in batches:
            model.zero_grad(set_to_none=True)
            lg = logits_of(model(b[:, :-1])).float()
            loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), b[:, 1:].reshape(-1), reduction="sum")
            loss.backward()
            tokens += b[:, 1:].numel()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    out: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, per_c in built.items():
            lin = model.get_submodule(name)
            for c, q in per_c.items():
                s = 0.0
                for x, g in saved[name]:
                    dy = q(x) - lin(x)
                    s += 0.5 * (g.float().square() * dy.float().square()).sum().item()
                out.setdefault(name, {})[c] = s / max(tokens, 1)
    return out
