"""`minifloat.optim.AdamW` against torch's AdamW, the storage formats against float64 and ml_dtypes."""

import copy
import io
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import minifloat
from minifloat.optim import (
    AdamW,
    bf16_stochastic,
    decode_state,
    dre_forward,
    dre_inverse,
    encode_state,
    join_remainder,
)
from tests.conftest import requires_cuda

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(37, 53, generator=g)), torch.nn.Parameter(torch.randn(300, generator=g))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * torch.exp(torch.randn(p.shape, generator=g))).to(p.dtype)


def _steps(runs, steps):
    """The same gradients, step by step, for each (parameters, optimizer) of `runs`."""
    for step in steps:
        for params, opt in runs:
            _grads(params, step)
            opt.step()


def _close(ours, theirs):
    for p, q in zip(ours, theirs, strict=True):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)


def test_fp32_states_are_torch_adamw():
    ours, theirs = _params(), _params()
    _steps([(ours, AdamW(ours, **HP)), (theirs, torch.optim.AdamW(theirs, **HP))], range(5))
    _close(ours, theirs)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8-dre"])
def test_a_step_equals_torch_adamw_on_the_stored_moments(fmt):
    """One step from a stored state equals torch's AdamW started from the very moments the format
    holds (decoded): the state's rounding is the only difference."""
    ours, theirs = _params(), _params()
    opt = AdamW(ours, **HP, state_format=fmt)
    _steps([(ours, opt)], range(3))
    b = torch.optim.AdamW(theirs, **HP)
    _steps([(theirs, b)], [3])  # creates its state, overwritten next with our decoded moments
    for p, q in zip(ours, theirs, strict=True):
        m, v = opt.moments(p)
        q.data.copy_(p.data)
        b.state[q]["exp_avg"].copy_(m)
        b.state[q]["exp_avg_sq"].copy_(v)
        b.state[q]["step"].fill_(3)
    _steps([(ours, opt), (theirs, b)], [3])
    _close(ours, theirs)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8-dre"])
def test_stored_moments_are_within_their_formats_rounding(fmt):
    """torch's exact AdamW moments, stored and read back: one rounding of the format (bf16: half
    an ulp; E4M3 with the block's absmax scale: 2^-4 relative, or 2^-10 of the scale for its
    subnormals; after the expansion: (1 + 2^-4)^(1/k) - 1 relative, k the block's exponent)."""
    params = _params()
    ref = torch.optim.AdamW(params, **HP)
    _steps([(params, ref)], range(3))
    for p in params:
        for x in (ref.state[p]["exp_avg"], ref.state[p]["exp_avg_sq"].sqrt()):
            got = decode_state(encode_state(x, fmt, block=128), fmt, x.shape).double().reshape(-1)
            want = x.double().reshape(-1)
            if fmt == "bf16":
                bound = want.abs() * 2**-8
            else:
                n = want.numel()
                blocks = torch.nn.functional.pad(want, (0, -n % 128)).view(-1, 128)
                scale = blocks.abs().amax(dim=1, keepdim=True) / 448
                if fmt == "fp8":
                    bound = torch.maximum(blocks.abs() * 2**-4, scale * 2**-10)
                else:  # COAT's exponent: k = ln(R) / ln(max / min) of the block's nonzero magnitudes, R
                    # E4M3's normal range 448 / 2^-6 (the published formula, computed here in float64)
                    mag = blocks.abs()
                    big = mag.amax(dim=1, keepdim=True)
                    small = torch.where(mag > 0, mag, torch.full_like(mag, math.inf)).amin(dim=1, keepdim=True)
                    spread = torch.log(big / small)
                    k = torch.where(spread > 0, math.log(448 / 2**-6) / spread, torch.ones_like(spread))
                    bound = blocks.abs() * ((1 + 2**-4) ** (1 / k) - 1) * 1.0001
                bound = bound.reshape(-1)[:n]
            assert ((got - want).abs() <= bound + 1e-30).all(), fmt


