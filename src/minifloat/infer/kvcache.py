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


def _slice_rows(q: QuantizedTensor | torch.Tensor, r0: int, r1: int) -> QuantizedTensor | torch.Tensor:
    """Rows [r0, r1) of a stored chunk (whole rows: exact for every format; an NVFP4 chunk's
    pieces keep its tensor scale)."""
    if isinstance(q, torch.Tensor):
        return q[r0:r1]
    return QuantizedTensor(q.data[r0:r1], q.scale[r0:r1], q.tensor_scale, (r1 - r0, q.shape[1]), q.scheme, q.orig_dtype)


def _row_bytes(store: Scheme | torch.dtype, hs: int) -> int:
    """Bytes of one head's row of `hs` values in `store` (an NVFP4 chunk's tensor scale aside)."""
    if isinstance(store, torch.dtype):
        return hs * torch.finfo(store).bits // 8
    scale = {"row": 4, "tensor": 0}.get(store.granularity)
    if scale is None:
        scale = hs // store.block[1] * (4 if store.scale_format == "fp32" else 1)
    return hs * store.element_format.bits // 8 + scale


DEMOTE_AT_ONCE = 16


class KVCache:
    """Per-layer K/V store (see the module docstring).

    With `budget_bytes` ("FP8 normally, FP4 under memory pressure"): when appending would take
    the cache past the budget, the oldest tokens move from `format` to `pressure_format` (their
    stored values re-quantized), except the first `sink_tokens` (attention sinks) and the last
    `recent_tokens`; each move is an event in `events`, and `precisions()` tells each token's
    format. If even that cannot fit the next tokens, a `MinifloatError` comes before anything
    is stored or dropped — unless `drop=True` asks for it: then the oldest tokens after the sinks
    leave the cache (StreamingLLM's eviction; an event ``"to": "dropped"`` each time), and
    `position()` keeps counting them, so that positions stay those of the whole sequence. The
    budget counts every layer; each layer keeps to its equal share."""

    def __init__(self, n_layer: int, format: str = "bf16", *, budget_bytes: int | None = None,
                 pressure_format: str = "nvfp4", sink_tokens: int = 4, recent_tokens: int = 32,
                 scales: dict[int, tuple[float, float]] | None = None, recent_format: str | None = None,
                 drop: bool = False) -> None:  # fmt: skip
        if n_layer < 1:
            raise MinifloatError(f"n_layer must be ≥ 1, got {n_layer}")
        self.format = _key(format)
        self.store = kv_format(self.format)
        self.pressure_format = _key(pressure_format)
        self.pressure = kv_format(self.pressure_format)
        if budget_bytes is not None and budget_bytes < 1:
            raise MinifloatError(f"the KV budget must be ≥ 1 byte, got {budget_bytes}")
        if sink_tokens < 0 or recent_tokens < 0:
            raise MinifloatError(f"sink_tokens and recent_tokens must be ≥ 0, got {sink_tokens} and {recent_tokens}")
        self.budget_bytes, self.sink_tokens, self.recent_tokens = budget_bytes, sink_tokens, recent_tokens
        if scales is not None and self.format != "fp8":
            raise MinifloatError(f"calibrated KV scales are per-tensor FP8 (vLLM's k_scale / v_scale); format is {self.format!r}")
        self.scales = scales  # layer → (K amax, V amax): one FP8 scale per layer and tensor, from calibration
        # the sinks and the recent window in a higher precision (KIVI's residual, transformers'
        # QuantizedCache residual_length): tokens enter in it and move to `format` as they age
        self.recent_format = None if recent_format is None else _key(recent_format)
        if self.recent_format is not None and scales is not None:
            raise MinifloatError("a high-precision recent window goes with dynamic scales, not calibrated ones")
        if drop and budget_bytes is None:
            raise MinifloatError("drop=True drops tokens to keep within a budget: give budget_bytes too")
        self.drop = drop  # only when asked: past the budget even in pressure_format, drop the oldest non-sink tokens
        self.dropped = 0  # tokens dropped so far (positions keep counting them)
        self.n_layer = n_layer
        self._segs: list[list[list]] = [[] for _ in range(n_layer)]  # [K, V, tokens, format name]
        self._work: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layer
        self._shape: tuple[int, int, int] | None = None  # (batch, heads, head_dim)
        self.events: list[dict] = []

    def length(self, layer: int = 0) -> int:
        """Tokens held for `layer`."""
        return sum(seg[2] for seg in self._segs[layer])

    def position(self, layer: int = 0) -> int:
        """Tokens seen: those held and those dropped (the next token's position)."""
        return self.length(layer) + self.dropped

    def precisions(self, layer: int = 0) -> list[str]:
        """The format each held token of `layer` is stored in, oldest first."""
        return [seg[3] for seg in self._segs[layer] for _ in range(seg[2])]

    def _pack(self, rows: torch.Tensor, store):
        return rows.to(store) if isinstance(store, torch.dtype) else quantize(rows, store)

    @staticmethod
    def _unpack(stored) -> torch.Tensor:
        return stored.float() if isinstance(stored, torch.Tensor) else stored.dequantize(torch.float32)

    def _check_shape(self, k: torch.Tensor) -> None:
        b, nh, _, hs = k.shape
        if self._shape is None:
            for name, store in ((self.format, self.store), (self.pressure_format, self.pressure)):
                if not isinstance(store, torch.dtype) and store.granularity == "block" and hs % store.block[1]:
                    raise MinifloatError(
                        f"KV cache {name!r} quantizes blocks of {store.block[1]} values of a head; "
                        f"the model's head_dim is {hs} (use fp8, bf16 or fp32)"
                    )
            self._shape = (b, nh, hs)
        elif self._shape != (b, nh, hs):
            raise MinifloatError(f"the cache holds batch × heads × head_dim {self._shape}; got {(b, nh, hs)}")

    def token_bytes(self, store) -> int:
        """Bytes one token takes in one layer (K and V) in `store`."""
        b, nh, hs = self._shape
        return 2 * b * nh * _row_bytes(store, hs)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the T new tokens' `k`, `v` (B, heads, T, head_dim) to `layer`; return every
        token's K and V (B, heads, length, head_dim), as stored (dequantized, float32)."""
        self._check_shape(k)
        b, nh, t, _ = k.shape
        if self.budget_bytes is not None and layer == 0:
            self._check_budget(t)  # before anything is stored: every layer has layer 0's sizes
        if self.scales is not None:  # the calibrated per-tensor scale; values past its amax saturate
            if layer not in self.scales:
                raise MinifloatError(f"the calibrated KV scales have no entry for layer {layer}")
            per_tensor = get_scheme("fp8")
            ka, va = self.scales[layer]
            kq, vq = quantize(_rows(k.detach()), per_tensor, amax=ka), quantize(_rows(v.detach()), per_tensor, amax=va)
        else:
            entry = self.format if self.recent_format is None else self.recent_format
            store = kv_format(entry)
            kq, vq = self._pack(_rows(k.detach()), store), self._pack(_rows(v.detach()), store)
        self._segs[layer].append([kq, vq, t, entry if self.scales is None else self.format])
        new = (_unrows(self._unpack(kq), b, nh), _unrows(self._unpack(vq), b, nh))
        old = self._work[layer]
        self._work[layer] = new if old is None else (torch.cat((old[0], new[0]), 2), torch.cat((old[1], new[1]), 2))
        if self.recent_format is not None:
            self._age(layer)
        if self.budget_bytes is not None:
            self._fit(layer)
        return self._work[layer]

    def _age(self, layer: int) -> None:
        """Move the tokens that left the recent window (not the sinks) from `recent_format` to `format`."""
        lo, hi = self.sink_tokens, self.length(layer) - self.recent_tokens
        start, i = 0, 0
        while i < len(self._segs[layer]):
            seg = self._segs[layer][i]
            a, b = max(start, lo), min(start + seg[2], hi)
            if seg[3] == self.recent_format and a < b:
                self._demote(layer, i, start, a - start, b - start, self.format)
                continue  # the segment was split: look at the same index again
            start += seg[2]
            i += 1

    def expect(self, batch: int, heads: int, head_dim: int) -> None:
        """Fix the shape of the rows before the first update (`least_bytes` needs it)."""
        self._check_shape(torch.empty(batch, heads, 0, head_dim))

    def least_bytes(self, new_tokens: int) -> int:
        """The fewest bytes the cache can hold its tokens and `new_tokens` more in: all but the
        sinks and the recent window in `pressure_format` (every layer; the shape must be known)."""
        n = self.length(0) + new_tokens
        kept = min(n, self.sink_tokens + self.recent_tokens)
        # per-chunk bytes beyond the per-token ones (NVFP4's tensor scales): those held, and two more chunks
        extra = self.layer_bytes(0) - sum(seg[2] * self.token_bytes(kv_format(seg[3])) for seg in self._segs[0])
        extra += 16 if not isinstance(self.pressure, torch.dtype) and self.pressure.is_nvfp4 else 0
        entry = self.store if self.recent_format is None else kv_format(self.recent_format)
        return self.n_layer * (kept * self.token_bytes(entry) + (n - kept) * self.token_bytes(self.pressure) + extra)

    def _check_budget(self, t: int) -> None:
        n = self.length(0) + t
        least = self.least_bytes(t)
        if least > self.budget_bytes and self.drop:
            # each dropped token frees at least its bytes in pressure_format, in every layer
            per = self.n_layer * self.token_bytes(self.pressure)
            want = -(-(least - self.budget_bytes) // max(per, 1))
            room = self.length(0) - self.sink_tokens - max(self.recent_tokens - t, 0)
            if 0 < want <= room:
                self._drop(max(want, min(DEMOTE_AT_ONCE, room)))
                n, least = self.length(0) + t, self.least_bytes(t)
        if least > self.budget_bytes:
            raise MinifloatError(
                f"the KV budget of {self.budget_bytes:,} bytes cannot hold {n} tokens even with all but the "
                f"{self.sink_tokens} first and {self.recent_tokens} last in {self.pressure_format} ({least:,} bytes); "
                + ("even dropping every token between them does not make room" if self.drop else
                   "nothing was dropped: raise the budget, shorten the sequence, or allow dropping (drop=True)")
            )

    def _fit(self, layer: int) -> None:
        share = self.budget_bytes // self.n_layer
        saving = self.token_bytes(self.store) - self.token_bytes(self.pressure)
        while self.layer_bytes(layer) > share:
            n = self.length(layer)
            lo, hi = self.sink_tokens, n - self.recent_tokens
            # at least DEMOTE_AT_ONCE tokens a move: fewer, larger chunks (each NVFP4 chunk holds a tensor scale)
            need = max(DEMOTE_AT_ONCE, -(-(self.layer_bytes(layer) - share) // max(saving, 1)))
            start = 0
            for i, seg in enumerate(self._segs[layer]):
                a, b = max(start, lo), min(start + seg[2], hi)
                if seg[3] == self.format and a < b:
                    self._demote(layer, i, start, a - start, min(b, a + need) - start, self.pressure_format)
                    break
                start += seg[2]
            else:
                raise MinifloatError(f"the KV budget of {self.budget_bytes:,} bytes is exceeded and no token can move to "
                                     f"{self.pressure_format}")  # fmt: skip

    def _demote(self, layer: int, i: int, start: int, a: int, b: int, to: str) -> None:
        """Move tokens [a, b) of segment i (which starts at token `start`) to format `to`."""
        kq, vq, t, fmt = self._segs[layer][i]
        bsz, nh, _ = self._shape
        per = bsz * nh
        before = self.layer_bytes(layer)
        parts = []
        if a:
            parts.append([_slice_rows(kq, 0, a * per), _slice_rows(vq, 0, a * per), a, fmt])
        mid = [self._pack(self._unpack(_slice_rows(q, a * per, b * per)), kv_format(to)) for q in (kq, vq)]
        parts.append([mid[0], mid[1], b - a, to])
        if b < t:
            parts.append([_slice_rows(kq, b * per, t * per), _slice_rows(vq, b * per, t * per), t - b, fmt])
        self._segs[layer][i : i + 1] = parts
        w = self._work[layer]
        w[0][:, :, start + a : start + b] = _unrows(self._unpack(mid[0]), bsz, nh)
        w[1][:, :, start + a : start + b] = _unrows(self._unpack(mid[1]), bsz, nh)
        self.events.append({"layer": layer, "tokens": [start + a, start + b], "from": fmt, "to": to,
                            "layer_bytes_before": before, "layer_bytes_after": self.layer_bytes(layer)})  # fmt: skip

    def _drop(self, n: int) -> None:
        """Remove the `n` oldest tokens after the sinks from every layer."""
        lo, hi = self.sink_tokens, self.sink_tokens + n
        per = self._shape[0] * self._shape[1]
        for layer in range(self.n_layer):
            kept, start = [], 0
            for kq, vq, t, fmt in self._segs[layer]:
                a, b = max(start, lo) - start, min(start + t, hi) - start
                if a >= b:
                    kept.append([kq, vq, t, fmt])
                else:
                    if a > 0:
                        kept.append([_slice_rows(kq, 0, a * per), _slice_rows(vq, 0, a * per), a, fmt])
                    if b < t:
                        kept.append([_slice_rows(kq, b * per, t * per), _slice_rows(vq, b * per, t * per), t - b, fmt])
                start += t
            self._segs[layer] = kept
            w = self._work[layer]
            if w is not None:
                self._work[layer] = tuple(torch.cat((x[:, :, :lo], x[:, :, hi:]), 2) for x in w)
        self.events.append({"layer": "all", "tokens": [lo + self.dropped, hi + self.dropped], "from": "held", "to": "dropped",
                            "layer_bytes_after": self.layer_bytes(0)})  # fmt: skip
        self.dropped += n

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens of every layer (a rejected speculation's rollback)."""
        if n < 0:
            raise MinifloatError(f"truncate keeps n ≥ 0 tokens, got {n}")
        if self.dropped:
            raise MinifloatError("a cache that dropped tokens cannot roll back (speculative decoding needs drop=False)")
        for layer, segs in enumerate(self._segs):
            kept, total = [], 0
            for kq, vq, t, fmt in segs:
                if total >= n:
                    break
                take = min(t, n - total)
                if take < t:
                    rows = take * self._shape[0] * self._shape[1]
                    kq, vq = _slice_rows(kq, 0, rows), _slice_rows(vq, 0, rows)
                kept.append([kq, vq, take, fmt])
                total += take
            self._segs[layer] = kept
            w = self._work[layer]
            if w is not None:
                self._work[layer] = (w[0][:, :, :n], w[1][:, :, :n])

    def layer_bytes(self, layer: int) -> int:
        return sum(seg[0].nbytes + seg[1].nbytes for seg in self._segs[layer])

    def nbytes(self) -> int:
        """Bytes of the packed store: codes, scales and tensor scales of every chunk."""
        return sum(self.layer_bytes(layer) for layer in range(self.n_layer))

    def stored(self, layer: int) -> list[tuple[object, object]]:
        """The packed K and V chunks of `layer` (plain tensors or QuantizedTensors)."""
        return [(seg[0], seg[1]) for seg in self._segs[layer]]


def _key(name: str) -> str:
    key = str(name).strip().lower().replace("-", "_")
    kv_format(key)
    return key
