"""Post-training quantization: QuantizedLinear against a float64 product of the dequantized
operands, bytes at rest against the formats' formulas, calibration, and the skip reasons."""

import copy
import dataclasses
import math

import pytest
import torch

import minifloat
from minifloat.infer import QUANT_CONFIGS, QuantizedLinear, calibrate, get_quant_config, quantize_model
from minifloat.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

CONFIGS = list(QUANT_CONFIGS)


def tiny_llama(hidden=128, inter=256, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=128)).eval()


def heavy_tailed(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g))


def expected(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """float64 product of the operands the layer multiplies: its input as the activation scheme
    quantizes it (or as it is, weight-only) and its weight, dequantized; plus the bias."""
    c = layer.config
    x2 = x.reshape(-1, x.shape[-1])
    if c.activation is not None:
        x2 = minifloat.quantize(x2, c.activation_scheme, amax=layer.input_amax if c.static else None).dequantize()
    y = x2.double() @ layer.weight.dequantize().double().t()
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.reshape(*x.shape[:-1], -1)


def fp32_bound(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """FP32 accumulation error bound of each output: K · 2^-23 · Σ|a||b| (plus the bias' rounding)."""
    x2 = x.reshape(-1, x.shape[-1]).abs().double() * 2  # a quantized |x| is at most ~2× |x| (saturation aside)
    s = x2 @ layer.weight.dequantize().abs().double().t()
    return (layer.in_features * 2.0**-23 * s + 1e-30).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("name", CONFIGS)
def test_quantized_linear_equals_float64_product_of_dequantized_operands(name):
    lin = torch.nn.Linear(256, 96)
    x = heavy_tailed(3, 5, 256, seed=1)
    layer = QuantizedLinear.from_linear(lin, name, input_amax=x.abs().max() if get_quant_config(name).static else None)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 96)
    err = (y.double() - expected(layer, x)).abs()
    assert (err <= fp32_bound(layer, x) + 2.0**-24 * expected(layer, x).abs()).all(), name
    # the high-precision weight is gone: only packed parts remain
    assert not any(p.dtype == torch.float32 and p.shape == (96, 256) for p in layer.buffers())
    assert list(layer.parameters()) == []


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_quantized_models_forward_matches_float64_reference_per_layer(name, which):
    model = tiny_gpt() if which == "gpt" else tiny_llama()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    summary = quantize_model(model, name, calibration=[ids])
    assert len(summary.quantized) == (8 if which == "gpt" else 14)
    seen = []

    def check(module, args, out):
        x = args[0]
        err = (out.double() - expected(module, x)).abs()
        assert (err <= fp32_bound(module, x) + 2.0**-24 * expected(module, x).abs()).all()
        seen.append(module)

    handles = [m.register_forward_hook(check) for m in model.modules() if isinstance(m, QuantizedLinear)]
    with torch.no_grad():
        out = model(ids)
    for h in handles:
        h.remove()
    logits = out if which == "gpt" else out.logits
    assert len(seen) == len(summary.quantized) and torch.isfinite(logits).all()


def _scale_bytes(name: str, n: int, k: int) -> int:
    """The weight's scale bytes by each format's definition."""
    return {
        "fp8-weight-only": 4 * n, "fp8-dynamic": 4 * n, "fp8-static": 4,
        "fp8-weight-only-fnuz": 4 * n, "fp8-dynamic-fnuz": 4 * n,
        "fp8-block": 4 * math.ceil(n / 128) * math.ceil(k / 128),
        "fp8-block-weight-only": 4 * math.ceil(n / 128) * math.ceil(k / 128),
        "mxfp8-weight-only": n * k // 32, "mxfp6-weight-only": n * k // 32,
        "mxfp8": n * k // 32, "mxfp6": n * k // 32, "mxfp4": n * k // 32, "mxfp4-weight-only": n * k // 32,
        "nvfp4-weight-only": n * k // 16 + 4, "nvfp4": n * k // 16 + 4,
        "nvfp4-4over6-weight-only": n * k // 16 + 4, "nvfp4-4over6": n * k // 16 + 4,
    }[name]  # fmt: skip


@pytest.mark.parametrize("name", CONFIGS)
def test_bytes_at_rest_equal_the_formats_formula(name):
    model = tiny_llama(hidden=192, inter=320)  # partial 128×128 blocks: 192 = 128 + 64, 320 = 2·128 + 64
    ids = torch.randint(0, 256, (1, 16))
    before = minifloat.infer.model_bytes(model)
    summary = quantize_model(model, name, calibration=[ids])
    bits = get_quant_config(name).weight_scheme.element_format.bits
    for layer in summary.quantized:
        n, k = layer.shape
        want = n * k * bits // 8 + _scale_bytes(name, n, k) + (4 if get_quant_config(name).static else 0)
        assert layer.bytes_after == want, layer.name
        assert layer.bytes_before == n * k * 4
    saved = sum(layer.bytes_before - layer.bytes_after for layer in summary.quantized)
    # 128×128 blocks compute on N and K rounded up to whole blocks: the process holds those zero codes too
    square = get_quant_config(name).weight_scheme.block == (128, 128)
    padding = sum(math.ceil(n / 128) * 128 * math.ceil(k / 128) * 128 - n * k for n, k in (s.shape for s in summary.quantized))
    padding = padding if square else 0
    assert summary.model_bytes_before == before
    assert summary.model_bytes_after == minifloat.infer.model_bytes(model) == before - saved + padding


def test_calibration_max_and_percentile():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    batches = [heavy_tailed(8, 32, seed=s) for s in range(3)]
    cal = calibrate(model, batches)
    assert float(cal["0"]) == max(float(b.abs().max()) for b in batches)
    with torch.no_grad():
        hidden = [torch.relu(model[0](b)) for b in batches]
    assert float(cal["2"]) == max(float(h.abs().max()) for h in hidden)
    pct = calibrate(model, batches, method="percentile", percentile=90.0)
    want = max(float(torch.quantile(b.abs().flatten(), 0.9)) for b in batches)
    assert float(pct["0"]) == pytest.approx(want, rel=1e-6) and float(pct["0"]) < float(cal["0"])
    with pytest.raises(minifloat.MinifloatError, match="unknown calibration method 'mean'"):
        calibrate(model, batches, method="mean")
    with pytest.raises(minifloat.MinifloatError, match="got no batches"):
        calibrate(model, [])


@pytest.mark.parametrize("name", ["fp8-static", "nvfp4"])
def test_static_configs_need_calibration_and_use_it(name):
    model = tiny_llama()
    with pytest.raises(minifloat.MinifloatError, match=f"config '{name}' quantizes inputs with calibrated scales"):
        quantize_model(copy.deepcopy(model), name)
    ids = torch.randint(0, 256, (2, 16))
    cal = calibrate(model, [ids])
    quantize_model(model, name, calibration=cal)
    layer = model.model.layers[0].mlp.up_proj
    assert float(layer.input_amax) == float(cal["model.layers.0.mlp.up_proj"])


def test_layers_that_do_not_fit_stay_in_high_precision_with_the_reason():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fits = torch.nn.Linear(64, 64)
            self.odd = torch.nn.Linear(40, 64)  # K = 40: a partial last block of 8 of MX's 32
            self.small = torch.nn.Linear(64, 8)
            self.unused = torch.nn.Linear(64, 64)
            self.lm_head = torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.lm_head(self.fits(x)) + self.odd(x[..., :40]).sum() + self.small(x).sum()

    net = Net()
    x = torch.randn(4, 64)
    reasons = {s.name: s.reason for s in quantize_model(copy.deepcopy(net), "mxfp8").layers}
    assert reasons == {"fits": None, "odd": None,
                       "small": "out_features=8 is below 16", "unused": None, "lm_head": "ignored (matches 'lm_head')"}  # fmt: skip
    static = {s.name: s.reason for s in quantize_model(copy.deepcopy(net), "fp8-static", calibration=[x], ignore=()).layers}
    assert static["unused"] == "calibration never reached it" and static["lm_head"] is None
    q = copy.deepcopy(net)
    quantize_model(q, "mxfp8", ignore=("f*",))
    assert isinstance(q.fits, torch.nn.Linear) and isinstance(q.lm_head, QuantizedLinear)
    assert torch.isfinite(q(x)).all()


def test_configs_by_name_and_their_errors():
    assert get_quant_config("FP8_Dynamic") is QUANT_CONFIGS["fp8-dynamic"]
    assert get_quant_config(QUANT_CONFIGS["nvfp4"].to_dict()) == QUANT_CONFIGS["nvfp4"]
    with pytest.raises(minifloat.MinifloatError, match="unknown quantization config 'fp9'; known: fp8-weight-only"):
        get_quant_config("fp9")
    with pytest.raises(minifloat.MinifloatError, match="one per tensor"):
        minifloat.infer.QuantConfig(name="x", weight="mxfp8", activation="mxfp8", static=True)
    with pytest.raises(minifloat.MinifloatError, match="pass input_amax"):
        QuantizedLinear.from_linear(torch.nn.Linear(32, 32), "fp8-static")
    with pytest.raises(minifloat.MinifloatError, match="input_amax must be a finite number > 0"):
        QuantizedLinear.from_linear(torch.nn.Linear(32, 32), "fp8-static", input_amax=float("nan"))


def test_nvfp4_weights_global_scale_exact_or_a_power_of_two():
    lin = torch.nn.Linear(64, 32)
    exact = QuantizedLinear.from_linear(lin, "nvfp4-weight-only").weight
    assert float(exact.tensor_scale) == pytest.approx(float(lin.weight.abs().max()) / (448 * 6), rel=1e-6)
    assert int(exact.scale.max()) == 0x7E  # the largest block's E4M3 scale is 448
    config = dataclasses.replace(QUANT_CONFIGS["nvfp4-weight-only"], pow2_global_scale=True)
    pow2 = QuantizedLinear.from_linear(lin, config).weight
    ts = float(pow2.tensor_scale)
    assert math.log2(ts) == int(math.log2(ts)) and ts >= float(exact.tensor_scale)
    assert int(pow2.scale.max()) <= 0x7E  # the E4M3 block scales stay ≤ 448


def test_bf16_models_keep_their_dtype_and_move_with_to():
    model = tiny_llama().to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 8))
    quantize_model(model, "fp8-dynamic")
    assert model(ids).logits.dtype == torch.bfloat16
    layer = model.model.layers[0].mlp.up_proj
    assert layer.weight.dtype == torch.bfloat16 and layer.bias is None
    assert model.to(torch.device("cpu")) is model and layer.weight_data.dtype == torch.uint8
    scales = layer.weight_scale.clone()
    model.half()  # converts the bias and the rest, never the float32 scales
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, scales)
    assert model(ids).logits.dtype == torch.float16