def test_dre_round_trip_is_exact_in_float64_and_fills_e4m3s_range():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 128, generator=g, dtype=torch.float64) * torch.exp(torch.randn(6, 1, generator=g, dtype=torch.float64) * 3))
    x[2] = 0.0  # an all-zero block
    x[3, :5] = 0.0
    x[4] = 2.5  # one magnitude
    y, c, k = dre_forward(x)
    assert torch.allclose(dre_inverse(y, c, k), x, rtol=1e-12, atol=0)
    mag = y[0].abs()
    spread = math.log(float(mag.max() / mag[mag > 0].min()))
    assert spread == pytest.approx(math.log(minifloat.E4M3.max / minifloat.E4M3.min_normal), rel=1e-9)
    assert k[4].item() == 1.0 and torch.equal(y[2], x[2])


def test_fp8_states_are_e4m3_codes_with_a_scale_per_block():
    x = torch.randn(1000) * 0.01
    s = encode_state(x, "fp8", block=128)
    assert s["codes"].shape == (8, 128) and s["codes"].dtype == torch.uint8 and s["scale"].shape == (8,)
    vals = s["codes"].numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64) * s["scale"].numpy()[:, None].astype(np.float64)
    got = decode_state(s, "fp8", x.shape)
    assert np.array_equal(got.numpy().astype(np.float64), vals.reshape(-1)[:1000].astype(np.float32).astype(np.float64))


def _resume_matches_a_straight_run(make_params, **kw):
    """Two identical runs of 2 steps; one goes through state_dict → torch.save (weights_only) →
    a new AdamW; 3 more steps each: the parameters agree bit for bit."""
    straight, resumed = make_params(), make_params()
    a, b = AdamW(straight, **HP, **kw), AdamW(resumed, **HP, **kw)
    _steps([(straight, a), (resumed, b)], range(2))
    buf = io.BytesIO()
    torch.save({"opt": b.state_dict(), "params": [p.detach().clone() for p in resumed]}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = [torch.nn.Parameter(t) for t in saved["params"]]
    c = AdamW(fresh, **HP, **kw)
    c.load_state_dict(saved["opt"])
    _steps([(straight, a), (fresh, c)], range(2, 5))
    for p, q in zip(straight, fresh, strict=True):
        assert q.dtype == p.dtype and torch.equal(p, q)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8", "fp8-dre"])
def test_resume_from_a_state_dict_is_bit_identical(fmt):
    _resume_matches_a_straight_run(_params, state_format=fmt)


def test_state_bytes_per_parameter_and_bad_arguments():
    sizes = {}
    for fmt in ("fp32", "bf16", "fp8", "fp8-dre"):
        p = torch.nn.Parameter(torch.randn(128 * 64))
        opt = AdamW([p], state_format=fmt)
        p.grad = torch.randn_like(p)
        opt.step()
        sizes[fmt] = (opt.state_nbytes() - 4) / p.numel()  # less the step counter
    assert sizes == {"fp32": 8.0, "bf16": 4.0, "fp8": 2 + 8 / 128, "fp8-dre": 2 + 24 / 128}
    with pytest.raises(minifloat.MinifloatError, match="state_format 'int8'"):
        AdamW([torch.nn.Parameter(torch.ones(2))], state_format="int8")


@pytest.mark.parametrize("fmt", ["bf16", "fp8-dre"])
def test_training_with_quantized_states_resumes_bit_for_bit(tmp_path, fmt):
    from minifloat import checkpoint
    from minifloat.train.config import TrainConfig
    from minifloat.train.loop import train

    cfg = dict(model="tiny", batch_size=4, seq_len=32, eval_every=0, max_bytes=200_000, warmup=2, optimizer_states=fmt)
    full = train(TrainConfig(steps=6, **cfg), tmp_path / "full", progress=False)
    train(TrainConfig(steps=3, **cfg), tmp_path / "split", progress=False)
    _, _, state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "split" / "checkpoints"))
    stored = next(iter(state["optimizer"]["state"].values()))
    assert {"exp_avg.value", "exp_avg.codes"} & set(stored)  # the quantized moments, as stored
    if fmt == "fp8-dre":
        assert stored["exp_avg.codes"].dtype == torch.uint8
    resumed = train(TrainConfig(steps=6, **cfg), tmp_path / "split", resume=True, progress=False)
    assert resumed["final"]["loss"] == full["final"]["loss"] and math.isfinite(full["final"]["loss"])


