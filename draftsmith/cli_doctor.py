"""`draftsmith doctor RUN`: why a run's drafter accepts what it does, with the evidence and the fix.

Exit codes: 0 with or without findings (a report is a result), 2 with one line for a run folder that is
missing or not a run, or an `--engine-url`/`--prompts` that cannot be used.
"""

import argparse
import sys


def add_parsers(sub) -> None:
    p = sub.add_parser("doctor", help="say why a run's drafter acceptance is low, from its run folder, with the fix")
    p.add_argument("run", help="a run folder, local or a URL (s3://...)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--engine-url", help="a running vLLM server with the drafter: compare its counters with the harness")
    p.add_argument(
        "--prompts", help="JSONL of prompts for --engine-url (prompt or prompt_ids per line; default: the evaluation's)"
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    from draftsmith.evals.doctor import DoctorInputError, diagnose

    if args.prompts and not args.engine_url:
        sys.stderr.write("error: doctor: --prompts needs --engine-url\n")
        return 2
    try:
        report = diagnose(args.run, engine_url=args.engine_url, prompts=args.prompts)
    except DoctorInputError as err:
        sys.stderr.write(f"error: doctor: {err}\n")
        return 2
    sys.stdout.write((report.to_json() if args.json else report.render_text()) + "\n")
    return 0


COMMANDS = {"doctor": cmd_doctor}
