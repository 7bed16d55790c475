"""Automatic per-layer precision under a bit budget.

`auto_precision` picks one candidate config per quantizable layer so that the summed measured
single-layer KL (`sensitivity`) is least with the average bits per weight (codes and scales,
weighted by each layer's weight count) at most `budget_bits` — a multiple-choice knapsack solved
exactly (`knapsack.solve`), or for hundreds of layers by Lagrangian relaxation with its duality gap
(`AutoPrecision.optimality_gap`) — then quantizes a copy of the model with that assignment and
evaluates it. The rules of thumb it is compared with: `heuristic_policy`, the first and last
blocks in 8 bits and the rest in FP4 (whatever that costs), and `fill_policy`, the layers nearest
the embedding, the head or both ends in 8 bits until the same budget is spent — the comparison
AutoRound's AutoScheme reports at equal average bits ("tail" and "head layers 8-bit").

Example:
    >>> from minifloat.models.gpt import GPT, GPTConfig
    >>> torch.manual_seed(0) and None
    >>> gpt = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)).eval()
    >>> data = [torch.randint(0, 256, (2, 17))]
    >>> r = auto_precision(gpt, data, ["fp8-dynamic", "mxfp4"], budget_bits=6.0)
    >>> r.average_bits <= 6.0, sorted(set(r.assignment.values()))
    (True, ['fp8-dynamic', 'mxfp4'])
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minifloat.adapt.knapsack import Solution, solve_bounded
from minifloat.adapt.sensitivity import DEFAULT_CANDIDATES, Sensitivity, refine, sensitivity
from minifloat.errors import MinifloatError
from minifloat.infer.evaluation.metrics import evaluate
from minifloat.infer.generation.cache import kv_bytes
from minifloat.infer.modules.accounting import bits_per_weight, layer_bytes, model_bytes
from minifloat.infer.quantize import calibrate, quantize_model

BIT_STEPS = 64  # costs in 1/64 bit per weight


@dataclass
class AutoPrecision:
    assignment: dict[str, str]  # layer → config
    average_bits: float
    budget_bits: float
    predicted_kl: float  # the summed single-layer KLs the knapsack minimised
    metrics: dict | None  # `evaluate` of the quantized model against the reference
    solver: str = "exact"  # "exact" (dynamic programming) or "lagrangian" (hundreds of layers)
    optimality_gap: float = 0.0  # at most this much summed KL above the best assignment within the budget

    def to_dict(self) -> dict:
        return dict(vars(self))


def average_bits(assignment: dict[str, str], s: Sensitivity) -> float:
    total = sum(s.params[n] for n in assignment)
    return sum(s.bits[n][c] * s.params[n] for n, c in assignment.items()) / total


def uniform_bits(model: torch.nn.Module, layers: Sequence[str], candidate: str) -> float:
    """Average bits per weight (codes and scales) of `candidate` on every layer of `layers`, from
    the quantized weights alone — no data: a calibrated input scale's value does not change the
    bytes. Lets a command refuse a budget no assignment can meet before it measures anything."""
    from minifloat.infer.modules.linear import QuantizedLinear
    from minifloat.infer.ptq.config import get_quant_config

    cfg = get_quant_config(candidate)
    bits = params = 0
    for name in layers:
        lin = model.get_submodule(name)
        q = QuantizedLinear.from_linear(lin, cfg, input_amax=1.0 if cfg.static else None)
        bits += 8 * layer_bytes(q, bias=False)
        params += lin.weight.numel()
    return bits / params


def choose(s: Sensitivity, budget_bits: float) -> dict[str, str]:
    """The assignment of least summed KL within `budget_bits` average bits per weight."""
    return dict(zip(s.layers, (s.candidates[i] for i in _solve(s, budget_bits).picks), strict=True))


def _solve(s: Sensitivity, budget_bits: float) -> Solution:
    unit = math.gcd(*s.params.values())
    # a layer's cost: its bits (codes + scales) in 1/64 bit per weight × its weights / unit, rounded up to a
    # whole number, so that the chosen assignment keeps the budget whatever its bits (a GPTQ layer's
    # act-order permutation adds a fraction)
    options = [[(math.ceil(s.bits[n][c] * BIT_STEPS * s.params[n] / unit - 1e-9), s.kl[n][c]) for c in s.candidates]
               for n in s.layers]  # fmt: skip
    budget = math.floor(budget_bits * BIT_STEPS * sum(s.params.values()) // unit + 1e-9)
    least = min(min(s.bits[n].values()) for n in s.layers)
    if budget_bits < least:
        raise MinifloatError(f"budget_bits={budget_bits}: the cheapest candidate takes {least:.2f} bits per weight")
    return solve_bounded(options, budget)


def close_layers(s: Sensitivity, budget_bits: float, factor: float = 3.0, most: int | None = None) -> list[str]:
    """The layers whose choice at `budget_bits` is close on the current KLs: each layer's KL saved
    per bit by moving from its cheapest to its dearest candidate, within `factor` of that rate at
    the margin of the knapsack's answer (between the least efficient layer it moved up and the most
    efficient it left down). The only ones whose measured KL could change the answer much; `most`
    keeps the ones nearest the margin (in the model's order)."""
    cheap = {n: min(s.candidates, key=lambda c: s.bits[n][c]) for n in s.layers}
    dear = {n: max(s.candidates, key=lambda c: s.bits[n][c]) for n in s.layers}

    def rate(n):
        spent = (s.bits[n][dear[n]] - s.bits[n][cheap[n]]) * s.params[n]
        return (s.kl[n][cheap[n]] - s.kl[n][dear[n]]) / spent if spent > 0 else 0.0

    picks = choose(s, budget_bits)
    up = [rate(n) for n in s.layers if picks[n] != cheap[n]]
    down = [rate(n) for n in s.layers if picks[n] == cheap[n]]
    edges = [v for v in (min(up, default=None), max(down, default=None)) if v is not None and v > 0]
    if not edges:
        return []
    margin = math.sqrt(edges[0] * edges[-1])
    close = [n for n in s.layers if margin / factor <= rate(n) <= margin * factor]
    if most is not None and len(close) > most:
        keep = set(sorted(close, key=lambda n: abs(math.log(rate(n) / margin)))[:most])
        close = [n for n in close if n in keep]
    return close


def auto_precision(
    model: torch.nn.Module,
    data: Sequence[torch.Tensor],
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    budget_bits: float = 5.0,
    *,
    sens: Sensitivity | None = None,
    eval_data: Sequence[torch.Tensor] | None = None,
    ignore: Sequence[str] = ("lm_head",),
    measure: str = "all",
    most: int | None = None,
    method: str = "rtn",
) -> AutoPrecision:
    """Choose and evaluate a per-layer assignment (see the module docstring); `sens` reuses a
    `sensitivity` of the same model and candidates; `eval_data` (default `data`) scores it.
    `measure`: ``"all"`` measures every layer's KL; ``"close"`` starts from the Fisher estimate
    and measures only the `close_layers` at this budget (at most `most` of them: a real model's
    hundreds of layers). `method`: how the candidates' layers are quantized (`sensitivity`)."""
    if measure not in ("all", "close"):
        raise MinifloatError(f"measure={measure!r}: use 'all' or 'close'")
    s = sens if sens is not None else sensitivity(model, data, candidates, ignore=ignore, method=method,
                                                  measure="all" if measure == "all" else "none")  # fmt: skip
    if measure == "close":
        refine(s, model, data, close_layers(s, budget_bits, most=most))
    sol = _solve(s, budget_bits)
    assignment = dict(zip(s.layers, (s.candidates[i] for i in sol.picks), strict=True))
    metrics = evaluate_policy(model, assignment, eval_data or data, calib=data, sens=s)
    return AutoPrecision(assignment, average_bits(assignment, s), budget_bits,
                         sum(s.kl[n][c] for n, c in assignment.items()), metrics, sol.method, sol.gap)  # fmt: skip


def evaluate_policy(model: torch.nn.Module, policy: dict[str, str | None], data, *, calib=None,
                    sens: Sensitivity | None = None) -> dict:  # fmt: skip
    """`evaluate` a copy of `model` quantized with `policy` (layer globs → configs) against it; with
    a GPTQ `sens`, `policy` names each layer (as `choose` does) and the layers are the GPTQ'd ones
    it holds (every layer from one candidate: that candidate's uniform GPTQ model)."""
    q = copy.deepcopy(model)
    if sens is not None and sens.method == "gptq":
        for name, c in policy.items():
            if c is not None:
                q.set_submodule(name, copy.deepcopy(sens.built[name][c]))
    else:
        cal = calibrate(model, [b[:, :-1] for b in (calib or data)])
        quantize_model(q, {**policy}, calibration=cal, ignore=())
    return {**evaluate(q, model, data), "average_bits": bits_per_weight(q)}


def block_index(name: str) -> int | None:
    """The transformer block a layer belongs to: the first number between dots in its name."""
    m = re.search(r"\.(\d+)\.", f".{name}.")
    return int(m.group(1)) if m else None


def heuristic_policy(layers: Sequence[str], high: str = "fp8-dynamic", low: str = "nvfp4") -> dict[str, str]:
    """The rule of thumb: the first and last blocks in `high`, every other layer in `low`."""
    blocks = [b for b in (block_index(n) for n in layers) if b is not None]
    if not blocks:
        raise MinifloatError("the layers' names hold no block numbers: no first and last block to keep")
    ends = {min(blocks), max(blocks)}
    return {n: (high if block_index(n) in ends else low) for n in layers}


FILL_ENDS = ("both", "first", "last")


def fill_policy(s: Sensitivity, budget_bits: float, high: str, low: str, end: str = "both") -> dict[str, str]:
    """The layers nearest one end in `high`, the rest in `low`, within `budget_bits` average bits.

    `end`: ``"first"`` walks from the embedding, ``"last"`` from the head, ``"both"`` alternates
    first, last, second, second-to-last, …. In that order every layer that still fits the budget
    goes to `high` (one that does not is passed over and the walk goes on), so the heuristic spends
    the budget as fully as whole layers allow. Layer order is the model's (`s.layers`)."""
    if end not in FILL_ENDS:
        raise MinifloatError(f"end={end!r}: use one of {', '.join(FILL_ENDS)}")
    for c in (high, low):
        if c not in s.candidates:
            raise MinifloatError(f"{c!r} is not among the sensitivity's candidates {s.candidates}")
    layers = list(s.layers)
    if end == "last":
        layers.reverse()
    elif end == "both":
        layers = [layers[i // 2] if i % 2 == 0 else layers[-1 - i // 2] for i in range(len(layers))]
    policy = {n: low for n in s.layers}
    total = sum(s.params.values())
    spent = sum(s.bits[n][low] * s.params[n] for n in s.layers)
    if spent > budget_bits * total:
        raise MinifloatError(f"budget_bits={budget_bits}: every layer in {low} already takes {spent / total:.2f} bits")
    for n in layers:
        extra = (s.bits[n][high] - s.bits[n][low]) * s.params[n]
        if spent + extra <= budget_bits * total:
            policy[n], spent = high, spent + extra
    return policy


@dataclass
class MemoryFit:
    """`fit_to_memory`'s answer: the assignment and where the bytes go."""

    assignment: dict[str, str]
    average_bits: float
    budget_bytes: int
    fixed_bytes: int  # what stays in high precision: embeddings, norms, biases, the ignored layers
    quantized_bytes: int  # the quantized layers' codes and scales
    kv_bytes: int  # the KV cache at `context_tokens`
    predicted_kl: float

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.quantized_bytes + self.kv_bytes

    def to_dict(self) -> dict:
        return {**vars(self), "total_bytes": self.total_bytes}


def fit_to_memory(
    model: torch.nn.Module,
    budget_bytes: int,
    *,
    context_tokens: int,
    data: Sequence[torch.Tensor] | None = None,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    sens: Sensitivity | None = None,
    kv_format: str = "fp8",
    batch_size: int = 1,
    ignore: Sequence[str] = ("lm_head",),
) -> MemoryFit:
    """The per-layer assignment of least summed KL whose served model and KV cache (at
    `context_tokens` tokens × `batch_size` sequences, in `kv_format`) fit `budget_bytes`.
    Needs `data` (or a `sensitivity` result `sens`)."""
    if context_tokens < 0 or batch_size < 1:
        raise MinifloatError(f"context_tokens must be ≥ 0 and batch_size ≥ 1, got {context_tokens} and {batch_size}")
    if sens is None:
        if data is None:
            raise MinifloatError("fit_to_memory needs data= (token-id batches) or sens= (a sensitivity result)")
        sens = sensitivity(model, data, candidates, ignore=ignore)
    dense = sum(model.get_submodule(n).weight.nbytes for n in sens.layers)
    fixed = model_bytes(model) - dense
    kv = kv_bytes(model, context_tokens, kv_format, batch_size)
    params = sum(sens.params.values())
    avail = budget_bytes - fixed - kv
    least = fixed + kv + math.ceil(sum(min(sens.bits[n].values()) * sens.params[n] for n in sens.layers) / 8)
    if least > budget_bytes:
        raise MinifloatError(
            f"{budget_bytes:,} bytes cannot hold the model and its KV cache: at least {least:,} "
            f"({fixed:,} high-precision, {kv:,} KV for {context_tokens} tokens × {batch_size}, the rest the "
            f"cheapest candidate): raise the budget, shorten the context or add cheaper candidates"
        )
    most = max(max(sens.bits[n].values()) for n in sens.layers)
    bits = min(8 * avail / params, most)
    while True:  # the knapsack counts in 1/64 bit per weight: step down until the exact bytes fit
        assignment = choose(sens, bits)
        weight = math.ceil(sum(sens.bits[n][c] * sens.params[n] for n, c in assignment.items()) / 8)
        if weight <= avail or bits <= min(min(sens.bits[n].values()) for n in sens.layers):
            break
        bits = max(bits - 1 / BIT_STEPS, min(min(sens.bits[n].values()) for n in sens.layers))
    return MemoryFit(assignment, average_bits(assignment, sens), int(budget_bytes), fixed, weight, kv,
                     sum(sens.kl[n][c] for n, c in assignment.items()))  # fmt: skip
