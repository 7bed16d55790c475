"""The decode kernels (`minifloat.kernels.gemv`) against a float64 product with the dequantized
weight, on every ISA path this CPU runs, forced in turn."""

import pytest
import torch

import minifloat
from minifloat import get_scheme
from minifloat.formats.packing import pack
from minifloat.kernels import gemv, reference
from minifloat.kernels import quantize as quantize_parts

pytestmark = pytest.mark.skipif(not gemv.isas(), reason="the CPU kernels were not built")

SCHEMES = {
    "nvfp4": get_scheme("nvfp4"), "nvfp4-4over6": get_scheme("nvfp4").replace(scale_rule="4over6"),
    "nvfp4_2d": get_scheme("nvfp4_2d"), "mxfp4": get_scheme("mxfp4"), "mxfp6_e2m3": get_scheme("mxfp6_e2m3"),
    "mxfp6_e3m2": get_scheme("mxfp6_e3m2"), "mxfp8": get_scheme("mxfp8"), "mxfp8_e5m2": get_scheme("mxfp8_e5m2"),
    "fp8_tensor": get_scheme("fp8"), "fp8_e5m2": get_scheme("fp8_e5m2"), "fp8_rowwise": get_scheme("fp8_rowwise"),
    "fp8_block128": get_scheme("fp8_block128"), "fp8_block128x128": get_scheme("fp8_block128x128"),
    "fp4_tensor": get_scheme("fp4"), "fp6_tensor": get_scheme("fp6_e3m2"),
}  # fmt: skip
ISAS = gemv.isas()


def oracle(x, parts, shape, scheme):
    """float64 x · Wᵀ with W dequantized, and the bound on float32 accumulation error: γ_K Σ|x||w|."""
    w = reference.dequantize(*parts, torch.Size(shape), scheme).double()
    xd = x.double()
    return xd @ w.t(), (xd.abs() @ w.abs().t()) * (shape[1] + 2) * 2.0**-24


def check(y, want, bound):
    assert y.dtype == torch.float32 and y.shape == want.shape
    finite = torch.isfinite(want)
    assert torch.equal(torch.isnan(y), torch.isnan(want)), "NaN where the float64 product has none, or not where it has"
    assert torch.equal(y[torch.isinf(want)], want[torch.isinf(want)].float())
    err = (y.double() - want).abs()[finite]
    assert (err <= bound[finite] + 1e-37).all(), f"max error {(err - bound[finite]).max():.3e} over the bound"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize(("n", "k"), [(37, 300), (5, 77), (130, 1040), (3, 16), (11, 60), (9, 250)])
def test_kernel_equals_the_float64_product_for_every_row_count(name, isa, n, k):
    scheme = SCHEMES[name]
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    parts = quantize_parts(w, scheme)
    for m in range(1, 17) if k == 300 else (1, 2, 16):
        x = torch.randn(m, k, generator=g)
        y = gemv.matmul(x, *parts, w.shape, scheme, isa=isa)
        check(y, *oracle(x, parts, w.shape, scheme))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(SCHEMES))
def test_each_row_of_a_call_equals_that_row_alone(name, isa):
    """A speculative verification's M rows equal M single decode steps bit for bit: no row's
    sums depend on the rows beside it (K = 1168 takes NVFP4's 128-column loop, nine chunks: pairs
    and a last one, with 3-4 rows of x in a group, which once summed them otherwise)."""
    scheme = SCHEMES[name]
    g = torch.Generator().manual_seed(7)
    w = torch.randn(70, 1168, generator=g) * torch.exp(torch.randn(70, 1, generator=g))
    parts = quantize_parts(w, scheme)
    x = torch.randn(16, 1168, generator=g)
    alone = torch.cat([gemv.matmul(x[i : i + 1], *parts, w.shape, scheme, isa=isa) for i in range(16)])
    for m in range(2, 17):
        assert torch.equal(gemv.matmul(x[:m], *parts, w.shape, scheme, isa=isa), alone[:m]), f"{m} rows"


