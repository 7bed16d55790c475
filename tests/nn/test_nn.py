import copy
import itertools
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import minifloat
from minifloat.gemm import choose_backend, native_support
from minifloat.kernels import reference
from minifloat.kernels.reference import rht as rht_reference
from minifloat.quant.hadamard import hadamard_signs
from minifloat.recipes import RECIPES, MXScaling, NVFP4BlockScaling, get_recipe
from tests.conftest import requires_cuda, sqnr_db

# SQNR floors per recipe (output, grad_input, grad_weight) against a float64 nn.Linear.
FLOORS = {"fp8": 20, "fp8-current": 20, "fp8-block": 20, "mxfp8": 20, "mxfp6": 14, "mxfp6-e2m3": 14, "mxfp6-e3m2": 14, "mxfp6-hybrid": 14, "mxfp4": 8, "nvfp4": 8, "nvfp4-4over6": 8,
          "mxfp4-rtn": 8, "mxfp4-rht": 8, "mxfp4-sr": 8, "mxfp4-tseng": 8, "mxfp4-tseng-rht32": 8, "mxfp4-tseng-fwd": 8, "mxfp4-tseng-least-error": 8,
          "mxfp8-rceil": 20, "mxfp4-rceil": 8, "fp8-fnuz": 20, "fp8-current-fnuz": 20, "nvfp4-1d-4over6": 8, "mxfp4-fwd": 8}
CEILING = 60  # above this a layer is not quantizing


def _pair(recipe, in_f=256, out_f=128, seed=0):
    torch.manual_seed(seed)
    ref = torch.nn.Linear(in_f, out_f).double()
    layer = minifloat.nn.Linear(in_f, out_f, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(ref.weight)
        layer.bias.copy_(ref.bias)
    return ref, layer


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("name", list(RECIPES))
def test_sqnr_of_every_gemm_is_within_the_recipe_band(name):
    assert set(FLOORS) == set(RECIPES)
    ref, layer = _pair(name)
    x = torch.randn(4, 64, 256, dtype=torch.float64)
    x[:, :, 7] *= 20  # an outlier channel, as activations have
    g = torch.randn(4, 64, 128, dtype=torch.float64)
    expected = _run(ref, x, g)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    for _ in range(2):  # the second step exercises delayed scales from the history
        layer.weight.grad = None
        got = _run(layer, x.float(), g.float())
        opt.step()
    for what, a, b in zip(("output", "grad_input", "grad_weight"), got, expected, strict=True):
        s = sqnr_db(a, b)
        assert FLOORS[name] <= s < CEILING, f"{name} {what}: {s:.1f} dB"


def _q(x, scheme):
    x = x.float().contiguous()
    return reference.dequantize(*reference.quantize(x, scheme, rounding=scheme.rounding), x.shape, scheme).double()


@pytest.mark.parametrize(
    "recipe",
    [get_recipe("mxfp8"), get_recipe("fp8-block"), get_recipe("mxfp4-rtn"), NVFP4BlockScaling(stochastic_rounding=False),
     MXScaling(element="e2m1", rht=True, rht_seed=3, grad_scale_rule="rceil"),
     MXScaling(element="e2m1", rht=True, rht_size=32), MXScaling(element="e2m1", rht=True, forward_rht=True, rht_seed=5),
     NVFP4BlockScaling(stochastic_rounding=False, outlier_channels=3), get_recipe("fp8-current").replace(outlier_channels=2),
     MXScaling(element="e2m1", forward_rht=True, outlier_channels=4)],
    ids=["mxfp8", "fp8-block", "mxfp4-rtn", "nvfp4-rht", "mxfp4-rht-rceil", "mxfp4-rht32", "mxfp4-forward-rht",
         "nvfp4-outliers", "fp8-current-outliers", "mxfp4-forward-rht-outliers"],
)
def test_each_gemm_quantizes_its_operands_along_its_reduction_dimension(recipe):
    """Rebuild the three GEMMs from the reference quantizer and float64 products."""
    _, layer = _pair(recipe, in_f=256, out_f=128)
    x, g = torch.randn(3, 48, 256), torch.randn(3, 48, 128)
    y, gx, gw = _run(layer, x, g)
    w = layer.weight.detach()
    s_in, s_w, s_g = (recipe.scheme(r) for r in ("input", "weight", "grad_output"))
    x2, g2 = x.reshape(-1, 256), g.reshape(-1, 128)
    xf, wf, high = x2, w, 0
    if recipe.outlier_channels:  # the k channels of largest amax (numpy's ranking) out of both, multiplied in BF16
        idx = torch.from_numpy(np.argsort(-x2.abs().amax(0).numpy(), kind="stable")[: recipe.outlier_channels].copy())
        bf = lambda t: t[:, idx].to(torch.bfloat16).double()  # noqa: E731
        high = bf(x2) @ bf(w).T
        keep = torch.ones(256, dtype=torch.bool)
        keep[idx] = False
        xf, wf = x2 * keep, w * keep
    if getattr(recipe, "forward_rht", False):  # the forward operands rotated along in_features
        signs = hadamard_signs(recipe.rht_size, recipe.rht_seed)
        xf, wf = (rht_reference(t.contiguous(), signs) for t in (xf, wf))
    want_y = _q(xf, s_in) @ _q(wf, s_w).T + high + layer.bias.double()
    w_t = _q(w, s_w).T if recipe.weight_2d else _q(w.t(), s_w)
    want_gx = _q(g2, s_g) @ w_t.T
    xt, gt = x2.t(), g2.t()
    if getattr(recipe, "rht", False):
        n = getattr(recipe, "rht_size", 16)
        signs = hadamard_signs(n, recipe.rht_seed)  # the transform's own oracle: tests/test_hadamard.py
        pad = -xt.shape[1] % n  # 144 tokens: whole groups of 16, and zero-padded to 160 for 32
        xt, gt = (rht_reference(torch.nn.functional.pad(t, (0, pad)).contiguous(), signs) for t in (xt, gt))
    want_gw = _q(gt, s_g) @ _q(xt, s_in).T
    for got, want in ((y.reshape(-1, 128), want_y), (gx.reshape(-1, 256), want_gx), (gw, want_gw)):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)


