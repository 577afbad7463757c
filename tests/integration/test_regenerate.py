"""The regeneration stage on the tiny target and on a local OpenAI-compatible server.

Covers turn order and conditioning, HFEngine parity with `chat_generate`, n-sample forks, drop reasons,
provenance, a permanent engine failure, and SIGKILL-then-resume.
"""

import copy
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from draftsmith.core import storage
from draftsmith.core.rejects import RejectedShareError
from draftsmith.core.stage import valid_manifest
from draftsmith.engines import hf
from draftsmith.engines.base import ChatRequest, Completion, SamplingParams, template_hash
from draftsmith.engines.openai_http import EngineRequestError
from draftsmith.tasks.prompt_pool import PromptRecord
from draftsmith.tasks.regenerate import read_conversations, regenerate, regenerate_records
from draftsmith.tasks.select_prompts import read_prompts
from tests.support.openai_server import ChatServer, Reply, Request, completion

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_regenerate_answers_every_turn_in_order(tiny_run, tiny_target):
    m = tiny_run["regenerate"]
    prompts = {r.id: r for r in read_prompts(tiny_run["select_prompts"], "train")}
    rows = read_conversations(m)
    assert len(rows) + m.counts["dropped.empty_answer"] + m.counts["dropped.truncated"] == len(prompts)
    assert len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        turns = prompts[row["id"]].turns
        users = [x["content"] for x in row["messages"] if x["role"] == "user"]
        answers = [x for x in row["messages"] if x["role"] == "assistant"]
        assert users == turns and len(answers) == len(turns) == len(row["finish"])
        roles = [x["role"] for x in row["messages"] if x["role"] != "system"]
        assert roles == ["user", "assistant"] * len(turns)
    _, tok = tiny_target
    assert m.info["chat_template_sha256"] == template_hash(tok.chat_template)
    assert m.info["chat_template_source"] == "engine" and m.info["thinking"] == "off"
    assert m.info["engine"] == "hf" and json.loads(m.info["sampling"])["n"] == 1
    assert json.loads(storage.read_bytes(m.path("provenance.json"))) == m.info


def test_turn_two_is_conditioned_on_turn_one(tiny_cfg, tiny_target):
    model, tok = tiny_target
    engine = hf.HFEngine(tiny_cfg.target)
    rec = PromptRecord(id="x", category="dialogue", turns=["Tell me about owls.", "Shorter please."])
    [fork] = regenerate_records(engine, tiny_cfg.regenerate, [rec], seed=0)
    first = fork.messages[1]["content"]
    history = [
        {"role": "user", "content": "Tell me about owls."},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Shorter please."},
    ]
    direct = hf.chat_generate(
        model, tok, [history], max_new_tokens=tiny_cfg.regenerate.max_new_tokens, temperature=0.0, top_p=1.0
    )
    assert fork.messages[3]["content"] == direct[0].text
    assert len(fork.finish) == 2 and fork.id == "x"


def test_hf_engine_greedy_equals_chat_generate(tiny_cfg, tiny_target):
    model, tok = tiny_target
    convs = [[{"role": "user", "content": q}] for q in ["What is 2+2?", "Name a bird.", "Write a haiku about rain."]]
    direct = hf.chat_generate(model, tok, convs, max_new_tokens=12, temperature=0.0, top_p=1.0)
    engine = hf.HFEngine(tiny_cfg.target, batch_size=3)
    outs = engine.chat([ChatRequest(messages=c) for c in convs], SamplingParams(max_tokens=12, n=2))
    assert [[c.text for c in o] for o in outs] == [[d.text, d.text] for d in direct]
    assert [o[0].finish_reason for o in outs] == [d.finish_reason for d in direct]
    assert engine.describe()["chat_template_sha256"] == template_hash(tok.chat_template)


def test_hf_engine_passes_only_template_kwargs_the_template_reads(tiny_cfg):
    engine = hf.HFEngine(tiny_cfg.target)
    assert engine.template_kwargs({"enable_thinking": False}) == {}  # switching off what is absent is fine
    with pytest.raises(ValueError, match=r"regenerate.extra_body: .* never reads \['enable_thinking'\]"):
        engine.template_kwargs({"enable_thinking": True})
    engine.tok = copy.deepcopy(engine.tok)
    engine.tok.chat_template = "{% if enable_thinking %}<think>{% endif %}" + engine.tok.chat_template
    assert engine.template_kwargs({"enable_thinking": True}) == {"enable_thinking": True}
    split = hf.split_reasoning(Completion(text="<think>step 1</think>\n42", num_tokens=5, finish_reason="stop"))
    assert (split.reasoning, split.text) == ("step 1", "42")


