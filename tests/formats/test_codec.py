"""Codecs against ml_dtypes, bit for bit: every code, every fp16/bf16 pattern, random fp32,
every midpoint ±1 ulp, both saturate modes; float64 against an exact rational oracle."""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minifloat import (
    CodeRangeError,
    DTypeError,
    RoundingError,
    UnknownFormatError,
    decode,
    encode,
    get_format,
)
from minifloat.formats.codec import encode_with_bits, random_bits, sr_bits, sr_seed
from tests.conftest import FORMAT_NAMES, ML_DTYPES, all_patterns, oracle_encode, requires_cuda

SATURATE = [True, False]


def assert_codes_equal(x: np.ndarray, ours: torch.Tensor, ref: np.ndarray) -> None:
    ours = ours.numpy()
    bad = np.nonzero(ours != ref)[0]
    assert bad.size == 0, f"{bad.size} mismatches, e.g. x={x[bad[:5]]!r} ours={ours[bad[:5]]} ref={ref[bad[:5]]}"


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_decode_every_code_matches_ml_dtypes(name, dtype):
    fmt = get_format(name)
    codes = np.arange(fmt.num_codes, dtype=np.uint8)
    ref = torch.from_numpy(codes.view(ML_DTYPES[name]).astype(np.float64))
    ours = decode(torch.from_numpy(codes), name, dtype=dtype)
    assert ours.dtype == dtype
    with np.errstate(over="ignore"):
        ref = ref.to(dtype)  # E8M0 beyond float16 becomes inf in both
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    assert torch.equal(ours[finite], ref[finite])
    assert torch.equal(torch.signbit(ours[finite]), torch.signbit(ref[finite]))  # -0.0 stays -0.0


@pytest.mark.filterwarnings("ignore:encode. e.m. has no NaN code")  # the inputs hold NaNs on purpose
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("saturate", SATURATE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_encode_every_16bit_pattern_matches_ml_dtypes(name, saturate, dtype):
    x = all_patterns(dtype)
    np_x = x.view(torch.int16).numpy().view(np.float16 if dtype == torch.float16 else ml_dtypes.bfloat16)
    assert_codes_equal(np_x, encode(x, name, saturate=saturate), oracle_encode(np_x, name, saturate))


def _random_fp32(n: int, fmt, seed: int) -> np.ndarray:
    """Half fully random bit patterns (every exponent, inf, NaN), half with exponents around
    the format's range (where the rounding happens), random signs and mantissas."""
    rng = np.random.default_rng(seed)
    anybits = rng.integers(0, 2**32, n // 2, dtype=np.uint64).astype(np.uint32)
    exp = rng.integers(max(fmt.emin - fmt.man_bits - 4, -149), min(fmt.emax + 4, 127), n - n // 2) + 127
    sign = rng.integers(0, 2, exp.size, dtype=np.uint32) << 31
    near = sign | (np.clip(exp, 0, 254).astype(np.uint32) << 23) | rng.integers(0, 2**23, exp.size, dtype=np.uint32)
    return np.concatenate([anybits, near]).view(np.float32)


@pytest.mark.filterwarnings("ignore:encode. e.m. has no NaN code")  # the inputs hold NaNs on purpose
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("saturate", SATURATE)
def test_encode_random_fp32_matches_ml_dtypes(name, saturate):
    x = _random_fp32(1_200_000, get_format(name), seed=FORMAT_NAMES.index(name))
    assert_codes_equal(x, encode(torch.from_numpy(x), name, saturate=saturate), oracle_encode(x, name, saturate))


def _midpoints(name: str) -> np.ndarray:
    """Every midpoint between adjacent values (and above max), ±1 float32 ulp, both signs."""
    vals = np.arange(2 ** get_format(name).bits, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float64)
    vals = np.unique(np.abs(vals[np.isfinite(vals)]))
    mids = (vals[1:] + vals[:-1]) / 2
    top = vals[-1] + (vals[-1] - vals[-2]) / 2  # the overflow threshold
    mids = np.concatenate([mids, [top], vals]).astype(np.float32)  # exact in float32
    mids = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))])
    return np.concatenate([mids, -mids])


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("saturate", SATURATE)
def test_encode_midpoints_plus_minus_one_ulp_match_ml_dtypes(name, saturate):
    x = _midpoints(name)
    assert_codes_equal(x, encode(torch.from_numpy(x), name, saturate=saturate), oracle_encode(x, name, saturate))
    x16 = x.astype(ml_dtypes.bfloat16)  # and where bf16 can hold them
    xt = torch.from_numpy(x16.view(np.int16)).view(torch.bfloat16)
    assert_codes_equal(x16, encode(xt, name, saturate=saturate), oracle_encode(x16, name, saturate))


