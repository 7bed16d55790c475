"""`KVCache`: the keys and values of the tokens a model has seen, per layer, stored packed.

Formats (`KV_FORMATS`): ``fp32`` and ``bf16`` (plain tensors); ``fp8`` (E4M3) and ``fp8_e5m2``
with one FP32 scale per head and token (the row of head_dim values); ``mxfp8``, ``mxfp6``
(E2M3), ``mxfp4`` with E8M0 scales per 32 values of a head's row (scale exponent rounded up, as
the PTQ configs); ``nvfp4`` with E4M3 scales per 16 values and an FP32 scale per appended chunk.

K and V of shape (B, heads, T, head_dim) are stored as 2-D tensors of rows (token, batch, head)
× head_dim — token-major, so that keeping the first n tokens (a speculative rollback) is a slice
of whole rows, exact for every format (block rows are 1; an NVFP4 chunk keeps its tensor scale).
Consecutive tokens of one format form a run whose rows grow in place of being re-chunked (NVFP4
keeps each appended chunk's tensor scale). Attention reads the exactly dequantized values, decoded
from the packed store at each call and not kept: `nbytes` counts every tensor the cache holds.

Options for low-bit keys (each measured by ``minifloat bench decode``):

- ``rotate="k"`` (or ``"kv"``): a random-sign Hadamard rotation R of the head dimension, applied to
  each key row before it is quantized and undone (Rᵀ, R orthogonal) when it is read. Attention
  sees q·(Q(kR)Rᵀ)ᵀ = (qR)·Q(kR)ᵀ: the same as rotating queries and keys alike, so QKᵀ is
  unchanged before quantization, and the rotation spreads outlier channels over every block.
- ``key_scales="channel"`` (KIVI, Liu et al. 2024): keys scaled per channel — each channel's
  values over a group of tokens share a block (the format's block width, 32 for FP8), stored
  transposed; values stay per token. Tokens enter in the high-precision ``recent_format`` (KIVI's
  residual, required) and move to ``format`` a whole group at a time.
- ``pre_rope=True`` (KVQuant, Hooper et al. 2024): keys quantized before the rotary embedding —
  the cache undoes RoPE on arrival and applies it again when the keys are read, with the model's
  own rotary embedding (``rope``, given by the model's adapter: positions → (cos, sin)); where the
  model has one of the standard form.

Example:
    >>> cache = KVCache(n_layer=1, format="fp8")
    >>> k = v = torch.randn(1, 2, 5, 64)
    >>> K, V = cache.update(0, k, v)
    >>> K.shape, cache.length(0), cache.nbytes(), 2 * (2 * 5 * 64 + 2 * 5 * 4)
    (torch.Size([1, 2, 5, 64]), 5, 1360, 1360)
"""

from __future__ import annotations

import functools
import math

import torch

