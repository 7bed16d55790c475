"""LoRA adapters that start as the best rank-r correction of a packed base's quantization error.

With PEFT's initialisation (B = 0) a LoRA run on a packed base starts from the quantized model
and spends its first steps relearning what quantization took away. Here the adapters start
where that error is smallest in the metric of the layer's own inputs (CLoQ, Deng et al. 2025,
arXiv 2501.18475; LoftQ's idea with calibration activations): for a Linear with original weight
W, packed weight Q and calibration inputs X (rows), the update ``ΔW = (α / r) · B · A`` solves

    min over rank-r ΔW of  ‖X (W − Q − ΔW)ᵀ‖²_F = tr((E − ΔW) H (E − ΔW)ᵀ),   E = W − Q, H = XᵀX,

in closed form: with ``H + λI = L Lᵀ`` (Cholesky; λ GPTQ's damping), the best rank-r
approximation ``U_r S_r V_rᵀ`` of ``E L`` (Eckart–Young) gives ``ΔW = U_r S_r V_rᵀ L⁻¹``, split
evenly between ``B = U_r S_r^½`` and ``A = S_r^½ V_rᵀ L⁻¹`` (each divided by √(α / r)).

The layers are initialised block by block (`minifloat.infer.ptq.sequential`): each layer's H is
measured on the inputs the blocks before it produce with their adapters already initialised, as
GPTQ measures its Hessians.

An adapter initialised this way belongs to the packed base it corrects: loaded onto the original
weights it would correct an error they do not have. ``--merge`` writes the model it makes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from minifloat.errors import MinifloatError
from minifloat.finetune.lora import FrozenPacked, LoRALinear, effective_weight
from minifloat.infer.ptq.sequential import run_sequential

DAMP = 0.01  # λ as a fraction of H's mean diagonal (GPTQ's default)


def residual_factors(error: torch.Tensor, gram: torch.Tensor, rank: int, damp: float = DAMP) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(B, A, captured): the rank-`rank` factors with ``B · A`` minimizing
    ``tr((error − B·A) (gram + λI) (error − B·A)ᵀ)`` (module docstring), in float64, and the
    fraction of that weighted error they remove. `error` is (out, in), `gram` (in, in)."""
    if error.ndim != 2 or gram.shape != (error.shape[1], error.shape[1]):
        raise MinifloatError(f"residual_factors: error {tuple(error.shape)} and Gram {tuple(gram.shape)} do not fit")
    h = gram.double().clone()
    diag = h.diagonal()
    lam = damp * float(diag.mean()) if float(diag.mean()) > 0 else 1.0
    diag[diag <= 0] = 1.0  # an input never seen: any value of that column is as good; keep it well posed
    for attempt in range(6):  # GPTQ's answer to a Gram that rounding left indefinite: more damping
        chol, info = torch.linalg.cholesky_ex(h + lam * (10**attempt) * torch.eye(h.shape[0], dtype=h.dtype))
        if int(info) == 0:
            break
    else:
        raise MinifloatError("residual_factors: the calibration Gram is not positive definite even damped ×10⁵")
    m = error.double() @ chol
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    b = u[:, :r] * root
    # A = S½ V_rᵀ L⁻¹ = (L⁻ᵀ V_r S½)ᵀ: one triangular solve, no inverse formed
    a = torch.linalg.solve_triangular(chol.mT, vh[:r].mT, upper=True).mT * root[:, None]
    total = float((s**2).sum())
    captured = float((s[:r] ** 2).sum()) / total if total > 0 else 1.0
    return b, a, captured


def init_from_residual(model: torch.nn.Module, adapters: Mapping[str, LoRALinear], originals: Mapping[str, torch.Tensor],
                       batches: Iterable, damp: float = DAMP) -> dict[str, float]:  # fmt: skip
    """Set every adapter of `adapters` (name → layer of `model`, on a packed base) to the
    calibrated correction of its base's error against `originals` (name → the weight before
    packing), block by block on `batches` (token-id tensors). Returns, per layer, the fraction of
    its input-weighted quantization error the adapters remove; a layer calibration never reached
    keeps PEFT's initialisation (and is absent)."""
    batches = list(batches)
    captured: dict[str, float] = {}
    for name, layer in adapters.items():
        if not isinstance(layer.base_layer, FrozenPacked):
            raise MinifloatError(f"{name}: its base is not packed; a residual initialisation corrects a packed base's error")
        if name not in originals:
            raise MinifloatError(f"{name}: its weight before packing was not kept")

    def initialise(name: str, layer: LoRALinear, stats: dict, transform, group) -> LoRALinear:
        error = originals[name].double() - effective_weight(layer.base_layer.layer).double()
        b, a, captured[name] = residual_factors(error, stats["hessian"], layer.rank, damp)
        root, r = layer.scaling**0.5, b.shape[1]  # r < the rank only for a layer narrower than it
        with torch.no_grad():
            layer.lora_B.weight.zero_()[:, :r] = (b / root).to(layer.lora_B.weight.dtype)
            layer.lora_A.weight[:r] = (a / root).to(layer.lora_A.weight.dtype)
        return layer

    run_sequential(model, batches, dict(adapters), kinds=("hessian",), prepare=lambda group: {}, quantize=initialise,
                   swap=lambda name, new: None)  # fmt: skip
    return captured
