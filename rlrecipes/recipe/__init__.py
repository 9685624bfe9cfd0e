"""Recipes: the schema (``schema.py``) and loading with inheritance and overrides (``loading.py``).

A recipe folder holds ``recipe.yaml`` (the full-scale run) and ``smoke.yaml`` (the same recipe
at tiny size on CPU), which inherits ``recipe.yaml`` through ``defaults: [recipe.yaml]`` and
holds only the differences. ``rlrecipes show --resolved`` prints the merged result.
"""
from ..models import FAMILIES, SMOKE
from .loading import (apply_overrides, dump_yaml, find_recipe, load_recipe, load_yaml_tree, parse_override,
                      recipe_from_dict, recipe_roots, registry, resolve_path)
from .schema import *  # noqa: F401,F403  (every section model)
from .schema import AlgorithmConfig, InferenceSettings, Recipe, RecipeError

__all__ = ["Recipe", "RecipeError", "AlgorithmConfig", "InferenceSettings", "load_recipe", "find_recipe",
           "registry", "recipe_roots", "parse_override", "apply_overrides", "load_yaml_tree", "dump_yaml",
           "resolve_path", "recipe_from_dict", "SMOKE", "FAMILIES"]
