"""Fault scenarios shared by `benchmarks/faults.py` and `tests/faults`: a flaky OpenAI-compatible server
driven through the regenerate stage, and a DCP checkpoint whose pickles would run code on resume.

Each scenario is a plain function returning a `FaultResult`, so the benchmark can repeat it and a test
can assert on one run.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from tests.support.faults.result import FaultResult
from tests.support.openai_server import ChatServer, Reply, Request, completion
from tests.support.paths import TINY


def expected_answer(question: str) -> str:
    """What the server answers to `question` when nothing goes wrong."""
    return "answer " + hashlib.sha256(question.encode()).hexdigest()[:16]


class FlakyChatServer:
    """`/v1/chat/completions` on 127.0.0.1 answering `expected_answer(last user message)`, but failing at
    random with a fixed seed: HTTP 5xx, a hang past the client's timeout, or a connection dropped halfway
    through the body. A question fails on at most `max_faults` attempts, so a client with more retries
    than that always gets through; the draw depends on (seed, question, attempt) only, not on the order
    in which concurrent requests arrive."""

    def __init__(
        self,
        seed: int = 0,
        *,
        p_5xx: float = 0.2,
        p_hang: float = 0.15,
        p_drop: float = 0.1,
        hang_s: float = 2.0,
        max_faults: int = 2,
    ) -> None:
        self.seed, self.hang_s, self.max_faults = seed, hang_s, max_faults
        self.p = (p_5xx, p_hang, p_drop)
        self.lock = threading.Lock()
        self.attempts: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()  # fault kind -> count
        self.answered: Counter[str] = Counter()  # question -> complete 200 responses
        self.pending_fault: dict[str, float] = {}  # question -> when its last fault began
        self.detect_s: list[float] = []
        self.server = ChatServer(self._respond, keep_alive=True)
        self.url = self.server.url

    def _respond(self, request: Request) -> Reply:
        question = request.question
        fault = self._draw(question)
        if fault == "hang":
            return Reply(hang=True, wait_s=self.hang_s)
        if fault == "5xx":
            return Reply(503, {"error": "overloaded"})
        body = completion(expected_answer(question))
        if fault == "drop":
            return Reply(200, body, cut=True)
        return Reply(200, body, sent=lambda: self._answered(question))

    def _answered(self, question: str) -> None:
        with self.lock:
            self.answered[question] += 1

    def _draw(self, question: str) -> str | None:
        now = time.monotonic()
        with self.lock:
            attempt = self.attempts[question]
            self.attempts[question] += 1
            if question in self.pending_fault:
                self.detect_s.append(now - self.pending_fault.pop(question))
            if attempt >= self.max_faults:
                return None
            key = f"{self.seed}:{attempt}:{question}".encode()
            u = random.Random(hashlib.sha256(key).digest()).random()
            p_5xx, p_hang, p_drop = self.p
            fault = (
                "5xx"
                if u < p_5xx
                else "hang"
                if u < p_5xx + p_hang
                else "drop"
                if u < p_5xx + p_hang + p_drop
                else None
            )
            if fault is not None:
                self.injected[fault] += 1
                self.pending_fault[question] = now
            return fault

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> FlakyChatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def flaky_endpoint(
    workdir: str | Path | None = None,
    *,
    seed: int = 0,
    recipe: Path = TINY,
    timeout_s: float = 0.5,
    hang_s: float = 1.5,
    concurrency: int = 4,
) -> FaultResult:
    """Regenerate the tiny recipe's prompts through a `FlakyChatServer`; count by prompt id what the
    committed shards lost, duplicated or got wrong."""
    from draftsmith.core.config import load_recipe
    from draftsmith.tasks.regenerate import read_conversations, regenerate
    from draftsmith.tasks.select_prompts import read_prompts, select_prompts

    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        c = load_recipe(recipe)
        prompts = select_prompts(c.select, c.target, seed=c.seed, out_uri=str(work / "select_prompts"))
        with FlakyChatServer(seed, hang_s=hang_s) as server:
            endpoint = {
                "base_url": server.url,
                "model": "flaky",
                "concurrency": concurrency,
                "timeout_s": timeout_s,
                "max_retries": server.max_faults + 2,
                "backoff_s": 0.01,
            }
            data = c.regenerate.model_dump() | {
                "engine": "openai",
                "openai": endpoint,
                "chat_template_sha256": "0" * 64,  # a remote template: declared, so no tokenizer is needed
            }
            cfg = type(c.regenerate).model_validate(data)
            manifest = regenerate(cfg, c.target, prompts, seed=seed, out_uri=str(work / "regenerate"))
            rows = read_conversations(manifest)
            injected, detect = sum(server.injected.values()), max(server.detect_s, default=0.0)
            kinds = dict(server.injected)
        ids = [r.id for r in read_prompts(prompts, "train")]
        seen = Counter(row["id"] for row in rows)
        corrupted = sum(1 for row in rows if not _answers_match(row["messages"]))
        return FaultResult(
            fault="flaky OpenAI endpoint",
            units=len(ids),
            lost=sum(1 for i in ids if seen[i] == 0),
            duplicated=sum(n - 1 for n in seen.values() if n > 1) + sum(1 for i in seen if i not in set(ids)),
            corrupted=corrupted,
            injected=injected,
            detected_within_s=detect,
            detail={"faults": kinds, "rows": len(rows)},
        )


def _answers_match(messages: list[dict]) -> bool:
    """Every assistant turn is the fault-free answer to the user turn before it."""
    last_user = None
    for m in messages:
        if m["role"] == "user":
            last_user = m["content"]
        elif m["role"] == "assistant" and (last_user is None or m["content"] != expected_answer(last_user)):
            return False
    return any(m["role"] == "assistant" for m in messages)


class _Touch:
    """Unpickling it creates `marker`: a harmless stand-in for `os.system`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def checkpoint_pickle(workdir: str | Path | None = None) -> FaultResult:
    """A DCP checkpoint whose `.metadata` is replaced by a code-running pickle: resume must refuse it before
    the code runs. `corrupted` counts payloads that ran; `lost` counts a genuine checkpoint that failed."""
    import torch
    import torch.distributed.checkpoint as dcp

    from draftsmith.drafters.training.checkpoint import UnsafeCheckpointError, load_dcp

    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        folder, marker = work / "ckpt", work / "payload-ran"
        dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(str(folder)))
        state = {"w": torch.zeros(4)}
        load_dcp(state, str(folder))
        lost = int(not torch.equal(state["w"], torch.arange(4.0)))
        (folder / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
        start = time.monotonic()
        refused = False
        try:
            load_dcp({"w": torch.zeros(4)}, str(folder))
        except UnsafeCheckpointError:
            refused = True
        took = time.monotonic() - start
        return FaultResult(
            fault="pickle in DCP .metadata",
            units=1,
            lost=lost,
            corrupted=int(marker.exists() or not refused),
            injected=1,
            detected_within_s=took,
        )


SCENARIOS = {
    "flaky-endpoint": flaky_endpoint,
    "checkpoint-pickle": checkpoint_pickle,
}
