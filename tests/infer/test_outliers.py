"""Input channels kept in BF16 beside the quantized product (`minifloat.infer.ptq.outliers`,
``keep_channels``): the layer's product against a float64 oracle, GPTQ's kept columns against
numpy's least squares, and what the kept channels buy on a massive activation channel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import minifloat
from minifloat.infer import QuantizedLinear, quantize_model
from minifloat.infer.checkpoints.export import layer_tensors
from minifloat.infer.ptq.method import PTQMethod, resolve_method


def _massive(seed=0, n=512, k=128, out=64, channel=7):
    """A weight and inputs with one massive activation channel (×100), as a real model's."""
    g = torch.Generator().manual_seed(seed)
    w = 0.05 * torch.randn(out, k, generator=g)
    x = torch.randn(n, k, generator=g)
    x[:, channel] *= 100
    return w, x


def _quantized(w, x, config, method):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.clone()
    model = torch.nn.Sequential(lin)
    quantize_model(model, config, ignore=(), method=method, calibration=[x])
    return model[0]


def _bf16(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).double().numpy()


def test_the_layer_multiplies_the_rest_quantized_and_the_kept_channels_in_bf16():
    """The float64 oracle: the input with the kept channels zeroed, rounded per 32 values with an E8M0
    scale 2^ceil(log2(amax / 448)) (OCP MX, the rounded-up rule) to E4M3 by ml_dtypes' cast, times
    the dequantized weight; plus the kept channels' BF16 inputs times their BF16 columns."""
    import ml_dtypes

    w, x = _massive()
    layer = _quantized(w, x, "mxfp8", PTQMethod(method="rtn", keep_channels=2))
    kept = layer.kept_index.tolist()
    assert 7 in kept and len(kept) == 2
    xs = x[:8].double().numpy().copy()
    xk = xs[:, kept].copy()
    xs[:, kept] = 0
    blocks = xs.reshape(8, -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, 1) / 448)), 1.0)
    xq = ((blocks / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale).reshape(8, -1)
    wq = layer.weight.dequantize(torch.float32)[:64, :128].double().numpy()
    assert (wq[:, kept] == 0).all()  # the kept columns are out of the packed weight
    want = xq @ wq.T + _bf16(torch.from_numpy(xk)) @ layer.kept_weight.double().numpy().T
    got = layer(x[:8]).double().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    d = layer.differentiable()  # what norm tuning trains through: the same product
    np.testing.assert_allclose(d(x[:8]).detach().double().numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_gptq_gives_the_kept_columns_the_least_squares_fit_of_what_the_rest_lost():
    """With the rest rounded to Q_r, the kept columns W_k' minimize ‖X_r (W_r − Q_r)ᵀ + X_k (W_k − W_k')ᵀ‖
    over the calibration rows: numpy's least squares (up to BF16 and H_kk's damping)."""
    w, x = _massive(seed=1)
    layer = _quantized(w, x, "mxfp8-weight-only", resolve_method("gptq", "mxfp8-weight-only", rotation="none",
                                                                 tune_norms=0, keep_channels=3))  # fmt: skip
    kept = layer.kept_index.tolist()
    rest = [j for j in range(128) if j not in kept]
    q = layer.weight.dequantize(torch.float32)[:64, :128].double().numpy()
    xd, wd = x.double().numpy(), w.double().numpy()
    target = xd[:, rest] @ (wd[:, rest] - q[:, rest]).T + xd[:, kept] @ wd[:, kept].T
    want = np.linalg.lstsq(xd[:, kept], target, rcond=None)[0].T
    np.testing.assert_allclose(layer.kept_weight.double().numpy(), want, rtol=2e-2, atol=1e-2 * np.abs(want).max())
    from minifloat.finetune.lora import effective_weight  # what a LoRA merge reads: the kept columns in place

    y, want_y = layer(x[:16]).double(), x[:16].double() @ effective_weight(layer).double().T
    assert ((y - want_y).norm() / want_y.norm()).item() < 1e-2  # the kept inputs rounded to BF16 in the layer


def test_keeping_the_massive_channel_cuts_mxfp8s_error_and_gptq_cuts_it_further():
    """What the kept channels are for: the massive channel's E4M3 rounding (4 significant bits under
    an E8M0 scale) is most of an MXFP8 layer's output error. Judged against the float64 product."""
    w, x = _massive(seed=2)
    exact = x.double() @ w.double().T

    def error(method):
        with torch.no_grad():
            y = _quantized(w, x, "mxfp8", method)(x).double()
        return ((y - exact).norm() / exact.norm()).item()

    plain = error(PTQMethod(method="rtn"))
    kept = error(PTQMethod(method="rtn", keep_channels=1))
    gptq = error(resolve_method("gptq", "mxfp8", rotation="none", tune_norms=0, keep_channels=1))
    assert kept < plain / 4  # (here ÷8.7)
    assert gptq < kept


def test_kept_channels_are_counted_refused_where_no_reader_applies_them_and_checked(tmp_path):
    w, x = _massive(seed=3)
    layer = _quantized(w, x, "mxfp8", PTQMethod(method="rtn", keep_channels=4))
    plain = _quantized(w, x, "mxfp8", PTQMethod(method="rtn"))
    # 4 BF16 columns of 64 rows and their int64 indices, beside the packed weight
    assert layer.packed_nbytes() - plain.packed_nbytes() == 64 * 4 * 2 + 4 * 8
    assert layer.to(torch.bfloat16).kept_weight.dtype == torch.bfloat16
    with pytest.raises(minifloat.MinifloatError, match="keeps 4 input channels out of the quantized product"):
        layer_tensors("model.layers.0.mlp.down_proj", layer, "compressed-tensors")
    with pytest.raises(minifloat.MinifloatError, match="keep_channels takes a number of input channels ≥ 0"):
        PTQMethod(keep_channels=-1)
    with pytest.raises(minifloat.MinifloatError, match="kept_index must hold distinct input channels"):
        QuantizedLinear(layer.weight, None, "mxfp8", kept_index=torch.tensor([3, 3, 5, 6]), kept_weight=layer.kept_weight)
    assert PTQMethod(method="rtn", keep_channels=4).label == "rtn+keep4"
    assert resolve_method("gptq", "mxfp8", export=True).keep_channels == 0  # no checkpoint holds them


def test_the_commands_take_keep_channels_with_a_scheme(capsys):
    from minifloat.cli import main

    assert main(["eval", "model.gguf", "--keep-channels", "4"]) == 2
    assert "--keep-channels go with --scheme" in capsys.readouterr().err
    assert main(["eval", "model.gguf", "--scheme", "mxfp8", "--keep-channels", "-1"]) == 2
    assert "keep_channels takes a number of input channels ≥ 0" in capsys.readouterr().err


def test_a_checkpoint_with_kept_channels_is_refused_before_any_work(tmp_path):
    from minifloat.infer.evaluation.pipeline import quantize_checkpoint

    with pytest.raises(minifloat.MinifloatError, match="quantize without --keep-channels to export"):
        quantize_checkpoint(tmp_path / "no-model", "mxfp8", tmp_path / "out",
                            method=PTQMethod(method="gptq", keep_channels=4))  # fmt: skip


def test_a_llama_keeps_channels_in_its_body_and_not_in_a_tied_head():
    """A tied head's packed table is the input embedding's rows: it keeps them whole (no kept
    channels), while every body Linear keeps its own; the model stays close to the unquantized one."""
    pytest.importorskip("transformers")
    from tests.infer.test_gptq import tiny_llama

    model, ref = tiny_llama(tied=True), tiny_llama(tied=True)
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    method = resolve_method("gptq", "mxfp8", tune_norms=0, keep_channels=4)
    quantize_model(model, "mxfp8", calibration=[ids[:2], ids[2:]], method=method, quantize_head=True)
    body = [m for n, m in model.named_modules() if isinstance(m, QuantizedLinear) and ".layers." in n]
    assert len(body) == 14 and all(m.kept_index is not None and m.kept_index.numel() == 4 for m in body)
    assert model.lm_head.kept_index is None and model.get_input_embeddings().tied_to is model.lm_head
    with torch.no_grad():
        err = (model(ids).logits - ref(ids).logits).abs().mean() / ref(ids).logits.abs().mean()
    assert err < 0.1
