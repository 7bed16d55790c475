"""Differential tests: the fused CPU kernels equal the pure-PyTorch reference byte for byte."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from minifloat import SCHEMES, get_scheme
from minifloat.kernels import cpu, reference
from minifloat.scaling.layout import as_float32, layout_for, to_grid

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="the CPU kernels were not built")

# the schemes the kernels encode: every one but AMD's fnuz FP8, which the reference serves (its −0 is NaN)
FAST = [n for n, s in SCHEMES.items() if cpu.encodes(s.element_format)]


def special_input(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 4)
    flat = x.view(-1)
    n = flat.numel()
    if n > 200:
        flat[:40] = 0  # a zero block
        flat[77] = float("nan")
        flat[150] = float("inf")
        flat[151] = -float("inf")
        flat[170] = 1e-42  # subnormal
    return x.to(dtype)


def _quantize(impl, x, scheme, *, scale=None, amax=None, **kw):
    """`impl`'s parts of `x`, with a scale or amax brought to the scale grid as minifloat.quantize
    does; with the shape and scheme, so that `dequantize(*parts)` reads them back."""
    lay = layout_for(x.shape, scheme)
    if scale is not None:
        scale = to_grid(scale, lay, "scale")
    if amax is not None:
        amax = as_float32(amax, "amax").reshape(()) if scheme.is_nvfp4 else to_grid(amax, lay, "amax")
    return (*impl(x, scheme, scale=scale, amax=amax, **kw), x.shape, scheme)


def fast(x, scheme, **kw):
    return _quantize(cpu.quantize, x, scheme, **kw)


def ref(x, scheme, **kw):
    return _quantize(reference.quantize, x, scheme, **kw)


def assert_same(a, b):
    (data_a, scale_a, ts_a, *_), (data_b, scale_b, ts_b, *_) = a, b
    assert torch.equal(data_a.view(torch.uint8), data_b.view(torch.uint8)), "codes differ"
    assert scale_a.shape == scale_b.shape
    assert torch.equal(scale_a.reshape(-1).view(torch.uint8), scale_b.reshape(-1).view(torch.uint8)), "scales differ"
    assert (ts_a is None) == (ts_b is None)
    if ts_a is not None:
        assert torch.equal(ts_a.view(torch.int32), ts_b.view(torch.int32))
    da, db = cpu.dequantize(*a), reference.dequantize(*b)
    assert torch.equal(da.view(torch.int32), db.view(torch.int32)), "dequantized values differ"


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("shape", [(7, 300), (130, 129), (1, 33), (3, 2, 50), (17,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_equals_reference(name, shape, dtype):
    x = special_input(shape, dtype, seed=sum(shape))
    scheme = get_scheme(name)
    assert_same(fast(x, scheme), ref(x, scheme))


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("shape", [(3, 4500), (300, 520), (17, 16500)])
def test_fast_equals_reference_across_spans_and_chunks(name, shape):
    """Rows longer than the kernels' 2048-column span, and several column chunks per row of
    1-D blocks; NaN / inf / zero blocks far from the start."""
    check_with_specials(get_scheme(name), shape)


def check_with_specials(scheme, shape):
    x = special_input(shape, torch.float32, seed=11)
    flat = x.view(-1)
    flat[2100:2140] = 0
    flat[4321] = float("nan")
    flat[3333] = -float("inf")
    flat[-5] = float("nan")  # in the last chunk
    assert_same(fast(x, scheme), ref(x, scheme))
    assert_same(fast(x.bfloat16(), scheme), ref(x.bfloat16(), scheme))


@pytest.mark.parametrize(
    ("name", "block", "shape"),
    [("fp8_block128x128", None, (130, 32768 + 300)), ("nvfp4_2d", None, (20, 32768 + 48)),
     ("fp8_block128x128", (2, 8), (5, 16500)), ("nvfp4_2d", (3, 16), (7, 40000)),
     ("fp8_block128x128", None, (100, 9000)), ("nvfp4_2d", None, (16, 9000))],
)
def test_fast_equals_reference_with_several_chunks_per_band(name, block, shape, three_threads):
    """2-D blocks are encoded in bands of whole rows up to 2^22 elements, or 2048 blocks wide:
    wider rows are split into chunks of min(2^22 / block rows, 2048 blocks) columns (32768 for
    128x128 and 16x16 blocks, 16384 for 2x8), each with its own pass for the block maxima; so
    are the rows of a single band (the last two cases), one chunk per thread."""
    scheme = get_scheme(name)
    check_with_specials(scheme if block is None else scheme.replace(block=block), shape)


# setup.py's compile flags; a native build adds -march=native to them (MINIFLOAT_NATIVE=1)
FLAGS = ["-O3", "-std=gnu11", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi"]


@pytest.fixture(scope="module", params=[*cpu.ISAS, "native"])
def other_build(request, tmp_path_factory):
    """Each ISA path of the installed library (the VBMI byte permutes and fused multiply-add of
    avx512, the pack-based encoder of avx2, the generic vector code of portable), and the kernels
    built with -march=native as MINIFLOAT_NATIVE=1 builds them."""
    if request.param != "native":
        if request.param not in cpu.isas():
            pytest.skip(f"this CPU does not run the {request.param} path")
        return cpu.variant(request.param)
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    source = Path(cpu.__file__).with_name("_cpu.c")
    if not source.exists():
        pytest.skip("an install without the kernel source")
    setup_py = (Path(__file__).parents[2] / "setup.py").read_text()
    assert all(f'"{flag}"' in setup_py for flag in FLAGS), "setup.py's compile flags changed: update FLAGS"
    out = tmp_path_factory.mktemp(request.param) / "_cpu.so"
    subprocess.run([gcc, "-shared", "-fPIC", *FLAGS, "-march=native", "-o", str(out), str(source)],
                   check=True, capture_output=True)  # fmt: skip
    return cpu.Kernels(ctypes.CDLL(str(out)), "portable")


@pytest.mark.slow
@pytest.mark.parametrize("name", FAST)
def test_other_builds_equal_reference(other_build, name, monkeypatch):
    monkeypatch.setattr(cpu, "library", lambda: other_build)
    scheme = get_scheme(name)
    for shape in [(7, 300), (130, 129), (3, 4500)]:
        for dtype in (torch.float32, torch.bfloat16):
            x = special_input(shape, dtype, seed=sum(shape))
            assert_same(fast(x, scheme), ref(x, scheme))
    check_with_specials(scheme, (17, 16500))


@pytest.mark.parametrize("name", ["fp8", "mxfp4", "nvfp4", "fp8_block128x128"])
def test_each_isa_path_equals_reference(other_build, name, monkeypatch):
    """The quick twin of the slow test above: every path this CPU runs, on a few schemes."""
    monkeypatch.setattr(cpu, "library", lambda: other_build)
    x = special_input((33, 700), torch.float32, seed=11)
    assert_same(fast(x, get_scheme(name)), ref(x, get_scheme(name)))


def test_the_default_build_is_portable():
    """The installed library was built without -march=native (setup.py's default): every path
    it takes is chosen at run time, so it runs on any x86-64."""
    assert cpu.build() == "portable"
    assert cpu.isas()[0] == "portable" and cpu.library().isa == cpu.isas()[-1]


@pytest.fixture
def three_threads():
    """The kernels split work by torch's thread count: 3 makes a single band split in three."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("base", "block"),
    [("fp8_block128", (1, 12)), ("mxfp4", (1, 6)), ("mxfp6_e3m2", (3, 20)), ("nvfp4", (2, 48)),
     ("fp8_block128", (2, 3000)), ("mxfp8", (1, 2500)), ("mxfp4", (4, 4096))],
)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fast_equals_reference_for_blocks_of_any_width(base, block, rounding):
    """Block widths that are not 8 * 2^k columns take the kernels' per-block path; blocks wider
    than the kernels' 2048-column span are encoded in pieces."""
    scheme = get_scheme(base).replace(block=block)
    x = special_input((37, 2 * 2048 + 100), torch.float32, seed=3)
    a = fast(x, scheme, rounding=rounding, generator=torch.Generator().manual_seed(1))
    b = ref(x, scheme, rounding=rounding, generator=torch.Generator().manual_seed(1))
    assert_same(a, b)


