"""GPTQ, the scale observers, rotations and smoothing, against independent references: layer
output errors measured here in float64, every value checked on its format's grid with ml_dtypes,
the MSE scale against a brute force over every scale of its grid, transforms against the
unquantized float64 product."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import minifloat
from minifloat.infer import QUANT_CONFIGS, QuantizedLinear, get_quant_config, quantize_model
from minifloat.infer.ptq import gptq as gptq_module
from minifloat.infer.ptq.gptq import GPTQConfig, gptq
from minifloat.infer.ptq.method import PTQMethod, resolve_method
from minifloat.infer.ptq.norm_tuning import NormTuning
from minifloat.infer.ptq.rotation import HadamardRotation
from minifloat.infer.ptq.scales import observe_scales
from minifloat.infer.ptq.smoothing import Smoothing, fold_into_norm, smoothing_factors
from minifloat.quant import block_scales, quantize, quantize_with_scales
from minifloat.scaling.schemes import get_scheme
from tests.conftest import ML_DTYPES

# every FP weight grid: FP8 per row / per tensor / 128×128, MXFP8, MXFP6 (both), MXFP4, NVFP4 (and 4over6)
SCHEMES = ["fp8_rowwise", "fp8", "fp8_block128x128", "mxfp8", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "nvfp4"]


def scheme_of(name):
    return get_quant_config("nvfp4-4over6-weight-only").weight_scheme if name == "nvfp4_4over6" else get_scheme(name)


def correlated_inputs(n, k, seed):
    """Rows with correlated channels and a few outlier channels, as a transformer's inputs: one
    distribution (the mixing matrix), samples drawn from `seed`."""
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(0)) / k**0.5 + torch.eye(k)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) @ mix
    x[:, :4] *= 8
    return x


def hessian(x):
    x = x.double()
    return x.T @ x / x.shape[0]


def output_error(w_hat, w, x):
    x, w_hat, w = x.double(), w_hat.double(), w.double()
    return float(((x @ w_hat.T - x @ w.T) ** 2).mean())


def block_decode_scales(q):
    """Each element's decode scale, from the stored scales decoded by ml_dtypes (not minifloat)."""
    s = q.scheme
    if s.scale_format == "fp32":
        grid = q.scale.numpy().astype(np.float64)
    elif s.scale_format == "e8m0":
        grid = q.scale.numpy().view(ML_DTYPES["e8m0"]).astype(np.float64)
    else:
        grid = q.scale.numpy().view(ML_DTYPES["e4m3"]).astype(np.float32) * q.tensor_scale.numpy()
    n, k = q.shape
    br, bc = s.block if s.granularity == "block" else (1 if s.granularity == "row" else n, q.data.shape[1] * 8 // s.element_format.bits)
    return np.repeat(np.repeat(grid, br, 0), bc, 1)[:n, :k].astype(np.float32)


def assert_on_grid(q):
    """Every dequantized value is e · d in float32: e a value of the element format (ml_dtypes),
    d its block's decode scale."""
    v = q.dequantize().numpy()
    d = block_decode_scales(q)
    fmt = ML_DTYPES[q.scheme.element]
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.where(d == 0, 0, v / d).astype(np.float32).astype(fmt).astype(np.float32)
    assert np.array_equal((e * d).astype(np.float32), v)
    assert np.abs(e).max() <= minifloat.get_format(q.scheme.element).max


@pytest.mark.parametrize("name", [*SCHEMES, "nvfp4_4over6"])
def test_gptq_errs_less_than_round_to_nearest_on_held_out_inputs_and_stays_on_the_grid(name):
    scheme = scheme_of(name)
    torch.manual_seed(0)
    w = torch.randn(192, 256) * 0.05
    calib, held_out = correlated_inputs(2048, 256, 1), correlated_inputs(1024, 256, 2)
    rtn = quantize(w, scheme)
    q = gptq(w, hessian(calib), scheme, block_scales(w, scheme))
    assert q.scheme == scheme and q.shape == w.shape
    assert torch.equal(q.scale, rtn.scale)  # the scales were fixed before the columns were rounded
    e_gptq, e_rtn = output_error(q.dequantize(), w, held_out), output_error(rtn.dequantize(), w, held_out)
    assert e_gptq < 0.6 * e_rtn, (e_gptq, e_rtn)
    assert_on_grid(q)


@pytest.mark.parametrize("name", [*SCHEMES, "nvfp4_4over6"])
@pytest.mark.parametrize("observer", ["minmax", "mse"])
def test_gptq_with_an_identity_hessian_is_round_to_nearest(name, observer):
    scheme = scheme_of(name)
    w = torch.randn(130, 200) * 3  # partial blocks both ways
    scales = observe_scales(w, scheme, observer)
    q = gptq(w, torch.eye(200, dtype=torch.float64), scheme, scales)
    r = quantize_with_scales(w, scheme, scales)
    assert torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
    if observer == "minmax":
        assert torch.equal(r.data, quantize(w, scheme).data)


@pytest.mark.parametrize("name", SCHEMES)
def test_gptq_rounds_rows_in_chunks_of_whole_scale_blocks_with_the_result_of_one_pass(name, monkeypatch):
    """Each row's errors go only to its own later columns, so chunking the rows (to bound the
    working memory) changes nothing: chunks of 16 rows (rounded to whole 128-row blocks where the
    scheme's blocks are 128 × 128) give the codes of one pass over all rows."""
    scheme = get_scheme(name)
    w, x = torch.randn(300, 200) * 0.05, correlated_inputs(512, 200, 1)
    scales = block_scales(w, scheme)
    monkeypatch.setattr(gptq_module, "ROWS_AT_ONCE", 10**9)
    whole = gptq(w, hessian(x), scheme, scales)
    monkeypatch.setattr(gptq_module, "ROWS_AT_ONCE", 16)
    chunked = gptq(w, hessian(x), scheme, scales)
    assert torch.equal(chunked.data, whole.data) and torch.equal(chunked.scale, whole.scale)
    assert_on_grid(chunked)


def test_gptq_of_a_large_head_holds_a_few_copies_of_it_not_one_per_temporary():
    """The peak resident memory `quantize_model` adds (GPTQ, the head included) in a fresh process,
    on a Llama whose 32768 × 256 head is most of its weights: measured 5.4× the head's FP32 bytes
    (its block scales observed, the calibration logits), where the whole-weight temporaries of
    GPTQ and a calibration run keeping every activation took 28×."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # a fixed mmap threshold: the peak is what is allocated
    out = subprocess.run([sys.executable, "-m", "tests.infer.ptq_memory_worker"], capture_output=True, text=True,
                         timeout=300, check=True, env=env)  # fmt: skip
    growth, head = map(int, out.stdout.split()[-2:])
    assert growth <= 8 * head, (growth, head)


def brute_force_errors(w, scheme):
    """Per block (one row of 32 / 16): the least squared error over every scale of the grid —
    every E8M0 exponent, every positive E4M3 code — with elements rounded by ml_dtypes."""
    fmt = ML_DTYPES[scheme.element]
    fmax = minifloat.get_format(scheme.element).max
    x = w.numpy().astype(np.float64).reshape(-1, scheme.block[1])
    if scheme.scale_format == "e8m0":
        scales = [2.0**e for e in range(-127, 128)]
    else:  # NVFP4: E4M3 codes 1..126 under the minmax tensor scale
        ts = float(quantize(w, scheme).tensor_scale)
        codes = np.arange(1, 127, dtype=np.uint8).view(ML_DTYPES["e4m3"]).astype(np.float32)
        scales = [float(np.float32(c) * np.float32(ts)) for c in codes]
    best = np.full(x.shape[0], np.inf)
    for d in scales:
        y = np.clip((x / d).astype(np.float32), -fmax, fmax).astype(fmt).astype(np.float64) * d
        best = np.minimum(best, ((y - x) ** 2).sum(1))
    return best


@pytest.mark.parametrize("name", ["mxfp4", "mxfp6_e2m3", "nvfp4"])
def test_mse_observer_finds_the_brute_force_optimum_of_its_scale_grid(name):
    scheme = get_scheme(name)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 128, generator=g) * torch.rand(24, 1, generator=g) * 4
    w[0, 3] = 40.0  # an outlier: shrinking the scale pays off around it
    q = quantize_with_scales(w, scheme, observe_scales(w, scheme, "mse"))
    mine = ((q.dequantize().double() - w.double()) ** 2).reshape(-1, scheme.block[1]).sum(1).numpy()
    best = brute_force_errors(w, scheme)
    assert np.all(mine <= best * (1 + 1e-6) + 1e-12)
    minmax = ((quantize(w, scheme).dequantize().double() - w.double()) ** 2).reshape(-1, scheme.block[1]).sum(1).numpy()
    assert mine.sum() < minmax.sum()  # and it is not minmax in disguise
    assert_on_grid(q)


def test_mse_observer_on_fp32_scales_searches_the_shrunk_amax():
    scheme = get_scheme("fp8_rowwise")
    w = torch.randn(16, 64)
    q = quantize_with_scales(w, scheme, observe_scales(w, scheme, "mse"))
    err = ((q.dequantize() - w) ** 2).sum(1)
    for p in (1.0, 0.95, 0.9, 0.85, 0.8):  # every shrink of the grid it searches, measured here
        amax = w.abs().amax(1, keepdim=True) * p
        s = (448.0 / amax).float()
        other = (torch.clamp(w * s, -448, 448).to(torch.float8_e4m3fn).float() / s - w).pow(2).sum(1)
        assert torch.all(err <= other * (1 + 1e-5) + 1e-12)


@pytest.mark.parametrize("size", [16, 32, 64, 128])
def test_rotation_keeps_the_float_product(size):
    r = HadamardRotation(size, seed=3)
    x, w = torch.randn(7, 256), torch.randn(24, 256)
    ref = x.double() @ w.double().T
    got = r(x).double() @ r.fold(w).double().T
    assert float((got - ref).norm() / ref.norm()) < 1e-5
    t = r(torch.eye(256))  # the rotation is orthogonal and block-diagonal
    assert torch.allclose(t @ t.T, torch.eye(256), atol=1e-5)
    assert float(t[:size, size:].abs().max()) == 0


def test_smoothing_keeps_the_float_product_online_and_folded_into_a_norm():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=g) * torch.linspace(0.1, 20, 64)
    w = torch.randn(32, 64, generator=g)
    s = smoothing_factors(x.abs().amax(0), [w], alpha=0.5)
    ref = x.double() @ w.double().T
    online = Smoothing(s)(x).double() @ (w * s).double().T
    assert float((online - ref).norm() / ref.norm()) < 1e-5
    # the same factors folded into an RMSNorm / LayerNorm: the norm's output divided by s
    for norm in (torch.nn.LayerNorm(64), torch.nn.RMSNorm(64)):
        with torch.no_grad():
            norm.weight.uniform_(0.5, 2.0, generator=g)
        h = torch.randn(5, 64, generator=g)
        ref = norm(h).double() @ w.double().T
        assert fold_into_norm(norm, s)
        got = norm(h).double() @ (w * s).double().T
        assert float((got - ref).norm() / ref.norm()) < 1e-5
    # the exponent α: factors by SmoothQuant's formula, computed here
    assert torch.allclose(s, (x.abs().amax(0) ** 0.5 / w.abs().amax(0) ** 0.5), rtol=1e-5)


def test_clear_errors():
    w = torch.randn(32, 64)
    singular = torch.ones(64, 64, dtype=torch.float64)  # rank 1
    with pytest.raises(minifloat.MinifloatError, match="Hessian of the layer is singular after damping 0"):
        gptq(w, singular, "mxfp4", block_scales(w, "mxfp4"), config=GPTQConfig(damp=0.0))
    assert gptq(w, singular, "mxfp4", block_scales(w, "mxfp4")).shape == w.shape  # damped: fine
    with pytest.raises(minifloat.MinifloatError, match="rotation hadamard:128 does not divide 0's 192 inputs; use hadamard:64"):
        quantize_model(torch.nn.Sequential(torch.nn.Linear(192, 32)), "mxfp4-weight-only",
                       calibration=[torch.randn(4, 192)], method=resolve_method("gptq", "mxfp4", rotation="hadamard:128"))  # fmt: skip
    with pytest.raises(minifloat.MinifloatError, match="unknown rotation 'hadamard:24'"):
        PTQMethod(rotation="hadamard:24")
    with pytest.raises(minifloat.MinifloatError, match="needs finite weights"):
        gptq(torch.full((32, 64), float("nan")), torch.eye(64), "mxfp4", block_scales(w, "mxfp4"))
    with pytest.raises(minifloat.MinifloatError, match="calibrates layer by layer: pass calibration="):
        quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 32)), "mxfp4-weight-only", method="gptq")
    with pytest.raises(minifloat.MinifloatError, match="the 4over6 observer chooses NVFP4 block scales; config 'mxfp4'"):
        quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 32)), "mxfp4", calibration=[torch.randn(2, 64)],
                       method=PTQMethod(method="gptq", observer="4over6"))  # fmt: skip


transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))


def tiny_llama(seed=0, layers=2, tied=False):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def calib_batches():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (4, 32), generator=g) for _ in range(4)]


def layer_inputs(model, ids):
    """Every Linear's input on `ids` (forward pre-hooks), by name."""
    seen = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, args[0].detach().reshape(-1, args[0].shape[-1]))

        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules()
             if isinstance(m, (torch.nn.Linear, QuantizedLinear))]  # fmt: skip
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("name", ["nvfp4-weight-only", "nvfp4", "mxfp4"])
def test_sequential_gptq_on_a_llama_shares_nvfp4_tensor_scales_and_beats_rtn(name):
    ref = tiny_llama()
    rtn, gq = tiny_llama(), tiny_llama()
    quantize_model(rtn, name, calibration=calib_batches())
    summary = quantize_model(gq, name, calibration=calib_batches(), method=PTQMethod(method="gptq"))
    assert len(summary.quantized) == 14 and summary.method.method == "gptq"
    layers = dict(gq.named_modules())
    if name.startswith("nvfp4"):  # q/k/v and gate/up: one NVFP4 tensor scale each, as an engine fuses them
        for block in ("model.layers.0", "model.layers.1"):
            ts = {float(layers[f"{block}.self_attn.{p}_proj"].weight_tensor_scale) for p in "qkv"}
            assert len(ts) == 1
            assert float(layers[f"{block}.mlp.gate_proj"].weight_tensor_scale) == float(layers[f"{block}.mlp.up_proj"].weight_tensor_scale)
    with torch.no_grad():
        e_ref, e_rtn, e_g = ref(IDS).logits.double(), rtn(IDS).logits.double(), gq(IDS).logits.double()
    assert ((e_g - e_ref) ** 2).mean() < ((e_rtn - e_ref) ** 2).mean()


