import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minifloat
from minifloat.gemm import (
    choose_backend,
    native_args,
    native_kind,
    native_support,
    operand_values,
    scaled_mm,
    swizzle_scales,
)
from minifloat.recipes import RECIPES, ROLES, get_recipe
from tests.conftest import requires_cuda

SCHEMES = sorted({get_recipe(r).scheme(role) for r in RECIPES for role in ROLES}, key=lambda s: (s.name, str(s)))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-{s.element}-{s.block}-{s.rounding}")
def test_emulated_gemm_equals_float64_product_of_the_dequantized_operands(scheme):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(48, 256, generator=g) * 3, torch.randn(40, 256, generator=g)
    qa = minifloat.quantize(a, scheme, generator=g)
    qb = minifloat.quantize(b, scheme, generator=g)
    da, db = qa.dequantize().double(), qb.dequantize().double()
    ref = da @ db.T
    out = scaled_mm(qa, qb)
    # FP32 accumulation of exact products: |error| ≤ K · 2^-24 · Σ|a||b| (a standard bound).
    bound = 256 * 2.0**-24 * (da.abs() @ db.abs().T)
    assert out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= bound).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # must not make it a BF16 matmul
        assert torch.equal(scaled_mm(qa, qb), out)
    assert not torch.equal(da, a.double())  # it really quantized


def test_transposed_operands_of_orientation_free_schemes():
    a, b = torch.randn(64, 32), torch.randn(48, 32)
    qa_t = minifloat.quantize(a.t().contiguous(), "fp8")  # holds aᵀ
    qb = minifloat.quantize(b, "fp8")
    out = scaled_mm(qa_t, qb, a_transposed=True)
    assert torch.allclose(out, qa_t.dequantize().t() @ qb.dequantize().T, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("scheme,tol", [("fp8", 1e-6), ("fp8_e5m2", 1e-6), ("fp8_rowwise", 2**-8)])
def test_native_cpu_scaled_mm_agrees_with_emulated(scheme, tol):
    """PyTorch's CPU _scaled_mm on the stored codes (row-wise writes bfloat16, hence its tolerance)."""
    g = torch.Generator().manual_seed(1)
    qa = minifloat.quantize(torch.randn(30, 72, generator=g), scheme)  # padded to 32 × 80 for the call
    qb = minifloat.quantize(torch.randn(17, 72, generator=g) * 100, scheme)
    native = scaled_mm(qa, qb, backend="native")
    emulated = scaled_mm(qa, qb, backend="emulated")
    assert native.shape == (30, 17)
    assert torch.allclose(native, emulated, rtol=tol, atol=tol * emulated.abs().max().item())


def test_backend_choice_and_errors():
    fp8, mx = minifloat.get_scheme("fp8"), minifloat.get_scheme("mxfp8")
    assert choose_backend([fp8], "cpu") == "emulated"
    assert choose_backend([fp8], "cpu", "native") == "native"
    assert "no native low-precision GEMM on cpu" in native_support(mx, "cpu")
    assert "has no GEMM for e3m2" in native_support(minifloat.get_scheme("mxfp6_e3m2"), "cpu")
    with pytest.raises(minifloat.MinifloatError, match="backend='native' cannot run mxfp8 on cpu"):
        choose_backend([mx], "cpu", "native")
    with pytest.raises(minifloat.MinifloatError, match="unknown GEMM backend 'fast'"):
        choose_backend([fp8], "cpu", "fast")
    # scaled_mm itself: the same checks (torch said "CPU does not support swizzle", or ran emulated)
    qa, qb = minifloat.quantize(torch.randn(8, 64), mx), minifloat.quantize(torch.randn(16, 64), mx)
    with pytest.raises(minifloat.MinifloatError, match="backend='native' cannot run mxfp8 on cpu; use"):
        scaled_mm(qa, qb, backend="native")
    with pytest.raises(minifloat.MinifloatError, match="unknown GEMM backend 'fast'"):
        scaled_mm(qa, qb, backend="fast")
    with pytest.raises(minifloat.MinifloatError, match="scaled_mm takes QuantizedTensors; a is a Tensor"):
        scaled_mm(torch.randn(8, 64), qb)


# Which GPUs run each family natively, transcribed from the module's table (PyTorch's and
# cuBLAS' documented requirements): H100 is 9.0, B200 10.0, RTX 5090 12.0, L4 8.9, A100 8.0.
NATIVE_ON = {
    "fp8": {(8, 9), (9, 0), (10, 0), (12, 0)},
    "fp8_rowwise": {(9, 0), (10, 0), (12, 0)},
    "fp8_block128": {(9, 0)},
    "fp8_block128x128": {(9, 0)},
    "mxfp8": {(10, 0), (12, 0)},
    "mxfp4": {(10, 0), (12, 0)},
    "nvfp4": {(10, 0), (12, 0)},
    "nvfp4_2d": {(10, 0), (12, 0)},
    "mxfp6_e3m2": set(),
}


@pytest.mark.parametrize("name", NATIVE_ON)
def test_native_support_follows_the_compute_capability_table(name, monkeypatch):
    import minifloat.gemm as gemm

    scheme = minifloat.get_scheme(name)
    for cap in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]:
        monkeypatch.setattr(gemm.support, "device_capability", lambda device, cap=cap: cap)
        why = native_support(scheme, "cuda")
        assert (why is None) == (cap in NATIVE_ON[name]), (cap, why)
        assert choose_backend([scheme], "cuda") == ("native" if cap in NATIVE_ON[name] else "emulated")
        if why is not None and native_kind(scheme) is not None:
            low = ".".join(map(str, min(NATIVE_ON[name])))
            need = f"exactly {low}" if name.startswith("fp8_block") else f"≥ {low}"
            assert why.endswith(f"GEMMs need compute capability {need}, this GPU is {cap[0]}.{cap[1]}"), why
        # backend="native" is refused exactly where "auto" would not choose it
        if cap in NATIVE_ON[name]:
            assert choose_backend([scheme], "cuda", "native") == "native"
        else:
            with pytest.raises(minifloat.MinifloatError, match=f"backend='native' cannot run {name} on cuda"):
                choose_backend([scheme], "cuda", "native")