def test_gradient_accumulation_over_micro_batches_is_fp32():
    # MX scales are powers of two and per 32 tokens, so four micro-batches of 64 tokens
    # quantize exactly like one batch of 256: the sums may differ only by FP32 rounding.
    _, big = _pair("mxfp8")
    small = copy.deepcopy(big)
    x, g = torch.randn(256, 256), torch.randn(256, 128)
    _run(big, x, g)
    for i in range(4):
        _run(small, x[i * 64 : (i + 1) * 64], g[i * 64 : (i + 1) * 64])
    assert small.weight.grad.dtype == torch.float32
    assert torch.allclose(small.weight.grad, big.weight.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(small.bias.grad, big.bias.grad, rtol=1e-5, atol=1e-5)


def _delayed_step(layer, opt, *amaxes):
    """One optimizer step of micro-batches whose inputs have the given amaxes."""
    for a in amaxes:
        x = torch.zeros(4, 32)
        x[0, 0] = a
        layer(x).sum().backward()
    opt.step()


def test_delayed_history_rolls_once_per_step_and_reduces_by_max():
    layer = minifloat.nn.Linear(32, 16, recipe="fp8")
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    _delayed_step(layer, opt, 2.0, 5.0)  # two micro-batches: one history entry, their max
    assert int(layer.amax_steps) == 1
    assert layer.amax_history[0, :2].tolist() == [5.0, 0.0]
    assert layer.scale[0].item() == pytest.approx(448.0 / 5.0)
    _delayed_step(layer, opt, 3.0)
    assert layer.amax_history[0, :2].tolist() == [3.0, 5.0]
    assert layer.scale[0].item() == pytest.approx(448.0 / 5.0)  # max over the history
    # grad_output's history uses E5M2's max.
    g_amax = layer.amax_history[2, 0].item()
    assert layer.scale[2].item() == pytest.approx(57344.0 / max(g_amax, layer.amax_history[2, 1].item()))


def test_delayed_history_ignores_evaluation_forwards():
    # A validation pass (eval() or no_grad) must not put its amaxes into the training history.
    layer = minifloat.nn.Linear(32, 16, recipe="fp8")
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    _delayed_step(layer, opt, 2.0)
    layer.eval()
    layer(torch.full((4, 32), 100.0))
    layer.train()
    with torch.no_grad():
        layer(torch.full((4, 32), 100.0))
    _delayed_step(layer, opt, 3.0)
    assert int(layer.amax_steps) == 2 and layer.amax_history[0, :3].tolist() == [3.0, 2.0, 0.0]
    assert layer.scale[0].item() == pytest.approx(448.0 / 3.0)


def test_delayed_history_rolls_in_a_deepcopy():
    # a copy is made without __init__: it must still be tracked, or its scales never update
    layer = copy.deepcopy(minifloat.nn.Linear(32, 16, recipe="fp8"))
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    _delayed_step(layer, opt, 5.0)
    assert int(layer.amax_steps) == 1 and layer.scale[0].item() == pytest.approx(448.0 / 5.0)


def test_delayed_modules_roll_at_their_own_optimizers_step():
    # Two models with their own optimizers, stepped alternately (a GAN), and a frozen layer.
    g, d = minifloat.nn.Linear(32, 16, recipe="fp8"), minifloat.nn.Linear(32, 16, recipe="fp8")
    frozen = minifloat.nn.Linear(32, 16, recipe="fp8").requires_grad_(False)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.0), torch.optim.SGD(d.parameters(), lr=0.0)
    _delayed_step(g, opt_g, 1.0)
    for step in range(3):
        g(torch.full((4, 32), 2.0 + step))  # d's step also runs g (forward only)
        frozen(torch.full((4, 32), 1.0 + step))
        _delayed_step(d, opt_d, 3.0)
        _delayed_step(g, opt_g, 1.0)  # g's pending: the max of both forwards of its step
    assert int(d.amax_steps) == 3 and d.amax_history[0, :3].tolist() == [3.0, 3.0, 3.0]
    assert int(g.amax_steps) == 4 and g.amax_history[0, :4].tolist() == [4.0, 3.0, 2.0, 1.0]
    assert int(frozen.amax_steps) == 3 and frozen.amax_history[0, :3].tolist() == [3.0, 2.0, 1.0]