def test_each_layer_of_a_sequential_gptq_is_gptq_on_the_inputs_the_quantized_layers_before_produce():
    model = tiny_llama()
    batches = calib_batches()
    quantize_model(model, "mxfp4-weight-only", calibration=batches, method=PTQMethod(method="gptq", observer="minmax"))
    # the last layer (down_proj of block 1): its Hessian from the fully quantized model's inputs
    name = "model.layers.1.mlp.down_proj"
    x = torch.cat([layer_inputs(model, b)[name] for b in batches])
    x_ref = torch.cat([layer_inputs(tiny_llama(), b)[name] for b in batches])  # the unquantized model's inputs
    original = tiny_llama().get_submodule(name).weight.detach().double()
    mine = model.get_submodule(name).weight
    assert_on_grid(mine)
    err = lambda q, inputs: float((inputs.double() @ (q - original).T).square().sum())  # noqa: E731 - GPTQ's objective
    # GPTQ minimizes ||X (W - Q)ᵀ|| over the inputs it was given: on the quantized predecessors' inputs
    # it beats round to nearest (on the minmax grid it shares), and by more there than on the
    # unquantized model's inputs, whose Hessian a non-sequential GPTQ would have used
    rtn = quantize(original.float(), mine.scheme).dequantize().double()
    q = mine.dequantize().double()
    assert err(q, x) < 0.8 * err(rtn, x)
    assert err(q, x) / err(rtn, x) < err(q, x_ref) / err(rtn, x_ref)


