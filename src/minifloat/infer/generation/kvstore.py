"""How a `KVCache` stores tokens: K and V rows packed in one format per run of consecutive tokens.

K and V of shape (B, heads, T, head_dim) are stored as 2-D tensors of rows (token, batch, head)
× head_dim (`to_rows`) — token-major, so that keeping the first n tokens (a speculative rollback)
is a slice of whole rows, exact for every format (block rows are 1; an NVFP4 chunk keeps its
tensor scale). A `Run` holds consecutive tokens of one format; its `Packed` rows grow in place of
being re-chunked. `ChannelPacked` holds keys scaled per channel (KIVI). Every tensor here is its
own storage: what `nbytes` counts is what the process holds.
"""

from __future__ import annotations

import math

import torch

from minifloat import kernels
from minifloat.quant import QuantizedTensor, quantize
from minifloat.scaling import rules
from minifloat.scaling.layout import part_specs
from minifloat.scaling.schemes import Scheme


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, nh, T, hs) → (T·B·nh, hs), token-major."""
    return x.permute(2, 0, 1, 3).reshape(-1, x.shape[-1])


def from_rows(r: torch.Tensor, b: int, nh: int) -> torch.Tensor:
    """(T·B·nh, hs) → (B, nh, T, hs)."""
    return r.reshape(-1, b, nh, r.shape[-1]).permute(1, 2, 0, 3)


class Packed:
    """The K or V rows of one run of tokens in one store, packed: ``data`` (rows, bytes of a row)
    or the plain rows of a dtype store; ``scale`` the per-row / per-block scale grid (one (1, 1)
    scale for a calibrated per-tensor run); NVFP4 keeps one FP32 tensor scale per appended chunk
    (``ts``) and the rows of each chunk (``chunks``). Every tensor here is its own storage (no view
    of a caller's tensor or of a larger store), so what it counts is what the process holds."""

    __slots__ = ("store", "data", "scale", "ts", "chunks", "hs")

    def __init__(self, store, data, scale=None, ts=None, chunks=None, hs=0) -> None:
        self.store, self.data, self.scale, self.ts, self.chunks, self.hs = store, data, scale, ts, chunks, hs

    @classmethod
    def pack(cls, rows: torch.Tensor, store, amax=None) -> Packed:
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

    def joins(self, other: Packed) -> bool:
        """Whether `other`'s rows can follow these in one store: the same store, and for a
        calibrated per-tensor run the same scale."""
        same = type(other) is type(self) and other.store == self.store and other.hs == self.hs
        return same and not (self._per_tensor() and not torch.equal(self.scale, other.scale))

    def extend(self, other: Packed) -> None:
        """Append `other`'s rows (`joins` must hold)."""
        assert self.joins(other)
        self.data = torch.cat((self.data, other.data))
        if self.scale is not None and not self._per_tensor():
            self.scale = torch.cat((self.scale, other.scale))
        if self.ts is not None:
            self.ts, self.chunks = torch.cat((self.ts, other.ts)), self.chunks + other.chunks

    def slice(self, r0: int, r1: int) -> Packed:
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
        return Packed(self.store, self.data[r0:r1].clone(), scale, ts, chunks, self.hs)

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


class ChannelPacked:
    """Keys scaled per channel (KIVI): each chunk is a group of t tokens' rows (t·P, head_dim), P =
    batch × heads, stored transposed — a channel's t values one row of (P·head_dim, t) — so the
    format's blocks run along the tokens: one scale per channel and block of tokens."""

    __slots__ = ("store", "chunks", "per", "hs")

    def __init__(self, store, chunks: list[QuantizedTensor], per: int, hs: int) -> None:
        self.store, self.chunks, self.per, self.hs = store, chunks, per, hs

    @classmethod
    def pack(cls, rows: torch.Tensor, store, per: int) -> ChannelPacked:
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

    def extend(self, other: ChannelPacked) -> None:
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

    def slice(self, r0: int, r1: int) -> ChannelPacked:
        """Rows [r0, r1): whole groups as they are; a group cut in two keeps its part's values,
        quantized again as a smaller group (its channels' scales then come from those tokens)."""
        out, start = [], 0
        for q in self.chunks:
            n = q.shape[1] * self.per
            a, b = max(start, r0), min(start + n, r1)
            if a < b:
                out.append(q.clone() if (a, b) == (start, start + n) else
                           ChannelPacked.pack(self._rows_of(q)[a - start : b - start], self.store, self.per).chunks[0])  # fmt: skip
            start += n
        return ChannelPacked(self.store, out, self.per, self.hs)


class Run:
    """Consecutive tokens of one layer stored in one format: their K and V."""

    __slots__ = ("k", "v", "tokens", "fmt")

    def __init__(self, k: Packed, v: Packed, tokens: int, fmt: str) -> None:
        self.k, self.v, self.tokens, self.fmt = k, v, tokens, fmt

    def extend(self, other: Run) -> bool:
        """Append `other`'s tokens; False (nothing changed) when the two cannot share one run."""
        if other.fmt != self.fmt or not (self.k.joins(other.k) and self.v.joins(other.v)):
            return False
        self.k.extend(other.k)
        self.v.extend(other.v)
        self.tokens += other.tokens
        return True

    def slice(self, t0: int, t1: int, per: int) -> Run:
        return Run(self.k.slice(t0 * per, t1 * per), self.v.slice(t0 * per, t1 * per), t1 - t0, self.fmt)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def row_bytes(store: Scheme | torch.dtype, hs: int) -> int:
    """Bytes of one head's row of `hs` values in `store` (an NVFP4 chunk's tensor scale aside)."""
    if isinstance(store, torch.dtype):
        return hs * torch.finfo(store).bits // 8
    specs = part_specs((1, hs), store)  # a partial last block is padded and has its own scale
    row = specs["data"][1][1]
    if store.granularity != "tensor":
        dtype, shape = specs["scale"]
        row += math.prod(shape) * dtype.itemsize
    return row
