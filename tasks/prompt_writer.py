"""Prompts the target writes itself: a `target` prompt source (Magpie, Xu et al. 2024).

An aligned chat model given its chat template's text up to a user message, and nothing after it, continues
with a user message of its own. Sampled at temperature 1, these are as varied as the conversations the model
was tuned on, and written in the distribution the model expects: what a drafter for that model should see.
They need no dataset, no network and no template vocabulary, which is why the embedded default mixes them
with the synthetic pool.

Rows come out as the file sources' rows do (`{"id", "category", "turns"}` dicts with a line number), so the
select stage's normalisation, dedupe, decontamination and mix treat them like any other source. A prompt not
finished within `max_new_tokens` is drawn again: cut off mid-sentence, it is not a prompt a user would send,
and sampling leaves a few of them in every batch, so they are attrition, not bad input.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from draftsmith.core.config import TargetConfig
from draftsmith.core.config.select import PromptSource, PromptWriting
from draftsmith.core.progress import Progress
from draftsmith.engines import hf
from draftsmith.engines.base import Completion

log = logging.getLogger(__name__)

# Draws per prompt asked for before giving up: SmolLM2 leaves about 1 in 12 unfinished at 48 tokens.
_MAX_DRAWS = 2
# Stands in for the user's message while the chat template is rendered; it never reaches the model.
_SLOT = "\x00draftsmith-user-message\x00"


def pre_query(tok: Any, system: str | None) -> str:
    """The chat template's text before a user message's content (system turn included).

    Raises:
        ValueError: The template does not render a user message's content verbatim.
    """
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": _SLOT}
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if _SLOT not in text:
        raise ValueError("select.sources: the target's chat template does not render a user message verbatim")
    return text.split(_SLOT)[0]


@torch.inference_mode()
def written_rows(
    src: PromptSource, target: TargetConfig, *, count: int, seed: int, progress: Progress | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """`count` finished prompts the target writes, numbered by draw (the gaps are the unfinished draws).

    Deterministic for a seed on one machine: each `generate` call draws from `torch.manual_seed(seed + call)`.

    Raises:
        ValueError: Fewer than half the draws finish, so `count` is out of reach (the message says which
            setting to raise).
    """
    writing = src.writing or PromptWriting()
    model, tok = hf.load_target(target)
    text = pre_query(tok, writing.system)
    line = kept = call = 0
    while kept < count:
        if line >= _MAX_DRAWS * count:
            raise ValueError(
                f"select.sources: the target finished {kept} of {line} prompts within {writing.max_new_tokens} "
                "tokens; raise writing.max_new_tokens"
            )
        with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
            torch.manual_seed(seed + call)
            (drawn,) = hf.generate_texts(
                model,
                tok,
                [text],
                max_new_tokens=writing.max_new_tokens,
                temperature=writing.temperature,
                top_p=writing.top_p,
                n=min(writing.batch_size, 2 * (count - kept)),
            )
        call += 1
        for completion in drawn:
            line += 1
            if completion.finished and kept < count:
                kept += 1
                yield line, _row(src, line, completion, writing)
                if progress is not None:
                    progress.advance()
    if line > kept:
        log.info("select_prompts: %d of %d prompts the target wrote were unfinished and drawn again", line - kept, line)


def _row(src: PromptSource, line: int, completion: Completion, writing: PromptWriting) -> dict[str, Any]:
    row: dict[str, Any] = {"id": f"{src.label()}-{line}", "category": src.category, "turns": [completion.text]}
    if writing.system is not None:
        row["system"] = writing.system
    return row