def test_rotation_and_smoothing_keep_the_model_unquantized_output_and_smoothing_folds_into_norms():
    model, ref = tiny_llama(), tiny_llama()
    # fp8-dynamic with a rotation and smoothing; compare against the same transforms without quantization
    summary = quantize_model(model, "mxfp8", calibration=calib_batches(),
                             method=PTQMethod(method="rtn", rotation="hadamard:32", smooth=0.5))  # fmt: skip
    assert len(summary.quantized) == 14
    layers = dict(model.named_modules())
    q = layers["model.layers.0.self_attn.q_proj"]
    assert isinstance(q.input_transform, HadamardRotation)  # smoothing folded into input_layernorm
    assert isinstance(layers["model.layers.0.self_attn.o_proj"].input_transform, torch.nn.Sequential)  # online
    assert not torch.equal(layers["model.layers.0.input_layernorm"].weight, ref.model.layers[0].input_layernorm.weight)
    x, x_ref = layer_inputs(model, IDS), layer_inputs(ref, IDS)
    for n, m in layers.items():
        if not isinstance(m, QuantizedLinear):
            continue
        with torch.no_grad():
            tx = m.input_transform(x[n]) if m.input_transform is not None else x[n]
            # the forward: the transformed input, quantized (MXFP8), times the quantized weight, in float64
            qx = minifloat.quantize(tx, m.config.activation_scheme).dequantize().double()
            w = m.weight.dequantize().double()
            want = qx @ w.T + (m.bias.double() if m.bias is not None else 0)
            bound = (qx.abs() @ w.abs().T) * (w.shape[1] + 2) * 2.0**-24
            assert ((m(x[n]).double() - want).abs() <= bound + 1e-30).all(), n
            # the transforms keep the product: T(x)·W'ᵀ is the original layer's x·Wᵀ up to MXFP8's error
            # (layer 0's projections of the norm's output: the same inputs in both models, up to smoothing)
            if n.startswith("model.layers.0.") and n.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                orig = ref.get_submodule(n)
                y_ref = x_ref[n].double() @ orig.weight.double().T
                assert ((tx.double() @ w.T - y_ref).norm() / y_ref.norm()) < 0.08, n  # untransformed: 1.44
    with torch.no_grad():
        err = (model(IDS).logits - ref(IDS).logits).abs().mean() / ref(IDS).logits.abs().mean()
    assert err < 0.1