def _exact_nearest_code(v: float, name: str) -> int:
    """Independent oracle for float64 inputs: the code whose value is nearest to `v` in exact
    rational arithmetic, ties to the even code, saturating at ±max."""
    table = np.arange(2 ** get_format(name).bits, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float64)
    best = None
    for code, value in enumerate(table):
        if not np.isfinite(value) or np.signbit(value) != np.signbit(v):
            continue
        d = abs(Fraction(float(value)) - Fraction(v))
        if best is None or d < best[0] or (d == best[0] and code % 2 == 0):
            best = (d, code)
    return best[1]


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_float64_rounds_once_correctly(name):
    # float64 values a hair off each midpoint: ml_dtypes would round them twice (via float32).
    mids = _midpoints(name)[: len(_midpoints(name)) // 6].astype(np.float64)
    x = np.concatenate([mids * (1 + 2.0**-40), mids * (1 - 2.0**-40), mids])
    x = x[np.abs(x) < get_format(name).max * 1.1]
    ours = encode(torch.from_numpy(x), name).numpy()
    ref = np.array([_exact_nearest_code(float(v), name) for v in x])
    assert_codes_equal(x, torch.from_numpy(ours), ref)
    # the double-rounding case itself: 1 + 1/16 + 2**-40 lies above the e4m3 midpoint 1.0625
    assert decode(encode(torch.tensor([1.0625 + 2.0**-40], dtype=torch.float64), "e4m3"), "e4m3").item() == 1.125


def test_float64_agrees_with_ml_dtypes_on_float32_values():
    x = _random_fp32(200_000, get_format("e4m3"), seed=7)
    with np.errstate(invalid="ignore"):
        x64 = x.astype(np.float64)
    ours = encode(torch.from_numpy(x64), "e4m3", saturate=False)
    assert_codes_equal(x, ours, oracle_encode(x, "e4m3", saturate=False))


def test_specials_documented_table():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e9, -0.0])
    assert encode(x, "e4m3").tolist() == [0x7F, 0x7E, 0xFE, 0x7E, 0x80]
    assert encode(x, "e4m3", saturate=False).tolist() == [0x7F, 0x7F, 0xFF, 0x7F, 0x80]
    assert encode(x, "e5m2", saturate=False).tolist() == [0x7E, 0x7C, 0xFC, 0x7C, 0x80]
    with pytest.warns(UserWarning, match="e2m1 has no NaN code, so a NaN encodes to a zero") as caught:
        assert encode(x, "e2m1", saturate=False).tolist() == [0x8, 0x7, 0xF, 0x7, 0x8]
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert encode(torch.tensor([0.0, -1.0, 2.0**-140, float("inf")]), "e8m0").tolist() == [255, 255, 0, 254]


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e8m0"])
def test_formats_with_a_nan_code_encode_nan_without_a_warning(name):
    """Only the formats without a NaN code (FP6, FP4) warn that a NaN became a zero."""
    assert encode(torch.tensor([float("nan"), 1.0]), name)[0].item() == get_format(name).nan_code