@pytest.mark.parametrize("name", ["fp8", "mxfp4", "mxfp6_e2m3", "nvfp4", "nvfp4_2d", "fp8_block128", "fp4"])
def test_fast_equals_reference_stochastic(name):
    x = special_input((33, 200), torch.float32, seed=5)
    scheme = get_scheme(name)
    a = fast(x, scheme, rounding="stochastic", generator=torch.Generator().manual_seed(9))
    b = ref(x, scheme, rounding="stochastic", generator=torch.Generator().manual_seed(9))
    assert_same(a, b)


@pytest.mark.parametrize(("base", "rule"), [("nvfp4", "4over6"), ("nvfp4_2d", "4over6"), ("mxfp4", "least-error"),
                                          ("mxfp6_e3m2", "least-error"), ("mxfp8", "least-error")])  # fmt: skip
@pytest.mark.parametrize("shape", [(7, 300), (130, 129), (33, 4500)])
@pytest.mark.parametrize(("dtype", "rounding"), [(torch.float32, "nearest"), (torch.bfloat16, "nearest"),
                                                 (torch.float32, "stochastic")])  # fmt: skip
def test_per_block_scale_choices_fast_equal_reference(base, rule, shape, dtype, rounding):
    """The scale rules that choose per block by the squared error — Four Over Six (NVFP4) and the
    "least-error" E8M0 exponent (MX) — in the kernel (zero, NaN, inf and subnormal blocks, padding, bf16,
    stochastic rounding after a round-to-nearest choice) equal the reference's."""
    scheme = get_scheme(base).replace(scale_rule=rule)
    x = special_input(shape, dtype, seed=sum(shape))
    kw = dict(rounding=rounding)
    a = fast(x, scheme, **kw, generator=torch.Generator().manual_seed(2))
    b = ref(x, scheme, **kw, generator=torch.Generator().manual_seed(2))
    assert_same(a, b)
    finite = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert_same(fast(finite, scheme), ref(finite, scheme))
    assert not torch.equal(fast(finite, scheme)[1], fast(finite, scheme.replace(scale_rule="floor"))[1])  # a real choice
    if scheme.is_nvfp4:  # a given tensor amax
        assert_same(fast(finite, scheme, amax=torch.tensor(7.0)), ref(finite, scheme, amax=torch.tensor(7.0)))