def test_models_trained_with_minifloat_linears_are_quantized_from_their_master_weights():
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    minifloat.convert(net, "nvfp4")
    assert isinstance(net[0], minifloat.Linear)
    master = net[0].weight.detach().clone()
    summary = quantize_model(net, "fp8-dynamic", ignore=())
    assert len(summary.quantized) == 2 and isinstance(net[0], QuantizedLinear)
    want = minifloat.quantize(master, "fp8_rowwise").dequantize()
    assert torch.equal(net[0].weight.dequantize(), want)


def test_four_over_six_weights_err_no_more_than_plain_nvfp4_per_block():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64)
    w = lin.weight.detach().double()
    plain = QuantizedLinear.from_linear(lin, "nvfp4-weight-only").weight
    four = QuantizedLinear.from_linear(lin, "nvfp4-4over6-weight-only").weight
    assert four.scheme.scale_rule == "4over6" and four.scheme.is_nvfp4
    # per 1×16 block, the squared error (float64) of the chosen scale is at most that of the 6-scaled block,
    # up to the tensor scale's difference (256·6 instead of 448·6 as the global numerator)
    err_plain = (plain.dequantize(torch.float64) - w).square().view(64, 16, 16).sum(-1)
    err_four = (four.dequantize(torch.float64) - w).square().view(64, 16, 16).sum(-1)
    assert err_four.sum() < 0.9 * err_plain.sum()
    assert (err_four <= err_plain * 1.05 + 1e-12).float().mean() > 0.9


