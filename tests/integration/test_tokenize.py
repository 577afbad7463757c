"""The tokenize stage on real files: rejects, provenance, the per-shard cache, extra and pretokenized sources."""

import json

import pytest
from transformers import AutoTokenizer

from draftsmith.core import storage
from draftsmith.core.manifest import FileEntry, StageManifest
from draftsmith.core.rejects import RejectedShareError
from draftsmith.core.target_setup import resolve_target
from draftsmith.engines.base import template_hash
from draftsmith.tasks import token_encode
from draftsmith.tasks.tokenization import read_token_shard, tokenize

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tok(tiny_cfg):
    return AutoTokenizer.from_pretrained(resolve_target(tiny_cfg.target.source))


def _conv(i: int, turns: int = 1) -> dict:
    messages = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"Question {i}.{t}: what is {i} + {t}?"},
            {"role": "assistant", "content": f"It is {i + t}, answer {i}.{t}."},
        ]
    return {"id": f"c{i}", "category": "math", "messages": messages, "finish": ["stop"] * turns}


def _corpus(tmp_path, shards: list[list], info: dict | None = None, name: str = "regenerate") -> StageManifest:
    """A regenerate-like manifest over JSONL shards; rows are dicts or raw bytes lines."""
    uri = str(tmp_path / name)
    files = []
    for k, rows in enumerate(shards):
        data = b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)
        fname = f"conversations-{k:05d}.jsonl"
        storage.write_bytes(f"{uri}/{fname}", data)
        files.append(FileEntry(name=fname, bytes=len(data), digest=storage.sha256(data), algo="sha256"))
    return StageManifest(stage="regenerate", key=f"k-{name}", uri=uri, files=files, info=info or {})


def _samples(m: StageManifest) -> list[dict]:
    return [s for n in m.names("tokens-") for s in read_token_shard(storage.read_bytes(m.path(n)))]


def _cfg(tiny_cfg, tmp_path, **update):
    base = {"num_workers": 0, "max_length": 256, "cache_uri": str(tmp_path / "cache")}
    return tiny_cfg.tokenize.model_copy(update=base | update)