def test_delayed_state_stays_float32_when_the_model_is_cast():
    layer = minifloat.nn.Linear(32, 16, recipe="fp8")
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    x = torch.full((4, 32), 0.1)
    (layer(x) * 1e-4).sum().backward()  # grad_output amax 1e-4: E5M2 scale 5.7e8
    opt.step()
    history, scale = layer.amax_history.clone(), layer.scale.clone()
    assert scale[2] > torch.finfo(torch.float16).max
    for dtype in (torch.float16, torch.bfloat16):
        layer.to(dtype)
        assert layer.weight.dtype == dtype
        assert layer.amax_history.dtype == layer.scale.dtype == torch.float32
        assert torch.equal(layer.amax_history, history) and torch.equal(layer.scale, scale)  # not inf, no bits lost
        assert layer(x.to(dtype)).dtype == dtype


def test_delayed_most_recent_interval_and_window():
    recipe = minifloat.DelayedScaling(amax_compute_algo="most_recent", interval=2, amax_history_len=2)
    layer = minifloat.nn.Linear(32, 16, recipe=recipe)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    _delayed_step(layer, opt, 4.0)
    assert layer.scale[0].item() == pytest.approx(112.0)  # step 1 updates
    _delayed_step(layer, opt, 8.0)
    assert layer.scale[0].item() == pytest.approx(112.0)  # step 2: not an update step
    _delayed_step(layer, opt, 7.0)
    assert layer.scale[0].item() == pytest.approx(64.0)  # step 3 updates, most recent
    assert layer.amax_history[0].tolist() == [7.0, 8.0]  # 4.0 left the window of 2


def test_delayed_scale_is_what_quantizes_and_nonfinite_amax_is_ignored():
    layer = minifloat.nn.Linear(32, 16, recipe="fp8", bias=False)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    _delayed_step(layer, opt, 10.0)
    bad = torch.zeros(4, 32)
    bad[0, 0] = float("nan")
    layer(bad).sum().backward()  # NaN micro-batch: its amax is not recorded
    layer.weight.grad = None  # (as a LossScaler skipping it would leave the weights)
    _delayed_step(layer, opt, 6.0)
    assert layer.amax_history[0, 0].item() == 6.0
    x = torch.randn(8, 32) * 30  # above the history's amax: saturates at the delayed scale
    with torch.no_grad():
        y = layer(x)
    scale = layer.scale
    xq = minifloat.fake_quantize(x, "fp8", scale=scale[0])
    wq = minifloat.fake_quantize(layer.weight.detach(), "fp8", scale=scale[1])
    assert torch.allclose(y, xq @ wq.T, rtol=1e-5, atol=1e-5)


