"""`QuantizedLinear`: a Linear for inference whose weight is held packed, as a `QuantizedTensor`.

Its parts are buffers (``weight_data``, ``weight_scale``, ``weight_tensor_scale`` for NVFP4,
``input_amax`` for a calibrated input; ``kept_index`` and ``kept_weight`` for input channels kept
out of the quantized product, `minifloat.infer.ptq.outliers`), so ``module.to(device)`` and
``state_dict()`` carry them;
the high-precision weight is gone. The forward quantizes the input as its config says (or not:
weight-only), multiplies with `minifloat.gemm.scaled_mm` — on a CPU the exact emulation (the
dequantized operands, FP32 accumulation), on a GPU that has the format the native
``torch._scaled_mm`` — adds the bias in FP32 and returns the input's dtype. The same result on
every backend up to summation order. Weight-only calls go through the weight prepacked once
(`minifloat.gemm.prepack`: the decode kernel's plan, else `minifloat.gemm.weight_only_mm`, the
dispatch decode kernels register with); the weight the GEMMs read is the compute layout that
`prepare` makes once from the buffers (the checkpoint layout, which `export` reads).

Example:
    >>> layer = QuantizedLinear.from_linear(torch.nn.Linear(64, 32), "fp8-dynamic")
    >>> layer(torch.randn(2, 64)).shape, layer.weight.scheme.name
    (torch.Size([2, 32]), 'fp8_rowwise')
"""

from __future__ import annotations

import math

import torch

from minifloat.errors import MinifloatError
from minifloat.gemm import prepack, scaled_mm
from minifloat.infer.ptq.config import QuantConfig, get_quant_config
from minifloat.infer.ptq.outliers import KEPT_DTYPE
from minifloat.infer.ptq.rtn import Transform, WeightQuantizer, round_to_nearest
from minifloat.quant import QuantizedTensor, fake_quantize, quantize
from minifloat.scaling.layout import layout_for


def apply_keeping_dtype(module: torch.nn.Module, fn, recurse: bool, names: tuple[str, ...]) -> None:
    """``torch.nn.Module._apply(fn)`` on `module`, its buffers `names` moved but kept in their dtype."""
    kept = {k: module._buffers[k] for k in names if module._buffers.get(k) is not None}
    torch.nn.Module._apply(module, fn, recurse)
    for k, old in kept.items():
        if module._buffers[k].dtype != old.dtype:
            module._buffers[k] = old.to(module._buffers[k].device)


