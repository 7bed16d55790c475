"""The KV cache for transformers models: a ``transformers.Cache`` whose layers are those of one
`KVCache` (packed FP8 / MX / NVFP4, one memory-pressure budget over every layer), handed to the
model as ``past_key_values``. transformers is an optional integration: nothing here imports it
until a cache is built.

Example (with transformers installed)::

    cache = quantized_cache(model.config, "fp8")
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
"""

from __future__ import annotations

import functools

from minifloat.errors import MinifloatError
from minifloat.infer.generation.kvcache import KVCache


@functools.cache
def _classes():
    try:
        from transformers.cache_utils import Cache, DynamicLayer
    except ImportError:  # pragma: no cover - an optional integration
        raise MinifloatError("a KV cache for transformers models needs transformers: pip install transformers") from None

    class MinifloatCacheLayer(DynamicLayer):
        """Layer `index` of the cache's one `KVCache`. It keeps no float copy: ``keys`` /
        ``values`` stay empty tensors that tell the model's dtype and device, and each `update`
        returns the layer's K and V decoded for that attention call."""

        def __init__(self, cache, index: int) -> None:
            super().__init__()
            self.cache, self.index = cache, index

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            k, v = self.cache.kv.update(self.index, key_states, value_states)
            # the model's dtype is the incoming states' (transformers 5.24 no longer keeps `self.dtype`)
            return k.to(key_states.device, key_states.dtype), v.to(value_states.device, value_states.dtype)

        def get_seq_length(self) -> int:
            return self.cache.kv.length(self.index)

        def crop(self, tokens_to_remove: int) -> None:
            """This layer only: transformers' ``Cache.crop`` calls every layer's."""
            n = self.get_seq_length()
            self.cache.kv.truncate(n - abs(tokens_to_remove) if tokens_to_remove <= 0 else tokens_to_remove, self.index)

        def reset(self) -> None:
            super().reset()
            if self.index == 0:
                self.cache.kv = KVCache(self.cache.kv.n_layer, **self.cache.kv.settings())

    class MinifloatCache(Cache):
        """A transformers ``Cache`` whose layers are those of one `KVCache` (``.kv``: its budget
        counts every layer, as for the built-in GPT); `nbytes`, `truncate`, `events`,
        `precisions`, `keys_values` and `tensors` are the `KVCache`'s."""

        def __init__(self, n_layer: int, **kv) -> None:
            self.kv = KVCache(n_layer, **kv)
            super().__init__(layers=[MinifloatCacheLayer(self, i) for i in range(n_layer)])

        @property
        def n_layer(self) -> int:
            return self.kv.n_layer

        def nbytes(self) -> int:
            return self.kv.nbytes()

        def tensors(self) -> list:
            return self.kv.tensors()

        def keys_values(self, layer: int):
            return self.kv.keys_values(layer)

        def length(self, layer: int = 0) -> int:
            return self.kv.length(layer)

        def truncate(self, n: int) -> None:
            self.kv.truncate(n)

        @property
        def events(self) -> list[dict]:
            return self.kv.events

        def precisions(self, layer: int = 0) -> list[str]:
            return self.kv.precisions(layer)

    return MinifloatCache


def quantized_cache(config, format: str | None = None, **kv):
    """A transformers ``Cache`` for a model with `config` (its decoder layers), storing K and V in
    `format`; `kv` are `KVCache`'s arguments (a `KVSpec`'s fields, ``spec=``, ``scales=``,
    ``rope=``): `budget_bytes` counts the whole cache (each layer keeps to its equal share)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return _classes()(int(text.num_hidden_layers), **({"format": format} if format is not None else {}), **kv)
