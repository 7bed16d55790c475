"""FP8 GEMMs on a CPU by oneDNN (`minifloat.gemm.onednn`): exact against a float64 product of the
dequantized operands, taken only where the setting says so; the probe only recommends."""

import pytest
import torch

import minifloat
from minifloat import quantize
from minifloat.gemm import onednn, scaled_mm


@pytest.fixture
def fresh_probe():
    onednn.probe.cache_clear()
    onednn.uses_onednn.cache_clear()
    yield
    onednn.probe.cache_clear()
    onednn.uses_onednn.cache_clear()


def _runs_here() -> bool:
    try:
        a = quantize(torch.randn(4, 32), "fp8")
        onednn.onednn_mm(a, a)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@pytest.mark.skipif(not _runs_here(), reason="this torch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("scheme", ["fp8", "fp8_rowwise", "fp8_e5m2"])
@pytest.mark.parametrize(("m", "n", "k"), [(37, 19, 300), (128, 64, 1024)])
def test_onednn_equals_the_float64_product_of_the_dequantized_operands(scheme, m, n, k):
    g = torch.Generator().manual_seed(m + n)
    a, b = quantize(torch.randn(m, k, generator=g), scheme), quantize(torch.randn(n, k, generator=g) * 3, scheme)
    da, db = a.dequantize().double(), b.dequantize().double()
    want = da @ db.t()
    bound = (da.abs() @ db.abs().t()) * (k + 2) * 2.0**-24
    got = onednn.onednn_mm(a, b)
    assert got.dtype == torch.float32 and ((got.double() - want).abs() <= bound).all()


def test_the_probe_falls_back_where_oneDNN_fails_or_disagrees(monkeypatch, fresh_probe):
    def broken(*args, **kwargs):
        raise RuntimeError("no CPU kernel for this dtype")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    p = onednn.probe()
    assert not p.onednn and "does not run here (no CPU kernel" in p.why
    onednn.probe.cache_clear()
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: (a.float() @ b.float()) * 1.01)
    p = onednn.probe()
    assert not p.onednn and "differs from the emulation" in p.why


def test_auto_takes_oneDNN_only_where_the_setting_says(monkeypatch, fresh_probe):
    runs = _runs_here()
    calls = []
    real = onednn.onednn_mm
    monkeypatch.setattr(onednn, "onednn_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    a, b = quantize(torch.randn(8, 64), "fp8_rowwise"), quantize(torch.randn(4, 64), "fp8_rowwise")
    want = scaled_mm(a, b, backend="emulated")
    monkeypatch.delenv("MINIFLOAT_CPU_SCALED_MM", raising=False)  # unset: the emulation, whatever a probe finds
    assert torch.equal(scaled_mm(a, b, backend="auto"), want) and calls == []
    monkeypatch.setenv("MINIFLOAT_CPU_SCALED_MM", "emulated")
    assert torch.equal(scaled_mm(a, b, backend="auto"), want) and calls == []
    if runs:
        onednn.uses_onednn.cache_clear()
        monkeypatch.setenv("MINIFLOAT_CPU_SCALED_MM", "onednn")
        got = scaled_mm(a, b, backend="auto")
        calls.clear()  # the one-off agreement check is a call too
        got = scaled_mm(a, b, backend="auto")
        da, db = a.dequantize().double(), b.dequantize().double()
        bound = (da.abs() @ db.abs().t()) * 66 * 2.0**-24  # FP32 sums of 64 exact products, in either order
        assert calls == [1] and ((got.double() - da @ db.t()).abs() <= bound).all()
        mx = quantize(torch.randn(8, 64), "mxfp8")
        scaled_mm(mx, mx, backend="auto")  # block scales along K: the emulation
        assert calls == [1]
    onednn.uses_onednn.cache_clear()
    monkeypatch.setenv("MINIFLOAT_CPU_SCALED_MM", "amx")
    with pytest.raises(minifloat.MinifloatError, match="MINIFLOAT_CPU_SCALED_MM='amx'"):
        scaled_mm(a, b, backend="auto")


def test_oneDNN_asked_for_where_it_disagrees_warns_and_the_emulation_serves(monkeypatch, fresh_probe):
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: (a.float() @ b.float()) * 1.01)
    monkeypatch.setenv("MINIFLOAT_CPU_SCALED_MM", "onednn")
    with pytest.warns(RuntimeWarning, match="differs from the emulation"):
        assert not onednn.uses_onednn()