def test_delayed_scaling_reads_its_step_count_once_not_per_quantize():
    # On a GPU int(buffer) waits for the device: the count is kept as a Python int instead,
    # and read again from the buffer only after a state_dict is loaded.
    torch.manual_seed(0)
    trained = minifloat.nn.Linear(32, 16, recipe="fp8")
    _delayed_step(trained, torch.optim.SGD(trained.parameters(), lr=0.0), 4.0)
    fresh = minifloat.nn.Linear(32, 16, recipe="fp8")
    x = torch.randn(4, 32) * 8  # above the history's amax: the delayed scale saturates it
    with torch.no_grad():
        fresh(x)  # no history yet: scaled from x itself
        fresh.load_state_dict(trained.state_dict())
        assert torch.equal(fresh(x), trained(x))  # now the loaded history's scale
        trained.amax_steps = torch.empty((), dtype=torch.int64, device="meta")  # unreadable from here on
        assert torch.equal(trained(x), fresh(x))


def test_first_step_without_history_scales_from_the_tensor():
    delayed = minifloat.nn.Linear(32, 16, recipe="fp8")
    current = minifloat.nn.Linear(32, 16, recipe="fp8-current")
    current.load_state_dict(delayed.state_dict())
    x = torch.randn(8, 32) * 1000
    assert torch.equal(delayed(x), current(x))


def test_state_dict_round_trip_restores_delayed_scaling():
    layer = minifloat.nn.Linear(32, 16, recipe="fp8")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for a in (3.0, 9.0, 1.0):
        _delayed_step(layer, opt, a)
    clone = minifloat.nn.Linear(32, 16, recipe="fp8")
    clone.load_state_dict(layer.state_dict())
    for name in ("amax_history", "scale", "amax_steps", "weight"):
        assert torch.equal(getattr(clone, name), getattr(layer, name))
    x = torch.randn(4, 32) * 5
    assert torch.equal(clone(x), layer(x))


def test_checkpoints_move_between_recipes():
    fp8 = minifloat.nn.Linear(32, 32, recipe="fp8")
    mx = minifloat.nn.Linear(32, 32, recipe="mxfp8")
    mx.load_state_dict(fp8.state_dict())  # extra delayed-scaling buffers are ignored
    assert torch.equal(mx.weight, fp8.weight)
    fresh = minifloat.nn.Linear(32, 32, recipe="fp8")
    fresh.load_state_dict(mx.state_dict())  # missing ones start fresh
    assert int(fresh.amax_steps) == 0
    plain = torch.nn.Linear(32, 32)
    plain.load_state_dict({k: v for k, v in fp8.state_dict().items() if k in ("weight", "bias")})


def test_convert_swaps_eligible_layers_and_shares_parameters(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
    w0 = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="minifloat"):
        minifloat.convert(model, "mxfp4")
    assert isinstance(model[0], minifloat.nn.Linear) and model[0].weight is w0
    assert type(model[2]) is torch.nn.Linear
    assert "keeping 2 (10, 128) in high precision (out_features=10 is below 16)" in caplog.text
    model(torch.randn(4, 64)).sum().backward()
    before = w0.detach().clone()
    opt.step()  # the optimizer created before convert still drives the same Parameters
    assert w0.grad is not None and not torch.equal(model[0].weight, before)


@pytest.mark.parametrize(
    ("recipe", "shape", "why"),
    [
        ("fp8", (16, 32), None),  # 16 is enough, for per-tensor scales too
        ("fp8", (8, 32), "in_features=8 is below 16"),
        ("fp8", (24, 32), None),
        ("mxfp8", (64, 96), None),
        ("mxfp8", (48, 64), None),  # a partial last block of 16 of MX's 32
        ("nvfp4", (32, 16), None),
        ("fp8-block", (128, 256), None),
        ("fp8-block", (256, 64), None),  # one partial 64×128 block row
        ("fp8-block", (256, 12), "out_features=12 is below 16"),
    ],
)
def test_convert_rule_every_layer_of_16_features_or_more(recipe, shape, why, caplog):
    in_f, out_f = shape
    model = torch.nn.Sequential(torch.nn.Linear(in_f, out_f))
    with caplog.at_level(logging.INFO, logger="minifloat"):
        minifloat.convert(model, recipe)
    assert isinstance(model[0], minifloat.nn.Linear) == (why is None)
    if why is not None:
        assert f"keeping 0 ({out_f}, {in_f}) in high precision ({why})" in caplog.text


