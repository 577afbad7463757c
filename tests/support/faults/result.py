"""What one run of a fault scenario found."""

from dataclasses import dataclass, field


@dataclass
class FaultResult:
    """One run of a fault scenario: how many units were lost, duplicated or wrong, how many faults were
    injected, and the longest time between a fault and the moment it was noticed (retried or refused)."""

    fault: str
    units: int
    lost: int = 0
    duplicated: int = 0
    corrupted: int = 0
    injected: int = 0
    detected_within_s: float = 0.0
    slots_leaked: int = 0  # global-concurrency slots (`gpu:<pool>`) still taken after the scenario
    detail: dict = field(default_factory=dict)
