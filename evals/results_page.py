"""One results page per pipeline run, whether its stages computed or came from the cache.

Stage artifacts appear only when a stage computes, so a run whose stages were all reused would show nothing.
The page is built from the run folder instead (`evals.doctor.facts.read_run`): per-benchmark acceptance, the
training loss's summary, the serving speed-up beside its free yardsticks, the doctor's findings and the plots.
Every figure says what it measures; in particular the evaluate stage's batched tokens/s ratio is never shown
as a speed-up, because it is not what a serving engine gains.
"""

import logging
from pathlib import PurePosixPath

from draftsmith.core import storage
from draftsmith.core.manifest import FileEntry
from draftsmith.core.ui import artifact_key, run_label
from draftsmith.drafters.training.metrics import summary_markdown
from draftsmith.evals import report, speedup_report
from draftsmith.evals.doctor.facts import RunFacts, read_run
from draftsmith.evals.doctor.report import Report, diagnose_facts

log = logging.getLogger(__name__)
# `draftsmith speedup`'s plot, recorded with its size and digest under `files` in speedup.json.
SPEEDUP_PLOT = "speedup.png"

_ACC_LEN = (
    "Acceptance length: tokens the target emits per verification round (accepted draft tokens plus its own), "
    "from real speculative decoding in the evaluate stage, greedy verification unless the recipe says otherwise."
)
_SERVED = (
    "Serving speed-up: output tokens/s of each server over plain serving (no speculation), in vLLM, on the same "
    "prompts, interleaved. The free yardsticks are vLLM's `ngram` prompt lookup and suffix decoding, which need "
    "no training."
)


def key_for(run_dir: str) -> str:
    """The page's artifact key: one per run folder, so the Artifacts tab keeps its versions together."""
    return artifact_key("results", run_label(run_dir))


def acceptance_section(results: dict | None) -> list[str]:
    if not results or not results.get("benches"):
        return ["## Acceptance length per benchmark", "", "Not measured: the evaluate stage has no results.", ""]
    benches = results["benches"]
    lines = ["## Acceptance length per benchmark", "", _ACC_LEN, "", *report.acceptance_table(benches), ""]
    first = [(b["bench"], b["position_accept"][0]) for b in benches if b.get("position_accept")]
    if first:
        lines += ["First draft token accepted, per benchmark: " + ", ".join(f"{n} {a:.2f}" for n, a in first), ""]
    mismatched = results.get("mismatched_outputs")
    if mismatched is not None:
        lines += [f"Outputs that differ from plain greedy decoding: {mismatched} of {results.get('prompts')}.", ""]
    return lines


def loss_section(metrics: list[dict]) -> list[str]:
    if not metrics:
        return ["## Training loss", "", "Not recorded: the train stage wrote no metrics.", ""]
    # One level down: the summary is a page of its own in the train stage's artifact.
    body = summary_markdown(metrics, title="Training loss", curve_points=10)
    return ["#" + line if line.startswith("#") else line for line in body.splitlines()] + [""]


def speedup_section(facts: RunFacts) -> list[str]:
    lines = ["## Serving speed-up", ""]
    train = facts.manifests.get("train")
    measured = facts.speedup
    if measured and train is not None and measured.get("train_key") == train.key:
        lines += [_SERVED, "", speedup_report.format_table(measured), ""]
        lines += [f"- {line}" for line in speedup_report.recommendation(measured)] + [""]
    elif measured:
        lines += ["Not measured for this checkpoint: `speedup/speedup.json` is for an earlier training run; "
                  f"`draftsmith speedup {facts.run}` measures this one.", ""]  # fmt: skip
    else:
        lines += [f"Not measured: `draftsmith speedup {facts.run}` serves the drafter and the free methods in vLLM.",
                  ""]  # fmt: skip
    ratio = (facts.results or {}).get("speedup")
    if ratio is not None:
        lines += [
            f"Harness ratio x{ratio:.2f}: the evaluate stage's tokens/s with the drafter over without, batched in one "
            "process on this machine's target. It checks that speculation runs; it is not a serving speed-up.",
            "",
        ]
    return lines


def _plot_entries(facts: RunFacts) -> list[tuple[str, FileEntry]]:
    """(stage, record) of each plot to show: the evaluate stage's, and the speed-up's when it measured this
    checkpoint. Each comes with the size and digest its producer recorded, so a damaged file is never shown."""
    evaluated = facts.manifests.get("evaluate")
    entries = [("evaluate", f) for f in evaluated.files if f.name.endswith(".png")] if evaluated else []
    train = facts.manifests.get("train")
    if facts.speedup and train is not None and facts.speedup.get("train_key") == train.key:
        recorded = (facts.speedup.get("files") or {}).get(SPEEDUP_PLOT)
        if recorded is None:
            log.warning("results page: %s records no %s; the plot is left out", facts.path("speedup"), SPEEDUP_PLOT)
        else:
            try:
                entries.append(("speedup", FileEntry.model_validate({"name": SPEEDUP_PLOT, **recorded})))
            except (TypeError, ValueError) as err:  # a bad record hides the plot, not the page
                log.warning("results page: %s: unreadable record of %s (%s)", facts.path("speedup"), SPEEDUP_PLOT, err)
    return entries


def _plots(facts: RunFacts) -> dict[str, str]:
    """Plot name -> data URL, from the evaluate stage's files and a matching speed-up measurement."""
    found: dict[str, str] = {}
    for stage, entry in _plot_entries(facts):
        url = facts.path(stage, entry.name)
        # A damaged or replaced plot must not hide the figures around it, nor be shown as this run's.
        problem = entry.problem(url)
        if problem is not None:
            log.warning("results page: plot left out: %s", problem)
            continue
        try:
            found[PurePosixPath(entry.name).stem] = report.png_bytes_url(storage.read_bytes(url), url)
        except ValueError as err:
            log.warning("results page: %s", err)
    return found


def results_markdown(facts: RunFacts, doctor: Report | None) -> str:
    """The page: headline, acceptance, training loss, serving speed-up, the doctor's findings, plots."""
    results = facts.results or {}
    lines = [f"# Results: {run_label(facts.run)}", ""]
    if results:
        lines += [
            f"Drafter {results.get('drafter')}, {results.get('draft_tokens_per_round')} draft tokens per round; "
            f"overall acceptance length **{results['acc_len']['overall']:.3f}** on {results.get('prompts')} prompts.",
            "",
        ]
    lines += acceptance_section(facts.results) + loss_section(facts.metrics) + speedup_section(facts)
    if doctor is not None:
        lines += [doctor.render_markdown(), ""]
    plots = _plots(facts)
    if plots:
        lines += ["## Plots", ""] + [f"### {name}\n\n![{name}]({url})\n" for name, url in plots.items()]
    return "\n".join(lines)


def publish(run_dir: str, *, with_doctor: bool = True) -> list[str]:
    """The results page of `run_dir` as a Prefect markdown artifact, inside a flow or task run; returns the keys
    created ([] outside a run, where an artifact would start a temporary server, or when the page fails)."""
    if not report.in_prefect_run():
        return []
    try:
        facts = read_run(run_dir)
        markdown = results_markdown(facts, diagnose_facts(facts) if with_doctor else None)
    except Exception as err:  # the stages' results are written: a page that fails must not fail the run
        log.warning("results page: none for %s: %s", run_dir, err)
        return []
    from prefect import artifacts

    key = key_for(run_dir)
    artifacts.create_markdown_artifact(markdown=markdown, key=key, description="draftsmith results")
    return [key]