def test_gptq_exports_load_bit_exactly_in_transformers_and_a_rotation_is_refused(tmp_path):
    pytest.importorskip("compressed_tensors")
    from minifloat.infer import export
    from tests.infer.test_export import read_with_transformers

    for name in ("fp8-dynamic", "mxfp4-weight-only", "nvfp4-weight-only"):
        model = tiny_llama()
        quantize_model(model, name, calibration=calib_batches(), method=resolve_method("gptq", name, export=True))
        hf = read_with_transformers(export(model, tmp_path / name), "compressed-tensors")
        sd = hf.state_dict()
        for n, m in model.named_modules():
            if isinstance(m, QuantizedLinear):
                mine = m.weight.dequantize()
                if m.weight.scheme.is_nvfp4:  # compressed-tensors rounds code × (scale / global) to bf16
                    assert (sd[f"{n}.weight"].float() == mine.bfloat16().float()).float().mean() > 0.99, n
                else:
                    assert torch.equal(sd[f"{n}.weight"].float(), mine), n
    model = tiny_llama()
    quantize_model(model, "mxfp4-weight-only", calibration=calib_batches(), method=resolve_method("gptq", "mxfp4", rotation="hadamard:32"))
    with pytest.raises(minifloat.MinifloatError, match="transforms its input before the GEMM"):
        export(model, tmp_path / "rotated")
    assert not (tmp_path / "rotated").exists()


