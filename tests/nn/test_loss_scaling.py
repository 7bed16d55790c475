import pytest
import torch

import minifloat
from minifloat import LossScaler


def _setup(scale=8.0, interval=2):
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return model, opt, LossScaler(init_scale=scale, growth_interval=interval)


def _step(model, opt, scaler, x):
    opt.zero_grad()
    scaler.scale(model(x).sum()).backward()
    took = scaler.step(opt)
    scaler.update()
    return took


def test_gradients_are_unscaled_before_the_step():
    model, opt, scaler = _setup()
    x = torch.ones(2, 4)
    opt.zero_grad()
    scaler.scale(model(x).sum()).backward()
    assert model.weight.grad[0, 0].item() == 16.0  # 2 rows × scale 8
    scaler.unscale_(opt)
    assert model.weight.grad[0, 0].item() == 2.0
    assert scaler.step(opt)
    assert model.weight[0, 0].item() == -1.0


def test_overflow_skips_the_step_and_backs_off():
    model, opt, scaler = _setup(scale=8.0)
    before = model.weight.detach().clone()
    assert not _step(model, opt, scaler, torch.full((1, 4), float("inf")))
    assert torch.equal(model.weight, before)
    assert scaler.get_scale() == 4.0 and scaler.skipped_steps == 1


@pytest.mark.parametrize("bad_first", [True, False])
def test_overflow_skips_only_that_optimizers_step(bad_first):
    # As torch's GradScaler: the optimizer with finite gradients steps, in either order; the
    # scale backs off once for the step.
    (good, good_opt, scaler), (bad, bad_opt, _) = _setup(scale=8.0), _setup()
    before = bad.weight.detach().clone()
    for opt in (good_opt, bad_opt):
        opt.zero_grad()
    scaler.scale(good(torch.ones(1, 4)).sum() + bad(torch.full((1, 4), float("inf"))).sum()).backward()
    order = [(bad_opt, False), (good_opt, True)] if bad_first else [(good_opt, True), (bad_opt, False)]
    assert [scaler.step(opt) for opt, _ in order] == [took for _, took in order]
    scaler.update()
    assert torch.equal(bad.weight, before) and good.weight[0, 0].item() == 0.0  # 1 - lr * 1
    assert scaler.get_scale() == 4.0 and scaler.skipped_steps == 1


def test_growth_after_interval_of_finite_steps():
    model, opt, scaler = _setup(scale=8.0, interval=2)
    _step(model, opt, scaler, torch.ones(1, 4))
    assert scaler.get_scale() == 8.0
    _step(model, opt, scaler, torch.ones(1, 4))
    assert scaler.get_scale() == 16.0
    _step(model, opt, scaler, torch.ones(1, 4))  # the tracker restarted at the growth
    assert scaler.get_scale() == 16.0
    _step(model, opt, scaler, torch.ones(1, 4))
    assert scaler.get_scale() == 32.0
    _step(model, opt, scaler, torch.ones(1, 4))  # one finite step counted
    _step(model, opt, scaler, torch.full((1, 4), float("nan")))
    _step(model, opt, scaler, torch.ones(1, 4))  # the tracker restarted at the overflow
    assert scaler.get_scale() == 16.0


