"""Four Over Six (arXiv 2512.02010) NVFP4 block scaling against an independent oracle: the
published rule computed block by block in NumPy with ml_dtypes' E4M3 and E2M1 roundings."""

import ml_dtypes
import numpy as np
import pytest
import torch

import minifloat
from minifloat.recipes import NVFP4BlockScaling


def oracle(x: np.ndarray) -> tuple[np.ndarray, int]:
    """The values Four Over Six gives `x` (rows, 16k float32), and how many blocks took the
    scale that maps their amax to 4: the tensor amax maps to 256 · 6; each block tries the
    scale of its amax to 6 and 1.5 × it (amax to 4), E4M3-rounded, and keeps the one whose
    round-to-nearest E2M1 values have the smaller squared error (a tie keeps 6)."""
    f32 = np.float32
    s_enc = f32(256 * 6) / f32(np.abs(x).max())
    tensor_dec = f32(1) / s_enc
    out, fours = np.empty_like(x), 0
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], 16):
            block = x[r, c : c + 16]
            six = f32(f32(np.abs(block).max() / f32(6)) * s_enc)
            best = None
            for s in (six, f32(six * f32(1.5))):
                dec = f32(f32(np.asarray(s).astype(ml_dtypes.float8_e4m3fn).astype(f32)) * tensor_dec)
                enc = f32(0) if dec == 0 else f32(f32(1) / dec)
                q = (block * enc).astype(f32).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
                err = ((q * np.float64(dec) - block.astype(np.float64)) ** 2).sum()
                if best is None or err < best[0]:
                    best = (err, (q * np.float64(dec)).astype(f32), s is not six)
            out[r, c : c + 16] = best[1]
            fours += best[2]
    return out, fours


@pytest.mark.parametrize("seed", [0, 1])
def test_four_over_six_equals_the_published_rule(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 128, generator=g) * torch.exp(torch.randn(24, 128, generator=g))  # heavy tails
    scheme = minifloat.get_scheme("nvfp4").replace(scale_rule="4over6")
    got = minifloat.quantize(x, scheme).dequantize()
    want, fours = oracle(x.numpy())
    assert torch.equal(got, torch.from_numpy(want))
    assert 0 < fours < x.numel() // 16  # both candidates taken somewhere: the choice is real


def test_four_over_six_errs_less_than_plain_nvfp4_and_stays_nvfp4():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    plain, fos = (minifloat.quantize(x, minifloat.get_scheme("nvfp4").replace(scale_rule=r)) for r in ("floor", "4over6"))
    err = [(q.dequantize() - x).square().sum().item() for q in (plain, fos)]
    assert err[1] < err[0]
    # the parts are plain NVFP4 (E4M3 block scales, an FP32 tensor scale): any NVFP4 reader decodes them
    assert fos.scale.dtype == torch.uint8 and fos.tensor_scale.dtype == torch.float32
    assert fos.tensor_scale.item() == pytest.approx(x.abs().max().item() / (256 * 6))
    assert int(fos.scale.max()) <= 0x7C  # E4M3 code of 384 (1.5 · 2^8): the scale × 1.5 stays below 448


def test_the_recipe_field_and_its_errors():
    r = NVFP4BlockScaling(four_over_six=True)
    assert {r.scheme(role).scale_rule for role in ("input", "weight", "grad_output")} == {"4over6"}
    assert r.scheme("grad_output").rounding == "stochastic" and r.scheme("weight").block == (16, 16)
    assert minifloat.get_recipe(r.to_dict()) == r and not minifloat.get_recipe("nvfp4").four_over_six
    with pytest.raises(minifloat.MinifloatError, match="needs scale_format='e4m3'"):
        minifloat.get_scheme("mxfp4").replace(scale_rule="4over6")
    layer = minifloat.Linear(64, 32, recipe=r)  # trains through the reference quantizer
    layer(torch.randn(8, 64)).sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