def test_convert_leaves_multihead_attention_out_proj_whose_forward_never_runs(caplog):
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    with caplog.at_level(logging.INFO, logger="minifloat"):
        minifloat.convert(layer, "mxfp8", filter=lambda fqn, m: True)
    assert type(layer.self_attn.out_proj) is torch.nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(layer.linear1, minifloat.nn.Linear) and isinstance(layer.linear2, minifloat.nn.Linear)
    assert "keeping self_attn.out_proj in high precision (nn.MultiheadAttention never calls its forward)" in caplog.text
    layer(torch.randn(2, 16, 64)).sum().backward()


def test_convert_filter_decides_and_repr_names_the_recipe():
    model = torch.nn.ModuleDict({"body": torch.nn.Linear(64, 64), "lm_head": torch.nn.Linear(64, 64)})
    minifloat.convert(model, "nvfp4", filter=lambda fqn, m: fqn != "lm_head")
    assert isinstance(model["body"], minifloat.nn.Linear) and type(model["lm_head"]) is torch.nn.Linear
    assert "recipe=nvfp4" in repr(model["body"])
    minifloat.convert(model, "fp8-current")  # re-convert: new recipe on converted layers
    assert model["body"].recipe == get_recipe("fp8-current")


def test_a_recipe_keeps_its_first_and_last_blocks_in_high_precision(caplog):
    """MXScaling(high_precision_first=1, high_precision_last=2): of the model's list of 5 blocks,
    blocks 0, 3 and 4 keep torch's Linears, each named in the log; the layers outside the list
    (the head) follow the usual rule; a model without a list of blocks is quantized whole, with a warning."""
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32))
                                 for _ in range(5))  # fmt: skip
    norms = torch.nn.ModuleList(torch.nn.LayerNorm(32) for _ in range(7))  # longer, but holds no Linear
    model = torch.nn.ModuleDict({"norms": norms, "blocks": blocks, "head": torch.nn.Linear(32, 32)})
    recipe = MXScaling(element="e2m1", high_precision_first=1, high_precision_last=2)
    with caplog.at_level("INFO", logger="minifloat"):
        minifloat.convert(model, recipe)
    quantized = {n for n, m in model.named_modules() if isinstance(m, minifloat.nn.Linear)}
    assert quantized == {"blocks.1.0", "blocks.1.2", "blocks.2.0", "blocks.2.2", "head"}
    assert "keeping blocks.4.2 (32, 32) in high precision (the recipe keeps blocks blocks.0, blocks.3, blocks.4)" in caplog.text
    policy = torch.nn.ModuleDict({"blocks": copy.deepcopy(blocks)})
    minifloat.convert(policy, {"*": recipe})  # a policy names its layers: the recipe's kept blocks do not override it
    assert all(isinstance(m, minifloat.nn.Linear) for m in policy.modules() if isinstance(m, torch.nn.Linear))
    caplog.clear()
    plain = minifloat.convert(torch.nn.Sequential(torch.nn.Linear(32, 32)), recipe)  # no blocks to keep: said, and all quantized
    assert isinstance(plain[0], minifloat.nn.Linear) and "has no nn.ModuleList of blocks: every Linear is quantized" in caplog.text
    two = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))})
    minifloat.convert(two, recipe)  # 1 + 2 blocks asked of 2: all kept, and said
    assert not any(isinstance(m, minifloat.nn.Linear) for m in two.modules()) and "all 2 blocks of blocks" in caplog.text
    with pytest.raises(minifloat.MinifloatError, match="high_precision_last=...\\) takes a whole number of blocks ≥ 0, got -1"):
        MXScaling(element="e2m1", high_precision_last=-1)
    with pytest.raises(minifloat.MinifloatError, match="rht_size=...\\) takes 16 or 32 .* got 8"):
        MXScaling(element="e2m1", rht=True, rht_size=8)


