"""`KVCache`: the keys and values of the tokens a model has seen, per layer, stored packed.

Formats (`KV_FORMATS`): ``fp32`` and ``bf16`` (plain tensors); ``fp8`` (E4M3) and ``fp8_e5m2``
with one FP32 scale per head and token (the row of head_dim values); ``mxfp8``, ``mxfp6``
(E2M3), ``mxfp4`` with E8M0 scales per 32 values of a head's row (scale exponent rounded up, as
the PTQ configs); ``nvfp4`` with E4M3 scales per 16 values and an FP32 scale per appended chunk.

K and V of shape (B, heads, T, head_dim) are stored as 2-D tensors of rows (token, batch, head)
× head_dim — token-major, so that keeping the first n tokens (a speculative rollback) is a slice
of whole rows, exact for every format (block rows are 1; an NVFP4 chunk keeps its tensor scale).
Attention reads the exactly dequantized values; a float working copy of them is kept beside the
packed store, and `nbytes` counts the packed store — what a cache of that format holds.

Example:
    >>> cache = KVCache(n_layer=1, format="fp8")
    >>> k = v = torch.randn(1, 2, 5, 64)
    >>> K, V = cache.update(0, k, v)
    >>> K.shape, cache.length(0), cache.nbytes(), 2 * (2 * 5 * 64 + 2 * 5 * 4)
    (torch.Size([1, 2, 5, 64]), 5, 1360, 1360)
"""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError
from minifloat.quant import QuantizedTensor, quantize
from minifloat.scaling.schemes import Scheme, get_scheme


def _schemes() -> dict[str, Scheme | torch.dtype]:
    rceil = {n: get_scheme(s).replace(name=f"kv_{n}", scale_rule="rceil")
             for n, s in (("mxfp8", "mxfp8"), ("mxfp6", "mxfp6_e2m3"), ("mxfp4", "mxfp4"))}  # fmt: skip
    return {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp8": get_scheme("fp8_rowwise"),
        "fp8_e5m2": Scheme(name="fp8_e5m2_rowwise", element="e5m2", granularity="row"),
        **rceil,
        "nvfp4": get_scheme("nvfp4"),
    }


KV_FORMATS: dict[str, Scheme | torch.dtype] = _schemes()
"""KV-cache formats by name: a dtype (stored as is) or the scheme each head's row is quantized with."""


def kv_format(name: str) -> Scheme | torch.dtype:
    key = str(name).strip().lower().replace("-", "_")
    if key not in KV_FORMATS:
        raise MinifloatError(f"unknown KV-cache format {name!r}; use one of {', '.join(KV_FORMATS)}")
    return KV_FORMATS[key]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, nh, T, hs) → (T·B·nh, hs), token-major."""
    return x.permute(2, 0, 1, 3).reshape(-1, x.shape[-1])


def _unrows(r: torch.Tensor, b: int, nh: int) -> torch.Tensor:
    """(T·B·nh, hs) → (B, nh, T, hs)."""
    return r.reshape(-1, b, nh, r.shape[-1]).permute(1, 2, 0, 3)


def _head_rows(q: QuantizedTensor | torch.Tensor, n: int) -> QuantizedTensor | torch.Tensor:
    """The first `n` rows of a stored chunk (whole rows: exact for every format)."""
    if isinstance(q, torch.Tensor):
        return q[:n]
    return QuantizedTensor(q.data[:n], q.scale[:n], q.tensor_scale, (n, q.shape[1]), q.scheme, q.orig_dtype)


class KVCache:
    """Per-layer K/V store in one `format` (see the module docstring)."""

    def __init__(self, n_layer: int, format: str = "bf16") -> None:
        if n_layer < 1:
            raise MinifloatError(f"n_layer must be ≥ 1, got {n_layer}")
        self.format = str(format).strip().lower().replace("-", "_")
        self.store = kv_format(self.format)
        self._chunks: list[list[tuple[object, object, int]]] = [[] for _ in range(n_layer)]  # (K, V, tokens)
        self._work: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layer
        self._shape: tuple[int, int] | None = None  # (batch, heads)

    def length(self, layer: int = 0) -> int:
        """Tokens held for `layer`."""
        return sum(n for _, _, n in self._chunks[layer])

    def _pack(self, x: torch.Tensor):
        r = _rows(x)
        if isinstance(self.store, torch.dtype):
            return r.to(self.store)
        return quantize(r, self.store)

    def _unpack(self, stored) -> torch.Tensor:
        return stored.float() if isinstance(stored, torch.Tensor) else stored.dequantize(torch.float32)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the T new tokens' `k`, `v` (B, heads, T, head_dim) to `layer`; return every
        token's K and V (B, heads, length, head_dim), as stored (dequantized, float32)."""
        b, nh, t, hs = k.shape
        if self._shape is None:
            self._shape = (b, nh)
            if not isinstance(self.store, torch.dtype) and self.store.granularity == "block" and hs % self.store.block[1]:
                raise MinifloatError(
                    f"KV cache {self.format!r} quantizes blocks of {self.store.block[1]} values of a head; "
                    f"the model's head_dim is {hs} (use fp8, bf16 or fp32)"
                )
        elif self._shape != (b, nh):
            raise MinifloatError(f"the cache holds batch × heads {self._shape}; got {(b, nh)}")
        kq, vq = self._pack(k.detach()), self._pack(v.detach())
        self._chunks[layer].append((kq, vq, t))
        new = (_unrows(self._unpack(kq), b, nh), _unrows(self._unpack(vq), b, nh))
        old = self._work[layer]
        self._work[layer] = new if old is None else (torch.cat((old[0], new[0]), 2), torch.cat((old[1], new[1]), 2))
        return self._work[layer]

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens of every layer (a rejected speculation's rollback)."""
        if n < 0:
            raise MinifloatError(f"truncate keeps n ≥ 0 tokens, got {n}")
        for layer, chunks in enumerate(self._chunks):
            kept, total = [], 0
            for kq, vq, t in chunks:
                if total >= n:
                    break
                take = min(t, n - total)
                if take < t:
                    rows = take * self._shape[0] * self._shape[1]
                    kq, vq = _head_rows(kq, rows), _head_rows(vq, rows)
                kept.append((kq, vq, take))
                total += take
            self._chunks[layer] = kept
            w = self._work[layer]
            if w is not None:
                self._work[layer] = (w[0][:, :, :n], w[1][:, :, :n])

    def nbytes(self) -> int:
        """Bytes of the packed store: codes, scales and tensor scales of every chunk."""
        total = 0
        for chunks in self._chunks:
            for kq, vq, _ in chunks:
                total += kq.nbytes + vq.nbytes
        return total

    def stored(self, layer: int) -> list[tuple[object, object]]:
        """The packed K and V chunks of `layer` (plain tensors or QuantizedTensors)."""
        return [(kq, vq) for kq, vq, _ in self._chunks[layer]]
