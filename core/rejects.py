"""Rows that a stage could not use: kept in `rejected.jsonl` with their reason, never silently lost.

A corpus of 150K rows always holds a few bad ones; failing the whole stage on the first is as wrong as
dropping them unseen. Stages collect rejects here, write them beside their outputs, count them by reason
in the manifest, and fail only when the rejected share passes the recipe's threshold.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from draftsmith.core.manifest import FileEntry, file_entry

REJECTED_FILE = "rejected.jsonl"
_EXCERPT_CHARS = 2000


class RejectedShareError(ValueError):
    """The share of rejected rows passed the recipe's threshold."""


@dataclass
class Rejects:
    """Collects rejected rows of one stage.

    Attributes:
        stage: Stage name, used in error messages.
        rows: One dict per rejected row: `source` (file or shard), `line` (1-based, or None), `id`
            (when known), `reason` (a short machine-readable tag), `detail` (human message) and
            `excerpt` (the raw row, cut to 2000 characters).
    """

    stage: str
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(
        self,
        *,
        source: str,
        reason: str,
        detail: str,
        line: int | None = None,
        row_id: str | None = None,
        raw: Any = None,
    ) -> None:
        excerpt = raw if isinstance(raw, str) else (repr(raw) if raw is not None else None)
        self.rows.append(
            {
                "source": source,
                "line": line,
                "id": row_id,
                "reason": reason,
                "detail": detail,
                "excerpt": excerpt[:_EXCERPT_CHARS] if excerpt is not None else None,
            }
        )

    def extend(self, other: Rejects) -> None:
        self.rows.extend(other.rows)

    def counts(self) -> dict[str, int]:
        """`{"rejected.<reason>": n}` for the manifest."""
        return {f"rejected.{r}": n for r, n in sorted(Counter(row["reason"] for row in self.rows).items())}

    def write(self, stage_uri: str) -> FileEntry:
        """Write `rejected.jsonl` (possibly empty) atomically and describe it."""
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in self.rows).encode()
        return file_entry(stage_uri, REJECTED_FILE, data)

    def check(self, total: int, max_share: float, *, where: str) -> None:
        """Fail when more than `max_share` of `total` input rows were rejected.

        Args:
            total: Input rows seen, rejected ones included.
            max_share: The recipe's threshold, in [0, 1].
            where: Where the rejects were written, for the message.

        Raises:
            RejectedShareError: Naming the share, the threshold, the top reasons and the first row.
        """
        if not self.rows or total <= 0:
            return
        share = len(self.rows) / total
        if share <= max_share:
            return
        top = ", ".join(f"{r}={n}" for r, n in Counter(row["reason"] for row in self.rows).most_common(3))
        first = self.rows[0]
        at = f"{first['source']}:{first['line']}" if first["line"] else first["source"]
        raise RejectedShareError(
            f"{self.stage}: {len(self.rows)} of {total} rows rejected ({share:.1%}), above the threshold "
            f"{max_share:.1%} ({top}); first: {at}: {first['detail']}; all in {where}"
        )