def test_autocast_disables_or_overrides_the_recipe():
    _, layer = _pair("mxfp4", 64, 64)
    x = torch.randn(8, 64)
    with minifloat.autocast(enabled=False):
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    with minifloat.autocast("mxfp8"):
        y8 = layer(x)
    _, mx8 = _pair("mxfp8", 64, 64)
    mx8.load_state_dict(layer.state_dict())
    assert torch.equal(y8, mx8(x))
    assert not torch.equal(layer(x), y8)


@pytest.mark.parametrize("name", list(RECIPES))
def test_torch_autocast_sets_the_output_dtype_not_the_gemm(name):
    # As nn.Linear's, the output takes autocast's dtype; the quantized GEMMs (FP32 emulation,
    # Hadamard transform) must not run in BF16: the same values as without autocast, rounded.
    _, layer = _pair(name)
    x = torch.randn(64, 256, requires_grad=True)
    g = torch.randn(64, 128).bfloat16()
    torch.manual_seed(1)  # the same stochastic-rounding seeds in both runs
    y = layer(x)
    y.backward(g.float())
    grads = x.grad, layer.weight.grad
    x.grad = layer.weight.grad = None
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb = layer(x)
        yb.backward(g)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.bfloat16())
    assert torch.equal(x.grad, grads[0]) and torch.equal(layer.weight.grad, grads[1])


