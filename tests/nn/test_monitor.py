import math

import pytest
import torch

import minifloat


def test_records_every_operand_with_exact_fractions():
    layer = minifloat.nn.Linear(32, 32, recipe="fp8-current", bias=False)
    model = torch.nn.Sequential(layer)
    x = torch.full((4, 32), 1e-6)
    x[0, 0] = 448.0  # scale 1: the tiny values flush to zero (below E4M3's 2^-9)
    with minifloat.monitor(model) as mon:
        model(x).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
        model(x)
    inp = [r for r in mon.records if r["operand"] == "input"]
    assert [r["step"] for r in inp] == [0, 1]
    assert inp[0]["layer"] == "0" and inp[0]["amax"] == 448.0 and inp[0]["scale"] == 1.0
    assert inp[0]["flushed"] == pytest.approx(127 / 128)
    assert inp[0]["saturated"] == 0.0
    assert {r["operand"] for r in mon.records} == {"input", "weight", "grad_output"}
    assert mon.latest()[("0", "input")]["step"] == 1
    assert layer._monitor is None  # closed


def test_counts_steps_of_its_own_model_once_per_backward():
    model = minifloat.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)), "mxfp8")
    other = torch.nn.Linear(4, 4)
    # Two optimizers over one model (e.g. Muon for matrices, AdamW for the rest), and another model's.
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.0), torch.optim.SGD(model[1].parameters(), lr=0.0)]
    other_opt = torch.optim.SGD(other.parameters(), lr=0.0)
    with minifloat.monitor(model) as mon:
        for _ in range(3):
            model(torch.randn(2, 32)).sum().backward()
            for opt in opts:
                opt.step()
            other(torch.randn(1, 4)).sum().backward()
            other_opt.step()
        assert mon.step == 3  # was 9: every optimizer in the process counted
    assert sorted({r["step"] for r in mon.records}) == [0, 1, 2]


def test_saturation_with_a_delayed_scale():
    layer = minifloat.nn.Linear(32, 16, recipe="fp8")
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    layer(torch.ones(2, 32)).sum().backward()
    opt.step()  # history amax 1 → scale 448
    x = torch.ones(2, 32)
    x[0, :8] = 4.0  # 8 of 64 values above 448 / 448
    with minifloat.monitor(torch.nn.Sequential(layer)) as mon:
        layer(x)
    assert mon.records[0]["saturated"] == pytest.approx(8 / 64)


def test_names_the_first_layer_that_went_nonfinite():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    minifloat.convert(model, "mxfp8")
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    with minifloat.monitor(model) as mon:
        model(torch.randn(4, 32)).sum().backward()
    assert mon.first_nonfinite == {"step": 0, "layer": "1", "where": "output"}


def test_sampling_every_n_steps_still_checks_nonfinite_each_step():
    layer = minifloat.nn.Linear(32, 32, recipe="mxfp8", bias=False)
    model = torch.nn.Sequential(layer)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with minifloat.monitor(model, every=2) as mon:
        for step in range(4):
            x = torch.randn(4, 32)
            if step == 3:
                x[0, 0] = float("nan")
            model(x).sum().backward()
            opt.step()
    assert sorted({r["step"] for r in mon.records}) == [0, 2]
    assert mon.first_nonfinite == {"step": 3, "layer": "0", "where": "output"}
    with pytest.raises(minifloat.MinifloatError, match="every=0"):
        minifloat.monitor(model, every=0)


def test_a_block_whose_nvfp4_scale_underflows_counts_as_flushed_not_saturated():
    layer = minifloat.nn.Linear(32, 16, recipe="nvfp4", bias=False)
    x = torch.full((1, 32), 1e-9)  # second block: scale 1e-9/6 · 6·448/1e4 underflows E4M3
    x[0, :16] = 1e4
    with minifloat.monitor(torch.nn.Sequential(layer)) as mon:
        layer(x)
    inp = next(r for r in mon.records if r["operand"] == "input")
    assert inp["flushed"] == 0.5 and inp["saturated"] == 0.0


def test_the_first_nonfinite_is_kept_across_steps_and_records_are_bounded():
    model = torch.nn.Sequential(minifloat.nn.Linear(32, 32, recipe="fp8-current"), minifloat.nn.Linear(32, 32, recipe="fp8-current"))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with minifloat.monitor(model, max_records=5) as mon:
        for step in range(3):
            x = torch.randn(4, 32)
            if step:
                x[0, 0] = float("nan")  # layer 0's output: NaN from step 1 on
            model(x).sum().backward()
            opt.step()
        assert mon.first_nonfinite == {"step": 1, "layer": "0", "where": "output"}
    assert len(mon.records) == 5 and mon.records[-1]["step"] == 2  # the newest 5 of 18
    with pytest.raises(minifloat.MinifloatError, match="max_records=0"):
        minifloat.monitor(model, max_records=0)