class QuantizedLinear(torch.nn.Module):
    """``y = x · Wᵀ + b`` with W packed in `config.weight`'s scheme; see the module docstring."""

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None, config: QuantConfig, *,
                 input_amax: torch.Tensor | None = None, backend: str = "auto",
                 input_transform: torch.nn.Module | None = None, kept_index: torch.Tensor | None = None,
                 kept_weight: torch.Tensor | None = None) -> None:  # fmt: skip
        super().__init__()
        # applied to the input before it is quantized (a rotation or smoothing folded into W)
        self.input_transform = input_transform
        config = get_quant_config(config)
        if not isinstance(weight, QuantizedTensor) or weight.dim() != 2:
            raise MinifloatError(
                "QuantizedLinear takes a 2-D QuantizedTensor weight (out_features, in_features)"
            )
        if weight.scheme != config.weight_scheme:
            raise MinifloatError(
                f"the weight is {weight.scheme.name}, config {config.name!r} says {config.weight}"
            )
        self.config = config
        self.out_features, self.in_features = weight.shape
        self.backend = backend
        self._weight_meta = (weight.shape, weight.scheme, weight.orig_dtype)
        # the codes of the N × K real values only: blocks pad N and K up to whole blocks, which the
        # formats do not store (the padding is rebuilt, as zero codes, where the weight is read)
        width = -(-self.in_features * weight.scheme.element_format.bits // 8)
        self.register_buffer("weight_data", weight.data[: self.out_features, :width].clone())
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("weight_tensor_scale", weight.tensor_scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        if config.static and input_amax is None:
            raise MinifloatError(
                f"config {config.name!r} quantizes the input with a calibrated scale: pass input_amax "
                f"(minifloat.infer.calibrate measures it)"
            )
        amax = None
        if config.static:
            # beside the weight: a calibration kept on the CPU serves a model on a GPU
            amax = torch.as_tensor(input_amax, dtype=torch.float32).detach().clone().reshape(()).to(weight.data.device)
            if not (torch.isfinite(amax) and amax > 0):
                raise MinifloatError(f"input_amax must be a finite number > 0, got {float(amax)}")
        self.register_buffer("input_amax", amax)
        if (kept_index is None) != (kept_weight is None):
            raise MinifloatError("kept input channels need both kept_index and kept_weight")
        if kept_index is not None:
            kept_index = torch.as_tensor(kept_index, dtype=torch.int64).detach().clone().reshape(-1)
            if kept_index.numel() and not (0 <= int(kept_index.min()) and int(kept_index.max()) < self.in_features
                                           and len(kept_index.unique()) == kept_index.numel()):  # fmt: skip
                raise MinifloatError(f"kept_index must hold distinct input channels in [0, {self.in_features}), got "
                                     f"{kept_index.tolist()}")  # fmt: skip
            if tuple(kept_weight.shape) != (self.out_features, kept_index.numel()):
                raise MinifloatError(f"kept_weight must be ({self.out_features}, {kept_index.numel()}): the weight's "
                                     f"columns of the kept channels; got {tuple(kept_weight.shape)}")  # fmt: skip
            kept_index = kept_index.to(weight.data.device)
            kept_weight = kept_weight.detach().to(KEPT_DTYPE).clone().to(weight.data.device)
        # input channels kept out of the quantized product, multiplied in BF16 (`minifloat.infer.ptq.outliers`)
        self.register_buffer("kept_index", kept_index)
        self.register_buffer("kept_weight", kept_weight)
        self._compute: QuantizedTensor | None = None  # the compute layout, made once (`prepare`)
        self.prepare()

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, config: str | QuantConfig, *,
                    input_amax: torch.Tensor | float | None = None, backend: str = "auto",
                    weight_quantizer: WeightQuantizer = round_to_nearest, stats: dict | None = None,
                    transform: Transform | None = None) -> QuantizedLinear:  # fmt: skip
        """Quantize `linear`'s weight with `weight_quantizer` (round to nearest by default; it
        reads the layer's calibration `stats`) and keep its bias in its dtype. `transform`, if
        given, first turns the weight into the one to quantize and gives the input transform
        that keeps the product (e.g. a rotation: W·R with x → x·R)."""
        config = get_quant_config(config)
        stats = stats or {}
        with torch.no_grad():
            w, input_transform = linear.weight.detach(), None
            if transform is not None:
                w, input_transform = transform(w, stats)
            weight = weight_quantizer(w, config, stats)
        return cls(weight, linear.bias, config, input_amax=input_amax, backend=backend, input_transform=input_transform)

    # float32 by the formats' definition; the kept channels' weight BF16 (what the layer multiplies)
    _EXACT = ("weight_scale", "weight_tensor_scale", "input_amax", "kept_weight")

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves every part; ``.half()`` / ``.to(bf16)`` converts only the bias:
        rounding a float32 scale would change the values the codes stand for."""
        apply_keeping_dtype(self, fn, recurse, self._EXACT)
        self.prepare()  # the compute layout again, from the moved parts
        return self

    def _packed(self, data: torch.Tensor) -> QuantizedTensor:
        """The weight with codes `data`: the buffers' N × K codes and the zero codes that the
        blocks pad N and K up to, which the checkpoint does not store."""
        shape, scheme, dtype = self._weight_meta
        lay = layout_for(shape, scheme)
        size = (lay.rows_pad, lay.cols_pad * scheme.element_format.bits // 8)
        if tuple(data.shape) != size:
            padded = data.new_zeros(size)
            padded[: data.shape[0], : data.shape[1]] = data
            data = padded
        return QuantizedTensor(data, self.weight_scale, self.weight_tensor_scale, shape, scheme, dtype)

    def checkpoint_weight(self) -> QuantizedTensor:
        """The weight as the buffers hold it, whatever the compute layout is (what `export` writes)."""
        return self._packed(self.weight_data)

    def prepare(self, backend: str | None = None) -> QuantizedLinear:
        """Make the compute layout once: the weight as the GEMMs read it — today the packed weight
        with the block padding in place: the codes' buffer is then a view of the first N rows and
        K columns of the padded codes, so the padding is all the layout adds. The checkpoint layout (the
        buffers, what `state_dict` and `export` read) keeps its shape; moving the module makes the
        layout again. `backend` also sets the GEMM backend (``"auto"``, ``"emulated"``,
        ``"native"`` or a weight-only kernel's name)."""
        if backend is not None:
            self.backend = backend
        n, width = self.weight_data.shape
        self._compute = self._packed(self.weight_data)
        if self._compute.data.shape != self.weight_data.shape:  # padded: the buffer becomes a view of the padded codes
            self._buffers["weight_data"] = self._compute.data[:n, :width]
        self._prepacked = prepack(self._compute, self.backend)  # a decode step's GEMV, planned once
        return self

    def beyond_weight(self) -> str | None:
        """What the layer computes besides its packed weight's product, which no checkpoint reader
        applies (an input transform, kept input channels), or None."""
        if self.input_transform is not None:
            return f"transforms its input before the GEMM ({type(self.input_transform).__name__})"
        if self.kept_index is not None:
            return f"keeps {self.kept_index.numel()} input channels out of the quantized product (in BF16)"
        return None

    def compute_extra_nbytes(self) -> int:
        """Bytes the compute layout holds beyond the checkpoint buffers (the block padding)."""
        return self.weight_data.untyped_storage().nbytes() - self.weight_data.nbytes

    @property
    def weight(self) -> QuantizedTensor:
        """The packed weight, as the GEMMs read it (the compute layout: made from the buffers, and
        again when the module moves)."""
        return self._compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise MinifloatError(f"input has {x.shape[-1]} features, the layer takes {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(math.prod(lead), self.in_features)
        if self.input_transform is not None:
            x2 = self.input_transform(x2)
        kept = None
        if self.kept_index is not None:
            kept = x2.index_select(1, self.kept_index)
            x2 = x2.index_fill(1, self.kept_index, 0.0)  # out of the quantized product and its scales
        c = self.config
        if c.activation is None:  # weight-only: the high-precision input times the exact weight
            y = self._prepacked(x2)
        else:
            qx = quantize(x2, c.activation_scheme, amax=self.input_amax if c.static else None)
            if self.backend == "auto" and self._prepacked.decodes(x2):
                # a decode step: the few quantized rows dequantized (exact), the weight read packed by
                # the decode kernels — the emulated product up to summation order
                y = self._prepacked(qx.dequantize(torch.float32))
            else:
                y = scaled_mm(qx, self.weight, out_dtype=torch.float32, backend=self.backend)
        if kept is not None:  # BF16 operands, FP32 products and sum
            y = y + kept.to(KEPT_DTYPE).float() @ self.kept_weight.float().T
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def differentiable(self) -> DifferentiableLinear:
        """This layer as a training graph sees it (`DifferentiableLinear`): the same product, a
        gradient for the input."""
        return DifferentiableLinear(self)

    def packed_nbytes(self) -> int:
        """Bytes the layer stores for its weight and input scale: codes and scales, the bias not counted."""
        return sum(b.nbytes for n, b in self.named_buffers() if n != "bias" and not n.startswith("input_transform."))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, config={self.config.name}"


class DifferentiableLinear(torch.nn.Module):
    """A `QuantizedLinear`'s product with a gradient for its input: the weight dequantized once
    (frozen: float32, the exact values the packed codes stand for), the input transformed and
    rounded as the layer's config says (`fake_quantize`: the same values `QuantizedLinear.forward`
    multiplies, the gradient straight through), FP32 products. What tunes the layers before a
    quantized one (`minifloat.infer.ptq.norm_tuning`) sees; it holds a full-precision weight, so it
    lives only while they are tuned."""

    def __init__(self, layer: QuantizedLinear) -> None:
        super().__init__()
        self.config, self.input_transform = layer.config, layer.input_transform
        self.in_features, self.out_features = layer.in_features, layer.out_features
        w = layer.weight.dequantize(torch.float32)[: layer.out_features, : layer.in_features].clone()
        self.kept_index = layer.kept_index
        if self.kept_index is not None:  # the kept columns' BF16 weights in place of the quantized zeros
            w[:, self.kept_index] = layer.kept_weight.float()
        self.register_buffer("weight", w.contiguous())
        self.register_buffer("bias", None if layer.bias is None else layer.bias.float())
        self.register_buffer("input_amax", layer.input_amax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(math.prod(lead), self.in_features)
        if self.input_transform is not None:
            x2 = self.input_transform(x2)
        c = self.config
        x2 = x2.float()
        if self.kept_index is not None:
            kept = x2.index_select(1, self.kept_index).to(KEPT_DTYPE).float()
            x2 = x2.index_fill(1, self.kept_index, 0.0)
        if c.activation is not None:
            x2 = fake_quantize(x2, c.activation_scheme, amax=self.input_amax if c.static else None)
        if self.kept_index is not None:
            x2 = x2.index_copy(1, self.kept_index, kept)
        y = torch.nn.functional.linear(x2, self.weight, self.bias)
        return y.to(x.dtype).reshape(*lead, self.out_features)