def test_the_commands_take_the_methods_and_refuse_what_cannot_work(tmp_path, capsys):
    pytest.importorskip("gguf")
    import json
    import re

    from minifloat.cli import main
    from tests.infer.test_gguf_and_bad_inputs import _one_line_error, write_tiny_gguf

    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path)
    small = ["--eval-batches", "1", "--batch-size", "2", "--seq-len", "32", "--calib-batches", "2"]
    capsys.readouterr()
    assert main(["ptq-compare", path, "--schemes", "nvfp4-weight-only,mxfp8", "--methods", "rtn,gptq", "--no-torchao",
                 "--no-plots", "--asymmetric", "1", "--out", str(tmp_path / "ptq"), *small]) == 0  # fmt: skip
    metrics = json.loads((tmp_path / "ptq" / "metrics.json").read_text())
    assert [(r["config"], r["method"]) for r in metrics["runs"]] == [  # asymmetric calibration: GPTQ's runs only
        ("nvfp4-weight-only", "rtn"), ("nvfp4-weight-only", "gptq+hadamard:16+asym1"), ("mxfp8", "rtn"),
        ("mxfp8", "gptq+asym1+keep16+norms60")]  # fmt: skip  (mxfp8's pipeline keeps channels and tunes its norms)
    assert all(r["quantize_seconds"] > 0 for r in metrics["runs"])
    capsys.readouterr()
    assert re.search(r"\| mxfp8 +\| gptq\+asym1\+keep16\+norms60 +\| minifloat +\|", (tmp_path / "ptq" / "report.md").read_text())
    assert main(["eval", path, "--scheme", "mxfp4-weight-only", "--method", "gptq", "--rotate", "hadamard:32",
                 "--json", *small]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["kl"] > 0
    # the recommended pipeline without its rotation, which no checkpoint reader applies
    assert main(["quantize", path, "--scheme", "nvfp4-weight-only", "--method", "gptq", "--observer", "mse",
                 "--out", str(tmp_path / "q"), *small[2:]]) == 0  # fmt: skip
    assert "nvfp4-weight-only: 14 of 15 Linears quantized" in capsys.readouterr().out
    assert minifloat.infer.load_model(tmp_path / "q") is not None
    # what cannot work says so in one line, before any work
    _one_line_error(capsys, ["quantize", path, "--scheme", "mxfp4-weight-only", "--rotate", "hadamard:32", "--out",
                             str(tmp_path / "r")], "no compressed-tensors reader applies minifloat's online Hadamard")  # fmt: skip
    assert not (tmp_path / "r").exists()
    short = tmp_path / "short.txt"
    short.write_text("a few kilobytes of text. " * 200)  # enough for evaluation windows, not for 64 × 8 new samples
    _one_line_error(capsys, ["eval", path, "--scheme", "nvfp4", "--method", "gptq", "--calib", str(short), "--calib-batches",
                             "64", "--seq-len", "64", "--eval-batches", "1"], "the calibration text (training split) has")  # fmt: skip
    _one_line_error(capsys, ["eval", path, "--method", "gptq"], "--method / --observer / --rotate / --smooth / --asymmetric / --tune-norms / --keep-channels go with --scheme")
    _one_line_error(capsys, ["eval", path, "--scheme", "mxfp4", "--rotate", "hadamard:7"], "unknown rotation 'hadamard:7'")
    _one_line_error(capsys, ["eval", path, "--scheme", "nvfp4", "--asymmetric", "1"], "refits the weights GPTQ rounds")
    _one_line_error(capsys, ["eval", path, "--scheme", "nvfp4", "--method", "gptq", "--asymmetric", "0"], "asymmetric ridge")
    _one_line_error(capsys, ["ptq-compare", path, "--methods", "awq", "--out", str(tmp_path / "x")], "unknown method 'awq'")
    _one_line_error(capsys, ["ptq-compare", path, "--methods", "gptq", "--llmcompressor", str(tmp_path / "nope"),
                             "--out", str(tmp_path / "x")], "no such Python")  # fmt: skip


def test_a_tied_head_is_not_rotated_and_a_transformed_one_unties_its_embedding():
    model, ref = tiny_llama(layers=1, tied=True), tiny_llama(layers=1, tied=True)
    ref.load_state_dict(model.state_dict())
    rotate = resolve_method("gptq", "mxfp8", rotation="hadamard:32")
    summary = quantize_model(model, "mxfp8", calibration=calib_batches(), method=rotate, quantize_head=True)
    assert model.lm_head.input_transform is None and model.model.layers[0].mlp.down_proj.input_transform is not None
    emb = model.get_input_embeddings()
    assert emb.tied_to is model.lm_head  # one table, read by both
    assert "tied to the LM head" in [s for s in summary.layers if s.embedding][0].note
    table, original = model.lm_head.weight.dequantize(), ref.get_input_embeddings().weight
    assert float((table - original).norm() / original.norm()) < 0.05  # the original table's rows, not rotated ones
    with torch.no_grad():
        assert torch.equal(emb(IDS[:1])[0], table[IDS[0]])
        err = (model(IDS).logits - ref(IDS).logits).abs().mean() / ref(IDS).logits.abs().mean()
    assert err < 0.2
    # a transform handed in for round to nearest reaches the head too: the embedding then keeps its own table
    model = tiny_llama(layers=1, tied=True)
    model.load_state_dict(ref.state_dict())
    r = HadamardRotation(32)
    summary = quantize_model(model, "mxfp8-weight-only", quantize_head=True, transform=lambda w, stats: (r.fold(w), r))
    row = [s for s in summary.layers if s.embedding][0]
    assert "its own table" in row.note and row.bytes_before == 0
    own = quantize(ref.get_input_embeddings().weight.detach(), model.lm_head.weight.scheme).dequantize()
    with torch.no_grad():
        assert torch.equal(model.get_input_embeddings()(IDS[:1])[0], own[IDS[0]])


def test_round_to_nearest_with_mse_scales_through_quantize_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48))
    w = model[0].weight.detach().clone()
    quantize_model(model, "mxfp4-weight-only", ignore=(), method=PTQMethod(observer="mse"))
    q = model[0].weight
    assert_on_grid(q)
    # each block's squared error: within the scale range the observer searches, the least of any
    # E8M0 scale of the grid (the brute force by ml_dtypes), and less than the scheme's own rule's
    mine = ((q.dequantize().double() - w.double()) ** 2).reshape(-1, 32).sum(1).numpy()
    assert np.all(mine <= brute_force_errors(w, q.scheme) * (1 + 1e-6) + 1e-12)
    minmax = ((quantize(w, q.scheme).dequantize().double() - w.double()) ** 2).reshape(-1, 32).sum(1).numpy()
    assert np.all(mine <= minmax + 1e-12) and mine.sum() < minmax.sum()


