"""AMD's FP8 (e4m3fnuz / e5m2fnuz) by name through scaled quantization, PTQ and training recipes,
against ml_dtypes."""

import ml_dtypes
import numpy as np
import torch

import minifloat
from minifloat.infer.ptq.config import get_quant_config
from minifloat.infer.quantize import quantize_model
from minifloat.recipes import get_recipe


def _oracle_rowwise(w: torch.Tensor, dtype) -> np.ndarray:
    """Per row: scale = amax / the format's max (ml_dtypes' finfo), the values rounded by ml_dtypes."""
    scale = w.abs().amax(1, keepdim=True).numpy().astype(np.float32) / np.float32(ml_dtypes.finfo(dtype).max)
    return (w.numpy() / scale).astype(dtype).astype(np.float32) * scale


def test_rowwise_fnuz_matches_ml_dtypes():
    w = torch.randn(48, 96) * torch.logspace(-3, 2, 96)
    q = minifloat.quantize(w, "fp8_rowwise_fnuz")
    np.testing.assert_allclose(minifloat.dequantize(q).numpy(), _oracle_rowwise(w, ml_dtypes.float8_e4m3fnuz), rtol=1e-6, atol=0)
    assert bool(torch.isnan(minifloat.dequantize(minifloat.quantize(torch.tensor([[1.0, float("nan")]]), "fp8_fnuz"))).any())


def test_fp8_dynamic_fnuz_ptq_weights_are_ml_dtypes_codes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    x = torch.randn(4, 64)
    summary = quantize_model(model, get_quant_config("fp8-dynamic-fnuz"), ignore=())
    assert len(summary.quantized) == 2
    for layer, w in zip((model[0], model[2]), weights, strict=True):
        np.testing.assert_allclose(minifloat.dequantize(layer.weight).numpy(), _oracle_rowwise(w, ml_dtypes.float8_e4m3fnuz), rtol=1e-6)
    assert torch.isfinite(model(x)).all()


def test_fp8_fnuz_training_recipe_by_name():
    recipe = get_recipe("fp8-fnuz")
    assert [recipe.scheme(r).element for r in ("input", "weight", "grad_output")] == ["e4m3fnuz", "e4m3fnuz", "e5m2fnuz"]
    torch.manual_seed(0)
    model = minifloat.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)), "fp8-current-fnuz")
    x = torch.randn(16, 32)
    model(x).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_fnuz_layers_stay_high_precision_in_a_compressed_tensors_export():
    """No compressed-tensors format holds E4M3FNUZ (its codes' top value is E4M3FN's NaN), so an
    export keeps such layers in high precision and says why."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    summary = quantize_model(model, get_quant_config("fp8-dynamic-fnuz"), ignore=(), export_format="compressed-tensors")
    assert not summary.quantized and "compressed-tensors has no format" in summary.skipped[0].reason
