import math

import pytest
import torch

import minifloat
from minifloat import AmaxHistory, MinifloatError, get_format, quantize, scale_from_amax
from minifloat.scaling.rules import (
    e8m0_exponent,
    finite_amax,
    fp32_scale,
    fp32_scale_scalar,
    nvfp4_global_scale,
    nvfp4_global_scale_scalar,
)

E4M3, E2M1 = get_format("e4m3"), get_format("e2m1")


def test_scale_from_amax_te_rules():
    assert scale_from_amax(torch.tensor(448.0), "e4m3").item() == 1.0
    assert scale_from_amax(torch.tensor(7.0), "e4m3", margin=1).item() == 448 / 7 / 2
    assert scale_from_amax(torch.tensor(57344.0 / 8), "e5m2").item() == 8.0
    for bad in [0.0, -1.0, float("inf"), float("nan")]:  # only a positive finite amax makes a new scale (TE: amax > 0)
        assert scale_from_amax(torch.tensor(bad), "e4m3", previous=torch.tensor(3.0)).item() == 3.0
    assert scale_from_amax(torch.tensor(0.0), "e4m3").item() == 1.0
    assert scale_from_amax(torch.tensor(1e-44), "e4m3").item() == torch.finfo(torch.float32).max  # inf -> max


def test_current_scaling_propagates_nan():
    assert math.isnan(fp32_scale(torch.tensor(float("nan")), E4M3).item())


def test_infinite_amax_scales_by_one_as_te_does():
    # TE's compute_scale_from_amax: inf (or 0) → 1. max / inf = 0 would decode every value as 0 · inf = NaN.
    assert fp32_scale(torch.tensor(math.inf), E4M3).item() == 1.0 == fp32_scale_scalar(math.inf, E4M3)
    x = torch.tensor([[1.0, -2.0, 0.0, 500.0]])
    for scheme in ("fp8", "fp4", "fp8_block128"):
        assert quantize(x, scheme, amax=math.inf).dequantize().tolist() == quantize(x, scheme, scale=1.0).dequantize().tolist()
    with pytest.raises(MinifloatError, match="amax is a largest magnitude, ≥ 0; got -2.0"):
        quantize(x, "fp8", amax=-2.0)


def test_margin_and_history_settings_are_checked():
    for margin in (0.5, float("nan"), 1000, True):
        with pytest.raises(MinifloatError, match=r"margin must be a whole number of binades in \[-126, 126\]"):
            minifloat.Scheme(element="e4m3", margin=margin)
    with pytest.raises(MinifloatError, match="margin must be"):  # at construction, not at the first scheme() call
        minifloat.DelayedScaling(margin=1000)
    with pytest.raises(MinifloatError, match="percentile must be in \\[0, 100\\], got 150"):
        AmaxHistory(4, algo="percentile", percentile=150)
    with pytest.raises(MinifloatError, match="ema_decay must be in \\[0, 1\\), got 1.5"):
        AmaxHistory(4, algo="ema", ema_decay=1.5)
    for kwargs in ({"length": 0}, {"ema_decay": 1.0}, {"ema_decay": -0.1}, {"percentile": -1.0}, {"percentile": 100.5}):
        with pytest.raises(MinifloatError, match="must be"):
            AmaxHistory(**kwargs)
    for kwargs in ({"length": 1}, {"ema_decay": 0.0}, {"percentile": 0.0}, {"percentile": 100.0}):  # the bounds
        AmaxHistory(**kwargs)


@pytest.mark.parametrize("amax", [1.0, 3.0, 447.0, 448.0, 449.0, 1e-30, 2.0**-130, 6e37])
def test_e8m0_rules_against_math(amax):
    fmt = get_format("e4m3")
    floor = e8m0_exponent(torch.tensor(amax), fmt, "floor").item()
    assert floor == max(-127, min(127, math.floor(math.log2(amax)) - fmt.emax))  # OCP MX §6.3
    rceil = e8m0_exponent(torch.tensor(amax), fmt, "rceil").item()
    ratio = float(torch.tensor(amax) * torch.tensor(1 / 448.0))
    assert rceil == max(-127, min(127, math.ceil(math.log2(ratio))))
    assert amax / 2.0**rceil <= 448 or rceil == 127  # rceil never saturates


def test_e8m0_specials():
    out = e8m0_exponent(torch.tensor([0.0, float("nan")]), E2M1)
    assert out[0].item() == 0 and math.isnan(out[1].item())
    with pytest.raises(MinifloatError, match="unknown MX scale rule 'round'"):
        e8m0_exponent(torch.tensor(1.0), E2M1, "round")