# The recommended pipelines as measured and tabled by config name (docs/guides/ptq.md): the oracle
# for the recommendation `recommended` derives from what a config is.
ASYM = {"gptq": GPTQConfig(asymmetric=1.0)}
TUNED = {"norm_tuning": NormTuning()}  # FP8 inputs with dynamic scales
RECOMMENDED_BY_NAME = {
    "mxfp6": {"rotation": "hadamard:32"}, "mxfp6-weight-only": {"rotation": "hadamard:32"},
    "mxfp4": {"rotation": "hadamard:32", "smooth": 0.5, **ASYM}, "mxfp4-weight-only": {"rotation": "hadamard:32", **ASYM},
    "nvfp4-weight-only": {"rotation": "hadamard:16", **ASYM}, "nvfp4": {"observer": "4over6", "smooth": 0.5, **ASYM},
    "nvfp4-4over6": {"smooth": 0.5, **ASYM}, "nvfp4-4over6-weight-only": {"rotation": "hadamard:16", **ASYM},
    "fp8-dynamic": TUNED, "fp8-dynamic-fnuz": TUNED, "fp8-block": TUNED,
    "mxfp8": {"keep_channels": 16, **TUNED}, "mxfp8-weight-only": {"rotation": "hadamard:32"},
}  # fmt: skip