def test_stochastic_rounding_does_not_depend_on_the_thread_count():
    """The random bits are a function of (seed, element index), not of the thread schedule."""
    x = torch.randn(512, 640)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fast(x, get_scheme("nvfp4"), rounding="stochastic", generator=torch.Generator().manual_seed(3))
        torch.set_num_threads(max(2, threads))
        many = fast(x, get_scheme("nvfp4"), rounding="stochastic", generator=torch.Generator().manual_seed(3))
    finally:
        torch.set_num_threads(threads)
    assert_same(one, many)
    other = fast(x, get_scheme("nvfp4"), rounding="stochastic", generator=torch.Generator().manual_seed(4))
    assert not torch.equal(one[0], other[0])


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_mx_rules_every_element(rule, element):
    scheme = get_scheme("mxfp8").replace(element=element, scale_rule=rule)
    x = special_input((9, 256), torch.float32, seed=1)
    assert_same(fast(x, scheme), ref(x, scheme))


def pow2_scale_input(dtype, seed):
    """One 32-block per binade 2^-149 .. 2^127 (both ends outside the no-multiply encoder's
    range), elements of few significant bits (exact ties between codes), float32 subnormals
    and ±inf, no NaN (a NaN block takes the other encoder)."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.arange(-149, 128)
    ints = torch.randint(-64, 65, (2, exps.numel(), 32), generator=g).float()
    shift = torch.randint(0, 14, (2, exps.numel(), 32), generator=g).float()
    x = ints * torch.exp2(exps[None, :, None].float() - 6 - shift)  # underflows to subnormals / 0 at the bottom
    x[:, :, 0] = 127 * torch.exp2(exps.float() - 6)  # the block amax
    x[0, 200, 5], x[1, 201, 9] = float("inf"), -float("inf")
    return x.reshape(2, -1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_mx_encoder_without_multiply_over_every_scale(element, rule, dtype):
    scheme = get_scheme("mxfp8").replace(element=element, scale_rule=rule)
    x = pow2_scale_input(dtype, seed=2)
    assert_same(fast(x, scheme), ref(x, scheme))


@pytest.mark.parametrize("scale", [1.0, 0.7, 3.0e-3])
@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_scaled_encoder_over_every_binade(element, scale):
    """The multiply-first encoder (FP32 and NVFP4 scales) over products x * scale in every
    float32 binade, float32 subnormals, exact ties between codes, overflow to inf, and NaN."""
    scheme = get_scheme("fp8").replace(element=element)
    x = pow2_scale_input(torch.float32, seed=4)
    x[1, 333] = float("nan")
    kw = {"scale": torch.tensor(scale)}
    assert_same(fast(x, scheme, **kw), ref(x, scheme, **kw))


def test_given_scale_amax_and_margin():
    x = special_input((12, 256), torch.float32, seed=2)
    for scheme, kw in [
        (get_scheme("fp8"), {"scale": torch.tensor(3.0)}),
        (get_scheme("fp8").replace(margin=2), {}),
        (get_scheme("fp8_rowwise"), {"amax": torch.arange(1.0, 13.0)}),
        (get_scheme("fp8_block128"), {"scale": torch.rand(12, 2) + 0.5}),
        (get_scheme("nvfp4"), {"amax": torch.tensor(1e3)}),
    ]:
        assert_same(fast(x, scheme, **kw), ref(x, scheme, **kw))


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("nvfp4", {"amax": torch.tensor(1e30)}),  # block scales underflow to 0: inf * 0
        ("nvfp4", {"amax": torch.tensor(float("nan"))}),  # NaN tensor scale: every block scale NaN
        ("nvfp4", {"amax": torch.tensor(float("inf"))}),
        ("nvfp4", {"amax": torch.tensor(0.0)}),
        ("fp8", {"scale": torch.tensor(0.0)}),
        ("fp8", {"scale": torch.tensor(float("inf"))}),  # 0 * inf
        ("fp8", {}),  # tensor scale from the kernel's own amax: inf and no NaN
        ("fp8_rowwise", {}),
        ("mxfp8", {}),
        ("nvfp4", {}),
    ],
)
def test_nan_products_are_found(name, kw):
    """The kernels look for NaN lanes only where x * scale can be NaN (a NaN in x, a scale of 0,
    inf or NaN); products of inf and 0 scales, and inf inputs under finite scales, in the
    vector loop (not only in the scalar tail)."""
    x = torch.randn(4, 4096)
    x[1, 100] = float("inf")
    x[2, 1000:1032] = 0
    x[2, 1010] = -float("inf")
    x[3, 3000:3100] = 0
    scheme = get_scheme(name)
    assert_same(fast(x, scheme, **kw), ref(x, scheme, **kw))
    if kw and scheme.element_format.nan_code is not None:  # FP4 has no NaN: inf * 0 saturates to 0
        assert cpu.dequantize(*fast(x, scheme, **kw)).isnan().any()


ODD_NAN = torch.tensor(-1, dtype=torch.int32).view(torch.float32)  # bits 0xffffffff: a NaN, not the default one


@pytest.mark.parametrize(
    ("name", "given"),
    [(n, g) for n in ("fp8", "fp8_rowwise", "fp8_block128", "fp8_block128x128", "fp4") for g in ("none", "scale", "amax")]
    + [("nvfp4", "none"), ("nvfp4", "amax")],  # scale= is for FP32-scaled schemes
)
def test_nan_scales_have_the_same_bits_whatever_the_layout_or_payload(name, given):
    """A NaN decode scale is the default quiet NaN in both paths: the reference's reductions
    over a non-contiguous input, or a NaN of another payload passed in, gave other NaN bits."""
    scheme = get_scheme(name)
    x = torch.randn(300, 160, generator=torch.Generator().manual_seed(5))
    x[7, 3], x[200, 150] = float("nan"), ODD_NAN
    x = x.t()  # non-contiguous: the reference reduces it in another order
    kw = {} if given == "none" else {given: ODD_NAN}
    assert_same(fast(x, scheme, **kw), ref(x, scheme, **kw))


@pytest.mark.parametrize("where", [5, 65536 + 3, 70003 - 2])  # first chunk, second chunk, the tail
@pytest.mark.parametrize("special", [float("inf"), float("nan")])
def test_amax_kernel_special_values_anywhere(where, special):
    """The amax kernel takes the largest |bits| first and the exact pass only for a 64Ki-element
    chunk that holds inf or NaN: specials in any chunk, and in the tail past the last 8 elements."""
    x = torch.randn(70003)
    x[where] = special
    finite = x.abs()[torch.isfinite(x)].max()
    assert cpu.tensor_amax(x, ignore_nan=True).item() == finite.item()
    assert torch.isnan(cpu.tensor_amax(x)) == (special != special)
    if special == special:
        assert cpu.tensor_amax(x).item() == finite.item()


def test_amax_kernel():
    x = special_input((1000,), torch.float32, seed=3)
    assert torch.isnan(cpu.tensor_amax(x))
    ref = x.abs()[torch.isfinite(x)].max()
    assert cpu.tensor_amax(x, ignore_nan=True).item() == ref.item()
    assert cpu.tensor_amax(x.bfloat16(), ignore_nan=True).item() == x.bfloat16().abs()[torch.isfinite(x)].max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(64, 96), (2048, 37), (33, 129), (1, 40), (40, 1), (8, 8)])
def test_transpose_kernel_copies_every_element(shape, dtype):
    # Whole 32 x 32 tiles (8 x 8 register transposes) and ragged edges; NaN payloads kept.
    base = special_input(shape, torch.float32, seed=5).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    base.view(bits).view(-1)[3] = 0x7FC0_1234 if dtype == torch.float32 else 0x7E12  # a NaN with a payload
    for view in (base.t(), base[1:].t(), base[:, 1:].t()):  # a storage offset; columns sliced (no fast path)
        out = cpu.contiguous(view)
        assert out.is_contiguous() and out.shape == view.shape and out.dtype == dtype
        assert torch.equal(out.view(bits), view.contiguous().view(bits))


def _sr_thresholds(y, fmt):
    """ceil(frac(r) · 2^32), r = |y| · 2^(m - e) in float64 (e = floor(log2 |y|) clamped to
    [emin, emax]): the random bits below it round up, the rest down."""
    a = y.double().abs()
    _, ex = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    e = (ex - 1).double().clamp(fmt.emin, fmt.emax)
    r = (a * torch.pow(2.0, fmt.man_bits - e)).clamp(max=float(2 ** (fmt.man_bits + 2)))
    r = torch.where(torch.isfinite(r), r, 0.0)
    return torch.ceil((r - torch.floor(r)) * 2.0**32).to(torch.int64)


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_stochastic_rounding_at_its_thresholds(element):
    """The kernels' 8-lane stochastic rounding equals the reference for random bits just below,
    at and above each element's threshold (random bits rarely land there)."""
    from minifloat.formats import get_format
    from minifloat.formats.codec import encode_with_bits

    fmt = get_format(element)
    g = torch.Generator().manual_seed(0)
    grid = torch.linspace(-fmt.max, fmt.max, 401)
    specials = [0.0, -0.0, 1e-45, -1e-45, 1e-40, 2.0**fmt.emin, 2.0 ** (fmt.emin - fmt.man_bits - 1), fmt.max,
                -fmt.max, fmt.max * 1.01, 3e38, -3e38, float("inf"), -float("inf"), float("nan")]  # fmt: skip
    y = torch.cat([torch.randn(2000, generator=g) * torch.exp(torch.randn(2000, generator=g) * 3), grid,
                   grid * (1 + 2**-23), grid * (1 - 2**-23), grid + 2**-30, torch.tensor(specials)]).float()  # fmt: skip
    t = _sr_thresholds(y, fmt)
    for bits in (t - 2, t - 1, t, t + 1, torch.zeros_like(t), torch.full_like(t, 2**32 - 1)):
        bits = bits.clamp(0, 2**32 - 1)
        expected = encode_with_bits(y, fmt, bits=bits, canonical_nan=True)
        assert torch.equal(cpu.encode_sr(y, bits, fmt), expected)


