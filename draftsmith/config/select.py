"""Configuration of the prompt-selection stage."""

from typing import Literal

from pydantic import Field, model_validator

from draftsmith.config.base import StrictModel
from draftsmith.config.stages import Resources


class SelectConfig(StrictModel):
    """Prompt selection: the built-in synthetic pool or a JSONL file, deduplicated, with a held-out split."""

    source: Literal["synthetic", "jsonl"] = Field("synthetic", description="Where prompts come from.")
    path: str | None = Field(None, description="JSONL file (local or fsspec URL) when source is `jsonl`.")
    num_prompts: int = Field(gt=0, description="Prompts drawn from the synthetic pool (or kept from the file).")
    num_eval: int = Field(gt=0, description="Prompts held out for evaluation, stratified by category.")
    mix: dict[str, float] | None = Field(None, description="Category proportions for the synthetic pool.")
    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")

    @model_validator(mode="after")
    def _path_for_files(self) -> "SelectConfig":
        if self.source == "jsonl" and not self.path:
            raise ValueError("select.path: required when select.source is 'jsonl'")
        return self
