import json
import math

import pytest
import torch

from minifloat import MinifloatError, fake_quantize, save
from minifloat.analysis import error_report, sqnr_db, synthetic
from minifloat.cli import main


def test_sqnr_formula():
    x = torch.tensor([3.0, 4.0])
    assert sqnr_db(x, x + torch.tensor([0.0, 0.5])) == pytest.approx(10 * math.log10(25 / 0.25))
    assert sqnr_db(x, x) == math.inf


def test_error_report_against_direct_computation():
    x = synthetic("outliers", 64, 256)
    r = error_report(x, "fp8")
    d = fake_quantize(x, "fp8").double()
    assert r["sqnr_db"] == pytest.approx(sqnr_db(x, d))
    assert r["max_abs_err"] == pytest.approx((x.double() - d).abs().max().item())
    assert r["frac_underflow"] == pytest.approx(((x != 0) & (d == 0)).double().mean().item())
    assert r["frac_saturated"] == 0.0  # a tensor scale fits the amax exactly
    assert r["memory_vs_fp16"] == pytest.approx(0.5, abs=1e-3)
    # MX's floor rule leaves headroom below 2**(emax+1): some values clip to the block max
    assert error_report(synthetic("gaussian", 64, 256), "mxfp8")["frac_saturated"] > 0


def test_error_cli_synthetic_and_file(tmp_path, capsys):
    assert main(["error", "--input", "heavy", "--size", "32x64", "--schemes", "fp8,mxfp4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["scheme"] for r in out["results"]] == ["fp8", "mxfp4"] and out["shape"] == [32, 64]
    save(tmp_path / "t.safetensors", {"w": torch.randn(8, 32)})
    assert main(["error", "--input", f"{tmp_path / 't.safetensors'}:w", "--schemes", "nvfp4"]) == 0
    assert "nvfp4" in capsys.readouterr().out


def test_error_cli_bad_input(capsys):
    assert main(["error", "--input", "uniformish"]) == 2
    assert "unknown input 'uniformish'" in capsys.readouterr().err
    assert main(["error", "--input", "/nonexistent.safetensors"]) == 2
    assert "cannot read /nonexistent.safetensors" in capsys.readouterr().err
    with pytest.raises(MinifloatError):
        error_report(torch.empty(0), "fp8")