def test_the_compute_layout_is_made_once_and_weight_only_calls_go_through_the_dispatch():
    from minifloat.gemm import register_weight_only_kernel, unregister_weight_only_kernel, weight_only_kernels

    lin = torch.nn.Linear(64, 200)  # 200 rows: 128×128 blocks pad them to 256
    block = QuantizedLinear.from_linear(lin, "fp8-block")
    assert block.weight is block.weight and block.weight.data.shape == (256, 128)  # padded once, then kept
    assert block.compute_extra_nbytes() == 256 * 128 - 200 * 64  # the padding of 200 × 64 FP8 codes to 128×128 blocks
    assert block.weight_data.shape == (200, 64) and not block.weight.data[200:].any() and not block.weight.data[:, 64:].any()
    assert block.weight_data.data_ptr() == block.weight.data.data_ptr()  # one copy of the codes
    layer = QuantizedLinear.from_linear(lin, "nvfp4-weight-only")
    assert layer.weight.data.data_ptr() == layer.weight_data.data_ptr() and layer.compute_extra_nbytes() == 0
    x = torch.randn(5, 64)
    want = (x.double() @ layer.weight.dequantize().double().t() + lin.bias.double()).float()  # float64 oracle
    assert torch.allclose(layer(x), want, rtol=1e-5, atol=1e-5)
    calls = []

    def fn(x, w):
        calls.append(w.scheme.name)
        return torch.zeros(x.shape[0], w.shape[0])

    register_weight_only_kernel("test-zeros", lambda x, w: w.scheme.is_nvfp4, fn)
    try:
        assert "test-zeros" in weight_only_kernels()
        out = layer(x)  # "auto" takes the registered kernel that supports the weight
        assert calls == ["nvfp4"] and torch.equal(out, lin.bias.detach().expand(5, -1))
        assert torch.allclose(layer.prepare("emulated")(x), want, rtol=1e-5, atol=1e-5) and calls == ["nvfp4"]
        with pytest.raises(minifloat.MinifloatError, match="does not take a mxfp4"):
            QuantizedLinear.from_linear(lin, "mxfp4-weight-only").prepare("test-zeros")(x)
    finally:
        unregister_weight_only_kernel("test-zeros")
    assert weight_only_kernels() == ["decode"]
    assert torch.allclose(layer.prepare("auto")(x), want, rtol=1e-5, atol=1e-5)  # the kernel is gone: no zeros
