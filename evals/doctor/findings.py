"""A finding of `draftsmith doctor`: which check, how bad, the figures behind it and what addresses it."""

from dataclasses import asdict, dataclass, field

SEVERITIES = ("ok", "info", "warn", "error")


@dataclass(frozen=True)
class Finding:
    """`check`: the check's name (`docs/doctor.md` has one section each); `severity`: ok, info (a fact worth
    knowing, or a check that could not run for want of a recorded fact), warn (likely costs acceptance),
    error (acceptance cannot be right until fixed); `evidence`: figures, each with its file and field;
    `fix`: the recipe field or command that addresses it."""

    check: str
    severity: str
    title: str
    evidence: tuple[str, ...] = field(default_factory=tuple)
    fix: str = ""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"finding {self.check}: severity {self.severity!r} is not one of {SEVERITIES}")

    def to_dict(self) -> dict:
        return asdict(self) | {"evidence": list(self.evidence)}


def ok(check: str, title: str, *evidence: str) -> Finding:
    return Finding(check, "ok", title, tuple(evidence))


def info(check: str, title: str, *evidence: str, fix: str = "") -> Finding:
    return Finding(check, "info", title, tuple(evidence), fix)


def warn(check: str, title: str, *evidence: str, fix: str) -> Finding:
    return Finding(check, "warn", title, tuple(evidence), fix)


def error(check: str, title: str, *evidence: str, fix: str) -> Finding:
    return Finding(check, "error", title, tuple(evidence), fix)


def missing(check: str, what: str, fix: str) -> Finding:
    """The check could not run: the fact it reads is not in the run folder."""
    return Finding(check, "info", f"not checked: {what}", (), fix)