from minifloat import kernels
from minifloat.errors import MinifloatError
from minifloat.naming import canonical, lookup
from minifloat.quant import QuantizedTensor, quantize
from minifloat.quant.hadamard import hadamard_matrix
from minifloat.scaling import rules
from minifloat.scaling.layout import part_specs
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
    return lookup(KV_FORMATS, name, "KV-cache format")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, nh, T, hs) → (T·B·nh, hs), token-major."""
    return x.permute(2, 0, 1, 3).reshape(-1, x.shape[-1])


def _unrows(r: torch.Tensor, b: int, nh: int) -> torch.Tensor:
    """(T·B·nh, hs) → (B, nh, T, hs)."""
    return r.reshape(-1, b, nh, r.shape[-1]).permute(1, 2, 0, 3)


class _Packed:
    """The K or V rows of one run of tokens in one store, packed: ``data`` (rows, bytes of a row)
    or the plain rows of a dtype store; ``scale`` the per-row / per-block scale grid (one (1, 1)
    scale for a calibrated per-tensor run); NVFP4 keeps one FP32 tensor scale per appended chunk
    (``ts``) and the rows of each chunk (``chunks``). Every tensor here is its own storage (no view
    of a caller's tensor or of a larger store), so what it counts is what the process holds."""

    __slots__ = ("store", "data", "scale", "ts", "chunks", "hs")

    def __init__(self, store, data, scale=None, ts=None, chunks=None, hs=0) -> None:
        self.store, self.data, self.scale, self.ts, self.chunks, self.hs = store, data, scale, ts, chunks, hs

    @classmethod
    def pack(cls, rows: torch.Tensor, store, amax=None) -> _Packed:
        """Quantize (or cast) `rows` (n, head_dim) into `store` as one chunk."""
        if isinstance(store, torch.dtype):  # a fresh tensor: never a view of the model's activations
            return cls(store, torch.empty(rows.shape, dtype=store, device=rows.device).copy_(rows), hs=rows.shape[1])
        q = quantize(rows, store, amax=amax)
        ts = None if q.tensor_scale is None else q.tensor_scale.reshape(1)
        return cls(store, q.data, q.scale, ts, None if ts is None else [rows.shape[0]], rows.shape[1])

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.ts) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def _per_tensor(self) -> bool:
        return not isinstance(self.store, torch.dtype) and self.store.granularity == "tensor"

    def joins(self, other: _Packed) -> bool:
        """Whether `other`'s rows can follow these in one store: the same store, and for a
        calibrated per-tensor run the same scale."""
        same = type(other) is type(self) and other.store == self.store and other.hs == self.hs
        return same and not (self._per_tensor() and not torch.equal(self.scale, other.scale))

    def extend(self, other: _Packed) -> None:
        """Append `other`'s rows (`joins` must hold)."""
        assert self.joins(other)
        self.data = torch.cat((self.data, other.data))
        if self.scale is not None and not self._per_tensor():
            self.scale = torch.cat((self.scale, other.scale))
        if self.ts is not None:
            self.ts, self.chunks = torch.cat((self.ts, other.ts)), self.chunks + other.chunks

    def slice(self, r0: int, r1: int) -> _Packed:
        """Rows [r0, r1) as a store of their own (copies: whole rows, exact for every format; an
        NVFP4 chunk's rows keep its tensor scale)."""
        scale = None if self.scale is None else (self.scale if self._per_tensor() else self.scale[r0:r1].clone())
        ts = chunks = None
        if self.ts is not None:
            keep, chunks, start = [], [], 0
            for i, n in enumerate(self.chunks):
                a, b = max(start, r0), min(start + n, r1)
                if a < b:
                    keep.append(i)
                    chunks.append(b - a)
                start += n
            ts = self.ts[keep].clone()
        return _Packed(self.store, self.data[r0:r1].clone(), scale, ts, chunks, self.hs)

    def pieces(self) -> list[QuantizedTensor | torch.Tensor]:
        """The store as QuantizedTensors (plain tensors for a dtype store): one a chunk for NVFP4
        (its own tensor scale), else one for the whole run."""
        if isinstance(self.store, torch.dtype):
            return [self.data]
        if self.ts is None:
            return [QuantizedTensor(self.data, self.scale, None, (self.rows, self.hs), self.store)]
        out, start = [], 0
        for n, ts in zip(self.chunks, self.ts, strict=True):
            out.append(QuantizedTensor(self.data[start : start + n], self.scale[start : start + n], ts.reshape(()),
                                       (n, self.hs), self.store))  # fmt: skip
            start += n
        return out

    def dequantize(self) -> torch.Tensor:
        """The rows' values, float32 (n, head_dim): exactly `quantize`'s decode."""
        if isinstance(self.store, torch.dtype):
            return self.data.float()
        if self.ts is None or len(self.chunks) == 1:
            ts = None if self.ts is None else self.ts.reshape(())
            return QuantizedTensor(self.data, self.scale, ts, (self.rows, self.hs), self.store).dequantize()
        # chunks of different tensor scales: each row's decode scales (E4M3 code × its chunk's
        # tensor scale, the same float32 product as one chunk's decode) handed over as FP32 scales
        per_row = torch.repeat_interleave(self.ts, torch.tensor(self.chunks, device=self.ts.device))
        scales = rules.decode_scales(self.scale, per_row[:, None], "e4m3")
        fp32 = self.store.replace(scale_format="fp32", scale_rule="floor")
        return kernels.dequantize(self.data, scales, None, (self.rows, self.hs), fp32)


