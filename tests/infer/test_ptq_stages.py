"""PTQ in stages: observers against float64 statistics computed here, round to nearest against
ml_dtypes' grids, a weight quantizer handed the statistics it asks for, and a transform
whose input transform keeps the layer's product."""

import numpy as np
import pytest
import torch

import minifloat
from minifloat.infer import QuantizedLinear, get_quant_config, quantize_model
from minifloat.infer.ptq.observers import observe
from minifloat.infer.ptq.rtn import round_to_nearest
from tests.infer.test_gptq import ML_DTYPES, assert_on_grid, block_decode_scales


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))


def test_observers_equal_float64_statistics():
    model = _model()
    batches = [torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    stats = observe(model, batches, ("amax", "channel_amax", "hessian"))
    x = torch.cat([b.reshape(-1, 64) for b in batches]).double()
    assert float(stats["0"]["amax"]) == float(x.abs().max())
    assert torch.equal(stats["0"]["channel_amax"].double(), x.abs().amax(0))
    assert torch.allclose(stats["0"]["hessian"], x.t() @ x / x.shape[0], rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        h = torch.nn.functional.gelu(model[0](x.float())).double()
    assert torch.allclose(stats["2"]["hessian"], h.t() @ h / h.shape[0], rtol=1e-6, atol=1e-9)
    with pytest.raises(minifloat.MinifloatError, match="unknown observer 'mse'"):
        observe(model, batches, ("mse",))
    with pytest.raises(minifloat.MinifloatError, match="input of 0 holds a NaN"):
        observe(model, [torch.full((1, 64), float("nan"))], ("hessian",))


@pytest.mark.parametrize("name", ["fp8-block", "mxfp4-weight-only", "nvfp4"])
def test_round_to_nearest_rounds_each_element_to_a_nearest_value_of_its_block_grid(name):
    """Against ml_dtypes: every element is a value of the element format times its block's decode
    scale (both decoded by ml_dtypes), and no other value of that grid is nearer to the weight."""
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(4)) * 3
    q = round_to_nearest(w, get_quant_config(name), {})
    assert_on_grid(q)
    d = block_decode_scales(q).astype(np.float64)
    fmt = ML_DTYPES[q.scheme.element]
    codes = np.arange(256, dtype=np.uint8).view(fmt).astype(np.float64)
    grid = np.unique(codes[np.isfinite(codes)])  # every finite value of the element format
    x = w.numpy().astype(np.float64) / d  # the weight on its block's grid
    v = q.dequantize().numpy().astype(np.float64) / d  # a grid value up to float32 rounding (assert_on_grid)
    e = grid[np.abs(v[..., None] - grid).argmin(-1)]
    i = np.clip(np.searchsorted(grid, x), 1, len(grid) - 1)
    nearest = np.minimum(np.abs(x - grid[i - 1]), np.abs(x - grid[i]))  # saturating: beyond the ends, the end
    assert np.all(np.abs(x - e) <= nearest * (1 + 1e-6) + 1e-9)
    if name == "fp8-block":  # the scheme's own rule: each 128×128 block's amax maps to E4M3's 448
        amax = w.abs().reshape(1, 128, 2, 128).amax(dim=(1, 3)).reshape(1, 2)
        assert torch.equal(q.scale, (amax / 448).float())


def test_a_weight_quantizer_gets_the_statistics_it_needs():
    model = _model(1)
    batches = [torch.randn(4, 64) for _ in range(2)]
    seen = {}

    def quantizer(w, config, stats):
        seen[w.shape] = stats
        return round_to_nearest(w, config, stats)

    quantizer.needs = ("hessian",)
    with pytest.raises(minifloat.MinifloatError, match=r"the PTQ stages need \['hessian'\]: pass calibration="):
        quantize_model(model, "nvfp4-weight-only", ignore=(), weight_quantizer=quantizer)
    ref = _model(1)
    quantize_model(ref, "nvfp4-weight-only", ignore=())
    quantize_model(model, "nvfp4", calibration=batches, ignore=(), weight_quantizer=quantizer)
    x = torch.cat(batches).double()
    assert torch.allclose(seen[(128, 64)]["hessian"], x.t() @ x / 8) and set(seen[(128, 64)]) == {"hessian", "amax"}
    assert float(model[0].input_amax) == float(x.abs().max())
    assert torch.equal(model[2].weight_data, ref[2].weight_data)  # the quantizer rounded to nearest: identical codes


def test_a_rotation_transform_keeps_the_product_and_is_not_exported(tmp_path):
    lin = torch.nn.Linear(64, 32)
    r = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))[0].float()  # an orthogonal matrix

    class Rotate(torch.nn.Module):
        def forward(self, x):
            return x @ r

    def rotation(w, stats):
        return w @ r, Rotate()

    q = QuantizedLinear.from_linear(lin, "fp8-weight-only", transform=rotation)
    x = torch.randn(6, 64)
    exact = (x.double() @ r.double()) @ q.weight.dequantize().double().t() + lin.bias.double()
    assert torch.allclose(q(x).double(), exact, rtol=1e-5, atol=1e-5)  # the input goes through the transform
    # the weight quantized is the rotated one (W·R within FP8's error), not W
    w, rotated = q.weight.dequantize().double(), (lin.weight @ r).detach().double()
    assert (w - rotated).norm() / rotated.norm() < 0.05 < (w - lin.weight.detach().double()).norm() / rotated.norm()
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    llama = transformers.LlamaForCausalLM(cfg).eval()

    def any_rotation(w, stats):
        k = w.shape[1]
        rk = torch.linalg.qr(torch.randn(k, k, dtype=torch.float64))[0].float()
        return w @ rk, type("R", (torch.nn.Module,), {"forward": lambda self, x: x @ rk})()

    quantize_model(llama, "fp8-weight-only", transform=any_rotation)
    with pytest.raises(minifloat.MinifloatError, match="transforms its input before the GEMM"):
        minifloat.infer.export(llama, tmp_path / "out")
