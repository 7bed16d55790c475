import dataclasses
import json

import pytest

import minifloat
from minifloat.recipes import RECIPES, ROLES, DelayedScaling, MXScaling, NVFP4BlockScaling, get_recipe


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipes_round_trip_through_json(name):
    r = get_recipe(name)
    assert get_recipe(json.loads(json.dumps(r.to_dict()))) == r


def test_fp8_recipe_defaults_follow_transformer_engine():
    r = get_recipe("fp8")
    assert r == DelayedScaling(format="hybrid", margin=0, amax_history_len=1024, amax_compute_algo="max", interval=1)
    assert [r.scheme(role).element for role in ("input", "weight", "grad_output")] == ["e4m3", "e4m3", "e5m2"]
    assert DelayedScaling(format="e4m3").scheme("grad_output").element == "e4m3"


def test_block_and_mx_recipes_quantize_along_blocks_of_the_published_sizes():
    block = get_recipe("fp8-block")
    assert block.scheme("input").block == (1, 128) and block.scheme("weight").block == (128, 128)
    assert block.weight_2d
    for name, element in [("mxfp8", "e4m3"), ("mxfp6", "e2m3"), ("mxfp6-e2m3", "e2m3"), ("mxfp6-e3m2", "e3m2"),
                          ("mxfp4", "e2m1")]:  # fmt: skip
        s = get_recipe(name).scheme("grad_output")
        assert (s.element, s.block, s.scale_format) == (element, (1, 32), "e8m0")
    assert MXScaling(element="e2m3", grad_element="e3m2").scheme("grad_output").element == "e3m2"
    # MXFP4's fixes: gradients rounded stochastically on rounded-up scales; the forward's operands untouched
    tseng = get_recipe("mxfp4-tseng")
    g = tseng.scheme("grad_output")
    assert (g.rounding, g.scale_rule, tseng.scheme("input").name, tseng.rht) == ("stochastic", "rceil", "mxfp4", True)
    assert get_recipe("mxfp4-rtn") == MXScaling(element="e2m1")
    # the fixes measured best are the default: Tseng et al.'s and the first block kept; the old behaviour is mxfp4-rtn
    assert get_recipe("mxfp4") == dataclasses.replace(tseng, high_precision_first=1) and tseng.high_precision_first == 0
    hybrid = get_recipe("mxfp6-hybrid")  # FP8's hybrid, in FP6: precision forward, range for gradients
    assert [hybrid.scheme(role).name for role in ("input", "weight", "grad_output")] == ["mxfp6_e2m3", "mxfp6_e2m3", "mxfp6_e3m2"]


def test_what_linear_and_convert_read_off_each_recipe():
    # weight_2d: square weight blocks serve W and Wᵀ; delayed: scales from an amax history kept in the module
    expect = {"fp8": (False, True), "fp8-current": (False, False), "fp8-block": (True, False),
              "mxfp8": (False, False), "mxfp6": (False, False), "mxfp6-e2m3": (False, False),
              "mxfp6-e3m2": (False, False), "mxfp6-hybrid": (False, False), "mxfp4": (False, False), "nvfp4": (True, False), "nvfp4-4over6": (True, False),
              "mxfp4-rtn": (False, False), "mxfp4-tseng": (False, False), "mxfp4-rht": (False, False), "mxfp4-sr": (False, False), "mxfp4-tseng-rht32": (False, False), "mxfp4-tseng-fwd": (False, False), "mxfp4-tseng-least-error": (False, False), "mxfp8-rceil": (False, False), "mxfp4-rceil": (False, False), "fp8-fnuz": (False, True), "fp8-current-fnuz": (False, False), "nvfp4-1d-4over6": (False, False), "mxfp4-fwd": (False, False)}  # fmt: skip
    assert set(expect) == set(RECIPES)
    for name, want in expect.items():
        r = get_recipe(name)
        assert (r.weight_2d, r.delayed) == want, name


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipes_are_frozen(name):
    # a layer remembers the schemes its recipe gave; a recipe changed in place would desync them
    r = get_recipe(name)
    field = dataclasses.fields(r)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(r, field, getattr(r, field))


def test_fp8_block_hybrid_takes_e5m2_for_gradients_only():
    from minifloat.recipes import Float8BlockScaling

    r = Float8BlockScaling(format="hybrid")
    assert [r.scheme(role).element for role in ROLES] == ["e4m3", "e4m3", "e5m2"]
    assert r.scheme("grad_output").block == (1, 128) and r.scheme("weight").block == (128, 128)
    assert DelayedScaling(amax_history_len=1).amax_history_len == 1  # the shortest history


def test_nvfp4_recipe_switches():
    r = get_recipe("nvfp4")
    assert r.rht and r.stochastic_rounding and r.weight_2d
    assert r.scheme("weight").block == (16, 16) and r.scheme("grad_output").rounding == "stochastic"
    assert r.scheme("input").rounding == "nearest"
    plain = NVFP4BlockScaling(rht=False, stochastic_rounding=False, weight_2d_blocks=False)
    assert plain.scheme("weight").block == (1, 16) and plain.scheme("grad_output").rounding == "nearest"
    assert not plain.weight_2d


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: get_recipe("fp9"), "unknown recipe 'fp9'; known: fp8"),
        (lambda: DelayedScaling(format="e5m2"), "unknown FP8 format 'e5m2'"),
        (lambda: DelayedScaling(amax_history_len=0), "amax_history_len must be ≥ 1"),
        (lambda: DelayedScaling(amax_compute_algo="mean"), "unknown amax_compute_algo 'mean'"),
        (lambda: MXScaling(element="e9m9"), "unknown format"),
        (lambda: get_recipe({"recipe": "bogus"}), "not a recipe description"),
        (lambda: get_recipe("fp8").scheme("bias"), "unknown operand role 'bias'"),
        (lambda: NVFP4BlockScaling(rht="no"), r"NVFP4BlockScaling\(rht=...\) takes True or False, got 'no'"),
        (lambda: NVFP4BlockScaling(rht_seed=-1), "rht_seed must be an integer ≥ 0, got -1"),
    ],
)
def test_bad_recipes_name_the_problem(bad, match):
    with pytest.raises(minifloat.MinifloatError, match=match):
        bad()


def test_callable_amax_algo_is_recorded_but_not_rebuilt():
    r = DelayedScaling(amax_compute_algo=lambda h: h.mean())
    d = r.to_dict()
    assert d["amax_compute_algo"].startswith("<callable")
    with pytest.raises(minifloat.MinifloatError, match="callable"):
        get_recipe(d)


@pytest.mark.parametrize("name", list(RECIPES))
def test_schemes_are_remembered_per_recipe_without_changing_it(name):
    recipe = get_recipe(name)
    fresh = dataclasses.replace(recipe)
    first = [recipe.scheme(role) for role in ROLES]
    assert [recipe.scheme(role) for role in ROLES] == first
    assert all(recipe.scheme(role) is s for role, s in zip(ROLES, first, strict=True))  # no new Scheme per call
    assert recipe == fresh and hash(recipe) == hash(fresh) and recipe.to_dict() == fresh.to_dict()
    assert [fresh.scheme(role) for role in ROLES] == first
