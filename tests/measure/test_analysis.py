import json
import math

import pytest
import torch

from minifloat import MinifloatError, fake_quantize, quantize, save
from minifloat.cli import main
from minifloat.measure.error_analysis import error_report, sqnr_db, synthetic
from tests.conftest import sqnr_db as float64_sqnr_db  # the oracle: not the function under test


def test_sqnr_formula():
    x = torch.tensor([3.0, 4.0])
    assert sqnr_db(x, x + torch.tensor([0.0, 0.5])) == pytest.approx(10 * math.log10(25 / 0.25))
    assert sqnr_db(x, x) == math.inf


def test_error_report_against_direct_computation():
    x = synthetic("outliers", 64, 256)
    r = error_report(x, "fp8")
    d = fake_quantize(x, "fp8").double()
    assert r["sqnr_db"] == pytest.approx(float64_sqnr_db(d, x))
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
    # a file minifloat.save wrote: its entries, not the stored parts (q.scale is a 1x1 grid)
    x = torch.randn(8, 32)
    save(tmp_path / "q.safetensors", {"q": quantize(x, "fp8_rowwise"), "x": x})
    assert main(["error", "--input", str(tmp_path / "q.safetensors"), "--schemes", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["input"].endswith("q.safetensors:q (dequantized fp8_rowwise)") and out["shape"] == [8, 32]
    assert main(["error", "--input", f"{tmp_path / 'q.safetensors'}:x", "--schemes", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shape"] == [8, 32]


def test_error_cli_bad_input(tmp_path, capsys):
    assert main(["error", "--input", "uniformish"]) == 2
    assert "unknown input 'uniformish'" in capsys.readouterr().err
    assert main(["error", "--input", "/nonexistent.safetensors"]) == 2
    assert "cannot read /nonexistent.safetensors" in capsys.readouterr().err
    garbage = tmp_path / "g.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    assert main(["error", "--input", str(garbage)]) == 2
    assert f"cannot read {garbage}" in capsys.readouterr().err
    assert main(["error", "--size", "4x-3"]) == 2
    assert "--size must be two positive numbers like 1024x1024, got '4x-3'" in capsys.readouterr().err
    with pytest.raises(MinifloatError):
        error_report(torch.empty(0), "fp8")


def test_error_report_leaves_out_what_a_nan_poisons():
    """A NaN takes its block (row, tensor) with it: that share is `frac_nan`, and the other
    figures are those of the remaining elements, as if the block were not there."""
    x = synthetic("gaussian", 16, 64)
    clean = x.clone()
    x[3, 5] = float("nan")
    r = error_report(x, "mxfp8")
    assert r["frac_nan"] == pytest.approx(31 / (16 * 64 - 1))  # the other 31 of its 32-block
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[3, :32] = False
    d = fake_quantize(clean, "mxfp8")  # the other blocks quantize as without the NaN
    assert r["sqnr_db"] == pytest.approx(float64_sqnr_db(d[keep], clean[keep]))
    assert r["max_abs_err"] == pytest.approx((clean[keep].double() - d[keep]).abs().max().item())
    assert error_report(x, "fp8_rowwise")["frac_nan"] == pytest.approx(63 / (16 * 64 - 1))
    whole = error_report(x, "fp8")  # a tensor scale: nothing is left to measure
    assert whole["frac_nan"] == 1.0 and math.isnan(whole["sqnr_db"]) and math.isnan(whole["frac_saturated"])
    assert error_report(clean, "mxfp8")["frac_nan"] == 0.0


def test_error_cli_nan_input_and_file_choice(tmp_path, capsys):
    from safetensors.torch import save_file

    x = synthetic("gaussian", 16, 64)
    x[0, 0] = float("nan")
    save_file({"a_ids": torch.arange(4), "w": x}, str(tmp_path / "m.safetensors"))
    assert main(["error", "--input", str(tmp_path / "m.safetensors"), "--schemes", "fp8,mxfp8"]) == 0
    out = capsys.readouterr().out
    assert "m.safetensors:w (16, 64)" in out  # the first floating-point tensor, not the int one
    assert "the input holds 1 NaN and 0 inf" in out and "NaN" in out.splitlines()[2]
    assert main(["error", "--input", str(tmp_path / "m.safetensors:w"), "--schemes", "fp8", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]  # strict JSON: nan as a string
    assert row["sqnr_db"] == "nan" and row["frac_nan"] == 1.0


def test_saturated_and_underflow_fractions_count_the_right_elements():
    # MX floor rule (OCP MX v1.0 §6.3): a block of amax 1.9 gets 2**(floor(log2 1.9) - 8), so
    # it holds at most 448 * 2**-8 = 1.75; 1.9 and 1.8 clip, 1.75 and below do not.
    x = torch.full((2, 32), 0.51)  # rounds down to 0.5 inside the range: not saturated
    x[0, :3] = torch.tensor([1.9, -1.8, 1.75])
    r = error_report(x, "mxfp8")
    assert r["frac_saturated"] == 2 / 64
    small = error_report(x * 2**-7, "mxfp8")  # a power-of-two smaller, norm below 1: the same fractions
    d = fake_quantize(x * 2**-7, "mxfp8").double()
    assert small["rel_l2"] == pytest.approx(((x * 2**-7).double() - d).norm().item() / (x * 2**-7).double().norm().item())
    assert small["frac_saturated"] == 2 / 64 and math.isfinite(small["sqnr_db"])
    # fp8 per tensor, amax 448: scale 1, so |x| below half of E4M3's 2**-9 flushes to zero
    y = torch.tensor([448.0, 1.0, 2.0**-11, -(2.0**-11), 2.0**-9, 0.0, 3e-4, 5.0])
    r = error_report(y, "fp8")
    assert r["frac_underflow"] == 3 / 8 and r["frac_saturated"] == 0.0  # zero is not flushed
    d = fake_quantize(y, "fp8").double()
    assert r["rel_l2"] == pytest.approx(((y.double() - d).norm() / y.double().norm()).item(), rel=1e-12)
    zeros = error_report(torch.zeros(4, 32), "mxfp4")
    assert zeros["rel_l2"] == 0.0 and zeros["sqnr_db"] == math.inf and zeros["frac_underflow"] == 0.0


def test_sqnr_of_a_zero_reference_with_noise_is_minus_infinity():
    assert sqnr_db(torch.zeros(3), torch.ones(3)) == -math.inf
    assert sqnr_db(torch.tensor([0.3]), torch.tensor([0.2])) == pytest.approx(10 * math.log10(0.09 / 0.01))


def test_synthetic_inputs_have_their_documented_distributions():
    t = synthetic("heavy", 1000, 1000).double()
    # Student-t with 3 degrees of freedom: P(|T| > 3) = 2 (1 - F(3)), with its closed-form CDF
    # F(t) = 1/2 + (u / (1 + u²) + atan u) / π, u = t / √3
    u = 3 / math.sqrt(3)
    tail = 2 * (1 - (0.5 + (u / (1 + u * u) + math.atan(u)) / math.pi))
    assert (t.abs() > 3).double().mean().item() == pytest.approx(tail, rel=0.03)  # 0.0577
    assert t.median().abs().item() < 0.01
    g = synthetic("gaussian", 1000, 1000).double()
    assert g.mean().abs().item() < 0.005 and g.std().item() == pytest.approx(1.0, rel=0.01)
    o = synthetic("outliers", 300, 512)
    big = o.abs().amax(dim=1) > 20  # a Gaussian row of 512 stays far below 20; ×100 far above
    assert int(big.sum()) == 3  # 1 % of the rows
    assert o[big].std().item() == pytest.approx(100, rel=0.1) and o[~big].std().item() == pytest.approx(1, rel=0.05)
    assert int((synthetic("outliers", 50, 64).abs().amax(dim=1) > 20).sum()) == 1  # at least one row
    assert torch.equal(synthetic("heavy", 4, 8, seed=3), synthetic("heavy", 4, 8, seed=3))
