"""The root `PipelineConfig`: one section per stage plus target, drafter and storage."""

import re
from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from draftsmith.core.config.base import StrictModel
from draftsmith.core.config.drafter import DrafterConfigBase, drafter_union, on_register
from draftsmith.core.config.hidden_states import HiddenStatesConfig
from draftsmith.core.config.regenerate import RegenerateConfig
from draftsmith.core.config.select import SelectConfig
from draftsmith.core.config.stages import (
    DispatchConfig,
    EvaluateConfig,
    StorageConfig,
    TargetConfig,
)
from draftsmith.core.config.sweep import SpeedupConfig
from draftsmith.core.config.tokenize import TokenizeConfig
from draftsmith.core.config.train import TrainConfig

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")

# At run time the union of every registered drafter config (rebuilt when a plugin registers one); checkers see
# the base class every member extends.
if TYPE_CHECKING:
    Drafter = DrafterConfigBase
else:
    Drafter = drafter_union()


class PipelineConfig(StrictModel):
    """A whole recipe. Flows take this model as their parameter, so the Prefect UI shows a typed form."""

    name: str = Field(description="Recipe name; also the run folder name under `storage.run_root`.")
    seed: int = Field(0, ge=0, description="Seed for every random choice in the pipeline.")
    target: TargetConfig = Field(description="The target LLM.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Where runs live.")
    dispatch: DispatchConfig = Field(
        default_factory=DispatchConfig, description="Watching stages dispatched to other pools."
    )
    select: SelectConfig = Field(description="Prompt selection.")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig, description="Regeneration.")
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig, description="Tokenization.")
    hidden_states: HiddenStatesConfig = Field(description="Hidden-state capture.")
    drafter: Drafter = Field(discriminator="kind", description="The drafter architecture.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Drafter training.")
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig, description="Evaluation.")
    speedup: SpeedupConfig = Field(
        default_factory=SpeedupConfig,
        description="`draftsmith speedup`: the trained drafter served by vLLM, speculation off against on "
        "(not a pipeline stage; `make run` ends with it). Command-line flags override it.",
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> "PipelineConfig":
        # Messages carry the dotted path themselves: a model-level error has no location of its own.
        if not _NAME.fullmatch(self.name):  # `match` with `$` lets a trailing newline through
            raise ValueError(f"name: {self.name!r} must be lowercase letters, digits, '.', '_' or '-'")
        layers = self.target.num_layers
        for i, tap in enumerate(self.hidden_states.taps):
            if tap >= layers:
                raise ValueError(
                    f"hidden_states.taps[{i}]: tap {tap} must be below target.num_layers ({layers}); "
                    "the last layer's output is captured separately as the last hidden state"
                )
        hs = self.hidden_states
        if hs.engine == "vllm" and hs.vllm.max_model_len <= self.tokenize.max_length:
            raise ValueError(
                f"hidden_states.vllm.max_model_len: {hs.vllm.max_model_len} leaves no room for the token vLLM "
                f"generates after a tokenize.max_length ({self.tokenize.max_length}) sample"
            )
        if self.select.num_eval >= self.select.num_prompts:
            raise ValueError(
                f"select.num_eval: {self.select.num_eval} held-out prompts leave none of "
                f"select.num_prompts ({self.select.num_prompts}) for training"
            )
        tok_thinking = self.tokenize.thinking == "on"
        if tok_thinking != self.regenerate.thinking and not self.tokenize.allow_provenance_mismatch:
            raise ValueError(
                f"tokenize.thinking: {self.tokenize.thinking!r} disagrees with regenerate.thinking "
                f"({self.regenerate.thinking}); training on another mode than the corpus was generated in "
                "costs acceptance. Align them or set tokenize.allow_provenance_mismatch: true"
            )
        if hs.mode == "online" and self.train.world_size > 1:
            raise ValueError(
                f"train.distributed: online hidden states feed one training rank (the Mooncake stream has one "
                f"consumer); this recipe asks for {self.train.world_size}. Use hidden_states.mode: offline"
            )
        self._drafter_checks()
        return self

    def _drafter_checks(self) -> None:
        self.drafter.check_target(self.target)
        try:
            self.drafter.serving_depths(self.speedup.draft_tokens, self.evaluate.num_draft_tokens)
        except ValueError as err:
            raise ValueError(f"speedup.{err}") from None


def _rebuild_drafter_field() -> None:
    """A newly registered drafter family joins the `drafter:` union."""
    PipelineConfig.model_fields["drafter"].annotation = drafter_union()
    PipelineConfig.model_rebuild(force=True)


on_register(_rebuild_drafter_field)
