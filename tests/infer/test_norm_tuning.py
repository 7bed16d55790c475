"""Norm tuning after PTQ: the quantized layers' training view against an oracle built here
(torch's own float8 cast, the dequantized weight), the distillation against the teacher's logits
on windows it never saw, and through `quantize_model` / `eval`: only the gains move."""

import copy
import dataclasses
import json

import pytest
import torch

import minifloat
from minifloat.infer import QuantizedLinear, get_quant_config, quantize_model
from minifloat.infer.evaluation.metrics import evaluate
from minifloat.infer.ptq.method import resolve_method
from minifloat.infer.ptq.norm_tuning import NormTuning, norm_parameters, tune_norms
from minifloat.nn.convert import swap_modules

transformers = pytest.importorskip("transformers")


def per_token_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp8-dynamic's input as the field defines it: per row, scale amax / 448, torch's E4M3 cast."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (x / s).to(torch.float8_e4m3fn).float() * s


def test_the_training_view_computes_the_layers_product_and_passes_the_gradient_straight_through():
    g = torch.Generator().manual_seed(0)
    layer = QuantizedLinear.from_linear(torch.nn.Linear(96, 48), "fp8-dynamic")
    view = layer.differentiable()
    x = (torch.randn(5, 7, 96, generator=g) * torch.logspace(-2, 2, 96)).requires_grad_(True)
    y = view(x)
    w = layer.weight.dequantize()[:48, :96]
    oracle = torch.nn.functional.linear(per_token_e4m3(x.detach().reshape(-1, 96)), w, layer.bias).reshape(5, 7, 48)
    torch.testing.assert_close(y, oracle, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(y, layer(x), rtol=1e-5, atol=1e-5)  # what the packed layer serves
    up = torch.randn(5, 7, 48, generator=g)
    y.backward(up)
    torch.testing.assert_close(x.grad, up @ w, rtol=1e-5, atol=1e-5)  # d(x Wᵀ)/dx, the rounding passed through
    assert not any(b.requires_grad for b in view.buffers())


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # sharper distributions: a KL worth fitting
    return model


def _windows(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 33), generator=g) for _ in range(n)]


def _training_view(model) -> dict[str, QuantizedLinear]:
    """Each `QuantizedLinear` of `model` swapped for its training view, as `quantize_model` does
    before tuning; returns the packed layers by name (to swap back)."""
    packed = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    swap_modules(model, list(packed), lambda old: old.differentiable())
    return packed


def _kl(model, reference, batches) -> float:
    return evaluate(model, reference, batches)["kl"]


@pytest.mark.parametrize("config", ["fp8-dynamic", "mxfp8", "nvfp4-weight-only"])
def test_distillation_recovers_gains_the_quantized_student_lost_on_windows_it_never_saw(config):
    """The student: the teacher quantized, then its gains knocked off by a random factor per
    channel — what the tuning must undo through each quantized layer's rounding. Held-out KL to
    the teacher (an evaluation of both models, not the tuning's own figure) falls tenfold."""
    teacher = _llama()
    student = copy.deepcopy(teacher)
    quantize_model(student, config, calibration=_windows(1))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in norm_parameters(student).values():
            p.mul_(torch.exp(torch.randn(p.shape, generator=g) * 0.5))
    held_out = _windows(9)
    before = _kl(student, teacher, held_out)
    packed = _training_view(student)
    r = tune_norms(student, teacher, _windows(3, 8), NormTuning(steps=100, lr=5e-2))
    for n, q in packed.items():
        swap_modules(student, [n], lambda old, q=q: q)
    after = _kl(student, teacher, held_out)
    assert r.parameters == 5 * 128 and r.kl_after < r.kl_before
    assert after < before / 8, (before, after)  # 0.43 → 0.03-0.04; quantization alone: 0.001-0.01
    assert all(p.requires_grad and p.grad is None for p in student.parameters())


