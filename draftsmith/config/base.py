"""The strict base model every config section derives from."""

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown keys are errors, values are immutable, defaults are validated too.

    Frozen models hash and serialise deterministically, which the stage cache keys rely on.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
