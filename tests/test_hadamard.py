import torch

from minifloat.hadamard import hadamard_matrix, rht


def test_hadamard_matrix_is_orthogonal_with_pm_quarter_entries():
    t = hadamard_matrix(16, seed=3).double()
    assert torch.allclose(t @ t.T, torch.eye(16, dtype=torch.float64), atol=1e-6)
    assert torch.equal(t.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    assert not torch.equal(hadamard_matrix(16, seed=3), hadamard_matrix(16, seed=4))


def test_rht_preserves_products_and_pads_with_zeros():
    a, b = torch.randn(5, 40), torch.randn(7, 40)  # 40 is padded to 48
    t = hadamard_matrix(16)
    ta, tb = rht(a, t), rht(b, t)
    assert ta.shape == (5, 48)
    assert torch.allclose(ta @ tb.T, a @ b.T, atol=1e-4)


def test_rht_spreads_an_outlier_over_its_group():
    x = torch.zeros(1, 16)
    x[0, 3] = 16.0
    y = rht(x, hadamard_matrix(16))
    assert torch.equal(y.abs(), torch.full((1, 16), 4.0))