class _FakeLibrary:
    """A loaded library as ctypes shows it: functions whose restype can be set."""

    _name = "stale.so"

    def __init__(self, source_hash: bytes, with_kernels: bool):
        def mf_source_hash():
            return source_hash

        self.mf_source_hash = mf_source_hash
        if with_kernels:
            for name in cpu.KERNELS:
                for isa in cpu.ISAS:
                    setattr(self, f"{name}_{isa}", lambda *a: None)


@pytest.mark.parametrize(
    ("source_hash", "with_kernels", "why"),
    [(b"0123456789abcdef", True, "built from other versions of _cpu.c, _cpu_avx2.c, _cpu_avx512.c, _gemv.c, _decode.c, _gemv.h"),
     (None, False, "mf_amax")],
)
def test_a_library_built_from_another_source_is_not_used(monkeypatch, source_hash, with_kernels, why):
    """An updated checkout that was not rebuilt: warn once and run the reference."""
    import ctypes
    import hashlib
    from pathlib import Path

    sources = b"".join(Path(cpu.__file__).with_name(name).read_bytes() for name in cpu.SOURCES)
    real = hashlib.sha256(sources).hexdigest()[:16].encode()
    fake = _FakeLibrary(source_hash or real, with_kernels)
    try:
        with monkeypatch.context() as m:
            m.setattr(ctypes, "CDLL", lambda path: fake)
            cpu.library.cache_clear()
            with pytest.warns(RuntimeWarning, match=why):
                assert cpu.library() is None
            assert not cpu.supports(torch.ones(3))  # the reference serves
    finally:
        cpu.library.cache_clear()
    assert cpu.library() is not None


