"""Strict pipeline configuration, loaded from YAML recipes (see `deployments/recipes/`)."""

from draftsmith.config.hidden_states import HiddenStatesConfig
from draftsmith.config.loader import RecipeError, dump_recipe, load_recipe
from draftsmith.config.pipeline import PipelineConfig
from draftsmith.config.regenerate import RegenerateConfig
from draftsmith.config.select import SelectConfig
from draftsmith.config.stages import (
    DrafterConfig,
    EvaluateConfig,
    Resources,
    StorageConfig,
    TargetConfig,
    TrainConfig,
)
from draftsmith.config.tokenize import TokenizeConfig

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
