"""`draftsmith doctor`: why a drafter's acceptance is what it is, read from its run folder, with the fix.

`diagnose(run)` reads what the stages wrote (`facts.read_run`) and runs every check; each check is a small
function of the run's facts returning findings (`findings.Finding`). `render_text` and `to_json` print the
report; `render_markdown` is the results page's section (`evals.results_page`). The checks and their
thresholds: `docs/doctor.md`.
"""

from draftsmith.evals.doctor.facts import DoctorInputError, RunFacts, read_run
from draftsmith.evals.doctor.findings import Finding
from draftsmith.evals.doctor.report import CHECKS, Report, diagnose, diagnose_facts

__all__ = [
    "CHECKS", "DoctorInputError", "Finding", "Report", "RunFacts", "diagnose", "diagnose_facts", "read_run",
]  # fmt: skip