def test_a_second_derivative_is_a_clear_error():
    # The quantized backward is not differentiable (a gradient penalty through it): say so.
    _, layer = _pair("mxfp8", 64, 64)
    x = torch.randn(4, 64, requires_grad=True)
    (g,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.square().sum().backward()


def test_leading_dims_bf16_and_no_bias():
    layer = minifloat.nn.Linear(64, 32, bias=False, recipe="fp8-current", dtype=torch.bfloat16)
    x = torch.randn(2, 3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    assert y.shape == (2, 3, 5, 32) and y.dtype == torch.bfloat16
    assert x.grad.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.bfloat16


def test_input_of_the_wrong_width_is_a_clear_error():
    layer = minifloat.nn.Linear(64, 32, recipe="mxfp8")
    # (2, 128) has the elements of (4, 64): it must not be silently reshaped
    for shape in [(4, 32), (2, 128), ()]:
        with pytest.raises(minifloat.MinifloatError, match=rf"got an input of shape {re.escape(str(shape))}; its last"):
            layer(torch.randn(shape))
    with pytest.raises(minifloat.MinifloatError, match="convert\\(\\) takes a torch.nn.Module, got str"):
        minifloat.convert("model", "fp8")


def test_a_float64_model_or_input_is_a_clear_error_naming_the_fix():
    # nn.Linear runs in float64; the quantizers do not: say so at the layer, not deep in quantize
    layer = minifloat.nn.Linear(64, 32, recipe="mxfp8")
    with pytest.raises(minifloat.DTypeError, match=r"got a torch.float64 input; run the model in float32 \(model.float\(\)\)"):
        layer(torch.randn(4, 64, dtype=torch.float64))
    with pytest.raises(minifloat.DTypeError, match="got a torch.float64 weight"):
        layer.double()(torch.randn(4, 64))
    with minifloat.autocast(enabled=False):  # high precision: as nn.Linear
        assert layer(torch.randn(4, 64, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("name", list(RECIPES))
def test_empty_batch_gives_empty_output_and_zero_gradients(name):
    layer = minifloat.nn.Linear(64, 32, recipe=name)
    x = torch.randn(0, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()  # grad_weight's GEMM reduces over no tokens
    assert y.shape == (0, 32) and x.grad.shape == (0, 64)
    assert torch.equal(layer.weight.grad, torch.zeros(32, 64)) and torch.equal(layer.bias.grad, torch.zeros(32))


def test_nan_input_gives_nan_output_never_finite():
    _, layer = _pair("mxfp8", 64, 32)
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    y = layer(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


def test_outlier_channels_take_a_layers_outliers_out_of_its_fp4_blocks():
    """A few input channels 40× the rest (a pretrained model's activations): with them multiplied
    in BF16 the forward's error against the float64 product falls ×3.9; the backward GEMMs
    are the plain recipe's bit for bit; a NaN in an outlier channel reaches the output."""
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    x[:, [3, 77, 190]] *= 40
    recipe = NVFP4BlockScaling(stochastic_rounding=False)
    ref, plain = _pair(recipe)
    _, split = _pair(recipe.replace(outlier_channels=3))
    g = torch.randn(64, 128)
    (y0, gx0, gw0), (y3, gx3, gw3) = _run(plain, x, g), _run(split, x, g)
    want = ref(x.double()).detach()
    err = lambda y: ((y.double() - want).norm() / want.norm()).item()  # noqa: E731
    assert err(y3) < err(y0) / 3  # 0.034 against 0.130
    assert torch.equal(gx3, gx0) and torch.equal(gw3, gw0)
    x[5, 77] = float("nan")
    y = split(x)
    assert torch.isnan(y[5]).all() and torch.isfinite(y[torch.arange(64) != 5]).all()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_outlier_channels_must_be_a_whole_number(bad):
    with pytest.raises(minifloat.MinifloatError, match=r"outlier_channels=\.\.\.\) takes a whole number"):
        get_recipe("nvfp4").replace(outlier_channels=bad)


def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    minifloat.convert(model, "mxfp8")
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin)
    x = torch.randn(32, 64)
    y_eager, y_comp = model(x), compiled(x)
    assert torch.equal(y_eager, y_comp)
    y_eager.square().sum().backward()
    y_comp.square().sum().backward()
    assert torch.equal(model[0].weight.grad, twin[0].weight.grad)


def test_tiny_hf_llama_converts_and_trains():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    minifloat.convert(model, "mxfp8", filter=lambda fqn, m: "lm_head" not in fqn)
    converted = [n for n, m in model.named_modules() if isinstance(m, minifloat.nn.Linear)]
    assert len(converted) == 2 * 7  # q, k, v, o, gate, up, down per layer
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@requires_cuda
@pytest.mark.parametrize("name", list(RECIPES))
def test_native_cuda_training_step_agrees_with_emulated(name):
    """Where the GPU has the recipe's GEMMs: one forward/backward with backend 'auto' (native)
    against 'emulated' on the same weights, to bfloat16's rounding (native block GEMMs write it).
    Stochastic rounding draws differently per call, so the NVFP4 recipe runs without it here."""
    recipe = get_recipe(name)
    if isinstance(recipe, NVFP4BlockScaling):
        recipe = NVFP4BlockScaling(stochastic_rounding=False)
    schemes = [recipe.scheme(r) for r in ("input", "weight", "grad_output")]
    if choose_backend(schemes, "cuda") != "native":
        pytest.skip(next(w for s in schemes if (w := native_support(s, "cuda"))))
    torch.manual_seed(0)
    x, g = torch.randn(2, 128, 512, device="cuda"), torch.randn(2, 128, 256, device="cuda")
    native = minifloat.nn.Linear(512, 256, recipe=recipe, device="cuda")
    emulated = copy.deepcopy(native)
    emulated.backend = "emulated"
    for a, b in zip(_run(native, x, g), _run(emulated, x, g), strict=True):
        assert torch.allclose(a, b, rtol=2**-7, atol=2**-7 * b.abs().max().item())


def test_importing_minifloat_does_not_import_torch_dynamo():
    # torch.compiler.disable (what keeps the kernels opaque to torch.compile) imports
    # torch._dynamo, 1.8 s here: made by the first minifloat Linear, not on import.
    code = "import sys, torch, minifloat; minifloat.quantize(torch.ones(4, 32), 'mxfp8'); print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_torch_compile_does_not_recompile_per_layer_shape(caplog):
    # Each Linear's whole forward is one call opaque to torch.compile: a traced forward was
    # compiled once per layer shape, past dynamo's recompile limit (8) in a model with more.
    import torch._dynamo

    torch._dynamo.reset()
    widths = [32 * (i + 1) for i in range(11)]
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)])
    minifloat.convert(model, "mxfp8")
    compiled = torch.compile(model)
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        compiled(torch.randn(4, 32)).sum().backward()
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]


def test_which_weights_fsdp_gathers_quantized_follows_what_the_scheme_is():
    """One-byte codes whose scales the row shards hold alone (per row, blocks one row tall) or
    agree on with one all-reduce (per tensor); not 128×128 blocks, FP6 / FP4 or NVFP4."""
    from minifloat.nn.all_gather import gathers

    want = {"fp8", "fp8_e5m2", "fp8_rowwise", "fp8_block128", "mxfp8", "mxfp8_e5m2", "fp8_fnuz", "fp8_rowwise_fnuz", "fp8_e5m2fnuz"}
    assert {n for n, s in minifloat.SCHEMES.items() if gathers(s)} == want
