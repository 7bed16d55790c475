"""Memory pressure: one runtime policy that keeps a model's serving state — its weights and its KV
cache — within a byte budget, moving precision down as the context grows and back up when
memory frees.

`MemoryPolicy` takes a high-precision model (the built-in GPT or a transformers causal LM), quantizes its Linears to `high`
(FP8) and owns a `KVCache` in `kv_format` (FP8). The original Linears are the source every
re-quantization starts from; they are what a server keeps in host memory or reads again from
the checkpoint, and are not counted against the budget. The budget counts every parameter and
buffer of the served model (`model_bytes`) and every byte of the packed KV cache.

Before each forward (`prepare(new_tokens)`) the policy finds the least degradation that fits:
1. the KV cache first: its oldest tokens (but the sinks and the recent window) move to
   `kv_pressure_format` (FP4), as the generation issue's cache does under a budget;
2. then the weights, one layer at a time in sensitivity order (the layer whose move to `low`
   costs least first), each re-quantized from the source to `low` (FP4);
and, when the KV cache is cleared (`new_sequence`) or shrinks, moves layers back to `high` in the
reverse order — only where `headroom_tokens` more tokens would still fit, so that a layer does not
move up and down on alternate steps. Every move is logged in `events`. A context that cannot
fit even with every layer in `low` and the KV at its least is an error before anything is
stored. KV tokens that moved to FP4 stay there (their FP8 values are gone); new tokens enter in
`kv_format` again. The budget holds between forwards; a move builds a layer's new copy before it
lets the old one go, so for that moment one layer's copy more is held (a server would keep that
much aside).

Example:
    >>> from minifloat.models.gpt import GPT, GPTConfig
    >>> torch.manual_seed(0) and None
    >>> gpt = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)).eval()
    >>> p = MemoryPolicy(gpt, budget_bytes=200_000, low="mxfp4", headroom_tokens=8)
    >>> prompt = torch.randint(0, 256, (1, 8))
    >>> _ = p.generate(prompt, 50)          # the context grows: one layer moves to FP4
    >>> p.peak_bytes <= 200_000, p.level
    (True, 1)
    >>> _ = p.generate(prompt[:, :4], 2)    # a short request: it moves back
    >>> p.level, moves(p.events)
    (0, {'weight_down': 1, 'weight_up': 1, 'kv': 2})
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.generation.cache import kv_of, new_cache
from minifloat.infer.generation.kvcache import KVCache
from minifloat.infer.modules.accounting import layer_bytes, model_bytes
from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.ptq.config import get_quant_config
from minifloat.infer.quantize import calibrate
from minifloat.models.adapter import adapter_for
from minifloat.nn.convert import swap_modules


def sensitivity_order(sens, high: str, low: str) -> list[str]:
    """Layers by the KL their move from `high` to `low` adds per byte it saves, least first."""
    def cost(n):
        saved = max((sens.bits[n][high] - sens.bits[n][low]) * sens.params[n], 1e-9)
        return (sens.kl[n][low] - sens.kl[n][high]) / saved

    return sorted(sens.layers, key=cost)


class MemoryPolicy:
    """See the module docstring. `order`: layer names (least sensitive first), a `Sensitivity`
    (ordered by `sensitivity_order`), or None (the model's order, last layer first)."""

    def __init__(self, model: torch.nn.Module, budget_bytes: int, *, order=None, high: str = "fp8-dynamic",
                 low: str = "nvfp4", kv_format: str = "fp8", kv_pressure_format: str | None = None, sink_tokens: int | None = None,
                 recent_tokens: int | None = None, calibration=None, headroom_tokens: int = 64) -> None:  # fmt: skip
        self.adapter = adapter_for(model)  # the built-in GPT or a transformers causal LM
        if budget_bytes < 1:
            raise MinifloatError(f"budget_bytes must be ≥ 1, got {budget_bytes}")
        self.high, self.low = get_quant_config(high), get_quant_config(low)
        if (self.high.needs_calibration or self.low.needs_calibration) and calibration is None:
            raise MinifloatError(f"{self.low.name if self.low.needs_calibration else self.high.name} calibrates its "
                                 f"input: pass calibration= (batches of token ids)")  # fmt: skip
        if calibration is not None and not isinstance(calibration, dict):
            calibration = calibrate(model, calibration)
        self.calibration = calibration or {}
        self.model, self.budget_bytes, self.headroom_tokens = model.eval(), int(budget_bytes), headroom_tokens
        names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n and n != "lm_head"]
        if order is None:
            order = names[::-1]
        elif hasattr(order, "layers"):
            order = sensitivity_order(order, self.high.name, self.low.name)
        order = [n for n in order if n in names]
        if not order:
            raise MinifloatError("the order names none of the model's Linears")
        self.order: list[str] = list(order)
        self.source = {n: model.get_submodule(n) for n in self.order}  # off budget: host memory / checkpoint
        self.bytes = {n: {c.name: layer_bytes(self._build(n, c), compute=True) for c in (self.high, self.low)} for n in self.order}
        # what is not a served layer (embeddings, norms, the head); a layer's bytes include its bias
        self._base = model_bytes(model) - sum(layer_bytes(m) for m in self.source.values())
        # the first `level` layers of `order` are in `low`: start at the least that holds the weights alone
        self.level = next((i for i in range(len(self.order) + 1) if self.served_bytes(i) <= self.budget_bytes), None)
        if self.level is None:
            raise MinifloatError(f"{self.budget_bytes:,} bytes cannot hold the model's weights even with every layer in "
                                 f"{self.low.name} ({self.served_bytes(len(self.order)):,})")  # fmt: skip
        at = {n: (self.low if i < self.level else self.high) for i, n in enumerate(self.order)}
        swap_modules(model, self.order, lambda old: self._build(self._name(old), at[self._name(old)]))
        given = dict(pressure_format=kv_pressure_format, sink_tokens=sink_tokens, recent_tokens=recent_tokens)
        self.kv_args = {"format": kv_format, **{k: v for k, v in given.items() if v is not None}}  # else KVSpec's defaults
        self.events: list[dict] = []
        self.peak_bytes = 0
        self.steps = 0
        self.new_sequence()
        g = self.adapter.kv_geometry
        self._shape = (1, g.kv_heads, g.head_dim)

    def _name(self, source: torch.nn.Module) -> str:
        return next(n for n, m in self.source.items() if m is source)

    def _build(self, name: str, config) -> QuantizedLinear:
        amax = self.calibration.get(name) if config.needs_calibration else None
        return QuantizedLinear.from_linear(self.source[name], config, input_amax=amax)

    def served_bytes(self, level: int | None = None) -> int:
        """The served model's bytes with the first `level` layers of the order in `low`."""
        level = self.level if level is None else level
        return self._base + sum(self.bytes[n][(self.low if i < level else self.high).name] for i, n in enumerate(self.order))

    def usage(self) -> int:
        return model_bytes(self.model) + self.kv.nbytes()

    def new_sequence(self) -> None:
        """Clear the KV cache (a new request): memory frees, layers may move back up."""
        self.cache = new_cache(self.adapter, budget_bytes=self.budget_bytes, **self.kv_args)
        self.kv: KVCache = kv_of(self.cache)  # what the cache holds, every layer

    def _move(self, name: str, config, tokens: int) -> None:
        before = self.usage()
        old = self.model.get_submodule(name).config.name
        swap_modules(self.model, [name], lambda _old: self._build(name, config))
        self.events.append({"step": self.steps, "what": "weight", "layer": name, "from": old, "to": config.name,
                            "direction": "down" if config is self.low else "up",
                            "tokens": tokens, "bytes_before": before, "bytes_after": self.usage()})  # fmt: skip

    def prepare(self, new_tokens: int) -> None:
        """Before a forward over `new_tokens` more tokens: move layers so that the weights and the
        KV cache (at its least) fit, or back up where there is room; set the KV cache's share."""
        if self.kv._shape is None:
            self.kv.expect(*self._shape)
        n = self.kv.length(0) + new_tokens
        least = self.kv.least_bytes(new_tokens)
        level = self.level
        while level < len(self.order) and self.served_bytes(level) + least > self.budget_bytes:
            level += 1
        if self.served_bytes(level) + least > self.budget_bytes:
            raise MinifloatError(
                f"{self.budget_bytes:,} bytes cannot hold the model with every layer in {self.low.name} "
                f"({self.served_bytes(len(self.order)):,}) and {n} tokens of KV cache at its least ({least:,}): "
                f"raise the budget or shorten the context"
            )
        full = self.kv.nbytes() + (new_tokens + self.headroom_tokens) * self.kv.token_bytes(self.kv.store) * self.kv.n_layer
        while level > 0 and self.served_bytes(level - 1) + full <= self.budget_bytes:
            level -= 1
        for i in range(self.level, level):  # down
            self._move(self.order[i], self.low, n)
        for i in range(self.level - 1, level - 1, -1):  # up
            self._move(self.order[i], self.high, n)
        self.level = level
        self.kv.budget_bytes = self.budget_bytes - self.served_bytes(level)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of `ids` (1, T) continuing the cache, within the budget."""
        self.prepare(ids.shape[1])
        before = len(self.kv.events)
        logits = self.adapter.forward(ids, self.cache)
        self.events += [{"step": self.steps, "what": "kv", **e} for e in self.kv.events[before:]]
        self.steps += 1
        self.peak_bytes = max(self.peak_bytes, self.usage())
        return logits

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation of `input_ids` (1, T) in a new sequence; returns the whole sequence."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise MinifloatError(f"generate takes input_ids of shape (1, T), got {tuple(input_ids.shape)}")
        if input_ids.shape[1] + max_new_tokens > self.adapter.context_length:
            raise MinifloatError(f"{input_ids.shape[1]} + {max_new_tokens} tokens exceed the model's context of "
                                 f"{self.adapter.context_length}")  # fmt: skip
        self.new_sequence()
        seq = input_ids
        logits = self.forward(seq)[0, -1]
        for i in range(max_new_tokens):
            seq = torch.cat((seq, logits.argmax().view(1, 1)), 1)
            if i + 1 < max_new_tokens:
                logits = self.forward(seq[:, -1:])[0, -1]
        return seq

    def precisions(self) -> dict[str, str]:
        return {n: self.model.get_submodule(n).config.name for n in self.order}


def moves(events: Sequence[dict]) -> dict[str, int]:
    """How many weight moves went down and up, and how many KV moves there were."""
    weight = [e for e in events if e["what"] == "weight"]
    return {"weight_down": sum(e["direction"] == "down" for e in weight), "weight_up": sum(e["direction"] == "up" for e in weight),
            "kv": sum(e["what"] == "kv" for e in events)}  # fmt: skip
