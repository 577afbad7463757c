"""Strict pipeline configuration, loaded from YAML recipes (see `deployments/recipes/`)."""

from draftsmith.config.loader import RecipeError, dump_recipe, load_recipe
from draftsmith.config.pipeline import PipelineConfig
from draftsmith.config.stages import (
    DrafterConfig,
    EvaluateConfig,
    HiddenStatesConfig,
    RegenerateConfig,
    Resources,
    SelectConfig,
    StorageConfig,
    TargetConfig,
    TokenizeConfig,
    TrainConfig,
)

__all__ = [
    "DrafterConfig",
    "EvaluateConfig",
    "HiddenStatesConfig",
    "PipelineConfig",
    "RecipeError",
    "RegenerateConfig",
    "Resources",
    "SelectConfig",
    "StorageConfig",
    "TargetConfig",
    "TokenizeConfig",
    "TrainConfig",
    "dump_recipe",
    "load_recipe",
]