def test_a_bf16_remainder_run_checkpoints_its_fp32_masters_and_refuses_another_master(tmp_path):
    """The checkpoint's weights are the FP32 masters (BF16 parameter + remainder, exactly), so it
    serves any precision; resuming with another master or state format is refused by name."""
    from minifloat import checkpoint
    from minifloat.train.config import TrainConfig
    from minifloat.train.loop import train

    cfg = dict(model="tiny", batch_size=4, seq_len=32, eval_every=0, max_bytes=200_000, warmup=2, precision="fp8",
               optimizer_states="fp8", master="bf16+remainder")  # fmt: skip
    train(TrainConfig(steps=3, **cfg), tmp_path, progress=False)
    _, weights, state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "checkpoints"))
    w = weights["blocks.0.mlp.fc.weight"]
    assert w.dtype == torch.float32 and (w.view(torch.int32) & 0xFFFF).any()  # bits below BF16's: the remainder
    assert torch.equal(w, w.to(torch.bfloat16).float()) is False
    with pytest.raises(minifloat.MinifloatError, match="checkpoint has master='bf16\\+remainder', this run master='bf16-sr'"):
        train(TrainConfig(steps=6, **{**cfg, "master": "bf16-sr"}), tmp_path, resume=True, progress=False)
    with pytest.raises(minifloat.MinifloatError, match="--master bf16-sr keeps the weights in BF16, which --precision fp32"):
        TrainConfig(master="bf16-sr", precision="fp32")


def test_bf16_plus_remainder_is_the_fp32_master_exactly():
    """BF16 parameters with the int16 remainder follow an FP32-master run bit for bit (the same
    BF16-representable start and gradients); the parameters are the masters' nearest BF16."""
    exact = [torch.nn.Parameter(p.detach().to(torch.bfloat16).float()) for p in _params()]
    bf16 = [torch.nn.Parameter(p.detach().clone().to(torch.bfloat16)) for p in exact]
    a = AdamW(exact, **HP, state_format="fp8-dre")
    b = AdamW(bf16, **HP, state_format="fp8-dre", master="bf16+remainder")
    for step in range(4):
        _grads(exact, step)
        for p, q in zip(exact, bf16, strict=True):
            p.grad = p.grad.to(torch.bfloat16).float()
            q.grad = p.grad.to(torch.bfloat16)
        a.step()
        b.step()
    for p, q in zip(exact, bf16, strict=True):
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.to(torch.bfloat16))
        assert torch.equal(join_remainder(q, b.state[q]["remainder"]).view(torch.int32), p.detach().view(torch.int32))
    assert b.state[bf16[0]]["remainder"].dtype == torch.int16


