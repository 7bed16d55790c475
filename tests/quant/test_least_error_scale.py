"""The ``"least-error"`` E8M0 rule of MX block scaling against an independent oracle: the rule computed
block by block in NumPy, with ml_dtypes' roundings of each MX element format."""

import ml_dtypes
import numpy as np
import pytest
import torch

import minifloat
from minifloat.infer.ptq.config import QuantConfig
from minifloat.recipes import MXScaling

ELEMENTS = {"e2m1": (ml_dtypes.float4_e2m1fn, 6.0, 2), "e2m3": (ml_dtypes.float6_e2m3fn, 7.5, 2),
            "e3m2": (ml_dtypes.float6_e3m2fn, 28.0, 4), "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8)}  # fmt: skip


def oracle(x: np.ndarray, element: str) -> tuple[np.ndarray, int]:
    """The values the rule gives `x` (rows, 32k float32), and how many blocks took the exponent
    above the floor: the floor exponent is floor(log2 amax) - emax (OCP MX); where it maps the
    amax past the format's max, the exponent one up is tried too, and the block keeps the one whose
    round-to-nearest values (saturating) have the smaller squared error (a tie keeps the floor)."""
    dtype, top, emax = ELEMENTS[element]
    out, ups = np.empty_like(x), 0
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], 32):
            block = x[r, c : c + 32].astype(np.float64)
            e = int(np.floor(np.log2(np.abs(block).max()))) - emax
            best = None
            for k in (e, e + 1) if np.abs(block).max() / 2.0**e > top else (e,):
                q = np.clip(block / 2.0**k, -top, top).astype(dtype).astype(np.float64) * 2.0**k
                err = ((q - block) ** 2).sum()
                if best is None or err < best[0]:
                    best = (err, q, k != e)
            out[r, c : c + 32] = best[1]
            ups += best[2]
    return out, ups


@pytest.mark.parametrize("element", list(ELEMENTS))
def test_mse_rule_equals_the_oracle_and_errs_no_more_than_floor(element):
    g = torch.Generator().manual_seed(len(element))
    x = torch.randn(16, 256, generator=g) * torch.exp(torch.randn(16, 256, generator=g))  # heavy tails
    scheme = minifloat.get_scheme("mxfp8").replace(element=element, scale_rule="least-error")
    got = minifloat.quantize(x, scheme).dequantize()
    want, ups = oracle(x.numpy(), element)
    assert torch.equal(got.double(), torch.from_numpy(want))
    assert 0 < ups < x.numel() // 32  # both exponents taken somewhere: the choice is real
    floor = minifloat.quantize(x, scheme.replace(scale_rule="floor")).dequantize()
    assert (got - x).square().sum() < (floor - x).square().sum()


def test_the_rule_is_mx_only_and_a_recipe_field():
    with pytest.raises(minifloat.MinifloatError, match="needs scale_format='e8m0'"):
        minifloat.get_scheme("nvfp4").replace(scale_rule="least-error")
    r = minifloat.get_recipe("mxfp4-tseng-least-error")
    assert r.scheme("input").scale_rule == r.scheme("weight").scale_rule == "least-error"
    assert r.scheme("grad_output").scale_rule == "rceil"  # stochastic rounding keeps its rounded-up scales
    assert minifloat.get_recipe(r.to_dict()) == r and isinstance(r, MXScaling)


def test_a_ptq_config_takes_the_rule_for_its_mx_schemes():
    c = QuantConfig(name="mxfp4-least-error", weight="mxfp4", activation="mxfp4", scale_rule="least-error")
    assert c.weight_scheme.scale_rule == c.activation_scheme.scale_rule == "least-error"
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    err = {r: (minifloat.quantize(w, c.weight_scheme.replace(scale_rule=r)).dequantize() - w).square().sum() for r in ("rceil", "least-error")}
    assert err["least-error"] < err["rceil"]


def test_the_rule_s_earlier_name_says_the_new_one():
    with pytest.raises(minifloat.MinifloatError, match="scale rule 'mse' is now 'least-error'"):
        minifloat.get_scheme("mxfp4").replace(scale_rule="mse")