def test_bad_rows_go_to_rejected_jsonl_and_fail_only_past_the_threshold(tiny_cfg, tok, tmp_path):
    bad = [
        b'{"id": "broken", "messages": [',
        b"\xff\xfe not utf-8",
        {"id": "norole", "messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]},
        {"id": "userlast", "messages": [{"role": "user", "content": "x"}]},
    ]
    corpus = _corpus(tmp_path, [[_conv(i) for i in range(6)] + bad])
    m = tokenize(_cfg(tiny_cfg, tmp_path, max_rejected_share=0.5), tiny_cfg.target, corpus, out_uri=str(tmp_path / "t"))
    assert m.counts["rows"] == 10 and m.counts["samples"] == 6
    assert {k: v for k, v in m.counts.items() if k.startswith("rejected.")} == {
        "rejected.invalid_utf8": 1,
        "rejected.malformed_json": 1,
        "rejected.missing_role": 1,
        "rejected.no_final_assistant_turn": 1,
    }
    rejected = storage.read_jsonl(m.path("rejected.jsonl"))
    assert [(r["line"], r["reason"]) for r in rejected][:2] == [(7, "malformed_json"), (8, "invalid_utf8")]
    assert rejected[2]["id"] == "norole" and rejected[2]["source"] == "conversations-00000.jsonl"
    with pytest.raises(RejectedShareError, match=r"4 of 10 rows rejected \(40\.0%\), above the threshold 10\.0%"):
        tokenize(_cfg(tiny_cfg, tmp_path, max_rejected_share=0.1), tiny_cfg.target, corpus, out_uri=str(tmp_path / "u"))
    assert storage.exists(str(tmp_path / "u" / "rejected.jsonl"))  # written before failing, for inspection


def test_provenance_mismatch_is_refused_unless_allowed(tiny_cfg, tok, tmp_path):
    ours = template_hash(tok.chat_template)
    good = _corpus(tmp_path, [[_conv(0)]], {"chat_template_sha256": ours, "thinking": "off"}, "good")
    m = tokenize(_cfg(tiny_cfg, tmp_path), tiny_cfg.target, good, out_uri=str(tmp_path / "t0"))
    assert m.info["provenance"] == "checked" and m.info["chat_template_sha256"] == ours
    other = _corpus(tmp_path, [[_conv(0)]], {"chat_template_sha256": "ab" * 32, "thinking": "on"}, "other")
    with pytest.raises(ValueError) as err:
        tokenize(_cfg(tiny_cfg, tmp_path), tiny_cfg.target, other, out_uri=str(tmp_path / "t1"))
    message = str(err.value)
    assert "ab" * 32 in message and ours in message and "tokenize.allow_provenance_mismatch" in message
    assert "'on' (corpus) != 'off' (tokenize.thinking)" in message
    cfg = _cfg(tiny_cfg, tmp_path, allow_provenance_mismatch=True)
    assert tokenize(cfg, tiny_cfg.target, other, out_uri=str(tmp_path / "t2")).info["provenance"] == "mismatch_allowed"
    legacy = _corpus(tmp_path, [[_conv(0)]], {"chat_template_sha256": ours[:16]}, "legacy")  # old 16-hex prefix
    assert tokenize(_cfg(tiny_cfg, tmp_path), tiny_cfg.target, legacy, out_uri=str(tmp_path / "t3")).counts["samples"]


def test_changing_one_shard_retokenizes_only_that_shard(tiny_cfg, tmp_path, monkeypatch):
    seen: list[str] = []
    real = token_encode._process_lines

    def counting(label, lines):
        seen.append(label)
        return real(label, lines)

    monkeypatch.setattr(token_encode, "_process_lines", counting)
    shards = [[_conv(i) for i in range(k * 4, k * 4 + 4)] for k in range(3)]
    cfg = _cfg(tiny_cfg, tmp_path)
    first = tokenize(cfg, tiny_cfg.target, _corpus(tmp_path, shards, name="r1"), out_uri=str(tmp_path / "a"))
    assert sorted(set(seen)) == [f"conversations-{k:05d}.jsonl" for k in range(3)]
    seen.clear()
    shards[1][0] = _conv(99, turns=2)
    second = tokenize(cfg, tiny_cfg.target, _corpus(tmp_path, shards, name="r2"), out_uri=str(tmp_path / "b"))
    assert seen == ["conversations-00001.jsonl"]
    assert [f.digest for f in second.files if f.name != "tokens-00001.safetensors"] == [
        f.digest for f in first.files if f.name != "tokens-00001.safetensors"
    ]
    assert "c99" in {s["id"] for s in _samples(second)} and second.counts["samples"] == first.counts["samples"]


def test_extra_sources_and_pretokenized_rows_in_a_worker_pool(tiny_cfg, tok, tmp_path):
    extra = tmp_path / "extra.jsonl"
    rows = [
        {"id": "pre", "category": "external", "input_ids": [10, 11, 12, 13], "loss_mask": [0, 0, 1, 1]},
        {"id": "conv", "category": "external", "messages": _conv(7, turns=2)["messages"]},
    ]
    extra.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = _corpus(tmp_path, [[_conv(i) for i in range(5)]])
    cfg = _cfg(tiny_cfg, tmp_path, extra_sources=[str(extra)], num_workers=2, chunk_size=2)
    m = tokenize(cfg, tiny_cfg.target, corpus, out_uri=str(tmp_path / "t"))
    assert m.names("tokens-") == ["tokens-00000.safetensors", "tokens-00001.safetensors"]
    samples = {s["id"]: s for s in _samples(m)}
    assert samples["pre"]["input_ids"].tolist() == [10, 11, 12, 13]
    assert samples["pre"]["loss_mask"].tolist() == [False, False, True, True]
    conv = samples["conv"]
    assert (
        tok.decode(conv["input_ids"][conv["loss_mask"]])
        == "It is 7, answer 7.0.<|im_end|>\nIt is 8, answer 7.1.<|im_end|>\n"
    )
    # In-process tokenization gives the same samples as the pool (bytes differ only in safetensors header order).
    solo_cfg = cfg.model_copy(update={"num_workers": 0, "cache_uri": ""})
    solo = tokenize(solo_cfg, tiny_cfg.target, corpus, out_uri=str(tmp_path / "s"))
    assert [(s["id"], s["input_ids"].tolist(), s["loss_mask"].tolist()) for s in _samples(solo)] == [
        (s["id"], s["input_ids"].tolist(), s["loss_mask"].tolist()) for s in _samples(m)
    ]
    assert solo.counts == m.counts and not storage.exists(str(tmp_path / ".cache"))
    with pytest.raises(ValueError, match=r"tokenize\.extra_sources\[0\]: .*missing\.jsonl: file not found"):
        bad = cfg.model_copy(update={"extra_sources": [str(tmp_path / "missing.jsonl")]})
        tokenize(bad, tiny_cfg.target, corpus, out_uri=str(tmp_path / "x"))


def test_worker_tokenizer_equals_autotokenizer_and_init_errors_surface(tiny_cfg, tok, tmp_path):
    """Workers skip `AutoTokenizer` (and its torch import) only where it would build the same tokenizer."""
    path = str(resolve_target(tiny_cfg.target.source))
    fast = token_encode.load_tokenizer(path)
    assert type(fast) is type(tok) and fast.chat_template == tok.chat_template
    assert fast.special_tokens_map == tok.special_tokens_map
    rendered = tok.apply_chat_template(_conv(3, turns=2)["messages"], tokenize=False)
    assert isinstance(rendered, str)
    text = rendered + " naïve <b>x</b>"
    assert fast(text, return_offsets_mapping=True) == tok(text, return_offsets_mapping=True)
    # A worker that cannot start reports the error instead of being respawned forever.
    cfg = _cfg(tiny_cfg, tmp_path, num_workers=1, renderer="nope")
    corpus = _corpus(tmp_path, [[_conv(0)]])
    with pytest.raises(ValueError, match=r"tokenize\.renderer: unknown renderer 'nope'"):
        tokenize(cfg, tiny_cfg.target, corpus, out_uri=str(tmp_path / "t"))
