"""`minifloat.nn.Linear`: a drop-in `torch.nn.Linear` whose three GEMMs run in low precision.

The weight stays an ordinary Parameter in the model's dtype — the master copy — so
optimizers, ``state_dict`` and checkpoints are unchanged. Each GEMM quantizes its operands
per the recipe along its own reduction dimension (see `minifloat.recipes`), accumulates in
FP32 and adds the bias in high precision:

- ``output = input · weightᵀ``          (input and weight along K)
- ``grad_input = grad_output · weight``  (grad_output and weight along N)
- ``grad_weight = grad_outputᵀ · input`` (grad_output and input along the tokens M)

Per-tensor scales give the same values in either orientation, so those recipes quantize each
operand once; block recipes quantize a row-wise and a column-wise copy from high precision, as
Transformer Engine does, except for square weight blocks (128×128, NVFP4's 16×16), which serve
both. For the weight gradient the forward keeps only the packed column-wise input (1 byte or
less per element), not the high-precision activation.

Example:
    >>> layer = Linear(64, 32, recipe="mxfp8")
    >>> y = layer(torch.randn(2, 5, 64))
    >>> y.shape, layer.weight.dtype
    (torch.Size([2, 5, 32]), torch.float32)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

import minifloat.nn.delayed as delayed
from minifloat import kernels
from minifloat.errors import DTypeError, MinifloatError
from minifloat.gemm.api import scaled_mm
from minifloat.gemm.emulated import autocast_dtype, without_autocast
from minifloat.gemm.support import choose_backend
from minifloat.nn.all_gather import GatheredWeight
from minifloat.nn.autocast import current as _autocast_current
from minifloat.quant.api import QUANTIZE_DTYPES, quantize
from minifloat.quant.hadamard import rht
from minifloat.recipes import RECIPES, ROLES, Recipe, get_recipe


class _Plan:
    """What one forward call quantizes with: the recipe, the backend, the module's state."""

    __slots__ = ("recipe", "backend", "layer", "has_state", "records", "monitor")

    def __init__(self, layer: Linear, recipe: Recipe, device: torch.device) -> None:
        self.recipe = recipe
        self.layer = layer
        # Delayed scales apply only under the module's own recipe; amaxes are recorded in training.
        self.has_state = recipe.delayed and recipe is layer.recipe
        self.records = self.has_state and layer.training and torch.is_grad_enabled()
        self.backend = choose_backend([recipe.scheme(r) for r in ROLES], device, layer.backend)
        self.monitor = layer._monitor

    @property
    def per_tensor(self) -> bool:
        return all(self.recipe.scheme(r).granularity == "tensor" for r in ROLES)

    @property
    def rht(self) -> bool:  # NVFP4's, or MXFP4's when asked for
        return bool(getattr(self.recipe, "rht", False))

    @property
    def forward_rht(self) -> bool:  # MX's `forward_rht`: the forward GEMM's operands along K too
        return bool(getattr(self.recipe, "forward_rht", False))

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """The random Hadamard transform of a GEMM operand along its last dim (`rht`, `forward_rht`)."""
        return rht(x, self.recipe.rht_seed, getattr(self.recipe, "rht_size", 16))

    def quantize(self, role: str, x: torch.Tensor, *, record: bool = True):
        """Quantize `x` (2-D, along its last dim) as operand `role`."""
        scheme = self.recipe.scheme(role)
        scale = None
        if self.has_state:
            scale = delayed.current_scale(self.layer, role)
            if self.records and record:
                delayed.record(self.layer, role, kernels.amax(x, ignore_nan=True))
        q = quantize(x, scheme, scale=scale)
        if self.monitor is not None and record:
            self.monitor.observe(self.layer, role, x, q)
        return q


