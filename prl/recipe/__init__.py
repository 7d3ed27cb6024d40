"""Recipes: schema (no torch), loading with overrides, resolution into per-process configs."""

from prl.recipe.load import RecipeError, load_recipe
from prl.recipe.schema import Recipe

__all__ = ["Recipe", "RecipeError", "load_recipe"]
