"""The serving schedule `draftsmith speedup` measured for a run's drafter: draft tokens per batch size.

A chain drafter pays at a small batch, where a verification step of a few more tokens costs little more than a
plain step, and stops paying as the batch grows and verification competes with the other requests for compute.
vLLM takes a schedule for that (`num_speculative_tokens_per_batch_size`: inclusive batch-size ranges, each with
its draft-token count, 0 turning speculation off; vLLM 0.32 `vllm/v1/spec_decode/dynamic/utils.py`).
`draftsmith speedup` measures each depth at each concurrency and records the fastest in
`<run>/speedup/speedup.json`; the export serves that schedule when it was measured for the checkpoint being
exported (the train stage's key), and nothing otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.core import storage

RESULT = ("speedup", "speedup.json")


@dataclass(frozen=True)
class Schedule:
    """Batch-size ranges `[start, end, draft tokens]`, as vLLM takes them, and where they were measured."""

    ranges: list[list[int]]
    source: str

    @property
    def most(self) -> int:
        """The deepest draft of the schedule: the engine's `num_speculative_tokens`."""
        return max(k for _, _, k in self.ranges)

    def describe(self) -> str:
        parts = [f"{a}{'' if a == b else f'-{b}'}: {k}" for a, b, k in self.ranges]
        return f"draft tokens per batch size {', '.join(parts)} (the last range goes on; measured in {self.source})"


def measured(run_dir: str, train_key: str) -> Schedule | None:
    """The schedule measured for this checkpoint, or None: no measurement, another checkpoint's, no chain
    drafter, or no depth that paid anywhere (the export then keeps the drafter's own depth, and says why)."""
    path = storage.join(run_dir, *RESULT)
    if not storage.exists(path):
        return None
    try:
        result = storage.read_json(path)
    except (OSError, ValueError):
        return None
    ranges = ((result.get("schedule") or {}).get("batch_size_ranges")) or []
    if result.get("train_key") != train_key or not ranges or max(k for _, _, k in ranges) < 1:
        return None
    return Schedule([[int(a), int(b), int(k)] for a, b, k in ranges], path)


def never_pays(run_dir: str, train_key: str) -> bool:
    """`draftsmith speedup` measured this checkpoint and found no level where any depth beats plain serving."""
    path = storage.join(run_dir, *RESULT)
    if not storage.exists(path):
        return False
    try:
        result = storage.read_json(path)
    except (OSError, ValueError):
        return False
    per_level = (result.get("schedule") or {}).get("per_level") or {}
    return result.get("train_key") == train_key and bool(per_level) and not any(per_level.values())
