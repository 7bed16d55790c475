"""Training recipes: which scheme quantizes each operand of a Linear's three GEMMs, as frozen
values built by name or by hand (`minifloat.recipes.recipe`)."""

from minifloat.recipes.recipe import (
    FP8_FORMATS,
    RECIPES,
    ROLES,
    CurrentScaling,
    DelayedScaling,
    Float8BlockScaling,
    MXScaling,
    NVFP4BlockScaling,
    Recipe,
    get_recipe,
)

__all__ = [
    "Recipe", "RECIPES", "ROLES", "FP8_FORMATS", "get_recipe",
    "DelayedScaling", "CurrentScaling", "Float8BlockScaling", "MXScaling", "NVFP4BlockScaling",
]  # fmt: skip
