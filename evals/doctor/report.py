"""Run every check over a run's facts and print the findings: text for people, JSON for machines, markdown
for the results page every pipeline run publishes (`evals.results_page`)."""

import json
from collections.abc import Callable
from dataclasses import dataclass

from draftsmith.evals.doctor import acceptance, conventions, copying, serving, training
from draftsmith.evals.doctor.facts import RunFacts, read_run
from draftsmith.evals.doctor.findings import SEVERITIES, Finding

# In the report's order: what the trainer says, then where acceptance goes, then conventions, then serving.
CHECKS: dict[str, Callable[[RunFacts], list[Finding]]] = {
    "training-health": training.training_health,
    "generalisation-gap": training.generalisation_gap,
    "position-acceptance": acceptance.position_loss,
    "long-context": acceptance.long_context,
    "free-speculation": acceptance.free_speculation,
    "copying": copying.copying,
    "tap-convention": conventions.tap_convention,
    "template": conventions.template_mode,
    "draft-vocabulary": conventions.vocab_coverage,
}


@dataclass(frozen=True)
class Report:
    run: str
    findings: tuple[Finding, ...]
    headline: dict

    def worst(self) -> str:
        return max((f.severity for f in self.findings), key=SEVERITIES.index, default="ok")

    def to_json(self) -> str:
        body = {"run": self.run, "worst": self.worst(), "headline": self.headline}
        return json.dumps(body | {"findings": [f.to_dict() for f in self.findings]}, indent=2)

    def render_text(self) -> str:
        lines = [f"draftsmith doctor: {self.run}", _headline(self.headline), ""]
        for f in sorted(self.findings, key=lambda f: -SEVERITIES.index(f.severity)):
            lines.append(f"[{f.severity}] {f.check}: {f.title}")
            lines += [f"    {e}" for e in f.evidence]
            if f.fix and f.severity != "ok":
                lines.append(f"    fix: {f.fix}")
        counts = {s: sum(f.severity == s for f in self.findings) for s in reversed(SEVERITIES)}
        lines += ["", "findings: " + ", ".join(f"{n} {s}" for s, n in counts.items())]
        return "\n".join(lines)

    def render_markdown(self) -> str:
        lines = [
            "## Doctor",
            "",
            _headline(self.headline),
            "",
            "| severity | check | finding | fix |",
            "|---|---|---|---|",
        ]
        for f in sorted(self.findings, key=lambda f: -SEVERITIES.index(f.severity)):
            evidence = "<br>".join(e.replace("|", "\\|") for e in f.evidence)
            title = f.title.replace("|", "\\|") + (f"<br><small>{evidence}</small>" if evidence else "")
            fix = f.fix.replace("|", "\\|")
            lines.append(f"| {f.severity} | {f.check} | {title} | {fix} |")
        return "\n".join(lines) + "\n"


def _headline(h: dict) -> str:
    if not h:
        return "no evaluation results in this run"
    parts = [f"acc_len overall {h['acc_len']:.3f} ({h['drafter']}, {h['draft_tokens_per_round']} drafts per round)"]
    if h.get("harness_tokens_per_s_ratio") is not None:
        parts.append(f"harness batched tokens/s ratio x{h['harness_tokens_per_s_ratio']:.2f} (not a serving speed-up)")
    return "; ".join(parts)


def diagnose_facts(facts: RunFacts, engine_url: str | None = None, prompts: str | None = None) -> Report:
    found: list[Finding] = []
    for check in CHECKS.values():
        found += check(facts)
    found += serving.train_serve(facts, engine_url, prompts)
    r = facts.results or {}
    headline = (
        {
            "acc_len": float(r["acc_len"]["overall"]),
            "drafter": r.get("drafter"),
            "draft_tokens_per_round": r.get("draft_tokens_per_round"),
            "harness_tokens_per_s_ratio": r.get("speedup"),
        }
        if r.get("acc_len")
        else {}
    )
    return Report(facts.run, tuple(found), headline)


def diagnose(run: str, engine_url: str | None = None, prompts: str | None = None) -> Report:
    """Read the run folder (local or any fsspec URL) and run every check; `DoctorInputError` for a folder
    that is not a run."""
    return diagnose_facts(read_run(run), engine_url, prompts)
