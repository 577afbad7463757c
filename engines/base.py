"""The target-engine interface: what regeneration asks of HF, an OpenAI-compatible server or vLLM.

Messages are OpenAI chat messages: `{"role", "content"}`, plus `reasoning_content` on assistant turns
of thinking models and `tool_calls` where the model called tools. Every backend answers a batch of
conversations with `n` completions each and describes itself for the stage's provenance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Message = dict[str, Any]


@dataclass(frozen=True)
class ChatRequest:
    """One conversation to continue with an assistant turn."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for one assistant turn; `temperature == 0` means greedy.

    `extra_body` is passed through to the server untouched (e.g. `{"thinking": true}`) and, for engines
    that render the template themselves, as chat-template keyword arguments.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Completion:
    """One generated assistant turn."""

    text: str
    num_tokens: int  # generated tokens, the end-of-turn token included (as vLLM and OpenAI usage count)
    finish_reason: Literal["stop", "length"]
    reasoning: str | None = None  # thinking text, kept apart from the answer
    tool_calls: list[dict[str, Any]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason == "stop"


@runtime_checkable
class TargetEngine(Protocol):
    """A backend that continues conversations with the target model."""

    def chat(self, requests: Sequence[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per request, in request order."""
        ...

    def describe(self) -> dict[str, str]:
        """Provenance: `engine`, `model` and, where known, `chat_template_sha256`."""
        ...

    def close(self) -> None:
        """Release processes, connections and memory."""
        ...


def template_hash(template: str | None) -> str:
    """sha256 of a chat template's text (`""` when absent): recorded by regenerate, checked by tokenize."""
    import hashlib

    return hashlib.sha256((template or "").encode()).hexdigest()
