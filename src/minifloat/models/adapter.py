"""Model adapters: the one place that knows how each kind of model inference runs on works —
its KV geometry, its forward with a cache (and which kind of cache that is), its context length,
its rotary embedding, and whether positions survive dropped cache tokens. Decoding, KV calibration, `auto_precision`'s KV bytes, `fit_to_memory` and
`MemoryPolicy` ask `adapter_for(model)` instead of testing the model's type.

Two kinds are registered: minifloat's built-in GPT and transformers causal LMs; another kind
plugs in with `register_adapter(matches, adapter_class)` (tried newest first).

Example:
    >>> from minifloat.models.gpt import GPT, GPTConfig
    >>> a = adapter_for(GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)))
    >>> a.kind, a.kv_geometry, a.context_length
    ('gpt', KVGeometry(n_layer=2, kv_heads=2, head_dim=32), 32)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minifloat.errors import MinifloatError
from minifloat.models.gpt import GPT
from minifloat.models.loading import is_transformers


@dataclass(frozen=True)
class KVGeometry:
    """What one token's K and V take in each layer: layers × KV heads × head_dim."""

    n_layer: int
    kv_heads: int
    head_dim: int


class ModelAdapter:
    """How inference drives one kind of model (see the module docstring)."""

    kind = "model"
    drops_tokens = False  # whether positions stay right when the cache drops old tokens
    # what `forward` takes as its cache: "kv" (a `KVCacheLike` itself) or "transformers" (a
    # transformers ``Cache``); `minifloat.infer.generation.cache.new_cache` builds either
    cache_type = "kv"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @property
    def kv_geometry(self) -> KVGeometry:
        raise NotImplementedError

    @property
    def context_length(self) -> int:
        raise NotImplementedError

    def rope(self):
        """positions → (cos, sin) (T, head_dim) of the model's rotary embedding, or None (none, or
        not of the standard form): what a cache that stores keys before RoPE re-applies."""
        return None

    def forward(self, ids: torch.Tensor, cache=None) -> torch.Tensor:
        """Logits (B, T, vocab) of `ids` (B, T), continuing what `cache` holds (which takes their K and V)."""
        raise NotImplementedError


class GPTAdapter(ModelAdapter):
    kind = "gpt"
    drops_tokens = True  # the GPT counts positions with the cache's `position()`

    @property
    def kv_geometry(self) -> KVGeometry:
        c = self.model.config
        return KVGeometry(c.n_layer, c.n_head, c.n_embd // c.n_head)

    @property
    def context_length(self) -> int:
        return self.model.config.block_size

    def forward(self, ids: torch.Tensor, cache=None) -> torch.Tensor:
        return self.model(ids, cache)


class TransformersAdapter(ModelAdapter):
    kind = "transformers"
    cache_type = "transformers"

    @property
    def _text(self):
        c = self.model.config
        return c.get_text_config(decoder=True) if hasattr(c, "get_text_config") else c

    @property
    def kv_geometry(self) -> KVGeometry:
        c = self._text
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return KVGeometry(int(c.num_hidden_layers), int(heads), int(head_dim))

    @property
    def context_length(self) -> int:
        return int(getattr(self._text, "max_position_embeddings", 0) or 2**31)

    def rope(self):
        """positions → (cos, sin) (T, head_dim) of the model's rotary embedding, when it has the
        standard form (``model.model.rotary_emb`` over the whole head dim, no attention scaling),
        else None; a list of those, one per layer, where the layers have their own (Gemma 3)."""
        rot = getattr(getattr(self.model, "model", None), "rotary_emb", None)
        if rot is None or float(getattr(rot, "attention_scaling", 1.0)) != 1.0:
            return None
        head_dim = self.kv_geometry.head_dim

        def of(*kind):
            def rope(positions: torch.Tensor):
                cos, sin = rot(torch.empty(0, dtype=torch.float32, device=positions.device), positions[None], *kind)
                return cos[0], sin[0]

            return rope

        kinds = getattr(rot, "layer_types", None)  # Gemma 3: a table per kind of layer, a function per layer
        if kinds:
            if any(float(getattr(rot, f"{k}_attention_scaling", 1.0)) != 1.0 for k in kinds):
                return None
            by_kind = {k: of(k) for k in kinds}
            rope = [by_kind[k] for k in rot.config.layer_types]
        else:
            rope = of()
        cos, _ = (rope[0] if isinstance(rope, list) else rope)(torch.arange(1))
        return rope if cos.shape[-1] == head_dim else None

    def forward(self, ids: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is None:
            return self.model(input_ids=ids).logits
        return self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits


_ADAPTERS: list[tuple[Callable[[torch.nn.Module], bool], type[ModelAdapter]]] = [
    (is_transformers, TransformersAdapter),
    (lambda m: isinstance(m, GPT), GPTAdapter),
]


def register_adapter(matches: Callable[[torch.nn.Module], bool], adapter: type[ModelAdapter]) -> None:
    """Let `adapter` drive every model `matches` accepts (tried before those registered earlier)."""
    _ADAPTERS.insert(0, (matches, adapter))


def adapter_for(model: torch.nn.Module) -> ModelAdapter:
    """The adapter of `model`'s kind; a clear error for a model no adapter drives."""
    for matches, adapter in _ADAPTERS:
        if matches(model):
            return adapter(model)
    raise MinifloatError(f"inference runs the built-in GPT and transformers causal LMs; got {type(model).__name__}")
