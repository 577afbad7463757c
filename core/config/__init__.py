"""Strict pipeline configuration, loaded from YAML recipes (see `deployments/recipes/`)."""

from draftsmith.core.config.drafter import DFlash2Config, DrafterConfig, DSparkConfig, Eagle3Config
from draftsmith.core.config.hidden_states import HiddenStatesConfig
from draftsmith.core.config.loader import (
    RecipeError,
    check_target_shape,
    dump_recipe,
    load_recipe,
    note_overrides,
    parse_recipe,
    record_recipe,
)
from draftsmith.core.config.nightly import NightlyConfig
from draftsmith.core.config.pipeline import PipelineConfig
from draftsmith.core.config.regenerate import RegenerateConfig
from draftsmith.core.config.select import SelectConfig
from draftsmith.core.config.stages import (
    EvaluateConfig,
    Resources,
    StorageConfig,
    TargetConfig,
)
from draftsmith.core.config.tokenize import TokenizeConfig
from draftsmith.core.config.train import TrainConfig

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
    "check_target_shape",
    "dump_recipe",
    "load_recipe",
    "note_overrides",
    "parse_recipe",
    "record_recipe",
]