def _outlier_split(x: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward GEMM's outlier channels (`Recipe.outlier_channels`): the `k` input channels of
    largest amax in this call. Returns x (M, K) and W (N, K) with those channels zeroed — what the
    recipe quantizes, so they set no block's scale — and their product from BF16-rounded operands
    with FP32 accumulation, (M, N): x Wᵀ = x₀ W₀ᵀ + x_k W_kᵀ exactly. A NaN in x makes its
    channel's amax NaN, which `topk` ranks first: it reaches the output through the BF16 product."""
    idx = x.abs().amax(0).topk(k).indices
    high = x[:, idx].bfloat16().float() @ weight[:, idx].bfloat16().float().t()
    return x.index_fill(1, idx, 0), weight.index_fill(1, idx, 0), high


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: _Plan):
        # Under torch.autocast the output takes its dtype, as torch.nn.Linear's (and TE's);
        # the GEMM itself stays the exact low-precision one.
        out_dtype = autocast_dtype(x.device) or x.dtype
        with without_autocast(x.device):
            return _LinearFunction._forward(ctx, x, weight, bias, plan, out_dtype)

    @staticmethod
    def _forward(ctx, x, weight, bias, plan: _Plan, out_dtype: torch.dtype):
        in_features = weight.shape[1]
        x2 = x.reshape(-1, in_features)
        # (a weight FSDP2 gathers as codes never gets here with k > 0: `gather_quantized` refuses it)
        k = min(plan.recipe.outlier_channels, in_features) if x2.shape[0] else 0
        xf, wf, high = (x2, weight, None) if not k else _outlier_split(x2, weight, k)
        if plan.forward_rht:  # both along K by the same orthogonal T: (x T)(W T)ᵀ = x Wᵀ
            xq = plan.quantize("input", plan.transform(xf))
            wq = plan.quantize("weight", plan.transform(wf))
        else:
            xq = plan.quantize("input", xf)
            # FSDP2 gathered it as codes and scales (`minifloat.nn.all_gather`): those are the packed weight
            wq = weight.quantized() if isinstance(weight, GatheredWeight) else plan.quantize("weight", wf)
        out = scaled_mm(xq, wq, backend=plan.backend)
        if high is not None:
            out += high
        if bias is not None:
            out += bias.float()
        # _unsafe_view: the result owns its storage, so it is not reported as a view (FSDP2
        # warns about views returned from modules, as in-place ops on them skip its hooks).
        out = torch.ops.aten._unsafe_view(out.to(out_dtype), (*x.shape[:-1], weight.shape[0]))
        if plan.monitor is not None:
            plan.monitor.check(plan.layer, "output", out)

        ctx.plan, ctx.x_shape, ctx.x_dtype, ctx.has_bias = plan, x.shape, x.dtype, bias is not None
        # The weight-gradient GEMM needs the input quantized along the tokens: keep it packed.
        if not ctx.needs_input_grad[1]:
            ctx.xt = None
        elif plan.per_tensor:  # the whole input (the forward's held the outlier channels out)
            ctx.xt = plan.quantize("input", x2, record=False) if k else xq
        else:
            xt = kernels.contiguous(x2.t())
            if plan.rht:
                xt = plan.transform(xt)
            ctx.xt = plan.quantize("input", xt, record=False)
        # The input-gradient GEMM needs the weight along out_features: reuse it when the
        # quantization does not depend on the orientation, else requantize in backward.
        # (not when outlier channels were taken out of it: the backward quantizes the whole weight)
        ctx.wq = wq if (plan.per_tensor or plan.recipe.weight_2d) and not plan.forward_rht and not k else None
        ctx.save_for_backward(weight)
        return out

    @staticmethod
    @once_differentiable  # a second derivative through it (create_graph=True) is a clear error
    def backward(ctx, grad_out):
        with without_autocast(grad_out.device):
            return _LinearFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        plan: _Plan = ctx.plan
        (weight,) = ctx.saved_tensors
        out_features = weight.shape[0]
        g2 = grad_out.reshape(-1, out_features)
        gq = plan.quantize("grad_output", g2)
        grad_x = grad_w = grad_b = None

        if ctx.needs_input_grad[0]:
            if ctx.wq is not None:
                grad_x = scaled_mm(gq, ctx.wq, b_transposed=True, backend=plan.backend)
            else:
                wt = plan.quantize("weight", kernels.contiguous(weight.t()), record=False)
                grad_x = scaled_mm(gq, wt, backend=plan.backend)
            grad_x = torch.ops.aten._unsafe_view(grad_x.to(ctx.x_dtype), ctx.x_shape)
            if plan.monitor is not None:
                plan.monitor.check(plan.layer, "grad_input", grad_x)
        if ctx.needs_input_grad[1]:
            if plan.per_tensor:
                grad_w = scaled_mm(gq, ctx.xt, a_transposed=True, b_transposed=True, backend=plan.backend)
            else:
                gt = kernels.contiguous(g2.t())
                if plan.rht:
                    gt = plan.transform(gt)
                gtq = plan.quantize("grad_output", gt, record=False)
                grad_w = scaled_mm(gtq, ctx.xt, backend=plan.backend)
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.float().sum(0).to(weight.dtype)
        ctx.xt = ctx.wq = None
        return grad_x, grad_w, grad_b, None


