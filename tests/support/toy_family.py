"""A drafter family that lives only here, registered as a plugin (`DRAFTSMITH_PLUGINS=tests.support.toy_family`).

`toy` is a one-layer chain drafter with a recipe section of its own: a few widths and a fixed depth. Its
model and objective are EAGLE-3's, built from a config it derives, and it is exported and served as EAGLE-3.
What it proves is the plumbing: validate, plan, train (in torchrun ranks), evaluate and export take a family
from the registry and never by name. `tests/integration/test_toy_family.py` runs it.
"""

import sys
from typing import Literal

from pydantic import Field

from draftsmith.core.config.drafter import DrafterConfigBase, Eagle3Config, register_drafter
from draftsmith.drafters import families

DEPTH = 2


class ToyConfig(DrafterConfigBase):
    """A toy chain drafter: one layer of `heads` heads of `head_dim`, trained `DEPTH` drafts deep."""

    kind: Literal["toy"] = Field("toy", description="Drafter family.")
    draft_vocab_size: int = Field(gt=0, description="Draft vocabulary: the most frequent loss tokens.")
    heads: int = Field(2, gt=0, description="Attention heads (as many key/value heads).")
    head_dim: int = Field(16, gt=0, description="Per-head width.")

    def drafts_per_round(self, num_draft_tokens: int) -> int:
        return num_draft_tokens

    @property
    def trained_depth(self) -> int | None:
        return DEPTH

    def serving_tokens(self, num_draft_tokens: int) -> int | None:
        return num_draft_tokens

    def describe(self) -> str:
        return f"toy ({self.heads} heads x {self.head_dim}, depth {DEPTH}, draft vocab {self.draft_vocab_size})"

    def as_eagle3(self) -> Eagle3Config:
        return Eagle3Config(
            num_heads=self.heads,
            num_kv_heads=self.heads,
            head_dim=self.head_dim,
            intermediate_size=4 * self.heads * self.head_dim,
            draft_vocab_size=self.draft_vocab_size,
            ttt_depth=DEPTH,
        )


class ToyFamily:
    """The `Family` of `toy`: EAGLE-3's functions over the derived config."""

    def __init__(self) -> None:
        from draftsmith.drafters.eagle3 import family as eagle3

        self._eagle3 = eagle3
        self.export: families.ExportMethod = eagle3.export

    def build(self, cfg: ToyConfig, inputs: families.BuildInputs):
        return self._eagle3.build(cfg.as_eagle3(), inputs)

    def objective(self, cfg: ToyConfig, model, head_VH, generator):
        return self._eagle3.objective(cfg.as_eagle3(), model, head_VH, generator)

    def checkpoint_blobs(self, model, taps, metadata):
        return self._eagle3.checkpoint_blobs(model, taps, metadata)

    def load(self, folder, target_model):
        return self._eagle3.load(folder, target_model)

    def generate(self, target, model, taps, prompt_S, **how):
        return self._eagle3.generate(target, model, taps, prompt_S, **how)

    def proposer(self, model, g):
        return self._eagle3.proposer(model, g)

    def code_modules(self):
        return [*self._eagle3.code_modules(), sys.modules[__name__]]


register_drafter(ToyConfig)
families.register_family("toy", ToyFamily)