def test_state_dict_round_trip_and_errors():
    model, opt, scaler = _setup()
    _step(model, opt, scaler, torch.full((1, 4), float("inf")))
    other = LossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict() == {"scale": 4.0, "growth_tracker": 0, "skipped_steps": 1}
    with pytest.raises(minifloat.MinifloatError, match="not a LossScaler state"):
        other.load_state_dict({"scale": 1.0})
    for scale in (float("nan"), 0.0, float("inf")):
        bad = {"scale": scale, "growth_tracker": 0, "skipped_steps": 0}
        with pytest.raises(minifloat.MinifloatError, match="a loss scale is finite and > 0"):
            other.load_state_dict(bad)
    assert other.get_scale() == 4.0  # a refused state changes nothing
    other.load_state_dict({"scale": 0.5, "growth_tracker": 3, "skipped_steps": 2})  # scales below 1 are scales
    assert other.state_dict() == {"scale": 0.5, "growth_tracker": 3, "skipped_steps": 2}
    with pytest.raises(minifloat.MinifloatError, match="growth_factor > 1"):
        LossScaler(growth_factor=0.5)
    # an infinite scale would skip every step forever; bounds that exclude the start are typos
    for kwargs in ({"init_scale": float("inf")}, {"init_scale": float("nan")}, {"min_scale": 2.0, "init_scale": 1.0},
                   {"max_scale": 1.0}, {"min_scale": 0.0}, {"max_scale": float("inf")}, {"growth_factor": float("inf")},
                   {"growth_factor": 1.0}, {"backoff_factor": 0.0}, {"backoff_factor": 1.0}, {"growth_interval": 0}):  # fmt: skip
        with pytest.raises(minifloat.MinifloatError, match="0 < min_scale ≤ init_scale ≤ max_scale < inf"):
            LossScaler(**kwargs)
    with pytest.raises(minifloat.MinifloatError, match="update\\(\\) before step"):
        LossScaler().update()


def test_skipped_step_does_not_roll_delayed_scaling_history():
    layer = minifloat.nn.Linear(32, 16, recipe="fp8")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=2.0**16)
    x = torch.randn(4, 32)
    x[0, 0] = float("inf")  # saturates the input; its output row overflows
    opt.zero_grad()
    scaler.scale(layer(x * 1e38).sum()).backward()
    assert not scaler.step(opt)
    scaler.update()
    assert int(layer.amax_steps) == 0  # no optimizer step, no history entry


def test_defaults_are_torchs_gradscaler_defaults():
    ours, torchs = LossScaler(), torch.amp.GradScaler("cpu")
    assert ours.get_scale() == torchs.get_scale() == 2.0**16
    assert (ours.growth_factor, ours.backoff_factor, ours.growth_interval) == (
        torchs.get_growth_factor(), torchs.get_backoff_factor(), torchs.get_growth_interval())  # fmt: skip


def test_scale_stays_within_its_bounds_and_the_bounds_may_meet():
    model, opt, _ = _setup()
    scaler = LossScaler(init_scale=4.0, min_scale=2.0, max_scale=8.0, growth_factor=1.5, backoff_factor=0.25,
                        growth_interval=1)  # fmt: skip
    _step(model, opt, scaler, torch.ones(1, 4))
    assert scaler.get_scale() == 6.0
    _step(model, opt, scaler, torch.ones(1, 4))
    assert scaler.get_scale() == 8.0  # 9 capped at max_scale
    _step(model, opt, scaler, torch.full((1, 4), float("inf")))
    assert scaler.get_scale() == 2.0  # 2 = 8 / 4 = min_scale
    _step(model, opt, scaler, torch.full((1, 4), float("inf")))
    assert scaler.get_scale() == 2.0  # 0.5 raised to min_scale
    fixed = LossScaler(init_scale=1.0, min_scale=1.0, max_scale=1.0)
    _step(model, opt, fixed, torch.full((1, 4), float("inf")))
    assert fixed.get_scale() == 1.0 and fixed.skipped_steps == 1


def test_disabled_scaler_does_not_scale_but_still_skips_non_finite_steps():
    model, opt, _ = _setup()
    scaler = LossScaler(init_scale=8.0, growth_interval=1, enabled=False)
    assert scaler.get_scale() == 1.0
    loss = model(torch.ones(2, 4)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    assert not scaler.unscale_(opt) and model.weight.grad[0, 0].item() == 2.0  # not divided
    assert scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1.0  # no growth
    before = model.weight.detach().clone()
    assert not _step(model, opt, scaler, torch.full((1, 4), float("nan")))
    assert torch.equal(model.weight, before) and scaler.skipped_steps == 1 and scaler.get_scale() == 1.0