def test_bf16_stochastic_rounding_is_unbiased():
    """Each value's expected rounding is itself: the mean of 200,000 draws within 5σ (σ of a
    Bernoulli choice between the two neighbouring BF16 values)."""
    n = 200_000
    for x0, seed in ((1.0 + 3 * 2**-10, 1), (-0.3, 2), (7.1e-3, 3), (2.0**-120 * 1.37, 4)):
        x = torch.full((n,), x0, dtype=torch.float32)
        y = bf16_stochastic(x, seed).double()
        # the two BF16 neighbours of x from its float32 bits: the upper 16 bits kept (toward zero),
        # and the next BF16 away from zero
        bits = int(np.array([x0], dtype=np.float32).view(np.uint32)[0])
        toward = np.array([bits & 0xFFFF0000], dtype=np.uint32).view(np.float32)[0]
        away = np.array([(bits & 0xFFFF0000) + 0x10000], dtype=np.uint32).view(np.float32)[0]
        lo, hi = sorted((float(toward), float(away) if bits & 0xFFFF else float(toward)))
        p = (float(x[0]) - lo) / (hi - lo) if hi > lo else 0.0
        sigma = (hi - lo) * math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(float(y.mean()) - float(x[0])) <= 5 * sigma + 1e-30, x0
        assert set(y.unique().tolist()) <= {lo, hi}
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    out = bf16_stochastic(special, 0).float()
    assert torch.isinf(out[:2]).all() and torch.isnan(out[2])


@pytest.mark.parametrize("master", ["bf16-sr", "bf16+remainder"])
def test_bf16_masters_resume_bit_for_bit(master):
    _resume_matches_a_straight_run(lambda: [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params()],
                                   state_format="fp8", master=master, seed=5)  # fmt: skip
    with pytest.raises(minifloat.MinifloatError, match="keeps the weights in bfloat16 parameters"):
        AdamW(_params(), master=master)


def test_bf16_parameters_store_in_bf16_and_compute_in_float32():
    """The oracle: the same model in float32 holding the BF16-rounded values. Its logits are the
    BF16-stored model's (every activation float32), and each BF16 gradient is its float32
    gradient rounded to BF16, whether the Linear is minifloat's (it quantizes the BF16 weight)
    or torch's."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.LayerNorm(32), minifloat.nn.Linear(32, 32, recipe="mxfp8"),
                              torch.nn.GELU(), torch.nn.Linear(32, 50))  # fmt: skip
    stored = minifloat.optim.bf16_parameters(net)
    reference = copy.deepcopy(stored)
    for module in reference.modules():  # a float32 model of the same values, without the casts
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()
        for name, p in module.named_parameters(recurse=False):
            setattr(module, name, torch.nn.Parameter(p.detach().float()))
    idx = torch.randint(0, 50, (4, 9))
    minifloat.optim.bf16_parameters(stored)  # again: still one cast per forward
    ours, theirs = stored(idx), reference(idx)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    for (name, p), q in zip(stored.named_parameters(), reference.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16, name
        assert torch.equal(p.grad, q.grad.to(torch.bfloat16)), name
    assert all(type(p) is torch.nn.Parameter for p in stored.parameters())  # restored after the forward
    bf16_compute = minifloat.optim.bf16_parameters(copy.deepcopy(reference), compute_dtype=None)
    assert bf16_compute(idx).dtype == torch.bfloat16


@requires_cuda
@pytest.mark.parametrize("fmt,master", [("fp32", "fp32"), ("bf16", "fp32"), ("fp8", "fp32"), ("fp8-dre", "bf16-sr"),
                                        ("fp8-dre", "bf16+remainder")])  # fmt: skip
def test_cuda_steps_match_cpu(fmt, master):
    """The same steps on a GPU: the stored states decode to the CPU's within one FP32 rounding of
    the update (the quantizers are bit-exact on both; torch's elementwise kernels may fuse)."""
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    cpu = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params()]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    a, b = (AdamW(ps, **HP, state_format=fmt, master=master) for ps in (cpu, gpu))
    for step in range(4):
        _grads(cpu, step)
        for p, q in zip(cpu, gpu, strict=True):
            q.grad = p.grad.cuda()
        a.step()
        b.step()
    for p, q in zip(cpu, gpu, strict=True):
        assert torch.allclose(q.cpu().float(), p.float(), rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=1e-7)
        for x, y in zip(a.moments(p), b.moments(q), strict=True):
            assert torch.allclose(y.cpu(), x, rtol=2**-3, atol=1e-6 * x.abs().max().item())