def test_n_samples_fork_each_prompt_and_continue_every_turn(tiny_cfg, tiny_run, tmp_path):
    cfg = tiny_cfg.regenerate.model_copy(update={"n": 2, "temperature": 1.0, "max_new_tokens": 6})
    m = regenerate(cfg, tiny_cfg.target, tiny_run["select_prompts"], seed=1, out_uri=str(tmp_path / "rg"))
    prompts = read_prompts(tiny_run["select_prompts"], "train")
    rows = {r["id"]: r for r in read_conversations(m)}
    assert set(rows) == {f"{p.id}#{s}" for p in prompts for s in range(2)}
    for p in prompts:
        forks = [rows[f"{p.id}#{s}"] for s in range(2)]
        for row in forks:
            assert [x["content"] for x in row["messages"] if x["role"] == "user"] == p.turns
            assert len(row["finish"]) == len(p.turns)
    firsts = [tuple(rows[f"{p.id}#{s}"]["messages"][-1]["content"] for s in range(2)) for p in prompts]
    assert sum(len(set(f)) > 1 for f in firsts) >= len(prompts) // 2  # samples, not copies
    assert m.counts["conversations"] == 2 * len(prompts) and json.loads(m.info["sampling"])["n"] == 2


def _verdict(question: str) -> str:
    """What the scripted server does with a question: answer it, answer it truncated, or say nothing."""
    return ["empty", "length", "ok", "ok", "ok"][int(hashlib.sha256(question.encode()).hexdigest(), 16) % 5]


def _scripted(fail_on: str | None) -> Callable[[Request], Reply]:
    """Deterministic answers that depend only on the last user message; `fail_on` gets a 400."""

    def respond(request: Request) -> Reply:
        question = request.question
        if question == fail_on:
            return Reply(400, {"error": "prompt rejected by policy"})
        verdict = _verdict(question)
        content = "" if verdict == "empty" else f"answer to {question}"
        finish = "length" if verdict == "length" else "stop"
        return Reply(200, completion(content, finish_reason=finish, completion_tokens=4))

    return respond


@pytest.fixture
def chat_server():
    servers: list[ChatServer] = []

    def start(fail_on: str | None = None) -> ChatServer:
        servers.append(ChatServer(_scripted(fail_on)))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _openai_cfg(tiny_cfg, url: str, **update):
    data = tiny_cfg.regenerate.model_dump() | {"engine": "openai", "openai": {"base_url": url, "model": "tiny"}}
    return type(tiny_cfg.regenerate).model_validate(data | update)


def test_drops_are_counted_rejected_and_not_continued(tiny_cfg, tiny_run, tiny_target, chat_server, tmp_path):
    server = chat_server()
    # Two turns in five fail, so a multi-turn pool drops most conversations: the share threshold (tested below)
    # is lifted here, since this test counts the drops whatever their share.
    cfg = _openai_cfg(tiny_cfg, server.url, drop_truncated=True, max_rejected_share=1.0, extra_body={"thinking": False})
    prompts = read_prompts(tiny_run["select_prompts"], "train")
    m = regenerate(cfg, tiny_cfg.target, tiny_run["select_prompts"], seed=0, out_uri=str(tmp_path / "rg"))
    expected: dict[str, str] = {}
    asked = 0
    for p in prompts:
        verdicts = [_verdict(t) for t in p.turns]
        bad = next((v for v in verdicts if v != "ok"), None)
        asked += len(verdicts) if bad is None else verdicts.index(bad) + 1
        if bad:
            expected[p.id] = "empty_answer" if bad == "empty" else "truncated"
    assert len(server.requests) == asked  # a dropped conversation is not continued past its failed turn
    rejected = storage.read_jsonl(m.path("rejected.jsonl"))
    assert {r["id"]: r["reason"] for r in rejected} == expected and expected
    assert m.counts["dropped.empty_answer"] == sum(v == "empty_answer" for v in expected.values())
    assert m.counts["dropped.truncated"] == sum(v == "truncated" for v in expected.values())
    assert {r["id"] for r in read_conversations(m)} == {p.id for p in prompts} - set(expected)
    _, tok = tiny_target
    assert m.info["engine"] == "openai" and m.info["base_url"] == server.url and m.info["model"] == "tiny"
    assert m.info["chat_template_sha256"] == template_hash(tok.chat_template)
    assert m.info["chat_template_source"] == "target_tokenizer" and m.info["extra_body"] == "thinking"


