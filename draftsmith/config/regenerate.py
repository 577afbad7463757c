"""Configuration of the regeneration stage and its target engines."""

from typing import Literal

from pydantic import Field

from draftsmith.config.base import StrictModel
from draftsmith.config.stages import Resources


class RegenerateConfig(StrictModel):
    """Response regeneration: the target answers every user turn, in order."""

    engine: Literal["hf", "openai", "vllm"] = Field("hf", description="Target engine backend.")
    batch_size: int = Field(16, gt=0, description="Conversations generated together.")
    max_new_tokens: int = Field(128, gt=0, description="Token limit per assistant turn.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    shard_size: int = Field(64, gt=0, description="Conversations per output shard (the resume unit).")
    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")