def test_the_recommended_pipeline_follows_what_a_config_is_not_its_name():
    import dataclasses

    from minifloat.infer.ptq.method import recommended

    for name, c in QUANT_CONFIGS.items():
        want = PTQMethod(method="gptq", **RECOMMENDED_BY_NAME.get(name, {}))
        assert recommended(name) == want, name
        assert recommended(dataclasses.replace(c, name="hand-built")) == want, name  # the same config, another name


def test_an_mx_weight_that_meets_a_massive_input_channel_is_better_rotated():
    """Why MX weights are rotated in the recommended pipeline: the column that meets a massive input
    channel holds each row's largest weight, which a per-row FP32 scale puts exactly on E4M3's 448
    and an E8M0 block scale leaves rounded to 4 significant bits — that column's error is then the
    layer's. A Hadamard rotation as wide as the block spreads the channel over its group. Judged by
    the layer's output error against the float64 product of the unquantized weight."""
    g = torch.Generator().manual_seed(0)
    w = 0.05 * torch.randn(64, 128, generator=g)
    w[:, 7] = (1 + torch.rand(64, generator=g)) * torch.randn(64, generator=g).sign()  # every row's largest
    x = torch.randn(512, 128, generator=g)
    x[:, 7] *= 100  # a massive activation channel
    exact = x.double() @ w.double().T

    def error(config, rotation=None):
        lin = torch.nn.Linear(128, 64, bias=False)
        lin.weight.data = w.clone()
        model = torch.nn.Sequential(lin)
        quantize_model(model, config, ignore=(), method=PTQMethod(method="rtn", rotation=rotation), calibration=[x])
        with torch.no_grad():
            return ((model(x).double() - exact).norm() / exact.norm()).item()

    per_row, mx, mx_rotated = error("fp8-weight-only"), error("mxfp8-weight-only"), error("mxfp8-weight-only", "hadamard:32")
    assert mx > 20 * per_row  # the massive column, rounded (here ~240×)
    assert mx_rotated < mx / 3  # (here ÷6)


