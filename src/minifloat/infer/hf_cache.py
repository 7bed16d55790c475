"""The KV cache for transformers models: a ``transformers.Cache`` whose layers store K and V in a
`KVCache` format (packed FP8 / MX / NVFP4, with the same memory-pressure budget), handed to the
model as ``past_key_values``. transformers is an optional integration: nothing here imports it
until a cache is built.

Example (with transformers installed)::

    cache = quantized_cache(model.config, "fp8")
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
"""

from __future__ import annotations

import functools

from minifloat.errors import MinifloatError
from minifloat.infer.kvcache import KVCache


@functools.cache
def _classes():
    try:
        from transformers.cache_utils import Cache, DynamicLayer
    except ImportError:  # pragma: no cover - an optional integration
        raise MinifloatError("a KV cache for transformers models needs transformers: pip install transformers") from None

    class MinifloatCacheLayer(DynamicLayer):
        """One layer's K and V in a `KVCache` (one layer, its share of the budget). It keeps no
        float copy: ``keys`` / ``values`` stay empty tensors that tell the model's dtype and
        device, and each `update` returns the layer's K and V decoded for that attention call."""

        def __init__(self, scales: tuple[float, float] | None = None, **kv) -> None:
            super().__init__()
            self.kv = KVCache(1, scales=None if scales is None else {0: scales}, **kv)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            k, v = self.kv.update(0, key_states, value_states)
            # the model's dtype is the incoming states' (transformers 5.24 no longer keeps `self.dtype`)
            return k.to(key_states.device, key_states.dtype), v.to(value_states.device, value_states.dtype)

        def get_seq_length(self) -> int:
            return self.kv.length(0)

        def crop(self, tokens_to_remove: int) -> None:
            n = self.kv.length(0)
            keep = n - abs(tokens_to_remove) if tokens_to_remove <= 0 else tokens_to_remove
            self.truncate(keep)

        def truncate(self, n: int) -> None:
            self.kv.truncate(n)

        def reset(self) -> None:
            settings = self.kv.settings()
            super().reset()
            self.kv = KVCache(1, **settings)

    class MinifloatCache(Cache):
        """A transformers ``Cache`` of `MinifloatCacheLayer` layers; `nbytes`, `truncate`,
        `events` and `precisions` as `KVCache`'s."""

        def __init__(self, n_layer: int, scales: dict[int, tuple[float, float]] | None = None, **kv) -> None:
            layers = [MinifloatCacheLayer(None if scales is None else scales[i], **kv) for i in range(n_layer)]
            super().__init__(layers=layers)

        def nbytes(self) -> int:
            return sum(layer.kv.nbytes() for layer in self.layers)

        @property
        def n_layer(self) -> int:
            return len(self.layers)

        def tensors(self) -> list:
            return [t for layer in self.layers for t in layer.kv.tensors()]

        def keys_values(self, layer: int):
            """Layer `layer`'s held K and V (B, heads, length, head_dim), float32 (`KVCache.keys_values`)."""
            return self.layers[layer].kv.keys_values(0)

        def length(self, layer: int = 0) -> int:
            return self.layers[layer].kv.length(0)

        def truncate(self, n: int) -> None:
            for layer in self.layers:
                layer.truncate(n)

        @property
        def events(self) -> list[dict]:
            return [e | {"layer": i} for i, layer in enumerate(self.layers) for e in layer.kv.events]

        def precisions(self, layer: int = 0) -> list[str]:
            return self.layers[layer].kv.precisions()

    return MinifloatCache


def quantized_cache(config, format: str = "bf16", *, budget_bytes: int | None = None, pressure_format: str = "nvfp4",
                    sink_tokens: int = 4, recent_tokens: int = 32, scales: dict | None = None,
                    recent_format: str | None = None):  # fmt: skip
    """A transformers ``Cache`` for a model with `config` (its decoder layers), storing K and V in
    `format`; `budget_bytes` (the whole cache) is split evenly over the layers; `scales`
    (`calibrate_kv`'s) make an FP8 cache per-tensor with calibrated scales."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_layer = int(text.num_hidden_layers)
    share = None if budget_bytes is None else max(budget_bytes // n_layer, 1)
    return _classes()(n_layer, scales=scales, format=format, budget_bytes=share, pressure_format=pressure_format,
                      sink_tokens=sink_tokens, recent_tokens=recent_tokens, recent_format=recent_format)  # fmt: skip

