"""`draftsmith doctor`: why a drafter's acceptance is what it is, read from its run folder, with the fix.

`diagnose(run)` reads what the stages wrote (`facts.read_run`) and runs every check; each check is a small
function of the run's facts returning findings (`findings.Finding`). `render_text` and `to_json` print the
report; `render_markdown` is the Prefect artifact's text. The checks and their thresholds: `docs/doctor.md`.
"""

from draftsmith.evals.doctor.facts import DoctorInputError, RunFacts, read_run
from draftsmith.evals.doctor.findings import Finding
from draftsmith.evals.doctor.report import CHECKS, Report, diagnose, diagnose_facts, publish

__all__ = [
    "CHECKS", "DoctorInputError", "Finding", "Report", "RunFacts", "diagnose", "diagnose_facts", "publish", "read_run",
]  # fmt: skip
