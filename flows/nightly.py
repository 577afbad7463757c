"""The `nightly-regression` flow: each drafter's nightly recipe through the `kimi-k3` pipeline, then judged
against its committed baseline. Logic lives in `tasks/regression.py`; this file only wires it."""

from datetime import UTC, datetime

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from draftsmith.core import storage
from draftsmith.core.config.nightly import NightlyConfig
from draftsmith.flows.pipeline import kimi_k3
from draftsmith.tasks import regression


class RegressionFailed(RuntimeError):
    """A nightly figure left its band (or a pipeline failed); the message lists which."""


def nightly_folder(cfg: NightlyConfig) -> str:
    """`<run_root>/<run_name>`, the run name defaulting to the UTC start time (a fresh folder each night)."""
    return storage.join(cfg.run_root, cfg.run_name or datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"))


@flow(name="nightly-regression", log_prints=True, validate_parameters=True)
def nightly_regression(config: NightlyConfig | None = None) -> list[regression.Check]:
    """Train and evaluate every nightly drafter, compare with the baselines, publish the verdict; fail if any
    figure leaves its band."""
    cfg = config or NightlyConfig()
    folder = nightly_folder(cfg)
    checks: list[regression.Check] = []
    notes: dict[str, str] = {}
    for drafter in cfg.drafters:
        recipe = regression.nightly_recipe(cfg, drafter)
        run_dir = storage.join(folder, recipe.name)
        notes[drafter] = regression.recipe_note(recipe, cfg.baseline_dir, cfg.overrides)
        state = kimi_k3(config=recipe, run_dir=run_dir, return_state=True)
        if state.is_completed():
            checks += regression.judge_task(recipe, run_dir, cfg.baseline_dir, cfg.bands)
        else:
            checks.append(regression.pipeline_failed(drafter, state.message or state.name or str(state.type)))
    summary = regression.summary_markdown(checks, folder, notes)
    create_markdown_artifact(summary, key=regression.ARTIFACT_KEY, description="Nightly regression verdict")
    log = get_run_logger()
    log.info(summary)
    for url in regression.prune_nights(cfg.run_root, cfg.keep_nights):
        log.info("nightly: deleted %s (keep_nights: %d)", url, cfg.keep_nights)
    failed = [c for c in checks if not c.passed]
    if failed:
        raise RegressionFailed(
            f"{len(failed)} nightly figure(s) out of band: "
            + "; ".join(f"{c.drafter} {c.figure} = {c.value}" for c in failed)
        )
    return checks
