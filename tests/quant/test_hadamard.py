import pytest
import torch

from minifloat import MinifloatError
from minifloat.kernels.reference import rht as rht_reference
from minifloat.quant.hadamard import hadamard_matrix, hadamard_signs, rht


def test_hadamard_matrix_is_orthogonal_with_pm_quarter_entries():
    t = hadamard_matrix(16, seed=3).double()
    assert torch.allclose(t @ t.T, torch.eye(16, dtype=torch.float64), atol=1e-6)
    assert torch.equal(t.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    assert not torch.equal(hadamard_matrix(16, seed=3), hadamard_matrix(16, seed=4))
    # the signs are the matrix's first column (H's is all ones), scaled by sqrt(16)
    assert torch.equal(hadamard_signs(16, seed=3), hadamard_matrix(16, seed=3)[:, 0] * 4)


@pytest.mark.parametrize("n", [2, 4, 16, 64])
def test_reference_is_the_matrix_product(n):
    # The butterflies against x @ T in float64 (the definition): a few float32 roundings apart.
    x = torch.randn(300, 4 * n, generator=torch.Generator().manual_seed(n))
    want = (x.double().reshape(-1, n) @ hadamard_matrix(n, seed=5).double()).reshape(x.shape)
    got = rht_reference(x, hadamard_signs(n, seed=5))
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=0, atol=4e-6 * x.abs().max().item())


def test_rht_preserves_products_and_pads_with_zeros():
    a, b = torch.randn(5, 40), torch.randn(7, 40)  # 40 is padded to 48
    ta, tb = rht(a), rht(b)
    assert ta.shape == (5, 48)
    assert torch.allclose(ta @ tb.T, a @ b.T, atol=1e-4)
    assert torch.equal(rht(a.bfloat16()), rht(a.bfloat16().float()))  # float32 out, from any float


def test_rht_spreads_an_outlier_over_its_group():
    x = torch.zeros(1, 16)
    x[0, 3] = 16.0
    y = rht(x)
    assert torch.equal(y.abs(), torch.full((1, 16), 4.0))


@pytest.mark.parametrize("seed", [0, 7])
def test_kernel_equals_reference_bit_for_bit(seed, monkeypatch):
    from minifloat.kernels import cpu

    if cpu.library() is None:
        pytest.skip("compiled kernels unavailable")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1037, 48, generator=g) * torch.logspace(-40, 30, 48)  # subnormal to huge
    x[3, 5], x[9, 17], x[20, 0] = float("nan"), float("inf"), float("-inf")
    x[50, :16] = 3.4e38  # the sums overflow to inf
    fast = rht(x, seed)
    monkeypatch.setenv("MINIFLOAT_KERNELS", "reference")
    ref = rht(x, seed)
    assert torch.equal(torch.isnan(fast), torch.isnan(ref))
    bits = lambda t: torch.where(torch.isnan(t), 0.0, t).view(torch.int32)  # noqa: E731 (NaN payloads aside)
    assert torch.equal(bits(fast), bits(ref))
    assert torch.isnan(ref[50, :16]).any() and torch.isinf(ref[9, 16:32]).all()  # overflow; an inf spreads


@pytest.mark.parametrize("n", [0, -4, 12, 24])
def test_sizes_that_are_not_powers_of_two_are_refused(n):
    with pytest.raises(MinifloatError, match=f"must be a power of two, got {n}"):
        rht(torch.randn(2, 48), n=n)
    with pytest.raises(MinifloatError, match=f"got {n}"):
        hadamard_matrix(n)


def test_the_defaults_are_nvidias_16_point_transform():
    # arXiv 2509.25149 §4.2: groups of 16 along the reduction dimension
    assert hadamard_matrix().shape == (16, 16) and torch.equal(hadamard_matrix(), hadamard_matrix(16, 0))
    assert torch.equal(hadamard_signs(), hadamard_signs(16, 0))
    x = torch.randn(3, 40)
    assert torch.equal(rht(x), rht(x, seed=0, n=16)) and rht(x).shape == (3, 48)
    assert [hadamard_matrix(n).shape[0] for n in (1, 2, 4, 32)] == [1, 2, 4, 32]