def test_refit_is_the_ridge_least_squares_fit_of_the_full_precision_outputs():
    """`refit` against numpy's least squares on the augmented system: the weight W* whose output on
    the inputs seen, X, is closest to W's on the full-precision inputs X_ref, plus λ‖W* − W‖²."""
    from minifloat.infer.ptq.gptq import refit

    g = torch.Generator().manual_seed(7)
    n, k = 400, 48
    w = torch.randn(24, k, generator=g)
    x_ref = correlated_inputs(n, k, seed=8).double()
    x = x_ref * (1 + 0.1 * torch.randn(k, generator=g).double()) + 0.2 * torch.randn(n, k, generator=g).double()
    h, c = x.T @ x / n, (x_ref - x).T @ x / n
    for ridge in (1e-9, 0.3, 3.0):
        lam = ridge * float(torch.diagonal(h).mean())
        a = np.vstack([x.numpy(), np.sqrt(n * lam) * np.eye(k)])
        b = np.vstack([x_ref.numpy() @ w.double().numpy().T, np.sqrt(n * lam) * w.double().numpy().T])
        want = np.linalg.lstsq(a, b, rcond=None)[0].T
        mine = refit(w, h, c, ridge).double().numpy()
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    fitted = refit(w, h, c, 1e-9).double()
    miss = lambda v: float((x_ref @ w.double().T - x @ v.T).square().sum())  # noqa: E731
    assert miss(fitted) < 0.5 * miss(w.double())
    with pytest.raises(minifloat.MinifloatError, match="asymmetric ridge"):
        GPTQConfig(asymmetric=0)


def test_asymmetric_gptq_fits_the_full_precision_models_outputs_where_plain_gptq_fits_its_own():
    """The last Linear of a tiny Llama after every layer before it was quantized: plain GPTQ keeps
    its output on the quantized model's inputs X near X Wᵀ; asymmetric GPTQ near X_ref Wᵀ, the
    full-precision model's output, which is what the next layers need (measured here in float64
    on the calibration rows, from forward hooks)."""
    batches = calib_batches()
    name = "model.layers.1.mlp.down_proj"
    original = tiny_llama().get_submodule(name).weight.detach().double()
    x_ref = torch.cat([layer_inputs(tiny_llama(), b)[name] for b in batches]).double()
    miss = {}
    for ridge in (None, 0.1):
        model = tiny_llama()
        method = PTQMethod(method="gptq", gptq=GPTQConfig(asymmetric=ridge))
        assert quantize_model(model, "nvfp4-weight-only", calibration=batches, method=method).method.label == (
            "gptq" if ridge is None else "gptq+asym0.1")
        x = torch.cat([layer_inputs(model, b)[name] for b in batches]).double()
        q = model.get_submodule(name).weight
        assert_on_grid(q)
        miss[ridge] = float((x_ref @ original.T - x @ q.dequantize().double().T).square().sum())
    assert miss[0.1] < 0.8 * miss[None]


def test_asymmetric_references_are_the_unquantized_models_inputs_and_only_where_every_token_is_read():
    """`reference_inputs` on a tiny Qwen2-MoE block: each layer's input as the unquantized model
    computes it (forward hooks on the model itself), for the layers that read every token
    (attention, the shared expert); a routed expert, which another router may send other tokens,
    gets none; a `ReferenceObserver` whose rows do not line up gives none."""
    import tempfile
    from pathlib import Path

    from minifloat.infer.ptq.observers import ReferenceObserver
    from minifloat.infer.ptq.sequential import capture_inputs, find_blocks, reference_inputs
    from minifloat.models.loading import load_model
    from tests.families.tiny import tiny_moe

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(tiny_moe(Path(tmp) / "m", "qwen2moe")).eval()
    ids = [torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    block = find_blocks(model)[0]
    targets = {m: n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.0.")}
    refs, outs = reference_inputs(block, capture_inputs(model, block, ids), targets)
    seen = [layer_inputs(model, b) for b in ids]
    routed = [n for n in targets.values() if ".experts." in n]
    assert routed and not any(n in refs for n in routed)
    assert "model.layers.0.self_attn.q_proj" in refs and any("shared_expert." in n for n in refs)
    for n, v in refs.items():
        for i in range(len(ids)):
            torch.testing.assert_close(v[i].reshape(-1, v[i].shape[-1]), seen[i][n], rtol=0, atol=0)
    assert len(outs) == len(ids)
    obs = ReferenceObserver([torch.ones(4, 3)])
    obs.observe(torch.ones(5, 3))
    assert obs.result() is None
    obs = ReferenceObserver([torch.ones(4, 3)] * 2)
    obs.observe(torch.ones(4, 3))  # one batch of two
    assert obs.result() is None