@pytest.mark.parametrize(
    ("name", "values"),
    [("e4m3", [0.3, 1.1, 3.3, 100.7, -0.013]), ("e5m2", [0.3, 1.1, 3000.5, -2e-5]),
     ("e3m2", [0.3, 1.1, 13.0]), ("e2m3", [0.3, 1.1, 5.1]), ("e2m1", [0.7, 2.6, -5.2, 0.2]),
     ("e8m0", [0.3, 3.0, 1000.0])],
)
def test_stochastic_rounding_is_unbiased_and_moves_at_most_one_code(name, values):
    g = torch.Generator().manual_seed(0)
    n = 40_000
    x = torch.tensor(values, dtype=torch.float32).repeat(n, 1)
    codes = encode(x, name, rounding="stochastic", generator=g)
    got = decode(codes, name, torch.float64)
    lo = decode(encode(x[0], name), name, torch.float64)  # round to nearest: one of the two
    table = decode(torch.arange(get_format(name).num_codes, dtype=torch.uint8), name, torch.float64)
    for j, v in enumerate(values):
        seen = got[:, j].unique()
        assert len(seen) == 2, seen
        assert seen.min() <= v <= seen.max()
        # Unbiased: the mean is within 5 binomial standard deviations of x (a correct
        # generator fails this about once in 10^6 draws; always rounding down misses by ~100σ).
        below, above = seen.min().item(), seen.max().item()
        p = (v - below) / (above - below)  # the probability of the upper neighbour
        sigma = (above - below) * (p * (1 - p) / n) ** 0.5
        assert abs(got[:, j].mean().item() - v) < 5 * sigma, (v, got[:, j].mean().item(), sigma)
        between = ((table > seen.min()) & (table < seen.max())).sum()
        assert between == 0 and lo[j] in seen  # adjacent codes only