def test_nonfinite_checks_read_no_tensor_during_forward_and_backward(monkeypatch):
    # bool(tensor) is a device sync on a GPU; the flags are read once per optimizer step.
    model = torch.nn.Sequential(minifloat.nn.Linear(32, 32, recipe="mxfp8"), minifloat.nn.Linear(32, 32, recipe="mxfp8"))
    reads = []
    real = torch.Tensor.__bool__
    x = torch.randn(4, 32)
    x[0, 0] = float("nan")  # layer 0's output goes NaN: the checks have something to find
    with minifloat.monitor(model, every=1000) as mon:
        mon.step = 1  # not a recording step: only the checks run
        monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(t) or real(t))
        model(x).sum().backward()
        monkeypatch.undo()
        assert reads == []
        assert mon.first_nonfinite == {"step": 1, "layer": "0", "where": "output"}  # read now, once


def test_refuses_what_it_could_not_watch():
    model = minifloat.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)), "mxfp8")
    with pytest.raises(minifloat.MinifloatError, match="monitor\\(\\) takes a torch.nn.Module, got str"):
        minifloat.monitor("model")
    # Each layer has one monitor slot: a second monitor would silence the first.
    with minifloat.monitor(model) as first:
        with pytest.raises(minifloat.MinifloatError, match="layer 0 is already watched by another monitor"):
            minifloat.monitor(model)
        model(torch.randn(2, 32))
    assert {r["layer"] for r in first.records} == {"0", "1"}
    minifloat.monitor(model).close()  # free again once the first is closed
    with pytest.warns(UserWarning, match="no minifloat Linear layers, so nothing will be recorded; convert it first"):
        minifloat.monitor(torch.nn.Sequential(torch.nn.Linear(32, 32))).close()


def test_edge_cases_of_counting_and_recording():
    layer = minifloat.nn.Linear(32, 16, recipe="fp8", bias=False)
    model = torch.nn.Sequential(layer)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with minifloat.monitor(model) as mon:
        opt.step()  # an optimizer step before any forward is not a step of the model
        assert mon.step == 0
        layer(torch.zeros(0, 32))  # an empty batch: amax 0, nothing saturated or flushed
        empty = next(r for r in mon.records if r["operand"] == "input")
        assert (empty["amax"], empty["saturated"], empty["flushed"]) == (0.0, 0.0, 0.0)
    layer(torch.ones(2, 32)).sum().backward()
    opt.step()  # delayed scaling: history amax 1 → scale 448 (TE's encode multiplier)
    x = torch.ones(2, 32)
    x[1, :4] = 0.0  # zeros are not "flushed"
    with minifloat.monitor(model, max_records=1) as mon:  # 1 is allowed: the newest record only
        layer(torch.ones(2, 32))
        layer(x)
    assert len(mon.records) == 1 and mon.records[0]["operand"] == "weight"
    with minifloat.monitor(model) as mon:
        layer(x)
    inp = mon.records[0]
    assert inp["operand"] == "input" and inp["scale"] == pytest.approx(448.0, rel=1e-6) and inp["flushed"] == 0.0


def test_the_no_layers_warning_points_at_the_caller():
    with pytest.warns(UserWarning, match="no minifloat Linear layers") as caught:
        minifloat.monitor(torch.nn.Sequential(torch.nn.Linear(4, 4))).close()
    assert caught[0].filename == __file__


def test_pending_checks_stay_bounded_without_optimizer_steps(monkeypatch):
    # Inference: no optimizer step ever reads the flags, so they are read every 4096 checks.
    layer = minifloat.nn.Linear(8, 8, recipe="mxfp8", bias=False)
    reads, real = [], torch.Tensor.tolist
    with minifloat.monitor(torch.nn.Sequential(layer)) as mon:
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or real(t))
        for _ in range(4100):  # what 4100 forwards check (one output each), without running them
            mon.check(layer, "output", torch.ones(1))
        monkeypatch.undo()
        assert reads == [4096]  # the flags read once, when 4096 were pending
        assert mon.first_nonfinite is None


def test_an_all_zero_nvfp4_input_has_no_scale():
    # NVFP4's decode scales of an all-zero tensor are 0: no encode multiplier exists (NaN, not inf)
    layer = minifloat.nn.Linear(32, 16, recipe="nvfp4", bias=False)
    with minifloat.monitor(torch.nn.Sequential(layer)) as mon:
        layer(torch.zeros(2, 32))
    inp = next(r for r in mon.records if r["operand"] == "input")
    assert math.isnan(inp["scale"]) and (inp["amax"], inp["saturated"], inp["flushed"]) == (0.0, 0.0, 0.0)
