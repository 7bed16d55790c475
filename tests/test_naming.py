"""One name lookup for every preset table: case, spaces and - or _ do not matter."""

import pytest

import minifloat
from minifloat.infer import QUANT_CONFIGS, get_quant_config
from minifloat.infer.generation.kvcache import KV_FORMATS, kv_format
from minifloat.recipes import RECIPES, get_recipe


@pytest.mark.parametrize(
    ("lookup", "table", "spelling", "key"),
    [(minifloat.get_scheme, minifloat.SCHEMES, " FP8-Rowwise", "fp8_rowwise"),
     (get_quant_config, QUANT_CONFIGS, "fp8_block_weight_only", "fp8-block-weight-only"),
     (get_recipe, RECIPES, "MXFP4_Tseng", "mxfp4-tseng"),
     (kv_format, KV_FORMATS, "FP8-E5M2", "fp8_e5m2")],
)
def test_every_table_takes_any_spelling_of_a_name(lookup, table, spelling, key):
    assert lookup(spelling) is table[key]
    with pytest.raises(minifloat.MinifloatError, match=f"unknown .*'{spelling}x'; known: {list(table)[0]}"):
        lookup(spelling + "x")
