"""The records evaluation code passes around: a benchmark prompt."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark item: `turns` are the user turns, in order (multi-turn items regenerate each answer)."""

    id: str
    category: str
    turns: list[str] = field(hash=False)
    system: str | None = None
    source: str = "builtin"
