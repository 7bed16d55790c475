"""FSDP2 all-gathers a Linear's weight as its codes and scales instead of its FP32 / BF16 values.

`QuantizedGatherWeight` wraps a minifloat `Linear`'s weight before ``fully_shard``: it behaves as
the weight itself under every op (the optimizer updates it, checkpoints gather it), and its
``fsdp_pre_all_gather`` hands FSDP2 the shard quantized in the Linear's weight scheme:

- per-tensor FP8 with current scaling (``fp8-current``): the shard's amax is max-reduced over the
  shard group first (4 bytes a weight), so every rank quantizes with the full weight's scale and
  only the E4M3 codes travel (1 byte a value; the scale goes along as metadata);
- MXFP8 (1×32 blocks along the rows, which FSDP2 does not split): each rank's rows are whole
  blocks, so the shard quantizes alone; the codes and the E8M0 scales travel (1 + 1/32 bytes).

Either way the gathered codes are those of quantizing the gathered weight (a block's scale
depends only on its own values; the per-tensor scale on the max over all ranks). The gathered
parameter is a `GatheredWeight`: the Linear's forward takes its codes as the packed weight
without quantizing again; any other op sees the dequantized weight (its value). The backward's
column-wise operand (MXFP8's dgrad) is quantized from that dequantized weight — the values the
forward used, not the FP32 master — a second rounding that per-tensor FP8 does not need.

The wire carries 0.5× (FP8) or 0.516× (MXFP8) a BF16 all-gather's bytes of these weights; the
rest of the model (embeddings, norms) is gathered as it is stored.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from minifloat.errors import MinifloatError
from minifloat.quant.api import quantize
from minifloat.quant.tensor import QuantizedTensor
from minifloat.scaling.schemes import Scheme

aten = torch.ops.aten
# Ops that keep a wrapped weight wrapped (FSDP2 chunks, pads, copies and views the parameter).
_KEEP = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
         aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor, aten.clone.default,
         aten.detach.default, aten.alias.default}  # fmt: skip


def gathers(scheme: Scheme) -> bool:
    """Whether FSDP2's shards (whole rows of the weight) can quantize a weight in `scheme` alone and
    all-gather the codes: one-byte codes, and scales that are the shards' own (blocks one row tall:
    MX, 1×128, per row) or one per tensor (its amax the max over the shards' amaxes, one
    all-reduce). Not 128×128 blocks (a shard's edge cuts them), not NVFP4 (two-level scales)."""
    one_row = scheme.granularity == "row" or (scheme.granularity == "block" and scheme.block[0] == 1)
    return scheme.element_format.bits == 8 and not scheme.is_nvfp4 and (scheme.granularity == "tensor" or one_row)


def _block_k(scheme: Scheme) -> int:
    """The columns a weight's rows must come in whole multiples of: a block's width (1 otherwise)."""
    return scheme.block[1] if scheme.granularity == "block" else 1


class QuantizedGatherWeight(torch.Tensor):
    """A float weight (the sharded master) that FSDP2 all-gathers quantized in `scheme`."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scheme: Scheme):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)  # fmt: skip

    def __init__(self, data: torch.Tensor, scheme: Scheme) -> None:
        if not gathers(scheme):
            raise MinifloatError(f"the {scheme.name} weight cannot be all-gathered quantized; that works for 8-bit "
                                 f"weights scaled per tensor, per row or in blocks one row tall (fp8-current, mxfp8)")  # fmt: skip
        self._data, self._scheme = data, scheme

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"QuantizedGatherWeight({self._scheme.name}, {self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        scheme = next(a._scheme for a in tree_leaves((args, kwargs)) if isinstance(a, cls))  # lists of tensors too
        out = func(*tree_map_only(cls, lambda t: t._data, args), **tree_map_only(cls, lambda t: t._data, kwargs or {}))
        if func is aten.copy_.default:
            return args[0]
        if func in _KEEP:
            return tree_map_only(torch.Tensor, lambda t: cls(t, scheme), out)
        return out

    def __tensor_flatten__(self):
        return ["_data"], self._scheme

    @staticmethod
    def __tensor_unflatten__(inner, scheme, outer_size, outer_stride):
        return QuantizedGatherWeight(inner["_data"], scheme)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        w = self._data
        if self._scheme.granularity == "tensor":  # the full weight's amax: the max over the shards
            amax = w.detach().abs().amax().float().reshape(1) if w.numel() else torch.zeros(1)
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
            q = quantize(w.detach(), self._scheme, amax=amax.reshape(()))
            return (q.data,), (q.scale,)
        q = quantize(w.detach(), self._scheme)
        return (q.data, q.scale), ()

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        codes, scale = (outputs[0], metadata[0]) if self._scheme.granularity == "tensor" else outputs
        if out is not None:  # FSDP2 gathered into the same storages again; a new per-tensor scale
            out._scale.copy_(scale)
            return None
        return GatheredWeight(codes, scale.clone(), self._scheme, param_dtype), tuple(outputs)


class GatheredWeight(torch.Tensor):
    """A gathered weight held as codes and scales: the value is the dequantized weight."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor, scheme: Scheme, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype, device=codes.device)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, scheme: Scheme, dtype: torch.dtype) -> None:
        self._codes, self._scale, self._scheme = codes, scale, scheme

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"GatheredWeight({self._scheme.name}, shape={tuple(self.shape)})"

    def quantized(self) -> QuantizedTensor:
        """The packed weight the Linear's GEMM takes: the gathered codes and scales."""
        return QuantizedTensor(self._codes, self._scale, None, self.shape, self._scheme, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        same = func in (aten.detach.default, aten.alias.default) or (
            func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(args[0].shape))
        if same:  # FSDP2's as_strided to the parameter's own shape, nn.Parameter's detach: the same codes
            t = args[0]
            return GatheredWeight(t._codes, t._scale, t._scheme, t.dtype)

        def value(t):
            return t.quantized().dequantize(t.dtype)

        return func(*tree_map_only(cls, value, args), **tree_map_only(cls, value, kwargs or {}))

    def __tensor_flatten__(self):
        return ["_codes", "_scale"], (self._scheme, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return GatheredWeight(inner["_codes"], inner["_scale"], *meta)


def gather_quantized(model: torch.nn.Module) -> int:
    """Wrap the weight of every minifloat `Linear` of `model` whose recipe's weight scheme `gathers`
    (in place, before ``fully_shard``); returns how many. A weight shared with
    another module (a tied head) is left as it is."""
    counts: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
    wrapped = 0
    for m in model.modules():
        quantized = isinstance(m, torch.nn.Linear) and getattr(m, "recipe", None) is not None  # a minifloat Linear (not imported: it imports this)
        if quantized and counts[id(m.weight)] == 1 and gathers(m.recipe.scheme("weight")):
            if getattr(m.recipe, "forward_rht", False):
                raise MinifloatError(f"{m}: the forward GEMM of a forward_rht recipe quantizes the rotated weight, which the "
                                     "gathered codes are not; train it without --fp8-all-gather, or with forward_rht=False")  # fmt: skip
            if m.recipe.outlier_channels:
                raise MinifloatError(f"{m}: the forward GEMM of a recipe with outlier_channels multiplies those channels of "
                                     "the high-precision weight, which the gathered codes are not; train it without "
                                     "--fp8-all-gather, or with outlier_channels=0")  # fmt: skip
            if m.in_features % max(_block_k(m.recipe.scheme("weight")), 32):  # 32: the MX blocks the codes are laid out in
                raise MinifloatError(f"an all-gathered quantized weight needs in_features a multiple of "
                                     f"{max(_block_k(m.recipe.scheme('weight')), 32)} (whole blocks); {m} has {m.in_features}")  # fmt: skip
            m.weight = torch.nn.Parameter(QuantizedGatherWeight(m.weight.data, m.recipe.scheme("weight")), requires_grad=True)
            wrapped += 1
    return wrapped