class Linear(torch.nn.Linear):
    """`torch.nn.Linear` with its GEMMs quantized by `recipe` (a name or a `Recipe`).

    Args:
        recipe: ``"fp8"`` (delayed scaling), ``"fp8-current"``, ``"fp8-block"``, ``"mxfp8"``,
            ``"mxfp6"``, ``"mxfp4"``, ``"nvfp4"``, or a `Recipe`.
        backend: ``"auto"`` (native GEMMs where the device has them), ``"emulated"`` or
            ``"native"`` (see `minifloat.gemm`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: str | Recipe = "fp8",
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = get_recipe(recipe)
        choose_backend([], "cpu", backend)  # validates the name
        self.backend = backend
        self._monitor = None
        if _OPAQUE is None:
            _opaque()
        if self.recipe.delayed:
            delayed.init_buffers(self, self.recipe)
            delayed.register(self)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: str | Recipe, *, backend: str = "auto") -> Linear:
        """A minifloat Linear sharing `linear`'s Parameters (tied weights stay tied)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe, backend=backend, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        if new.recipe.delayed:
            delayed.init_buffers(new, new.recipe, device=linear.weight.device)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_OPAQUE or _opaque())(self, x)  # _opaque(): a Linear unpickled in a fresh process

    def extra_repr(self) -> str:
        k = self.recipe.outlier_channels
        plain = self.recipe.replace(outlier_channels=0) if k else self.recipe
        name = next((n for n, v in RECIPES.items() if v == plain), type(self.recipe).__name__)
        return f"{super().extra_repr()}, recipe={name}" + (f", outlier_channels={k}" if k else "")

    def _apply(self, fn, recurse=True):
        # The delayed-scaling state stays float32 whatever dtype the model is cast to (as TE's
        # FP8 metadata does): in bf16 the amaxes would lose bits, and in fp16 a grad_output
        # scale (57344 / amax) overflows to inf. Devices still move.
        kept = {n: b for n in delayed.FP32_BUFFERS if (b := self._buffers.get(n)) is not None}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Checkpoints are precision-agnostic: a run saved under another recipe has no
        # (or other) delayed-scaling buffers; keep this module's fresh state then.
        keys = ("amax_history", "scale", "amax_steps")
        mine = hasattr(self, "amax_history")
        theirs = [k for k in keys if prefix + k in state_dict]
        if mine and theirs and state_dict[prefix + "amax_history"].shape != self.amax_history.shape:
            theirs = []  # another history length: start a fresh history
        if not mine or not theirs:
            state_dict = {k: v for k, v in state_dict.items() if k not in {prefix + k2 for k2 in keys}}
        n_missing = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if mine:
            delayed.forget_steps(self)  # amax_steps may have changed
        if mine and not theirs:
            missing_keys[n_missing:] = [k for k in missing_keys[n_missing:] if k[len(prefix):] not in keys]


def _forward(self: Linear, x: torch.Tensor) -> torch.Tensor:
    """`Linear.forward`: checks, the autocast state, then the three quantized GEMMs."""
    layer = f"{type(self).__name__}(in_features={self.in_features}, out_features={self.out_features})"
    if x.dim() == 0 or x.shape[-1] != self.in_features:
        raise MinifloatError(
            f"{layer} got an input of shape {tuple(x.shape)}; its last dimension must be in_features={self.in_features}"
        )
    state = _autocast_current()
    if not state.enabled:
        return F.linear(x, self.weight, self.bias)
    for what, t in (("input", x), ("weight", self.weight)):
        if t.dtype not in QUANTIZE_DTYPES:
            raise DTypeError(
                f"{layer} quantizes float32, bfloat16 or float16 tensors, got a {t.dtype} {what}; run the model in "
                f"float32 (model.float()), or keep this layer in high precision "
                f"(convert(..., filter=...), or minifloat.autocast(enabled=False))"
            )
    plan = _Plan(self, state.recipe or self.recipe, x.device)
    return _LinearFunction.apply(x, self.weight, self.bias, plan)


_OPAQUE = None


def _opaque():
    """`_forward` opaque to torch.compile: the kernels are compiled C called through ctypes,
    and the delayed-scaling state is updated in place; the rest of a compiled model still
    fuses. A traced forward would be compiled once per layer shape (past dynamo's limit of 8
    in a model with more). Made by the first Linear's __init__, outside any compiled region,
    not on import: torch.compiler.disable imports torch._dynamo, which takes seconds."""
    global _OPAQUE
    _OPAQUE = torch.compiler.disable(_forward)
    return _OPAQUE