def test_stochastic_rounding_is_reproducible_and_exact_values_stay():
    x = torch.randn(10_000)
    a = encode(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(3))
    b = encode(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(3))
    c = encode(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    exact = decode(encode(x, "e4m3"), "e4m3")
    assert torch.equal(encode(exact, "e4m3", rounding="stochastic"), encode(exact, "e4m3"))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_stochastic_rounding_rounds_up_exactly_when_the_draw_is_below_the_fraction(name):
    """SR rounds |x| up iff bits * 2**-32 < (|x| - lower) / quantum: a representable value
    stays put even for the extreme draws 0 and 2**32 - 1, and the threshold is exact."""
    fmt = get_format(name)
    table = decode(torch.arange(fmt.num_codes, dtype=torch.uint8), name, torch.float64)
    exact = table[torch.isfinite(table)]
    for b in (0, 2**32 - 1):
        bits = torch.full(exact.shape, b, dtype=torch.int64)
        assert torch.equal(encode_with_bits(exact, fmt, bits=bits), encode(exact, name))
    # 1 + a quarter of the quantum at 1: up for draws below 2**30, down from 2**30 on
    x = torch.full((4,), 1 + 0.25 * fmt.epsilon, dtype=torch.float64)
    bits = torch.tensor([0, 2**30 - 1, 2**30, 2**32 - 1])
    got = decode(encode_with_bits(x, fmt, bits=bits), fmt, torch.float64).tolist()
    assert got == [1 + fmt.epsilon] * 2 + [1.0] * 2


def test_stochastic_rounding_seeds_come_from_the_cpu_generator_on_any_device():
    # A seed drawn on an accelerator would make every call wait for the device to read it
    # back; from the CPU generator, CPU and GPU runs seeded alike also round alike.
    torch.manual_seed(5)
    lo, hi = torch.randint(0, 2**32, (2,), dtype=torch.int64).tolist()
    torch.manual_seed(5)
    assert sr_seed() == lo | hi << 32
    torch.manual_seed(5)
    on_meta = random_bits((3, 4), device="meta")  # a device whose values cannot be read back
    assert on_meta.shape == (3, 4) and on_meta.device.type == "meta"
    assert torch.randint(0, 2**32, (2,), dtype=torch.int64).tolist() != [lo, hi]  # the CPU stream moved on
    assert sr_seed(torch.Generator().manual_seed(1)) == sr_seed(torch.Generator().manual_seed(1))


def test_any_shape_and_strides():
    x = torch.randn(6, 5, 4) * 10
    nc = x.permute(2, 0, 1)[:, ::2]
    assert not nc.is_contiguous()
    codes = encode(nc, "e4m3")
    assert codes.shape == nc.shape and codes.dtype == torch.uint8
    assert torch.equal(codes, encode(nc.contiguous(), "e4m3"))
    assert torch.equal(decode(codes, "e4m3"), decode(codes.contiguous(), "e4m3"))
    assert encode(torch.tensor(2.0), "e2m1").shape == ()
    assert encode(torch.empty(0, 3), "e5m2").shape == (0, 3)
    assert decode(torch.empty(0, dtype=torch.uint8), "e2m1").shape == (0,)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_encode_rejects_non_float_dtypes(dtype):
    with pytest.raises(DTypeError, match=r"encode takes float32, bfloat16, float16, float64 tensors, got torch\."):
        encode(torch.zeros(3, dtype=dtype), "e4m3")


def test_bad_input_errors():
    with pytest.raises(DTypeError, match="got list"):
        encode([1.0, 2.0], "e4m3")
    with pytest.raises(UnknownFormatError, match="known: e4m3"):
        encode(torch.ones(2), "fp7")
    with pytest.raises(RoundingError, match="unknown rounding 'up'; use one of nearest, stochastic"):
        encode(torch.ones(2), "e4m3", rounding="up")
    with pytest.raises(CodeRangeError, match=r"code 16 does not fit e2m1, whose 4-bit codes are 0..15"):
        decode(torch.tensor([3, 16], dtype=torch.uint8), "e2m1")
    with pytest.raises(CodeRangeError, match="code 16 does not fit"):  # a valid lowest code 0
        decode(torch.tensor([0, 16], dtype=torch.uint8), "e2m1")
    with pytest.raises(CodeRangeError, match="code -1"):
        decode(torch.tensor([-1, 2]), "e4m3")
    with pytest.raises(DTypeError, match="integer codes"):
        decode(torch.tensor([1.0]), "e4m3")
    with pytest.raises(DTypeError, match="decode returns"):
        decode(torch.tensor([1], dtype=torch.uint8), "e4m3", dtype=torch.int32)


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, width=32), st.sampled_from(FORMAT_NAMES[:5]))
def test_encode_is_idempotent_and_monotone(v, name):
    x = torch.tensor([v, v * 1.001, v * 0.999], dtype=torch.float32)
    codes = encode(x, name)
    back = decode(codes, name)
    assert torch.equal(encode(back, name), codes)  # representable values encode to themselves
    s = torch.sort(x).values  # monotone: sorted inputs give sorted values
    assert torch.all(torch.diff(decode(encode(s, name), name)) >= 0)


@requires_cuda
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_cuda_matches_cpu(name):
    x = all_patterns(torch.bfloat16)
    assert torch.equal(encode(x.cuda(), name).cpu(), encode(x, name))
    codes = torch.arange(get_format(name).num_codes, dtype=torch.uint8)
    assert torch.equal(decode(codes.cuda(), name).cpu().nan_to_num(7.0), decode(codes, name).nan_to_num(7.0))


def test_sr_bits_follow_the_documented_counter_hash():
    """`sr_bits` against a plain-integer transcription of its docstring formula."""

    def mix32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    def bits(seed, i):
        hi = mix32((((i >> 32) ^ (seed >> 32)) + 0x9E3779B9) & 0xFFFFFFFF)
        return mix32(mix32((i & 0xFFFFFFFF) ^ (seed & 0xFFFFFFFF)) ^ hi)

    seed = 0x0123456789ABCDEF
    got = sr_bits(seed, 1001)
    assert [got[i].item() for i in (0, 1, 2, 31, 1000)] == [bits(seed, i) for i in (0, 1, 2, 31, 1000)]
    assert sr_bits(seed + 1, 4).tolist() != got[:4].tolist()