def test_a_bf16_gain_takes_steps_smaller_than_its_spacing():
    """AdamW at 1e-3 on gains near 0.5, where BF16's spacing is 2⁻⁹ ≈ 0.002: steps applied to the BF16
    gain itself would round away; through an FP32 master they add up."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 64))
    with torch.no_grad():
        teacher[2].weight.mul_(8)
    student = copy.deepcopy(teacher).to(torch.bfloat16)
    with torch.no_grad():
        student[1].weight.fill_(0.5)
    windows = [torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    r = tune_norms(student, teacher, windows, NormTuning(steps=40, lr=1e-3, warmup=0))
    assert student[1].weight.dtype == torch.bfloat16
    moved = (student[1].weight.detach().float() - 0.5).abs()
    assert float(moved.mean()) > 4 * 2**-9 and r.kl_after < 0.95 * r.kl_before, (moved, r)  # several spacings


def test_a_steps_windows_go_through_in_passes_that_fit_the_logits_budget(monkeypatch):
    """A large vocabulary's logits bound how many windows go through the model at once (memory that
    does not grow with `NormTuning.rows`); the step is the same — its mean KL, its gradient — so the
    gains come out as one pass's, up to the order of float32 sums. The passes seen by a hook."""
    from minifloat.infer.ptq import norm_tuning

    teacher = _llama()
    quantized = copy.deepcopy(teacher)
    quantize_model(quantized, "fp8-dynamic", calibration=_windows(1))
    windows = _windows(5, 3)  # 4 windows of 32 tokens each
    gains, results, sizes = [], [], []
    for budget in (norm_tuning.LOGITS_BUDGET, 2 * 32 * 256):  # all 4 windows in one pass; 2 windows a pass
        monkeypatch.setattr(norm_tuning, "LOGITS_BUDGET", budget)
        student = copy.deepcopy(quantized)
        _training_view(student)
        seen = []
        hook = student.register_forward_pre_hook(lambda mod, args, seen=seen: seen.append(args[0].shape[0]))
        results.append(tune_norms(student, teacher, windows, NormTuning(steps=3, lr=1e-3, warmup=0)))
        hook.remove()
        sizes.append(set(seen))
        gains.append(torch.cat([p.detach().flatten() for p in norm_parameters(student).values()]))
    assert sizes == [{4}, {2}]
    assert abs(results[0].kl_before - results[1].kl_before) < 1e-6 * results[0].kl_before
    assert abs(results[0].kl_after - results[1].kl_after) < 1e-4 * results[0].kl_after
    moved = (gains[0] - 1).abs().max()
    assert moved > 1e-3 and (gains[0] - gains[1]).abs().max() < 1e-3 * moved  # Adam: about lr a step


