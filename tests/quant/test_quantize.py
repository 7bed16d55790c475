"""Every preset against an independent NumPy implementation of its published formula
(float32 arithmetic where the reference libraries compute in float32, ml_dtypes for every
cast), plus torchao for MX, and the NaN / inf / zero / empty / odd-shape contract."""

import copy
import warnings

import numpy as np
import pytest
import torch

import minifloat
from minifloat import SCHEMES, MinifloatError, fake_quantize, get_scheme, quantize
from tests.conftest import ML_DTYPES, requires_cuda

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def ml_cast(y: np.ndarray, name: str) -> np.ndarray:
    """Saturating cast to an element format through ml_dtypes, back to float32."""
    mx = F32(minifloat.get_format(name).max)
    with np.errstate(invalid="ignore"):
        return np.clip(y, -mx, mx).astype(ML_DTYPES[name]).astype(F32)


def finite_amax(a: np.ndarray, axis) -> np.ndarray:
    a = np.abs(a)
    return np.where(np.isinf(a), F32(0), a).max(axis=axis)


def oracle(x: np.ndarray, scheme) -> np.ndarray:
    """Dequantized values by the published formulas (see minifloat.scaling for sources)."""
    name, fmt = scheme.element, scheme.element_format
    K = x.shape[-1]
    x2 = x.reshape(-1, K).astype(F32)
    R = x2.shape[0]
    group = {4: 2, 6: 4, 8: 1}[fmt.bits]
    if scheme.granularity == "block":
        br, bc = scheme.block
    else:
        bc = -(-K // group) * group
        br = 1 if scheme.granularity == "row" else R
    Rp, Kp = -(-R // br) * br, -(-K // bc) * bc
    xp = np.zeros((Rp, Kp), F32)
    xp[:R, :K] = x2
    t = xp.reshape(Rp // br, br, Kp // bc, bc)
    amax = finite_amax(t, axis=(1, 3))[:, None, :, None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if scheme.scale_format == "fp32":  # TE: scale = max / amax, amax 0 -> 1, inf -> FLT_MAX
            scale = F32(fmt.max) / amax
            scale = np.where(np.isinf(scale), FLT_MAX, scale)
            scale = np.where(amax == 0, F32(1), scale).astype(F32)
            deq = ml_cast(t * scale, name) * (F32(1) / scale)
        elif scheme.scale_format == "e8m0":  # OCP MX §6.3 floor rule; rceil: NVIDIA's ⌈log2(amax / max)⌉
            _, e = np.frexp(amax)
            E = e - 1 - fmt.emax
            if scheme.scale_rule == "rceil":
                E = np.ceil(np.log2(amax.astype(np.float64) / fmt.max))
            E = np.clip(E, -127, 127).astype(np.float64)
            E = np.where(amax == 0, 0, E)
            X = np.where(np.isnan(amax), np.nan, np.ldexp(1.0, np.nan_to_num(E).astype(int))).astype(F32)
            deq = ml_cast(t / X, name) * X
        else:  # NVFP4 two-level (NVIDIA / TE reference)
            a = np.abs(xp)
            g = a[np.isfinite(a)].max() if np.isfinite(a).any() else F32(0)
            s_enc = F32(2688.0) / F32(g)
            s_enc = F32(1) if g == 0 or s_enc == 0 else min(s_enc, FLT_MAX)
            s_dec = F32(1) / F32(s_enc)
            bs = ml_cast((amax / F32(6)) * F32(s_enc), "e4m3")  # saturating E4M3
            dec = (bs * s_dec).astype(F32)
            enc = np.where(dec == 0, F32(0), F32(1) / dec)
            deq = ml_cast(t * enc, name) * dec
    return deq.reshape(Rp, Kp)[:R, :K].reshape(x.shape)


def assert_same_values(ours: torch.Tensor, ref: np.ndarray) -> None:
    ours = ours.numpy()
    same = (ours == ref) | (np.isnan(ours) & np.isnan(ref))
    assert same.all(), f"{(~same).sum()} differ, e.g. ours={ours[~same][:4]} ref={ref[~same][:4]}"


def wide_input(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)
    return x


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("shape", [(3, 70), (130, 257), (1, 16), (2, 3, 40), (33,)])
def test_presets_match_published_formula(name, shape):
    x = wide_input(shape, seed=len(shape))
    assert_same_values(quantize(x, name).dequantize(), oracle(x.numpy(), get_scheme(name)))


@pytest.mark.parametrize("name", ["fp8", "mxfp8", "mxfp4", "nvfp4", "fp8_block128x128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(name, dtype):
    x = wide_input((20, 96)).clamp(-6e4, 6e4).to(dtype)
    q = quantize(x, name)
    assert_same_values(q.dequantize(), oracle(x.float().numpy(), get_scheme(name)))
    assert fake_quantize(x, name).dtype == dtype


@pytest.mark.parametrize(("name", "bits"), [("fp8", 8.0), ("mxfp8", 8.25), ("mxfp6_e3m2", 6.25), ("mxfp4", 4.25), ("nvfp4", 4.5)])
def test_bits_per_element_and_nbytes(name, bits):
    q = quantize(torch.randn(64, 256), name)
    assert q.bits_per_element == bits
    tensor_bytes = 4 if name in ("fp8", "nvfp4") else 0
    assert q.nbytes == 64 * 256 * bits / 8 + tensor_bytes


@pytest.mark.parametrize(("name", "row_bytes", "one_bytes"), [("fp8", 257, 1), ("fp6_e3m2", 195, 3), ("fp4", 129, 1)])
def test_odd_rows_pack_into_the_fewest_whole_bytes(name, row_bytes, one_bytes):
    # 257 codes: FP8 one byte each, FP6 four in three bytes (65 groups), FP4 two per byte
    q = quantize(torch.randn(3, 257), name)
    assert q.data.shape == (3, row_bytes) and q.nbytes == 3 * row_bytes + 4  # + the FP32 scale
    assert quantize(torch.tensor(3.0), name).data.shape == (1, one_bytes)  # a 0-d tensor: one code


def test_nan_poisons_exactly_its_block_or_row_or_tensor():
    x = torch.randn(4, 64)
    x[1, 37] = float("nan")
    for name, expect in [("mxfp8", (1, slice(32, 64))), ("mxfp4", (1, slice(32, 64))), ("nvfp4", (1, slice(32, 48))),
                         ("fp8_block128", (1, slice(0, 64))), ("fp8_rowwise", (1, slice(0, 64))),
                         ("fp8", (slice(None), slice(None))), ("fp4", (slice(None), slice(None)))]:
        d = quantize(x, name).dequantize()
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[expect] = True
        assert torch.equal(torch.isnan(d), mask), name


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("given", [{"scale": 2.0}, {"amax": 3.0}])
def test_nan_under_a_given_scale_is_never_finite(monkeypatch, kernels, given):
    """With scale= or amax= (delayed scaling) the scale does not see the data: FP8 keeps a NaN
    in its codes; FP6 / FP4 codes cannot, so the NaN's tensor / row / block scale becomes NaN."""
    monkeypatch.setenv("MINIFLOAT_KERNELS", kernels)
    x = torch.randn(4, 4096)
    x[1, 37] = float("nan")
    x[2, 4095] = float("nan")  # the last column: past the vector loops
    row, block = get_scheme("fp4").replace(granularity="row"), get_scheme("fp6_e3m2").replace(element="e2m3", granularity="block", block=(1, 96))
    only = torch.zeros_like(x, dtype=torch.bool)
    only[1, 37] = only[2, 4095] = True
    rows = torch.zeros_like(x, dtype=torch.bool)
    rows[1:3] = True
    blocks = torch.zeros_like(x, dtype=torch.bool)
    blocks[1, :96] = blocks[2, 4032:] = True
    tiles = get_scheme("fp4").replace(granularity="block", block=(16, 64))  # 2-D, 8 * 2^k columns
    tile_mask = torch.zeros_like(x, dtype=torch.bool)
    tile_mask[:, :64] = tile_mask[:, 4032:] = True
    for scheme, expect in [("fp8", only), ("fp8_block128", only), ("fp4", torch.ones_like(only)),
                           ("fp6_e3m2", torch.ones_like(only)), (row, rows), (block, blocks), (tiles, tile_mask)]:
        for rounding in ("nearest", "stochastic"):
            d = quantize(x, scheme, rounding=rounding, **given).dequantize()
            assert torch.equal(torch.isnan(d), expect), (scheme, rounding)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_zeros_infs_and_empty(name):
    assert torch.equal(quantize(torch.zeros(3, 50), name).dequantize(), torch.zeros(3, 50))
    x = torch.randn(2, 64)
    x[0, 3], x[1, 40] = float("inf"), -float("inf")
    d = quantize(x, name).dequantize()
    assert torch.isfinite(d).all(), name  # ±inf saturates to the largest value of its block
    assert d[0, 3] > 0 and d[1, 40] < 0 and d[0, 3] >= d[0, :16].abs().max()  # cols 0..15: one block
    for shape in [(0,), (0, 32), (5, 0)]:
        q = quantize(torch.empty(shape), name)
        assert q.dequantize().shape == shape and q.numel() == 0


def test_given_scale_and_amax_are_the_delayed_path():
    x = torch.randn(8, 64)
    q = quantize(x, "fp8", scale=torch.tensor(16.0))
    assert torch.equal(q.scale, torch.tensor([[1 / 16]]))
    assert torch.equal(q.dequantize(), fake_quantize(x, "fp8", amax=torch.tensor(28.0)))  # 448/28 = 16
    small = quantize(x * 0.01, "fp8", amax=0.5)  # an amax below 1 is an amax (scale 896)
    assert torch.equal(small.scale, torch.tensor([[1 / 896]]))
    with pytest.raises(MinifloatError, match="amax is a largest magnitude, ≥ 0; got -0.5"):
        quantize(x, "fp8", amax=-0.5)
    rows = torch.arange(1, 9, dtype=torch.float32)
    assert torch.equal(quantize(x, "fp8_rowwise", scale=rows).scale.flatten(), 1 / rows)
    g = x.abs().max() * 2
    assert quantize(x, "nvfp4", amax=g).tensor_scale == torch.tensor(1.0) / (torch.tensor(2688.0) / g)
    with pytest.raises(MinifloatError, match="scale= is for FP32-scaled schemes; mxfp8 derives its e8m0"):
        quantize(x, "mxfp8", scale=1.0)
    with pytest.raises(MinifloatError, match=r"scale of shape \(3,\) does not fit the scale grid \(8, 1\)"):
        quantize(x, "fp8_rowwise", scale=torch.ones(3))
    with pytest.raises(MinifloatError, match=r"amax= for nvfp4 is the tensor amax, one value; got shape \(3,\)"):
        quantize(x, "nvfp4", amax=torch.ones(3))
    # 0 or inf would decode every value as NaN or 0, a negative scale flips the signs.
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(MinifloatError, match=f"positive and finite; got {bad} \\(derive it with minifloat.scale_from_amax"):
            fake_quantize(x, "fp8", scale=bad)
    rows[5] = -rows[5]
    with pytest.raises(MinifloatError, match="positive and finite; got -6.0 among the 8 given"):
        quantize(x, "fp8_rowwise", scale=rows)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    x = torch.full((2000, 32), 0.3) * torch.linspace(0.5, 2, 32)
    g = torch.Generator().manual_seed(1)
    a = quantize(x, "mxfp4", rounding="stochastic", generator=g).dequantize()
    b = quantize(x, "mxfp4", rounding="stochastic", generator=torch.Generator().manual_seed(1)).dequantize()
    assert torch.equal(a, quantize(x, "mxfp4", rounding="stochastic", generator=torch.Generator().manual_seed(1)).dequantize())
    assert torch.equal(a, b)
    assert torch.allclose(a.mean(0), x[0], rtol=0.01)
    nearest = quantize(x, "mxfp4").dequantize()
    assert not torch.allclose(nearest.mean(0), x[0], rtol=0.01)  # nearest is biased here


def test_quantized_tensor_behaves_like_its_values():
    x = torch.randn(4, 32)
    q = quantize(x, "mxfp8")
    d = q.dequantize()
    assert torch.equal(q + 1, d + 1) and torch.equal(torch.add(q, 1), d + 1)
    assert torch.equal(q @ torch.eye(32), d @ torch.eye(32)) and torch.equal(q[1], d[1])
    assert torch.equal(torch.nn.functional.relu(q), torch.relu(d))
    assert q.to("cpu").dequantize().equal(d) and "mxfp8" in repr(q)
    # comparisons are elementwise, as a tensor's (== used to be Python's identity test)
    assert torch.equal(q == 0, d == 0) and torch.equal(q != d, d != d) and (q == q).all()
    assert torch.equal(2**q, 2**d) and torch.equal(q // 0.5, d // 0.5) and torch.equal(q % 0.5, d % 0.5)
    assert len({q, q}) == 1  # hashable by identity, as a tensor
    assert (len(q), q.size(), q.size(1), q.size(-2), q.dim(), q.numel()) == (4, (4, 32), 32, 4, 2, 128)
    assert q.to() is q and quantize(torch.empty(0, 32), "mxfp8").bits_per_element == 8.25
    c = q.clone()  # a QuantizedTensor with its own codes and scales
    assert type(c) is minifloat.QuantizedTensor and torch.equal(c.dequantize(), d)
    assert c.data.data_ptr() != q.data.data_ptr() and c.scale.data_ptr() != q.scale.data_ptr()


@pytest.mark.parametrize(
    "op",
    [lambda q: q.mul_(2), lambda q: q.zero_(), lambda q: q.copy_(torch.zeros(4, 32)), lambda q: torch.relu_(q),
     lambda q: torch.nn.functional.relu(q, inplace=True), lambda q: torch.add(torch.ones(4, 32), 1, out=q),
     lambda q: q.__setitem__(0, 5.0)],
)
def test_in_place_operations_are_refused_not_lost(op):
    # They would change a dequantized copy: q would silently keep its old values.
    q = quantize(-torch.ones(4, 32), "mxfp8")
    with pytest.raises(MinifloatError, match="a QuantizedTensor is read-only: .* would change a dequantized copy"):
        op(q)
    assert torch.equal(q.dequantize(), -torch.ones(4, 32))
    assert torch.equal(torch.zeros(4, 32).add_(q), q.dequantize())  # reading q in place of a tensor is fine


def test_tensor_methods_and_dtype_conversions_see_the_dequantized_values():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    q = quantize(x, "mxfp8")
    d = q.dequantize()
    assert torch.equal(q.max(), d.max()) and torch.equal(q.T, d.T) and (q.numpy() == d.numpy()).all()
    # a dtype cannot hold codes and scales: to(dtype) gives the values, as Tensor.float() does
    for conv in (lambda q: q.to(torch.bfloat16), lambda q: q.to("cpu", torch.bfloat16),
                 lambda q: q.to(dtype=torch.bfloat16), lambda q: q.half().bfloat16()):  # fmt: skip
        out = conv(q)
        assert type(out) is torch.Tensor and torch.equal(out, d.bfloat16())
    moved = q.to("cpu", non_blocking=True)
    assert isinstance(moved, minifloat.QuantizedTensor) and torch.equal(moved.data, q.data)
    one = quantize(torch.tensor(3.0), "fp8")
    assert float(one) == 3.0 and int(one) == 3 and bool(one)
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d QuantizedTensor"):
        len(one)
    with warnings.catch_warnings():  # NumPy 2's copy= protocol, without its deprecation warning
        warnings.simplefilter("error")
        assert np.array_equal(np.asarray(q), d.numpy()) and np.array(q, dtype=np.float64).dtype == np.float64
        assert np.array(q, copy=True).dtype == np.float32
        with pytest.raises(ValueError, match="copy=False cannot be honoured"):
            np.array(q, copy=False)
    # copies stay QuantizedTensors (copy must not find a dequantized tensor's __deepcopy__)
    assert type(copy.deepcopy(q)) is minifloat.QuantizedTensor and not hasattr(q, "no_such_method")


def test_fake_quantize_is_straight_through_and_exact():
    x = (torch.randn(8, 64, generator=torch.Generator().manual_seed(4)) * 50).requires_grad_()
    with torch.no_grad():
        x[0, 0], x[1, 1] = float("inf"), float("nan")
    for scheme in ("mxfp4", "fp8", "nvfp4"):
        x.grad = None
        y = fake_quantize(x, scheme)
        # the values are those of the detached path, bit for bit (inf saturated, NaN kept)
        assert torch.equal(y.detach().view(torch.int32), fake_quantize(x.detach(), scheme).view(torch.int32))
        w = torch.randn(8, 64)
        (y * w).nansum().backward()
        assert torch.equal(x.grad, torch.where(y.isnan(), 0.0, w))  # identity (nansum skips the NaN block)
    with torch.no_grad():
        assert fake_quantize(x, "fp8").grad_fn is None


def test_bad_input():
    with pytest.raises(MinifloatError, match="unknown scheme 'mxfp5'; known: fp8, fp8_e5m2"):
        quantize(torch.ones(2), "mxfp5")
    # the accepted dtypes, as quantize has them (float64 is not one)
    with pytest.raises(minifloat.DTypeError, match="quantize takes float32, bfloat16, float16 tensors, got torch.int64"):
        quantize(torch.ones(2, dtype=torch.long), "fp8")
    with pytest.raises(minifloat.DTypeError, match="got torch.float64; convert with x.float()"):
        quantize(torch.ones(2, dtype=torch.float64), "fp8")
    with pytest.raises(MinifloatError, match="a block of 3 e2m1 elements is not whole bytes"):
        minifloat.Scheme(element="e2m1", granularity="block", block=(1, 3))
    x = torch.randn(4, 32)
    with pytest.raises(MinifloatError, match="scale must be a number or a float tensor, got str '2'"):
        quantize(x, "fp8", scale="2")
    with pytest.raises(MinifloatError, match="amax must be a number or a float tensor, got str"):
        quantize(x, "nvfp4", amax="2")
    with pytest.raises(MinifloatError, match="generator must be a torch.Generator, got int"):
        quantize(x, "fp8", rounding="stochastic", generator=1)
    with pytest.raises(MinifloatError, match="got one on the meta device"):
        quantize(torch.empty(4, 32, device="meta"), "mxfp8")
    with pytest.raises(MinifloatError, match="dequantize returns floating-point values; got dtype=torch.int32"):
        quantize(x, "fp8").dequantize(torch.int32)


@pytest.mark.parametrize(("name", "elem"), [("mxfp8", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2),
                                            ("mxfp4", torch.float4_e2m1fn_x2)])
def test_mx_equals_torchao_floor(name, elem):
    torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao not installed")
    x = wide_input((64, 256), seed=3)
    x[0, :32] = 0
    x[1, 5] = float("nan")
    s, d = torchao_mx.to_mx(x, elem, 32)
    ref = torchao_mx.to_dtype(d, s, elem, 32, torch.float32)
    ours = quantize(x, name).dequantize()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    assert torch.equal(ours.nan_to_num(), ref.nan_to_num())


def test_kernels_that_were_built_are_used():
    """Not skipped with test_kernels: where the build produced the extension, it loads (a
    check that refused a good library would silently turn every kernel test into a skip)."""
    import importlib.util

    from minifloat.kernels import cpu

    if importlib.util.find_spec("minifloat.kernels._cpu") is None:
        pytest.skip("the CPU kernels were not built here (no C compiler): the reference serves")
    assert cpu.library() is not None and cpu.runs_on(torch.device("cpu"))


def test_missing_kernels_fall_back_to_reference_with_one_warning(monkeypatch):
    import importlib.util
    import warnings

    from minifloat.kernels import cpu

    cpu.library.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    try:
        x = torch.randn(4, 64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = quantize(x, "mxfp4").dequantize()
            b = quantize(x, "nvfp4").dequantize()
        assert len([w for w in caught if "fast CPU kernels unavailable" in str(w.message)]) == 1
        assert torch.equal(a, oracle_values(x, "mxfp4")) and torch.isfinite(b).all()
    finally:
        monkeypatch.undo()
        cpu.library.cache_clear()


def oracle_values(x, name):
    return torch.from_numpy(oracle(x.numpy(), get_scheme(name)))


def test_dequantize_refuses_what_is_not_a_quantized_tensor():
    with pytest.raises(minifloat.MinifloatError, match="dequantize takes a QuantizedTensor .*, got Tensor"):
        minifloat.dequantize(torch.ones(3))


@requires_cuda
@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_quantize_matches_cpu(name, dtype):
    """Bit-exact everywhere: the CUDA path (the PyTorch reference on the GPU) gives the CPU's
    codes and scales (the CPU's fused kernels), NaN included, and dequantizes to its values."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 384, generator=g) * torch.exp(2 * torch.randn(256, 384, generator=g))).to(dtype)
    x[3, 5] = float("nan")
    x[7, :40] = 0.0
    cpu, gpu = quantize(x, name), quantize(x.cuda(), name)
    assert torch.equal(gpu.data.cpu(), cpu.data)
    assert torch.equal(gpu.scale.cpu().view(torch.uint8), cpu.scale.view(torch.uint8))  # bits: NaN scales too
    if cpu.tensor_scale is not None:
        assert torch.equal(gpu.tensor_scale.cpu(), cpu.tensor_scale)
    assert torch.equal(gpu.dequantize().cpu().nan_to_num(7.0), cpu.dequantize().nan_to_num(7.0))
