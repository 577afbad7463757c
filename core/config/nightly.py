"""The nightly regression's settings: which recipes it runs, where, and how far a figure may drift.

The defaults are the committed nightly settings: the `nightly-<drafter>` recipes, the baselines in
`deployments/baselines/`, and bands that leave room for float drift between machines but not for a change.
"""

from pathlib import Path

from pydantic import Field, field_validator

from draftsmith.core.config.base import StrictModel
from draftsmith.core.config.drafter import BUILTIN_KINDS, drafter_kinds

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"


class Bands(StrictModel):
    """Tolerance bands around the baseline figures, and the health rules no baseline is needed for.

    Training and evaluation are seeded and bitwise deterministic on one CPU machine: two nightly runs give equal
    losses, accuracies and acc_len to the last digit (measured). So the bands are for what changes between
    machines of the nightly pool: the BLAS kernels and vector width a CPU gets change the order float sums are
    added in, a drift far below the bands. Outside them is a change of code, data or settings: a learning rate
    100x too high moves the first loss windows by 11-28% and acc_len by -0.12 on the EAGLE-3 recipe.
    """

    loss_rel: float = Field(
        0.01,
        gt=0.0,
        lt=1.0,
        description="Relative band of each loss-curve window mean and of the final loss. 1%: EAGLE-3's loss "
        "only drops 5% over the nightly run (its floor is the random target's entropy), so a wider band would "
        "miss whole changes of its curve.",
    )
    acc_len_abs: float = Field(
        0.05,
        gt=0.0,
        description="Absolute band of the evaluated acc_len. One accepted token more or fewer moves it by about "
        "0.012 over the ~80 decoding rounds of the nightly evaluation; 0.05 lets four flip.",
    )
    curve_windows: int = Field(
        6,
        ge=2,
        description="The loss curve is compared as the mean loss of this many equal windows of steps: single "
        "steps see one batch each, window means are the curve's shape.",
    )
    min_loss_drop: float = Field(
        0.02,
        ge=0.0,
        lt=1.0,
        description="Health: the last window's mean loss must be at least this fraction below the first's, "
        "whatever the baseline says. The nightly recipes drop 5% (EAGLE-3), 14% (DFlash2) and 19% (DSpark).",
    )


class NightlyConfig(StrictModel):
    """The `nightly-regression` flow's parameter: run each drafter's nightly recipe, compare with baselines."""

    drafters: list[str] = Field(
        default_factory=lambda: list(BUILTIN_KINDS),
        min_length=1,
        description="Drafters to run; each uses `<recipe_dir>/nightly-<drafter>.yaml`.",
    )
    recipe_dir: str = Field(str(DEPLOYMENTS / "recipes"), min_length=1, description="Folder of the nightly recipes.")
    baseline_dir: str = Field(
        str(DEPLOYMENTS / "baselines"),
        min_length=1,
        description="Folder of the committed `nightly-<drafter>.json` baselines.",
    )
    run_root: str = Field(
        "runs/nightly",
        min_length=1,
        description="Local folder or fsspec URL under which each night's runs are made.",
    )
    run_name: str | None = Field(
        None,
        description="Folder under `run_root` for this run's pipelines (`<run_root>/<run_name>/<recipe name>`). "
        "Null: the UTC start time, so every night trains afresh; a fixed name reuses that folder's finished stages.",
    )
    keep_nights: int = Field(
        14,
        ge=0,
        description="Timestamped night folders kept under `run_root` (this night's included); older ones are "
        "deleted after the verdict, failed nights as well. 0 keeps every night. Named runs are never deleted.",
    )
    overrides: dict[str, bool | int | float | str] = Field(
        default_factory=dict,
        description="Dotted recipe fields replaced in every nightly recipe, e.g. `{train.lr: 0.3}`, to see a "
        "change fail; the committed nightly sets none.",
    )
    bands: Bands = Field(default_factory=Bands, description="Tolerance bands and health rules.")

    @field_validator("drafters")
    @classmethod
    def _unique(cls, drafters: list[str]) -> list[str]:
        if len(set(drafters)) != len(drafters):
            raise ValueError(f"nightly.drafters: each drafter once, got {drafters}")
        if unknown := [d for d in drafters if d not in drafter_kinds()]:
            raise ValueError(
                f"nightly.drafters: unknown drafter families {unknown} (known: {', '.join(drafter_kinds())})"
            )
        return drafters

    @field_validator("run_name")
    @classmethod
    def _plain_name(cls, name: str | None) -> str | None:
        if name is not None and (not name or "/" in name or name in {".", ".."}):
            raise ValueError(f"nightly.run_name: {name!r} must be one folder name")
        return name
