"""Configuration of the tokenization stage."""

from pydantic import Field

from draftsmith.config.base import StrictModel
from draftsmith.config.stages import Resources


class TokenizeConfig(StrictModel):
    """Chat-template rendering with an assistant-only loss mask."""

    max_length: int = Field(1024, gt=8, description="Longer conversations are truncated to this many tokens.")
    num_workers: int = Field(2, ge=0, description="Tokenizer processes; 0 tokenizes in-process.")
    last_turn_only: bool = Field(False, description="Only the final assistant turn carries loss.")
    min_loss_tokens: int = Field(1, ge=0, description="Conversations with fewer loss tokens are dropped.")
    resources: Resources = Field(default_factory=Resources, description="Where this stage runs.")
