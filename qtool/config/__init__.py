"""Recipes: what to quantize (a YAML file, validated once at the edge) and, for one model, which quantizer goes
where (the plan). See docs/recipes.md.

- :mod:`.schema`: the pydantic schema and how a rule's partial spec lays over the one before it;
- :mod:`.loading`: YAML read safely, with file, key and line in every error;
- :mod:`.shipped`: the recipes qtool ships, and the words that describe a recipe in tables;
- :mod:`.plan`: the plan's types (one row per quantizer, SmoothQuant groups, folds, rotations);
- :mod:`.resolve`: recipe + model -> plan;
- :mod:`.layout`: what a model's layout says to rotations, KV cache rows, folds and SmoothQuant;
- :mod:`.messages`: the wording of recipe errors.

Torch is imported only where a plan is made, so that recipes validate without it.
"""

from .loading import RecipeFile, load_recipe, parse_recipe, read_recipe
from .plan import (AwqPlan, BatchNormFold, OnlineRotation, Plan, QuantizerPlan, RotationPlan, SmoothGroup,
                   granularity_word)
from .resolve import (CHECKPOINT_KEYS, GGUF_GRID_NOTE, GGUF_STACK_NOTE, GGUF_GRID_REFUSED, GGUF_GRID_STORED, input_channels_first,
                      resolve_plan, takes_token_ids)
from .schema import (DEFAULT_ACTIVATION_TYPES, DEFAULT_WEIGHT_TYPES, ActivationSpec, LayerRule, Recipe, RotateSpec,
                     WeightSpec, exact_pattern)
from .shipped import (describe_recipe, recipe_description, recipe_file, recipe_needs_data, shipped_recipes,
                      spec_label, weights_label)

__all__ = [
    "Recipe",
    "WeightSpec",
    "ActivationSpec",
    "LayerRule",
    "QuantizerPlan",
    "Plan",
    "BatchNormFold",
    "SmoothGroup",
    "AwqPlan",
    "RotateSpec",
    "RotationPlan",
    "OnlineRotation",
    "CHECKPOINT_KEYS",
    "GGUF_GRID_NOTE",
    "GGUF_STACK_NOTE",
    "takes_token_ids",
    "GGUF_GRID_REFUSED",
    "GGUF_GRID_STORED",
    "input_channels_first",
    "granularity_word",
    "exact_pattern",
    "load_recipe",
    "read_recipe",
    "RecipeFile",
    "parse_recipe",
    "recipe_file",
    "shipped_recipes",
    "describe_recipe",
    "spec_label",
    "weights_label",
    "recipe_description",
    "recipe_needs_data",
    "resolve_plan",
    "DEFAULT_WEIGHT_TYPES",
    "DEFAULT_ACTIVATION_TYPES",
]