def test_nvfp4_global_scale():
    assert nvfp4_global_scale(torch.tensor(2688.0)).item() == 1.0
    assert nvfp4_global_scale(torch.tensor(0.0)).item() == 1.0
    assert nvfp4_global_scale(torch.tensor(1e-44)).item() == torch.finfo(torch.float32).max


def float32_sweep() -> torch.Tensor:
    """Non-negative float32 amaxes: random bit patterns over the whole range (subnormals
    included), and the edges: 0, the smallest subnormal, FLT_MAX, inf, NaN."""
    bits = torch.randint(0, 0x7F800000, (4000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    edges = torch.tensor([0.0, 1e-45, 1.1754942e-38, 1.0, 448.0, 2688.0, 3.4028235e38, math.inf, math.nan])
    return torch.cat([bits.to(torch.int32).view(torch.float32), edges])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2", "e2m1"])
@pytest.mark.parametrize("margin", [0, 1, 3])
def test_scalar_fp32_scale_equals_the_tensor_rule(fmt, margin):
    """The kernels' per-call scalar versions of the rules give the tensor rules' float32 bits."""
    amax = float32_sweep()
    want = fp32_scale(amax, get_format(fmt), margin)
    got = torch.tensor([fp32_scale_scalar(a, get_format(fmt), margin) for a in amax.tolist()], dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_scalar_nvfp4_global_scale_equals_the_tensor_rule():
    amax = float32_sweep()
    want = nvfp4_global_scale(amax)
    got = torch.tensor([nvfp4_global_scale_scalar(a) for a in amax.tolist()], dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_finite_amax():
    x = torch.tensor([1.0, -5.0, float("inf"), float("nan")])
    assert math.isnan(finite_amax(x).item())
    assert finite_amax(x, ignore_nan=True).item() == 5.0
    assert finite_amax(torch.empty(0)).item() == 0.0
    small = torch.tensor([[0.25, -float("inf")], [float("nan"), 0.5]])  # inf counts as nothing, not as 1
    assert finite_amax(small, dim=1, ignore_nan=True).tolist() == [0.25, 0.5]
    assert finite_amax(small[:1]).item() == 0.25 and finite_amax(torch.tensor([-float("inf")])).item() == 0.0


def test_amax_history_algorithms():
    seq = [1.0, 7.0, 2.0, 3.0, 5.0]
    hist = {algo: AmaxHistory(length=3, algo=algo) for algo in ["max", "most_recent", "ema", "percentile"]}
    custom = AmaxHistory(length=3, algo=lambda h: h.sum())
    for a in seq:
        for h in [*hist.values(), custom]:
            h.update(torch.tensor(a))
    assert hist["max"].amax().item() == 5.0  # 7.0 has left the window [5, 3, 2]
    assert hist["most_recent"].amax().item() == 5.0
    ema = seq[0]
    for a in seq[1:]:
        ema = 0.9 * ema + 0.1 * a
    assert hist["ema"].amax().item() == pytest.approx(ema)
    assert hist["percentile"].amax().item() == pytest.approx(torch.quantile(torch.tensor([5.0, 3.0, 2.0]), 0.99).item())
    assert custom.amax().item() == 10.0
    assert AmaxHistory(length=4).amax().item() == 0.0
    assert hist["max"].history.tolist() == [5.0, 3.0, 2.0] and hist["max"].steps == len(seq)  # newest first
    one = AmaxHistory(length=1)
    for a in seq:
        one.update(torch.tensor(a))
    assert one.amax().item() == 5.0 and one.steps == len(seq)
    assert AmaxHistory().length == 1024  # TE's DelayedScaling default amax_history_len


def test_amax_history_state_dict_round_trip():
    h = AmaxHistory(length=4, algo="ema")
    for a in [3.0, 1.0]:
        h.update(torch.tensor(a))
    g = AmaxHistory(length=4, algo="ema")
    g.load_state_dict(h.state_dict())
    g.update(torch.tensor(2.0))
    h.update(torch.tensor(2.0))
    assert torch.equal(g.history, h.history) and g.amax() == h.amax()
    with pytest.raises(MinifloatError, match="length 4 does not fit length 2"):
        AmaxHistory(length=2).load_state_dict(h.state_dict())
    with pytest.raises(MinifloatError, match="unknown amax algorithm 'mean'"):
        AmaxHistory(algo="mean")
