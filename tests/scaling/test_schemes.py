import json

import numpy as np
import pytest
import torch

from minifloat import SCHEMES, MinifloatError, Scheme, UnknownFormatError, get_scheme
from minifloat.scaling.schemes import named

# The presets as the quantization issue defines them: element, block, scale format.
PUBLISHED = {
    "fp8": ("e4m3", "tensor", None, "fp32"),
    "fp8_e5m2": ("e5m2", "tensor", None, "fp32"),
    "fp8_rowwise": ("e4m3", "row", None, "fp32"),
    "fp8_block128": ("e4m3", "block", (1, 128), "fp32"),  # DeepSeek-V3 activations
    "fp8_block128x128": ("e4m3", "block", (128, 128), "fp32"),  # DeepSeek-V3 weights
    "mxfp8": ("e4m3", "block", (1, 32), "e8m0"),  # OCP MX v1.0
    "mxfp8_e5m2": ("e5m2", "block", (1, 32), "e8m0"),
    "mxfp6_e3m2": ("e3m2", "block", (1, 32), "e8m0"),
    "mxfp6_e2m3": ("e2m3", "block", (1, 32), "e8m0"),
    "mxfp4": ("e2m1", "block", (1, 32), "e8m0"),
    "nvfp4": ("e2m1", "block", (1, 16), "e4m3"),  # + an FP32 tensor scale
    "nvfp4_2d": ("e2m1", "block", (16, 16), "e4m3"),
    "fp6_e3m2": ("e3m2", "tensor", None, "fp32"),
    "fp4": ("e2m1", "tensor", None, "fp32"),
    "fp8_fnuz": ("e4m3fnuz", "tensor", None, "fp32"),  # AMD MI300's FP8
    "fp8_e5m2fnuz": ("e5m2fnuz", "tensor", None, "fp32"),
    "fp8_rowwise_fnuz": ("e4m3fnuz", "row", None, "fp32"),
}


def test_presets_are_the_published_definitions():
    assert list(SCHEMES) == list(PUBLISHED)
    for name, (element, granularity, block, scale_format) in PUBLISHED.items():
        s = SCHEMES[name]
        assert (s.name, s.element, s.granularity, s.block, s.scale_format) == (name, element, granularity, block, scale_format)
        assert (s.scale_rule, s.margin, s.rounding) == ("floor", 0, "nearest")  # OCP's rule is the default


def test_lookup_by_name_is_forgiving_about_case_and_spaces_only():
    assert get_scheme(" MXFP4 ") is SCHEMES["mxfp4"]
    assert get_scheme(SCHEMES["nvfp4"]) is SCHEMES["nvfp4"]
    for bad in ("mx_fp4", 4, None):
        with pytest.raises(MinifloatError, match=f"unknown scheme {bad!r}; known: fp8, fp8_e5m2"):
            get_scheme(bad)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_json_round_trip_gives_the_same_scheme(name):
    s = SCHEMES[name]
    assert Scheme.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_replace_drops_the_preset_name_and_named_finds_it_again():
    custom = get_scheme("mxfp8").replace(element="e2m1")
    assert custom.name == "custom" and custom.block == (1, 32)
    assert named(custom) is SCHEMES["mxfp4"]
    odd = custom.replace(block=(1, 64))
    assert named(odd) is odd


@pytest.mark.parametrize(
    "block", [(1, 32.5), (1.0, 32.0), (1, "32"), (True, 32), (1, 32, 1), (1,), 32, None, (0, 32), (1, -32)]
)
def test_block_must_be_two_whole_numbers_at_least_one(block):
    # 32.5 is not truncated to 32, a bool is not a size
    with pytest.raises(MinifloatError, match=r"block=\(rows, cols\), two whole numbers ≥ 1, got"):
        Scheme(element="e4m3", granularity="block", block=block)


def test_block_accepts_integers_of_any_kind():
    s = Scheme(element="e4m3", granularity="block", block=[np.int64(1), torch.tensor(64)])
    assert s.block == (1, 64) and all(type(b) is int for b in s.block)
    assert s.bits_per_element == 8 + 32 / 64


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"element": "e9m9"}, "e9m9"),
        ({"element": "e8m0"}, "e8m0 is a scale format, not an element format"),
        ({"element": "e4m3", "granularity": "channel"}, "unknown granularity 'channel'; use one of tensor, row, block"),
        ({"element": "e4m3", "scale_format": "bf16"}, "unknown scale format 'bf16'"),
        ({"element": "e4m3", "scale_rule": "round"}, "unknown scale rule 'round'"),
        ({"element": "e4m3", "rounding": "down"}, "unknown rounding 'down'"),
        ({"element": "e4m3", "block": (1, 32)}, "block=\\(1, 32\\) only goes with granularity='block'"),
        ({"element": "e4m3", "scale_format": "e8m0"}, "e8m0 scales are per block"),
        ({"element": "e4m3", "granularity": "block", "block": (1, 16), "scale_format": "e4m3"},
         "defined for e2m1 elements"),
        ({"element": "e3m2", "granularity": "block", "block": (1, 30)}, "a block of 30 e3m2 elements is not whole bytes; "
         "use a multiple of 4 columns"),
    ],
)  # fmt: skip
def test_invalid_fields_are_named_in_the_error(fields, message):
    error = UnknownFormatError if fields["element"] == "e9m9" else MinifloatError
    with pytest.raises(error, match=message):
        Scheme(**fields)


def test_from_dict_refuses_what_is_not_a_scheme():
    with pytest.raises(MinifloatError, match="not a scheme description"):
        Scheme.from_dict({"element": "e4m3", "color": "red"})
    with pytest.raises(MinifloatError, match="two whole numbers"):
        Scheme.from_dict({"element": "e4m3", "granularity": "block", "block": 128})
