import json

import ml_dtypes
import numpy as np
import pytest
import torch

import minifloat
from minifloat import FORMATS, FloatFormat, MinifloatError, NaNEncoding, UnknownFormatError, get_format
from tests.conftest import FORMAT_NAMES, ML_DTYPES

# emax_elem of each element format, from the OCP MX v1.0 spec, Table 1 (E8M0: 127).
OCP_EMAX = {"e4m3": 8, "e5m2": 15, "e3m2": 4, "e2m3": 2, "e2m1": 2, "e8m0": 127}


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_derived_properties_match_ml_dtypes_finfo(name):
    fmt, info = get_format(name), ml_dtypes.finfo(ML_DTYPES[name])
    assert fmt.bits == info.bits
    assert fmt.max == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert fmt.epsilon == float(info.eps)
    assert fmt.emax == OCP_EMAX.get(name, int(np.floor(np.log2(float(info.max)))))  # fnuz: not OCP, from its max


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_values_in_one_two_counts_decoded_values(name):
    values = np.arange(2 ** get_format(name).bits, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float64)
    assert get_format(name).values_in_1_2 == int(((values >= 1) & (values < 2)).sum())


def test_published_maxima():
    assert [FORMATS[n].max for n in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")] == [448, 57344, 28, 7.5, 6]
    assert FORMATS["e8m0"].max == 2.0**127


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("float8_e4m3fn", "e4m3"), ("E4M3", "e4m3"), ("float8_e5m2", "e5m2"),
        ("float6_e3m2fn", "e3m2"), ("float6_e2m3fn", "e2m3"), ("float4_e2m1fn", "e2m1"),
        ("fp4", "e2m1"), ("float8_e8m0fnu", "e8m0"), (torch.float8_e4m3fn, "e4m3"),
        (torch.float8_e5m2, "e5m2"), (torch.float8_e8m0fnu, "e8m0"), (torch.float4_e2m1fn_x2, "e2m1"),
    ],
)
def test_get_format_accepts_ml_dtypes_and_torch_spellings(spelling, name):
    assert get_format(spelling) is FORMATS[name]
    assert get_format(FORMATS[name]) is FORMATS[name]


def test_unknown_format_lists_known_names():
    with pytest.raises(UnknownFormatError, match=r"unknown format 'e4m4'; known: e4m3, e5m2, e4m3fnuz, e5m2fnuz, e3m2, e2m3, e2m1, e8m0"):
        get_format("e4m4")
    with pytest.raises(UnknownFormatError, match="torch.float32"):
        get_format(torch.float32)
    with pytest.raises(UnknownFormatError, match="not int"):
        get_format(3)


def test_formats_are_frozen_and_describe_is_json():
    with pytest.raises(AttributeError):
        FORMATS["e4m3"].bias = 8
    rows = json.loads(json.dumps([f.describe() for f in FORMATS.values()]))
    assert [r["name"] for r in rows] == FORMAT_NAMES
    assert rows[0]["max"] == 448 and rows[1]["has_inf"] is True


def test_public_api_exports():
    assert set(minifloat.__all__) <= set(dir(minifloat))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_table_figures_match_ml_dtypes_finfo(name):
    """The `minifloat formats` columns not covered above, against ml_dtypes' finfo."""
    fmt, info = get_format(name), ml_dtypes.finfo(ML_DTYPES[name])
    assert fmt.dynamic_range_binades == pytest.approx(np.log2(float(info.max) / float(info.smallest_subnormal)))
    assert fmt.memory_vs_fp16 == info.bits / 16
    assert fmt.has_subnormals == (float(info.smallest_subnormal) < float(info.smallest_normal))
    assert fmt.describe()["dynamic_range_binades"] == fmt.dynamic_range_binades


def test_published_dynamic_ranges():
    # e4m3: 448 / 2**-9; e5m2: 57344 / 2**-16; e2m1: 6 / 0.5 (binades, as the format tables print them)
    assert [round(FORMATS[n].dynamic_range_binades, 2) for n in ("e4m3", "e5m2", "e2m1")] == [17.81, 31.81, 3.58]
    assert [FORMATS[n].has_subnormals for n in FORMAT_NAMES] == [True, True, True, True, True, True, True, False]


@pytest.mark.parametrize(("ocp", "fnuz"), [("e4m3", "e4m3fnuz"), ("e5m2", "e5m2fnuz")])
def test_an_fn_checkpoint_read_as_fnuz_is_halved(ocp, fnuz):
    """The factor of two AMD's loaders correct: every finite, non-zero fn code's bits read as fnuz
    are half its value (ml_dtypes both sides); −0 (0x80) reads as fnuz's NaN."""
    codes = np.arange(256, dtype=np.uint8)
    as_fn, as_fnuz = codes.view(ML_DTYPES[ocp]).astype(np.float64), codes.view(ML_DTYPES[fnuz]).astype(np.float64)
    ok = np.isfinite(as_fn) & (as_fn != 0)
    factor = minifloat.formats.fnuz_scale_factor(FORMATS[ocp], FORMATS[fnuz])
    assert factor == 0.5 and np.array_equal(as_fnuz[ok], factor * as_fn[ok])
    assert np.isnan(as_fnuz[0x80]) and not np.isnan(as_fn[0x80])
    with pytest.raises(MinifloatError, match="do not share a bit layout"):
        minifloat.formats.fnuz_scale_factor(FORMATS["e4m3"], FORMATS["e5m2fnuz"])


def test_fnuz_has_no_negative_zero():
    codes = minifloat.encode(torch.tensor([-0.0, -1e-9, float("nan"), -float("nan"), -1.0]), "e4m3fnuz", saturate=False)
    assert codes.tolist() == [0, 0, 0x80, 0x80, 0xC0]  # ml_dtypes agrees: tests/formats/test_codec.py, every pattern


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"exp_bits": 5, "man_bits": 3, "bias": 15, "has_inf": False, "nan": NaNEncoding.NONE}, "9 bits: .* at most 8 bits"),
        ({"exp_bits": 0, "man_bits": 3, "bias": 1, "has_inf": False, "nan": NaNEncoding.NONE}, "≥ 1 exponent"),
        ({"exp_bits": 3, "man_bits": -1, "bias": 3, "has_inf": False, "nan": NaNEncoding.NONE}, "≥ 0 mantissa"),
        ({"exp_bits": 4, "man_bits": 3, "bias": 7, "has_inf": True, "nan": NaNEncoding.ALL_ONES}, "only IEEE-style"),
        ({"exp_bits": 4, "man_bits": 0, "bias": 7, "has_inf": True, "nan": NaNEncoding.IEEE}, "tell NaN from inf"),
    ],
)
def test_an_impossible_format_is_refused_by_name(fields, message):
    with pytest.raises(MinifloatError, match=f"FloatFormat 'mine': .*{message}"):
        FloatFormat("mine", **fields)


def test_a_custom_format_encodes_like_the_builtin_it_copies():
    mine = FloatFormat("mine", exp_bits=2, man_bits=1, bias=1, has_inf=False, nan=NaNEncoding.NONE)
    x = torch.tensor([0.3, -1.7, 5.2, 100.0])
    assert torch.equal(minifloat.encode(x, mine), minifloat.encode(x, "e2m1"))