def test_a_tuning_that_does_not_lower_the_kl_puts_the_gains_back():
    """A step far too large (lr 10) throws the gains off: the KL on the tuning's own windows rises, and
    the gains come back to the bit, said in the result and in the summary."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 64))
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student[1].weight.mul_(0.9)
    gains = {n: p.detach().clone() for n, p in norm_parameters(student).items()}
    windows = [torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    from minifloat.infer.quantize import QuantizeSummary

    whole = tune_norms(student, teacher, windows, NormTuning(steps=6, lr=10.0, warmup=0, check=0))  # no check: all 6 steps
    assert not whole.kept and whole.kl_after > whole.kl_before and whole.steps == whole.asked == 6
    assert all(torch.equal(p, gains[n]) for n, p in norm_parameters(student).items())
    assert "6 steps" in str(QuantizeSummary(get_quant_config("fp8-dynamic"), tuning=whole))
    assert "(not lower: the gains as they were before tuning are kept)" in str(QuantizeSummary(get_quant_config("fp8-dynamic"), tuning=whole))
    # the check after half the steps: the KL has risen by then, so the tuning stops there, its gains put back
    r = tune_norms(student, teacher, windows, NormTuning(steps=6, lr=10.0, warmup=0))
    assert not r.kept and r.kl_after > r.kl_before and (r.steps, r.asked) == (3, 6) and r.seconds > 0
    assert all(torch.equal(p, gains[n]) for n, p in norm_parameters(student).items())
    said = str(QuantizeSummary(get_quant_config("fp8-dynamic"), tuning=r))
    assert "3 of 6 steps" in said and "(not lower after 3 steps, stopped: the gains as they were before tuning are kept)" in said
    useful = tune_norms(student, teacher, windows, NormTuning(steps=20, lr=0.05))  # a useful tuning passes its check
    assert useful.kept and useful.steps == 20
    with pytest.raises(minifloat.MinifloatError, match="check is a fraction of its steps"):
        NormTuning(check=1.0)


def test_quantize_model_tunes_only_the_gains_and_says_so():
    batches = _windows(1)
    plain, tuned = _llama(), _llama()
    reference = _llama()
    quantize_model(plain, "fp8-dynamic", calibration=batches, method="gptq")
    method = resolve_method("gptq", "fp8-dynamic", tune_norms=20)
    with torch.no_grad():  # as a caller quantizing under no_grad: the tuning still has its gradients
        summary = quantize_model(tuned, "fp8-dynamic", calibration=batches, method=method, tuning=_windows(5, 8))
    assert method.label == "gptq+norms20" and summary.tuning.steps == 20
    assert summary.tuning.parameters == 5 * 128 and summary.tuning.kl_after < summary.tuning.kl_before
    assert "norm tuning: 640 normalization values, 20 steps" in str(summary)
    assert json.loads(json.dumps(summary.to_dict()))["norm_tuning"]["steps"] == 20
    gains = norm_parameters(tuned)
    changed = {n for n, p in gains.items() if not torch.equal(p, norm_parameters(plain)[n])}
    assert changed == set(gains)  # every gain moved ...
    for (n, a), (_, b) in zip(tuned.state_dict().items(), plain.state_dict().items(), strict=True):
        if n not in gains:  # ... and nothing else: the packed weights are GPTQ's, to the bit
            assert torch.equal(a, b), n
    assert all(isinstance(tuned.get_submodule(n), QuantizedLinear) for n, m in plain.named_modules()
               if isinstance(m, QuantizedLinear))  # fmt: skip
    assert all(torch.equal(p, q) for p, q in zip(reference.parameters(), _llama().parameters(), strict=True))


def test_norm_tuning_options_are_checked_before_any_work():
    assert resolve_method("gptq", "fp8-dynamic", tune_norms=0).norm_tuning is None
    assert resolve_method("rtn", "mxfp8", tune_norms=7).norm_tuning == NormTuning(steps=7)
    for bad in (-1, 2.5, True):
        with pytest.raises(minifloat.MinifloatError, match="tune_norms takes a number of steps"):
            resolve_method("gptq", "fp8-dynamic", tune_norms=bad)
    with pytest.raises(minifloat.MinifloatError, match="learning rate"):
        NormTuning(lr=float("nan"))
    method = resolve_method("rtn", "fp8-dynamic", tune_norms=3)
    model = _llama()
    with pytest.raises(minifloat.MinifloatError, match="tunes norms on token windows"):
        quantize_model(model, "fp8-dynamic", method=method)
    with pytest.raises(minifloat.MinifloatError, match="token windows"):
        quantize_model(model, "fp8-dynamic", method=method, tuning=[torch.zeros(4)])
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())  # nothing was quantized
    once = quantize_model(model, "fp8-dynamic", calibration=iter(_windows(1)), method=resolve_method("gptq", "fp8-dynamic", tune_norms=2))
    assert len(once.quantized) == 14 and once.tuning.asked == 2 and once.tuning.steps >= 1  # a one-pass iterator: GPTQ's and the tuning's windows
    with pytest.raises(minifloat.MinifloatError, match="no normalization layer"):
        tune_norms(torch.nn.Sequential(torch.nn.Embedding(8, 8)), torch.nn.Sequential(torch.nn.Embedding(8, 8)),
                   [torch.zeros(1, 3, dtype=torch.long)])  # fmt: skip


def test_eval_tunes_norms_from_the_command_line(tmp_path, capsys):
    """`eval --tune-norms`: the method in the summary's label; the flag wants a scheme."""
    from minifloat.cli import main

    model = _llama()
    model.save_pretrained(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("".join(chr(97 + (i * 7) % 26) + (" " if i % 5 == 0 else "") for i in range(40_000)))
    args = [str(tmp_path / "m"), "--data", str(text), "--eval-batches", "2", "--calib-batches", "2",
            "--batch-size", "2", "--seq-len", "32", "--json"]  # fmt: skip
    assert main(["eval", *args, "--scheme", "fp8-dynamic", "--tune-norms", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kl"] >= 0 and out["delta_ppl_pct"] == pytest.approx(100 * (out["ppl"] / out["ppl_ref"] - 1), rel=1e-6)
    assert main(["eval", *args, "--tune-norms", "4"]) == 2
    assert "--tune-norms / --keep-channels go with --scheme" in capsys.readouterr().err


def test_a_tuned_export_holds_the_tuned_gains(tmp_path):
    from safetensors.torch import load_file

    from minifloat.data.text import TextSource
    from minifloat.infer.evaluation.pipeline import quantize_checkpoint

    model = _llama()
    model.save_pretrained(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("".join(chr(97 + (i * 11) % 26) + (" " if i % 4 == 0 else "") for i in range(40_000)))
    source = TextSource(data=str(text), calib_batches=2, batch_size=2, seq_len=32)
    method = dataclasses.replace(resolve_method("gptq", "fp8-dynamic", tune_norms=6), norm_tuning=NormTuning(steps=6, lr=1e-2))
    summary = quantize_checkpoint(tmp_path / "m", "fp8-dynamic", tmp_path / "q", source=source, method=method)
    saved = load_file(tmp_path / "q" / "model.safetensors")
    original = model.state_dict()
    for n in norm_parameters(model):
        assert not torch.equal(saved[n].float(), original[n].float()), n
    assert summary.tuning is not None and summary.tuning.steps == 6
