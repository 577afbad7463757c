"""Strict pipeline configuration, loaded from YAML recipes (see `deployments/recipes/`)."""

from draftsmith.config.drafter import DFlash2Config, DrafterConfig, DSparkConfig, Eagle3Config
from draftsmith.config.hidden_states import HiddenStatesConfig
from draftsmith.config.loader import RecipeError, dump_recipe, load_recipe, note_overrides, record_recipe
from draftsmith.config.nightly import NightlyConfig
from draftsmith.config.pipeline import PipelineConfig
from draftsmith.config.regenerate import RegenerateConfig
from draftsmith.config.select import SelectConfig
from draftsmith.config.stages import (
    EvaluateConfig,
    Resources,
    StorageConfig,
    TargetConfig,
)
from draftsmith.config.tokenize import TokenizeConfig
from draftsmith.config.train import TrainConfig

__all__ = [
    "DFlash2Config",
    "DSparkConfig",
    "Eagle3Config",
    "DrafterConfig",
    "EvaluateConfig",
    "HiddenStatesConfig",
    "NightlyConfig",
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
    "note_overrides",
    "record_recipe",
]