def _with_codes(scheme, n, k, code, where):
    """A weight whose codes at `where` are `code` (NaN / inf of the element format)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    data, scale, ts = quantize_parts(w, scheme)
    from minifloat.formats.packing import unpack
    from minifloat.scaling.layout import layout_for

    lay = layout_for(w.shape, scheme)
    fmt = scheme.element_format
    codes = unpack(data.reshape(-1), fmt, lay.rows_pad * lay.cols_pad).view(lay.rows_pad, lay.cols_pad).clone()
    for r, c in where:
        codes[r, c] = code
    return pack(codes.reshape(-1), fmt).view(data.shape), scale, ts


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("name", "code"), [("mxfp8", 0x7F), ("fp8_rowwise", 0xFF), ("fp8_e5m2", 0x7C), ("fp8_e5m2", 0xFC),
                                            ("fp8_e5m2", 0x7E), ("mxfp8_e5m2", 0x7D)])  # fmt: skip
def test_nan_and_infinite_codes_propagate(name, code, isa):
    scheme = SCHEMES[name]
    n, k = 9, 200
    parts = _with_codes(scheme, n, k, code, [(2, 5), (4, 199), (7, 64)])
    for m in (1, 3, 6):  # 6 rows: each row of W in two passes
        x = torch.randn(m, k)
        x[0, 64] = 0.0  # inf × 0: NaN, as in the float64 product
        y = gemv.matmul(x, *parts, (n, k), scheme, isa=isa)
        want, bound = oracle(x, parts, (n, k), scheme)
        assert not torch.isfinite(want).all()
        check(y, want, bound)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "mxfp6_e3m2", "fp8_block128x128"])
def test_nan_scales_and_inputs_propagate(name, isa):
    scheme = SCHEMES[name]
    w = torch.randn(20, 256)
    data, scale, ts = quantize_parts(w, scheme)
    scale = scale.clone()
    scale.view(-1)[1] = float("nan") if scale.dtype == torch.float32 else (0xFF if scheme.scale_format == "e8m0" else 0x7F)
    x = torch.randn(2, 256)
    x[1, 3] = float("nan")
    y = gemv.matmul(x, data, scale, ts, w.shape, scheme, isa=isa)
    check(y, *oracle(x, (data, scale, ts), w.shape, scheme))


@pytest.mark.parametrize("isa", ISAS)
def test_nvfp4_block_sums_do_not_overflow_where_the_scaled_products_do_not(isa):
    """AVX-512 sums each NVFP4 block's products before its scale: inputs of 2^126 times weights of
    2^-30 are finite products, but their unscaled block sums are not (it takes the scaled path)."""
    scheme = SCHEMES["nvfp4"]
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 384, generator=g) * 2.0**-30
    w[:, 192:208] = w[:, 192:208].abs()  # a block of positive weights …
    parts = quantize_parts(w, scheme)
    for top in (2.0**99, 2.0**100, 2.0**101, 2.0**126):
        x = torch.randn(2, 384, generator=g)
        x[1, 192:208] = top  # … times inputs whose sum overflows unscaled: the largest |x| of the call
        y = gemv.matmul(x, *parts, w.shape, scheme, isa=isa)
        assert torch.isfinite(y).all(), top
        check(y, *oracle(x, parts, w.shape, scheme))


@pytest.mark.parametrize("isa", ISAS)
def test_an_e4m3_weight_with_huge_row_scales_is_exact(isa):
    """E4M3 values are decoded × 2^-8 and the 2^8 moved into the scale, except where that overflows."""
    scheme = SCHEMES["fp8_rowwise"]
    w = torch.randn(4, 64) * torch.tensor([[1.0], [1e36], [3e38], [1e-30]])
    parts = quantize_parts(w, scheme)
    x = torch.randn(1, 64) * 1e-3
    check(gemv.matmul(x, *parts, w.shape, scheme, isa=isa), *oracle(x, parts, w.shape, scheme))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["fp8_rowwise", "mxfp8", "fp8_block128"])
def test_e4m3_scales_that_overflow_times_2_to_the_8_stay_exact(name, isa):
    """A row's scales are taken for 512 columns at a time (or once per row) with the 2^8 folded in;
    where that product overflows, the scale is applied after the 2^8 — here in columns 512 on of
    row 4 (all of it for row scales), whose codes are all 1.0, so its products stay finite."""
    scheme = SCHEMES[name]
    k = 1024
    data, scale, ts = _with_codes(scheme, 5, k, 0x38, [(4, c) for c in range(k)])
    scale = scale.clone()
    huge = 2.0**121  # × 2^8 = 2^129: inf in float32
    if scale.dtype == torch.uint8:  # E8M0: the code of 2^121
        scale[4, scale.shape[1] // 2 :] = 127 + 121
    else:
        scale[4, scale.shape[1] // 2 :] = huge
    for m in (1, 5):  # one pass over each row of W, and two
        x = torch.randn(m, k) * 1e-3
        want, bound = oracle(x, (data, scale, ts), (5, k), scheme)
        assert torch.isfinite(want).all() and (want[:, 4].abs() > 2.0**100).all()
        check(gemv.matmul(x, data, scale, ts, (5, k), scheme, isa=isa), want, bound)


def test_the_isa_is_chosen_at_run_time_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("MINIFLOAT_GEMV_ISA", raising=False)
    monkeypatch.delenv("MINIFLOAT_ISA", raising=False)
    assert ISAS[0] == "portable" and gemv.best_isa() == ISAS[-1]
    monkeypatch.setenv("MINIFLOAT_ISA", "avx2")  # both kernels' path; MINIFLOAT_GEMV_ISA goes first
    assert gemv.best_isa() == "avx2"
    monkeypatch.setenv("MINIFLOAT_GEMV_ISA", "portable")
    assert gemv.best_isa() == "portable"
    monkeypatch.setenv("MINIFLOAT_GEMV_ISA", "sve")
    with pytest.raises(minifloat.MinifloatError, match="MINIFLOAT_GEMV_ISA='sve'"):
        gemv.best_isa()
    with pytest.raises(minifloat.MinifloatError, match="does not run on this CPU"):
        s = SCHEMES["mxfp4"]
        gemv.matmul(torch.randn(1, 32), *quantize_parts(torch.randn(2, 32), s), (2, 32), s, isa="neon")


def test_what_the_kernels_do_not_take_goes_to_the_reference(monkeypatch):
    s = SCHEMES["mxfp4"]
    parts = quantize_parts(torch.randn(8, 64), s)
    assert gemv.supports(torch.randn(16, 64), parts[0], (8, 64), s)
    assert not gemv.supports(torch.randn(17, 64), parts[0], (8, 64), s)  # prefill: the GEMM
    odd = s.replace(block=(1, 6))  # blocks not 16·j wide
    assert not gemv.supports(torch.randn(1, 60), quantize_parts(torch.randn(8, 60), odd)[0], (8, 60), odd)
    monkeypatch.setenv("MINIFLOAT_KERNELS", "reference")
    assert not gemv.supports(torch.randn(1, 64), parts[0], (8, 64), s)
    with pytest.raises(minifloat.MinifloatError, match="use reference_matmul"):
        gemv.matmul(torch.randn(1, 64), *parts, (8, 64), s)


def test_weight_only_layers_and_w4a4_decode_steps_run_on_the_kernels(monkeypatch):
    from minifloat.infer.modules.linear import QuantizedLinear

    calls = []
    real = gemv._library()

    class Counting:  # the library, counting the kernel's calls and their rows
        def __getattr__(self, name):
            return getattr(real, name)

        def mf_gemv(self, args):
            calls.append(args._obj.M)
            return real.mf_gemv(args)

    monkeypatch.setattr(gemv, "_library", lambda: Counting())
    lin = torch.nn.Linear(96, 40)
    for config in ("nvfp4-weight-only", "nvfp4", "mxfp8"):
        layer = QuantizedLinear.from_linear(lin, config, input_amax=4.0 if config == "nvfp4" else None)
        calls.clear()
        for m in (1, 4, 40):
            x = torch.randn(m, 96)
            got = layer(x)
            want = layer.prepare("emulated")(x)  # the exact emulation: quantized input, dequantized operands
            layer.prepare("auto")
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert calls == [1, 4], (config, calls)  # 40 rows: the GEMM


def test_the_multiply_add_probe_is_not_slower_than_a_float32_matrix_product():
    """`multiply_add_rate` is the floor of every row count's time (bench decode): no float32 product
    here outruns it, so torch's own matrix product (timed right after, the same threads) must not
    either — by half, as a shared machine's noise allows."""
    import time

    if not gemv.isas():
        pytest.skip("the kernels were not built")
    threads = torch.get_num_threads()
    rate = gemv.multiply_add_rate(threads, seconds=0.02)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    assert rate >= 0.5 * 512**3 / best, (rate, 512**3 / best)
    assert gemv.multiply_add_rate(1, "portable", seconds=0.01) > 0


