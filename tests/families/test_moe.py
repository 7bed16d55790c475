"""Mixtures of experts: every expert quantized (its fused 3-D parameters as one Linear per expert
weight), the router kept, GPTQ per expert on the tokens routed to it, an expert its router never
chose rounded to nearest and said so, the export read back by transformers + compressed-tensors."""

import copy

import pytest
import torch

from minifloat.data.text import TextSource, batches_for, tokenizer_for
from minifloat.infer.checkpoints.loaders import load_model as load_quantized
from minifloat.infer.evaluation.pipeline import quantize_checkpoint
from minifloat.infer.ptq.method import PTQMethod
from minifloat.infer.quantize import EXPERT, calibrate, quantize_model
from minifloat.models.experts import ExpertLinears
from minifloat.models.loading import load_model
from tests.families.tiny import EXPERTS, MOE_FAMILIES, tiny_moe


def _source(docs):
    return TextSource(data=str(docs), batch_size=2, seq_len=32, eval_batches=1, calib_batches=4)


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe(request, tmp_path_factory):
    return request.param, tiny_moe(tmp_path_factory.mktemp(request.param) / "model", request.param)


def test_the_unfused_experts_compute_what_the_fused_ones_did(moe):
    import transformers

    _, folder = moe
    fused = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = load_model(folder)
    assert all(isinstance(layer.mlp.experts, ExpertLinears) and len(layer.mlp.experts) == EXPERTS for layer in ours.model.layers)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, fused(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def _routed_inputs(model, batches):
    """Each expert Linear's inputs on `batches` (the tokens its router sent it), by name."""
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and EXPERT.search(name):
            hooks.append(m.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, []).append(args[0].detach())))
    with torch.no_grad():
        for b in batches:
            model(input_ids=b[:, :-1])
    for h in hooks:
        h.remove()
    return {n: torch.cat(x) for n, x in seen.items()}


def test_every_expert_is_quantized_and_gptq_beats_rtn_on_its_own_tokens(moe, docs):
    name, folder = moe
    model = load_model(folder)
    calib = batches_for(model, _source(docs), "train", tokenizer_for(folder))
    rtn, gptq = copy.deepcopy(model), copy.deepcopy(model)
    s_rtn = quantize_model(rtn, "nvfp4-weight-only", ignore=("lm_head",))
    s_gptq = quantize_model(gptq, "nvfp4-weight-only", calibration=calib, method=PTQMethod(method="gptq"))  # plain: no rotation
    experts = [r for r in s_gptq.quantized if EXPERT.search(r.name)]
    per_expert = 2 if name == "gptoss" else 3  # gate_up + down, or gate, up and down
    assert len(experts) == 2 * EXPERTS * per_expert  # every expert of both layers
    assert not any("router" in r.name or r.name.endswith("mlp.gate") for r in s_gptq.layers)  # the router is no Linear here
    weights = sum(r.shape[0] * r.shape[1] for r in experts)
    bits = 8 * sum(r.bytes_after - (4 * r.shape[0] if name == "gptoss" else 0) for r in experts) / weights
    assert bits == pytest.approx(4 + 8 / 16, abs=0.01)  # NVFP4: 4-bit codes + an E4M3 scale per 16 (+ a tensor scale)
    inputs = _routed_inputs(model, calib)
    err = {"rtn": 0.0, "gptq": 0.0}
    for layer, x in inputs.items():
        w = model.get_submodule(layer).weight
        for which, q in (("rtn", rtn), ("gptq", gptq)):
            err[which] += float((x @ (q.get_submodule(layer).weight.dequantize() - w).T).square().sum())
    assert err["gptq"] < err["rtn"], err
    assert {r.name for r in s_rtn.quantized} == {r.name for r in s_gptq.quantized}


def test_an_expert_its_router_never_chose_is_rounded_to_nearest_and_said_so(tmp_path, docs):
    folder = tiny_moe(tmp_path / "model", "gptoss", never_routed=5)
    model = load_model(folder)
    calib = batches_for(model, _source(docs), "train", tokenizer_for(folder))
    summary = quantize_model(model, "nvfp4", calibration=calib, method="gptq")  # W4A4: an input scale it never measured
    rows = {r.name: r for r in summary.layers}
    lonely = [r for n, r in rows.items() if ".experts.5." in n]
    assert lonely and all(r.scheme == "nvfp4" and "no calibration token" in (r.note or "") and "sibling" in r.note for r in lonely)
    assert all(r.scheme is not None for n, r in rows.items() if EXPERT.search(n))
    assert "router sent it no calibration token" in str(summary)
    plain = load_model(folder)  # round to nearest: the calibrated input scales, the siblings' where none was seen
    rtn = quantize_model(plain, "nvfp4", calibration=calibrate(plain, [b[:, :-1] for b in calib]))
    assert all(r.scheme == "nvfp4" and "sibling" in (r.note or "") for r in rtn.layers if ".experts.5." in r.name)


@pytest.mark.parametrize("scheme", ["fp8-weight-only", "mxfp4-weight-only", "mxfp6-weight-only"])
def test_the_export_reads_back_in_transformers(moe, docs, tmp_path, scheme):
    """Per-expert tensors: transformers decompresses them expert by expert into its fused parameters
    with the values minifloat's reader gives. Packed FP4 / FP6 experts come back in BF16, which holds
    an E2M1 / E2M3 code times a power-of-two scale exactly: in FP32 the logits agree."""
    name, folder = moe
    if name == "gptoss":
        pytest.skip("transformers maps GPT-OSS's checkpoints from OpenAI's MXFP4 blocks, not per-expert Linears")
    out = tmp_path / "ckpt"
    summary = quantize_checkpoint(folder, scheme, out, source=_source(docs), method="gptq")
    assert sum(bool(EXPERT.search(r.name)) for r in summary.quantized) == 2 * EXPERTS * 3
    hf = _transformers_reading(out)
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, load_quantized(out).eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def _transformers_reading(out):
    import transformers
    import transformers.utils.quantization_config as qc

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, quantization_config=qc.CompressedTensorsConfig(dequantize=True),
                                                           dtype=torch.float32)  # fmt: skip
    return hf.float().eval()


def test_transformers_still_drops_an_nvfp4_experts_global_scale(docs, tmp_path):
    """huggingface/transformers#48371: its expert path dequantizes NVFP4 experts without their
    `weight_global_scale`, so each comes back multiplied by it. minifloat's reader is exact (above,
    and tests/infer); when this fails, transformers reads them right: add nvfp4 to the test above."""
    folder = tiny_moe(tmp_path / "model", "mixtral")
    out = tmp_path / "ckpt"
    quantize_checkpoint(folder, "nvfp4-weight-only", out, source=_source(docs), method="gptq")
    ours, hf = load_quantized(out), _transformers_reading(out)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for layer in range(2):
            p = f"model.layers.{layer}.mlp.experts"
            gate_up, down = hf.get_submodule(p).gate_up_proj, hf.get_submodule(p).down_proj
            for e in range(EXPERTS):
                mine = ours.get_submodule(f"{p}.{e}")
                for got, w in ((gate_up[e][:64], "w1"), (gate_up[e][64:], "w3"), (down[e], "w2")):
                    g = float(f.get_tensor(f"{p}.{e}.{w}.weight_global_scale"))
                    expect = getattr(mine, w).weight.dequantize().double() * g
                    torch.testing.assert_close(got.double(), expect, rtol=1e-6, atol=0)