def test_declared_template_hash_and_rejected_share_threshold(tiny_cfg, tiny_run, chat_server, tmp_path):
    server = chat_server()
    declared = "ab" * 32
    cfg = _openai_cfg(tiny_cfg, server.url, chat_template_sha256=declared, thinking=True)
    m = regenerate(cfg, tiny_cfg.target, tiny_run["select_prompts"], seed=0, out_uri=str(tmp_path / "a"))
    assert (m.info["chat_template_sha256"], m.info["chat_template_source"], m.info["thinking"]) == (
        declared,
        "recipe",
        "on",
    )
    strict = _openai_cfg(tiny_cfg, server.url, drop_truncated=True, max_rejected_share=0.0)
    with pytest.raises(RejectedShareError, match=r"regenerate: \d+ of 18 rows rejected"):
        regenerate(strict, tiny_cfg.target, tiny_run["select_prompts"], seed=0, out_uri=str(tmp_path / "b"))


def test_permanent_failure_fails_the_stage_and_keeps_committed_chunks(tiny_cfg, tiny_run, chat_server, tmp_path):
    prompts = read_prompts(tiny_run["select_prompts"], "train")
    poison = prompts[10].turns[0]  # in the second chunk of 8
    bad = chat_server(fail_on=poison)
    out = str(tmp_path / "rg")
    with pytest.raises(EngineRequestError, match="HTTP 400.*prompt rejected by policy"):
        regenerate(_openai_cfg(tiny_cfg, bad.url), tiny_cfg.target, tiny_run["select_prompts"], seed=0, out_uri=out)
    assert sorted(os.listdir(f"{out}/chunks")) == ["00000.json"]
    # Another server for the same model: the endpoint is not part of the stage key, so the work resumes.
    good = chat_server()
    cfg = _openai_cfg(tiny_cfg, good.url, openai={"base_url": good.url, "model": "tiny", "concurrency": 2})
    m = regenerate(cfg, tiny_cfg.target, tiny_run["select_prompts"], seed=0, out_uri=out)
    done_first = {p.turns[0] for p in prompts[:8]}
    assert not done_first & {r.question for r in good.requests}  # committed prompts were not asked again
    ids = [r["id"] for r in read_conversations(m)] + [r["id"] for r in storage.read_jsonl(m.path("rejected.jsonl"))]
    assert sorted(ids) == sorted(p.id for p in prompts)


KILL_SCRIPT = """
import sys
from draftsmith.core.config import load_recipe
from draftsmith.tasks.select_prompts import select_prompts
from draftsmith.tasks.regenerate import regenerate
c = load_recipe(sys.argv[1], {"regenerate.shard_size": 1, "regenerate.batch_size": 1, "regenerate.max_new_tokens": 4})
p = select_prompts(c.select, c.target, seed=c.seed, out_uri=sys.argv[2] + "/select")
regenerate(c.regenerate, c.target, p, seed=c.seed, out_uri=sys.argv[2] + "/regenerate")
"""


def test_sigkill_mid_run_then_resume_answers_every_prompt_once(tmp_path):
    from draftsmith.core.config import load_recipe
    from draftsmith.tasks.select_prompts import select_prompts

    recipe = str(ROOT / "deployments/recipes/tiny-cpu.yaml")
    killed, clean = str(tmp_path / "killed"), str(tmp_path / "clean")
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, recipe, killed], cwd=ROOT)
    chunks = Path(killed) / "regenerate" / "chunks"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and len(list(chunks.glob("*.json"))) < 2:
        time.sleep(0.01)
    assert proc.poll() is None, "the regeneration process ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = len(list(chunks.glob("*.json")))
    assert 2 <= committed < 18 and not (Path(killed) / "regenerate" / "manifest.json").exists()

    c = load_recipe(recipe, {"regenerate.shard_size": 1, "regenerate.batch_size": 1, "regenerate.max_new_tokens": 4})
    prompts = select_prompts(c.select, c.target, seed=c.seed, out_uri=f"{killed}/select")
    resumed = regenerate(c.regenerate, c.target, prompts, seed=c.seed, out_uri=f"{killed}/regenerate")
    reference = regenerate(c.regenerate, c.target, prompts, seed=c.seed, out_uri=f"{clean}/regenerate")
    rows = read_conversations(resumed)
    ids = [r["id"] for r in rows] + [r["id"] for r in storage.read_jsonl(resumed.path("rejected.jsonl"))]
    assert sorted(ids) == sorted(p.id for p in read_prompts(prompts, "train"))  # none lost, none twice
    assert rows == read_conversations(reference)  # same rows, same order as an uninterrupted run
    assert valid_manifest(f"{killed}/regenerate", resumed.key) is not None
