"""When two prompts are the same prompt: equal after whitespace is collapsed and case folded, turn by turn.

Selection drops such repeats, and evaluation keeps its prompts apart from the training ones by this key.
"""

from collections.abc import Iterable


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def dedupe_key(system: str | None, turns: Iterable[str]) -> str:
    """One string per distinct (system, turns); separators that whitespace collapsing cannot produce keep
    ("a b", "c") distinct from ("a", "b c")."""
    return "\x1e".join([_normalize(system or ""), *(_normalize(t) for t in turns)])