def test_a_bound_call_is_the_kernel_a_plan_calls():
    """`Plan.bound` (what `bench decode` times beside torch's kernels) computes what the plan's
    call does, into the one output it made, and sees a new x written in place."""
    s = SCHEMES["nvfp4"]
    w = torch.randn(40, 256)
    parts = quantize_parts(w, s)
    plan = gemv.Plan(*parts, w.shape, s)
    x = torch.randn(3, 256)
    call = plan.bound(x)
    y = call()
    assert torch.equal(y, plan(x)) and call() is y
    check(y, *oracle(x, parts, w.shape, s))
    x.mul_(2)
    assert torch.equal(call(), plan(x))


def test_a_plan_serves_only_the_unchanged_tensors_it_was_made_from():
    """Plans are kept per weight; an in-place write (a NaN code) or a new tensor makes a new one."""
    s = SCHEMES["fp8_rowwise"]
    w = torch.randn(6, 64)
    data, scale, ts = quantize_parts(w, s)
    x = torch.randn(1, 64)
    assert torch.isfinite(gemv.matmul(x, data, scale, ts, w.shape, s)).all()  # the plan: no NaN codes
    data[2, 7] = 0x7F  # E4M3 NaN, written in place
    y = gemv.matmul(x, data, scale, ts, w.shape, s)
    assert torch.isnan(y[0, 2]) and torch.isfinite(y[0, [0, 1, 3, 4, 5]]).all()
    scale[3, 0] = 2 * scale[3, 0]
    check(gemv.matmul(x, data, scale, ts, w.shape, s), *oracle(x, (data, scale, ts), w.shape, s))


def test_gpu_check_says_what_it_needs_without_a_gpu(capsys):
    import importlib.util
    from pathlib import Path

    tool = Path(__file__).parents[2] / "tools" / "gpu_check.py"
    if torch.cuda.is_available() or not tool.exists():
        pytest.skip("a CUDA machine runs the real thing (make gpu-check)")
    spec = importlib.util.spec_from_file_location("gpu_check", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", "unused"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    names = [name for name, _, _ in mod.steps(Path("out"))]
    assert names[0] == "CUDA tests" and any("validate" in n for n in names) and "bench decode" in names