def test_block_scaled_native_gemms_need_torch_functional_scaled_mm(monkeypatch):
    import minifloat.gemm as gemm

    monkeypatch.setattr(gemm.support, "device_capability", lambda device: (10, 0))
    monkeypatch.delattr(F, "scaled_mm")
    assert "need torch.nn.functional.scaled_mm (torch ≥ 2.10)" in native_support(minifloat.get_scheme("mxfp8"), "cuda")
    assert native_support(minifloat.get_scheme("fp8"), "cuda") is None  # torch._scaled_mm, in every torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_no_capability_without_cuda():
    from minifloat.gemm import device_capability

    assert device_capability("cuda") is None and device_capability("cpu") is None


# ---- native arguments, read back by the layouts' documented meaning --------------------------
def _cublas_offset(r: int, c: int, cols: int) -> int:
    """cuBLAS' block-scaling layout: 128-row × 4-column tiles of 512 bytes in row-major tile
    order; inside a tile, row r's 4 scales at (r % 32) · 16 + (r % 128) // 32 · 4."""
    return ((r // 128) * (-(-cols // 4)) + c // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


@pytest.mark.parametrize("rows,cols", [(1, 1), (130, 5), (256, 8), (31, 4)])
def test_swizzled_scales_sit_at_cublas_offsets(rows, cols):
    grid = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    flat = swizzle_scales(grid)
    assert flat.numel() == -(-rows // 128) * 128 * -(-cols // 4) * 4
    seen = torch.zeros(flat.numel(), dtype=torch.bool)
    for r in range(rows):
        for c in range(cols):
            assert flat[_cublas_offset(r, c, cols)] == grid[r, c]
            seen[_cublas_offset(r, c, cols)] = True
    assert (flat[~seen] == 0).all()  # padding


def _up(n: int, m: int) -> int:
    """`n` rounded up to a multiple of `m`."""
    return -(-n // m) * m


def _element_values(mat: torch.Tensor) -> torch.Tensor:
    """(rows, K) float64 values of torch's float8 / packed float4 operand, decoded by torch and
    ml_dtypes (not by minifloat)."""
    if mat.dtype == torch.float4_e2m1fn_x2:
        b = mat.view(torch.uint8).contiguous().numpy()
        nibbles = np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1)
        return torch.from_numpy(nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float64))
    return mat.double()


def _scale_values(scale, recipe, swizzle, rows: int, k: int) -> torch.Tensor:
    """(rows, K) float64 scale of every element, as torch's scaled_mm documents each recipe."""
    S = F.ScalingType
    if recipe == S.TensorWise:
        return scale.double().expand(rows, k)
    if recipe == S.RowWise:
        return scale.double().reshape(-1, 1).expand(rows, k)
    if recipe == S.BlockWise1x128:
        assert scale.shape == (rows, k // 128) and scale.stride(0) == 1  # outer-dim-major
        return scale.double().repeat_interleave(128, dim=1)
    if recipe == S.BlockWise128x128:
        assert scale.shape == (_up(k // 128, 4), _up(rows, 128) // 128)  # (K blocks padded to 4, row blocks)
        grid = scale.t()[:, : k // 128]
        return grid.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows]
    block = 32 if recipe == S.BlockWise1x32 else 16
    assert swizzle == F.SwizzleType.SWIZZLE_32_4_4
    decoded = scale.double()  # torch's own float8_e8m0fnu / float8_e4m3fn decode
    idx = torch.tensor([[_cublas_offset(r, c, k // block) for c in range(k // block)] for r in range(rows)])
    return decoded[idx].repeat_interleave(block, dim=1)


def _operand(args: dict, side: str) -> torch.Tensor:
    mat = args["mat_a"] if side == "a" else args["mat_b"].t()
    values = _element_values(mat)
    rows, k = values.shape
    scales, recipes = args[f"scale_{side}"], args.get(f"scale_recipe_{side}")
    if recipes is None:  # torch._scaled_mm: tensor or row scales by shape
        recipes = F.ScalingType.TensorWise if scales.dim() == 0 else F.ScalingType.RowWise
    swizzles = args.get(f"swizzle_{side}")
    if not isinstance(scales, list):
        scales, recipes, swizzles = [scales], [recipes], [swizzles]
    for sc, rc, sw in zip(scales, recipes, swizzles, strict=True):
        values = values * _scale_values(sc, rc, sw, rows, k)
    return values


NATIVE_PAIRS = [  # (a scheme, b scheme, b passed transposed)
    ("fp8", "fp8", False), ("fp8", "fp8", True), ("fp8", "fp8_e5m2", False), ("fp8_rowwise", "fp8_rowwise", False),
    ("fp8_block128", "fp8_block128", False), ("fp8_block128", "fp8_block128x128", False),
    ("fp8_block128", "fp8_block128x128", True), ("fp8_block128x128", "fp8_block128", False),
    ("mxfp8", "mxfp8", False), ("mxfp8", "mxfp8_e5m2", False), ("mxfp4", "mxfp4", False),
    ("nvfp4", "nvfp4", False), ("nvfp4", "nvfp4_2d", False), ("nvfp4", "nvfp4_2d", True),
]


@pytest.mark.parametrize("sa,sb,b_t", NATIVE_PAIRS, ids=lambda v: str(v))
@pytest.mark.parametrize("m,n,k", [(40, 24, 208), (160, 144, 256), (3, 5, 40), (136, 256, 512)])  # the last: no padding of K
def test_native_arguments_hold_exactly_the_emulated_operands(sa, sb, b_t, m, n, k):
    """What torch._scaled_mm would read — codes, swizzled / strided scales, padding — read back
    by the layouts' documented meaning, equals the dequantized operands value for value."""
    g = torch.Generator().manual_seed(m + k)
    qa = minifloat.quantize(torch.randn(m, k, generator=g) * 4, sa)
    b = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, k)  # K blocks of very different scale
    qb = minifloat.quantize(b.t().contiguous() if b_t else b, sb)  # b_t: qb holds bᵀ
    args, (M, N) = native_args(qa, qb, b_transposed=b_t)
    assert (M, N) == (m, n)
    va, vb = _operand(args, "a"), _operand(args, "b")
    # padded no further than the kernels need: rows to 16, K to 16 elements (32 for FP4)
    # after the scheme's own padding to whole blocks
    k_blocks = max(_up(k, minifloat.get_scheme(s).block[1]) if minifloat.get_scheme(s).block else k for s in (sa, sb))
    k_to = _up(k_blocks, 32 if "fp4" in sa else 16)
    assert va.shape == (_up(m, 16), k_to) and vb.shape == (_up(n, 16), k_to)
    expect_a = operand_values(qa).double()
    expect_b = operand_values(qb, b_t).double()
    # equal up to the float32 roundings of code × FP32 scale (× NVFP4's tensor scale)
    assert torch.allclose(va[:m, :k], expect_a, rtol=2**-22, atol=0)
    assert torch.allclose(vb[:n, :k], expect_b, rtol=2**-22, atol=0)
    assert not va[m:].any() and not va[:, k:].any() and not vb[n:].any() and not vb[:, k:].any()
    for side in "ab":  # cuBLAS' block-wise scales are outer-dim-major: the transpose of a contiguous grid
        if args.get(f"scale_recipe_{side}") in (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128):
            assert args[f"scale_{side}"].t().is_contiguous()


@pytest.mark.parametrize("scheme", ["fp8", "fp8_rowwise"])
def test_native_gemm_of_an_empty_operand_is_an_empty_or_zero_result(scheme):
    empty, full = minifloat.quantize(torch.randn(0, 64), scheme), minifloat.quantize(torch.randn(8, 64), scheme)
    assert scaled_mm(empty, full, backend="native").shape == (0, 8)
    assert scaled_mm(full, empty, backend="native", out_dtype=torch.bfloat16).dtype == torch.bfloat16
    no_k = minifloat.quantize(torch.randn(8, 0), "fp8")  # K = 0: a sum of nothing
    assert torch.equal(scaled_mm(no_k, no_k, backend="native"), torch.zeros(8, 8))


def test_native_arguments_refuse_what_no_kernel_runs():
    x = torch.randn(32, 64)
    e5, row, mx, mx4 = (minifloat.quantize(x, s) for s in ("fp8_e5m2", "fp8_rowwise", "mxfp8", "mxfp4"))
    # the E5M2 × E5M2 refusal is cuBLAS's: an operand that reports a CUDA device, else e5 itself
    cuda_like = type("OnCuda", (), {"device": torch.device("cuda"), "__getattr__": lambda self, n: getattr(e5, n)})()
    with pytest.raises(minifloat.MinifloatError, match="no E5M2 × E5M2"):
        native_args(cuda_like, e5)
    with pytest.raises(minifloat.MinifloatError, match="the fp8_rowwise operand cannot be passed transposed"):
        native_args(row, row, b_transposed=True)
    with pytest.raises(minifloat.MinifloatError, match="the mxfp8 operand cannot be passed transposed"):
        native_args(mx, mx, a_transposed=True)  # 1×32 blocks follow the rows too
    with pytest.raises(minifloat.MinifloatError, match="operands of different K: 64 and 96"):
        native_args(mx, minifloat.quantize(torch.randn(32, 96), "mxfp8"))
    with pytest.raises(minifloat.MinifloatError, match="no native GEMM of mxfp8 with mxfp4"):
        native_args(mx, mx4)
    with pytest.raises(minifloat.MinifloatError, match="no native GEMM of mxfp6_e3m2"):
        native_args(*(minifloat.quantize(x, "mxfp6_e3m2") for _ in range(2)))


def test_every_recipe_has_a_native_kind_or_says_why_not():
    for name, recipe in RECIPES.items():
        kinds = {native_kind(recipe.scheme(r)) for r in ROLES}
        if name.startswith("mxfp6") or name.endswith("fnuz"):  # no cuBLAS GEMM for FP6, nor for AMD's FP8 on NVIDIA
            assert kinds == {None}
        else:
            assert None not in kinds, name


@requires_cuda
@pytest.mark.parametrize("sa,sb,b_t", NATIVE_PAIRS, ids=lambda v: str(v))
def test_native_cuda_gemm_agrees_with_emulated(sa, sb, b_t):
    """On a GPU that has the format: the real low-precision GEMM against the emulated one.
    Native block-scaled GEMMs write bfloat16, so they agree to bfloat16's rounding. Hopper's FP8
    tensor cores keep about 14 bits while they accumulate (DeepSeek-V3, §3.3.2), so per-tensor
    FP8 (float32 out) agrees within 2^-12 of Σ|a·b| (an H200 measured 2^-15.3)."""
    schemes = minifloat.get_scheme(sa), minifloat.get_scheme(sb)
    why = next((w for s in schemes if (w := native_support(s, "cuda"))), None)
    if why:
        pytest.skip(why)
    g = torch.Generator(device="cuda").manual_seed(0)
    qa = minifloat.quantize(torch.randn(256, 512, device="cuda", generator=g), sa)
    b = torch.randn(192, 512, device="cuda", generator=g)
    qb = minifloat.quantize(b.t().contiguous() if b_t else b, sb)
    native = scaled_mm(qa, qb, backend="native", b_transposed=b_t)
    emulated = scaled_mm(qa, qb, backend="emulated", b_transposed=b_t)
    assert native.dtype == emulated.dtype == torch.float32
    if schemes[0].granularity == "tensor":
        db = qb.dequantize()
        magnitude = qa.dequantize().double().abs() @ (db if b_t else db.t()).double().abs()
        assert torch.all((native - emulated).double().abs() <= 2**-12 * magnitude)
    else:
        assert torch.allclose(native, emulated, rtol=2**-8, atol=2**-8 * emulated.abs().max().item())