def test_each_fast_path_is_taken_where_it_applies(monkeypatch):
    """The dispatch: fp32 / bf16 / fp16 CPU tensors go to the kernels, other dtypes and devices
    and MINIFLOAT_KERNELS=reference to the reference (whose results would look the same, so
    the calls are counted); the transpose kernel serves only the plain transpose of a matrix."""
    from minifloat import kernels, quantize

    calls = []

    def spy(name):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, **k: calls.append(name) or real(*a, **k))

    for name in ("quantize", "dequantize", "tensor_amax", "rht16"):
        spy(name)
    lib = cpu.library()

    class Library:  # the loaded library, counting transposes
        def __getattr__(self, name):
            return getattr(lib, name)

        def mf_transpose(self, *args):
            calls.append("transpose")
            return lib.mf_transpose(*args)

    monkeypatch.setattr(cpu, "library", Library)
    x = torch.randn(40, 64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        quantize(x.to(dtype), "mxfp8").dequantize()
        kernels.amax(x.to(dtype))
    assert calls == ["quantize", "dequantize", "tensor_amax"] * 3
    calls.clear()
    kernels.amax(x.double()), kernels.contiguous(x.double().t()), kernels.contiguous(x.long().t())
    assert calls == []  # dtypes the kernels do not take (quantize refuses them itself)
    assert torch.equal(kernels.rht(x, torch.ones(16)), reference.rht(x, torch.ones(16)))  # the kernel, and its bits
    kernels.rht(x, torch.ones(32))  # only 16-wide transforms have a kernel
    assert calls == ["rht16"]
    calls.clear()
    m = x[:, :24]
    for view, fast in ((x.t(), True), (x, False), (m.t(), False), (x.t()[1:], False), (x.view(40, 8, 8).transpose(1, 2), False)):
        assert torch.equal(kernels.contiguous(view), view.contiguous())
        assert calls == (["transpose"] if fast else []), view.stride()
        calls.clear()
    real_reference = reference.quantize
    monkeypatch.setattr(reference, "quantize", lambda *a, **k: calls.append("reference") or real_reference(*a, **k))
    for name in SCHEMES:  # every scheme's own work in the kernel, both roundings; fnuz's in the reference
        quantize(x, name)
        quantize(x, name, rounding="stochastic")
    assert calls == [("quantize" if name in FAST else "reference") for name in SCHEMES for _ in range(2)]
    calls.clear()
    assert quantize(x[:0], "nvfp4").shape == (0, 64) and calls == ["reference"]  # empty: nothing to measure
    calls.clear()
    monkeypatch.setenv("MINIFLOAT_KERNELS", "reference")
    quantize(x, "nvfp4").dequantize()
    kernels.amax(x), kernels.contiguous(x.t()), kernels.rht(x, torch.ones(16))
    assert calls == ["reference"]  # no kernel