class _ChannelPacked:
    """Keys scaled per channel (KIVI): each chunk is a group of t tokens' rows (t·P, head_dim), P =
    batch × heads, stored transposed — a channel's t values one row of (P·head_dim, t) — so the
    format's blocks run along the tokens: one scale per channel and block of tokens."""

    __slots__ = ("store", "chunks", "per", "hs")

    def __init__(self, store, chunks: list[QuantizedTensor], per: int, hs: int) -> None:
        self.store, self.chunks, self.per, self.hs = store, chunks, per, hs

    @classmethod
    def pack(cls, rows: torch.Tensor, store, per: int) -> _ChannelPacked:
        hs = rows.shape[1]
        t = rows.shape[0] // per
        channels = rows.reshape(t, per, hs).permute(1, 2, 0).reshape(per * hs, t).contiguous()
        return cls(store, [quantize(channels, store)], per, hs)

    @property
    def rows(self) -> int:
        return sum(q.shape[1] for q in self.chunks) * self.per

    def tensors(self) -> list[torch.Tensor]:
        return [t for q in self.chunks for t in (q.data, q.scale, q.tensor_scale) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def joins(self, other) -> bool:
        return type(other) is type(self) and (other.store, other.per, other.hs) == (self.store, self.per, self.hs)

    def extend(self, other: _ChannelPacked) -> None:
        assert self.joins(other)
        self.chunks = self.chunks + other.chunks

    def _rows_of(self, q: QuantizedTensor) -> torch.Tensor:
        t = q.shape[1]
        return q.dequantize().reshape(self.per, self.hs, t).permute(2, 0, 1).reshape(t * self.per, self.hs)

    def dequantize(self) -> torch.Tensor:
        rows = [self._rows_of(q) for q in self.chunks]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def pieces(self) -> list[QuantizedTensor]:
        return list(self.chunks)

    def slice(self, r0: int, r1: int) -> _ChannelPacked:
        """Rows [r0, r1): whole groups as they are; a group cut in two keeps its part's values,
        quantized again as a smaller group (its channels' scales then come from those tokens)."""
        out, start = [], 0
        for q in self.chunks:
            n = q.shape[1] * self.per
            a, b = max(start, r0), min(start + n, r1)
            if a < b:
                out.append(q.clone() if (a, b) == (start, start + n) else
                           _ChannelPacked.pack(self._rows_of(q)[a - start : b - start], self.store, self.per).chunks[0])  # fmt: skip
            start += n
        return _ChannelPacked(self.store, out, self.per, self.hs)


KV_ROTATIONS = (None, "k", "kv")
KEY_SCALES = ("token", "channel")


class _Run:
    """Consecutive tokens of one layer stored in one format: their K and V."""

    __slots__ = ("k", "v", "tokens", "fmt")

    def __init__(self, k: _Packed, v: _Packed, tokens: int, fmt: str) -> None:
        self.k, self.v, self.tokens, self.fmt = k, v, tokens, fmt

    def extend(self, other: _Run) -> bool:
        """Append `other`'s tokens; False (nothing changed) when the two cannot share one run."""
        if other.fmt != self.fmt or not (self.k.joins(other.k) and self.v.joins(other.v)):
            return False
        self.k.extend(other.k)
        self.v.extend(other.v)
        self.tokens += other.tokens
        return True

    def slice(self, t0: int, t1: int, per: int) -> _Run:
        return _Run(self.k.slice(t0 * per, t1 * per), self.v.slice(t0 * per, t1 * per), t1 - t0, self.fmt)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _row_bytes(store: Scheme | torch.dtype, hs: int) -> int:
    """Bytes of one head's row of `hs` values in `store` (an NVFP4 chunk's tensor scale aside)."""
    if isinstance(store, torch.dtype):
        return hs * torch.finfo(store).bits // 8
    specs = part_specs((1, hs), store)  # a partial last block is padded and has its own scale
    row = specs["data"][1][1]
    if store.granularity != "tensor":
        dtype, shape = specs["scale"]
        row += math.prod(shape) * dtype.itemsize
    return row


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
    budget counts every layer; each layer keeps to its equal share.

    What the cache holds is its packed store and nothing else: `update` decodes the layer's
    tokens for the attention that asked (a temporary the caller drops), so `nbytes()` — the
    bytes the budget counts — is every byte of every tensor the cache keeps (`tensors()`)."""

    def __init__(self, n_layer: int, format: str = "bf16", *, budget_bytes: int | None = None,
                 pressure_format: str = "nvfp4", sink_tokens: int = 4, recent_tokens: int = 32,
                 scales: dict[int, tuple[float, float]] | None = None, recent_format: str | None = None,
                 drop: bool = False, rotate: str | None = None, key_scales: str = "token", pre_rope: bool = False,
                 rope=None) -> None:  # fmt: skip
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
        self._options(rotate, key_scales, pre_rope, rope)
        self.n_layer = n_layer
        self._runs: list[list[_Run]] = [[] for _ in range(n_layer)]  # oldest first; neighbours differ in format
        self._shape: tuple[int, int, int] | None = None  # (batch, heads, head_dim)
        self.events: list[dict] = []

    def _options(self, rotate, key_scales, pre_rope, rope) -> None:
        """Check and keep the options for low-bit keys (the module docstring)."""
        if rotate not in KV_ROTATIONS:
            raise MinifloatError(f"rotate={rotate!r}: use None, 'k' (keys) or 'kv' (keys and values)")
        if key_scales not in KEY_SCALES:
            raise MinifloatError(f"key_scales={key_scales!r}: use 'token' or 'channel' (KIVI)")
        if (rotate or key_scales != "token" or pre_rope) and self.scales is not None:
            raise MinifloatError("calibrated per-tensor KV scales take no key rotation, channel scales or pre-RoPE keys")
        if key_scales == "channel":
            if isinstance(self.store, torch.dtype):
                raise MinifloatError(f"key_scales='channel' quantizes keys; format {self.format!r} stores them as they are")
            if self.recent_format is None or self.budget_bytes is not None:
                raise MinifloatError("key_scales='channel' groups tokens before it quantizes them: it needs a "
                                     "high-precision recent window (recent_format='bf16', KIVI's residual) and no budget")  # fmt: skip
        if pre_rope and (rope is None or self.drop):
            raise MinifloatError("pre_rope=True needs the model's rotary embedding (rope=, which the transformers adapter "
                                 "gives for a model with one of the standard form) and a cache that keeps every token's position (drop=False)")  # fmt: skip
        self.rotate, self.key_scales, self.pre_rope, self.rope = rotate, key_scales, pre_rope, rope
        # a channel group: the format's block width along the tokens (32 tokens for per-row FP8)
        self.group = self.store.block[1] if not isinstance(self.store, torch.dtype) and self.store.block else 32

    def settings(self) -> dict:
        """The arguments that make an empty cache like this one."""
        return dict(format=self.format, budget_bytes=self.budget_bytes, pressure_format=self.pressure_format,
                    sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens, scales=self.scales,
                    recent_format=self.recent_format, drop=self.drop, rotate=self.rotate, key_scales=self.key_scales,
                    pre_rope=self.pre_rope, rope=self.rope)  # fmt: skip

    def length(self, layer: int = 0) -> int:
        """Tokens held for `layer`."""
        return sum(run.tokens for run in self._runs[layer])

    def position(self, layer: int = 0) -> int:
        """Tokens seen: those held and those dropped (the next token's position)."""
        return self.length(layer) + self.dropped

    def precisions(self, layer: int = 0) -> list[str]:
        """The format each held token of `layer` is stored in, oldest first."""
        return [run.fmt for run in self._runs[layer] for _ in range(run.tokens)]

    def _check_shape(self, k: torch.Tensor) -> None:
        b, nh, _, hs = k.shape
        if self._shape is None:  # a head_dim that is not a multiple of the blocks: a partial last block
            if self.rotate and hs & (hs - 1):
                raise MinifloatError(f"a Hadamard rotation of the head dimension needs a power of two; head_dim is {hs}")
            self._shape = (b, nh, hs)
        elif self._shape != (b, nh, hs):
            raise MinifloatError(f"the cache holds batch × heads × head_dim {self._shape}; got {(b, nh, hs)}")

    def token_bytes(self, store) -> int:
        """Bytes one token takes in one layer (K and V) in `store`."""
        b, nh, hs = self._shape
        return 2 * b * nh * _row_bytes(store, hs)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the T new tokens' `k`, `v` (B, heads, T, head_dim) to `layer`; return every
        token's K and V (B, heads, length, head_dim), as stored (dequantized, float32, built for
        this call: the cache keeps only its packed store)."""
        self._check_shape(k)
        t = k.shape[2]
        if self.budget_bytes is not None and layer == 0:
            self._check_budget(t)  # before anything is stored: every layer has layer 0's sizes
        kr, vr = self._encode(_rows(k.detach()), _rows(v.detach()), self.length(layer), t)
        if self.scales is not None:  # the calibrated per-tensor scale; values past its amax saturate
            if layer not in self.scales:
                raise MinifloatError(f"the calibrated KV scales have no entry for layer {layer}")
            ka, va = self.scales[layer]
            per_tensor = get_scheme("fp8")
            run = _Run(_Packed.pack(kr, per_tensor, ka), _Packed.pack(vr, per_tensor, va), t, self.format)
        else:
            entry = self.format if self.recent_format is None else self.recent_format
            store = kv_format(entry)
            run = _Run(_Packed.pack(kr, store), _Packed.pack(vr, store), t, entry)
        runs = self._runs[layer]
        if not (runs and runs[-1].extend(run)):
            runs.append(run)
        if self.recent_format is not None:
            self._age(layer)
        if self.budget_bytes is not None:
            self._fit(layer)
        return self.keys_values(layer)

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held token's K and V of `layer` (B, heads, length, head_dim), float32, decoded
        from the packed store on the store's device."""
        runs = self._runs[layer]
        if not runs:
            raise MinifloatError(f"layer {layer} of the KV cache holds no tokens yet")
        b, nh, _ = self._shape
        out = []
        for part in ("k", "v"):
            rows = [getattr(run, part).dequantize() for run in runs]
            out.append(rows[0] if len(rows) == 1 else torch.cat(rows))
        k, v = self._decode(out[0], out[1])
        return _unrows(k, b, nh), _unrows(v, b, nh)

    def _rotation(self, device: torch.device) -> torch.Tensor:
        return _hadamard(self._shape[2]).to(device)

    def _rope_rows(self, start: int, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions [start, start + t), one row per stored row (token-major)."""
        cos, sin = self.rope(torch.arange(start, start + t, device=device))
        per = self._shape[0] * self._shape[1]
        return cos.float().repeat_interleave(per, 0), sin.float().repeat_interleave(per, 0)

    def _encode(self, kr: torch.Tensor, vr: torch.Tensor, start: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New rows as they are stored: RoPE undone (pre-RoPE keys), then rotated."""
        if self.pre_rope:
            cos, sin = self._rope_rows(start, t, kr.device)
            k = kr.float()
            kr = k * cos - _rotate_half(k) * sin  # the inverse rotation: RoPE by −θ
        if self.rotate:
            r = self._rotation(kr.device)
            kr = kr.float() @ r
            vr = vr.float() @ r if self.rotate == "kv" else vr
        return kr, vr

    def _decode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored rows as attention reads them: rotated back, then RoPE applied again."""
        if self.rotate:
            r = self._rotation(k.device)
            k = k @ r.T
            v = v @ r.T if self.rotate == "kv" else v
        if self.pre_rope:
            cos, sin = self._rope_rows(0, k.shape[0] // (self._shape[0] * self._shape[1]), k.device)
            k = k * cos + _rotate_half(k) * sin
        return k, v

    def _age(self, layer: int) -> None:
        """Move the tokens that left the recent window (not the sinks) from `recent_format` to `format`."""
        lo, hi = self.sink_tokens, self.length(layer) - self.recent_tokens
        start, i = 0, 0
        while i < len(self._runs[layer]):
            run = self._runs[layer][i]
            a, b = max(start, lo), min(start + run.tokens, hi)
            if self.key_scales == "channel":  # channel scales: whole groups of tokens only
                b = a + (b - a) // self.group * self.group
            if run.fmt == self.recent_format and a < b:
                self._demote(layer, i, start, a - start, b - start, self.format)
                start, i = 0, 0  # the runs were split and merged: walk them again
                continue
            start += run.tokens
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
        extra = self.layer_bytes(0) - sum(run.tokens * self.token_bytes(kv_format(run.fmt)) for run in self._runs[0])
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
            for i, run in enumerate(self._runs[layer]):
                a, b = max(start, lo), min(start + run.tokens, hi)
                if run.fmt == self.format and a < b:
                    self._demote(layer, i, start, a - start, min(b, a + need) - start, self.pressure_format)
                    break
                start += run.tokens
            else:
                raise MinifloatError(f"the KV budget of {self.budget_bytes:,} bytes is exceeded and no token can move to "
                                     f"{self.pressure_format}")  # fmt: skip

    def _demote(self, layer: int, i: int, start: int, a: int, b: int, to: str) -> None:
        """Move tokens [a, b) of run i (which starts at token `start`) to format `to`."""
        run = self._runs[layer][i]
        per = self._shape[0] * self._shape[1]
        before = self.layer_bytes(layer)
        store = kv_format(to)
        keys = run.k.slice(a * per, b * per).dequantize()
        channel = self.key_scales == "channel" and to == self.format
        mid = _Run(_ChannelPacked.pack(keys, store, per) if channel else _Packed.pack(keys, store),
                   _Packed.pack(run.v.slice(a * per, b * per).dequantize(), store), b - a, to)  # fmt: skip
        parts = ([run.slice(0, a, per)] if a else []) + [mid] + ([run.slice(b, run.tokens, per)] if b < run.tokens else [])
        self._runs[layer][i : i + 1] = parts
        self._merge(layer)
        self.events.append({"layer": layer, "tokens": [start + a, start + b], "from": run.fmt, "to": to,
                            "layer_bytes_before": before, "layer_bytes_after": self.layer_bytes(layer)})  # fmt: skip

    def _merge(self, layer: int) -> None:
        """Join neighbouring runs of one format (fewer pieces to decode at each step)."""
        merged: list[_Run] = []
        for run in self._runs[layer]:
            if not (merged and merged[-1].extend(run)):
                merged.append(run)
        self._runs[layer] = merged

    def _keep(self, layer: int, t0: int, t1: int) -> None:
        """Keep the held tokens outside [t0, t1) of `layer`."""
        per = self._shape[0] * self._shape[1]
        kept, start = [], 0
        for run in self._runs[layer]:
            a, b = max(start, t0) - start, min(start + run.tokens, t1) - start
            if a >= b:
                kept.append(run)
            else:
                if a > 0:
                    kept.append(run.slice(0, a, per))
                if b < run.tokens:
                    kept.append(run.slice(b, run.tokens, per))
            start += run.tokens
        self._runs[layer] = kept
        self._merge(layer)

    def _drop(self, n: int) -> None:
        """Remove the `n` oldest tokens after the sinks from every layer."""
        lo, hi = self.sink_tokens, self.sink_tokens + n
        for layer in range(self.n_layer):
            self._keep(layer, lo, hi)
        self.events.append({"layer": "all", "tokens": [lo + self.dropped, hi + self.dropped], "from": "held", "to": "dropped",
                            "layer_bytes_after": self.layer_bytes(0)})  # fmt: skip
        self.dropped += n

    def truncate(self, n: int, layer: int | None = None) -> None:
        """Keep the first `n` tokens of every layer, or of `layer` alone (a rejected speculation's rollback)."""
        if n < 0:
            raise MinifloatError(f"truncate keeps n ≥ 0 tokens, got {n}")
        if self.dropped:
            raise MinifloatError("a cache that dropped tokens cannot roll back (speculative decoding needs drop=False)")
        for i in range(self.n_layer) if layer is None else (layer,):
            if self.length(i) > n:
                self._keep(i, n, self.length(i))

    def layer_bytes(self, layer: int) -> int:
        return sum(run.nbytes for run in self._runs[layer])

    def nbytes(self) -> int:
        """Bytes the cache holds: codes, scales and tensor scales of every layer."""
        return sum(self.layer_bytes(layer) for layer in range(self.n_layer))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (what `nbytes` adds up)."""
        return [t for runs in self._runs for run in runs for p in (run.k, run.v) for t in p.tensors()]

    def stored(self, layer: int) -> list[tuple[object, object]]:
        """The packed K and V of `layer`, oldest first: per run of one format a plain tensor or
        a QuantizedTensor (NVFP4: one per appended chunk, each with its own tensor scale)."""
        return [pair for run in self._runs[layer] for pair in zip(run.k.pieces(), run.v.pieces(), strict=True)]


KV_SPEC_OPTIONS = {"hadamard": {"rotate": "k"}, "hadamard-kv": {"rotate": "kv"}, "channel": {"key_scales": "channel"},
                   "pre-rope": {"pre_rope": True}}  # fmt: skip


def parse_kv_spec(spec: str) -> tuple[str, dict]:
    """A cache written as ``FORMAT[+RECENT][@OPTION…]`` — e.g. ``nvfp4+bf16@channel@hadamard`` —
    as (format, `KVCache` options): RECENT the sinks' and the last tokens' format, each OPTION one
    of ``hadamard`` (keys rotated), ``hadamard-kv``, ``channel`` (KIVI's per-channel key scales),
    ``pre-rope`` (keys quantized before RoPE).

    Example:
        >>> parse_kv_spec("nvfp4+bf16@channel")
        ('nvfp4', {'recent_format': 'bf16', 'key_scales': 'channel'})
    """
    head, *options = str(spec).strip().split("@")
    name, _, recent = head.partition("+")
    kw: dict = {"recent_format": _key(recent)} if recent else {}
    for o in options:
        if o.strip().lower() not in KV_SPEC_OPTIONS:
            raise MinifloatError(f"unknown KV-cache option {o!r} in {spec!r}; use {', '.join(KV_SPEC_OPTIONS)}")
        kw |= KV_SPEC_OPTIONS[o.strip().lower()]
    return _key(name), kw


@functools.lru_cache(maxsize=4)
def _hadamard(n: int) -> torch.Tensor:
    """The rotation of a head of `n` values, made once per process (every update and read uses it;
    no cache holds it, so `nbytes` stays every byte of the tokens)."""
    return hadamard_matrix(n)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) → (−x2, x1) over the two halves of the last dim: RoPE's pairing of channels."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _key(name: str) -> str:
    return canonical(KV_FORMATS, name, "KV-cache format")
