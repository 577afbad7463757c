"""The select_prompts stage end to end: file sources, rejects, filters, exact split, report, cache key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.core import storage
from draftsmith.core.config import SelectConfig, load_recipe
from draftsmith.core.rejects import RejectedShareError
from draftsmith.tasks.select_prompts import publish_report, read_prompts, select_prompts

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BENCH_QUESTION = (
    "Natalia sold clips to forty eight of her friends in April and then she sold half as many clips in May "
    "how many clips did Natalia sell altogether in April and May"
)
PARAPHRASE_BASE = (
    "Describe the main differences between the economic systems of ancient Rome and ancient Greece, "
    "focusing on trade, taxation, coinage and the role that slavery played in each of them."
)


def _accounted(counts: dict[str, int]) -> int:
    lost = sum(n for k, n in counts.items() if k.startswith(("dropped.", "rejected.")))
    return counts["train"] + counts["eval"] + lost


def test_select_splits_without_overlap(tiny_cfg, tiny_run):
    m = tiny_run["select_prompts"]
    train, held = read_prompts(m, "train"), read_prompts(m, "eval")
    assert len(train) + len(held) == tiny_cfg.select.num_prompts
    assert len(held) == tiny_cfg.select.num_eval == m.counts["eval"]
    assert not {r.id for r in train} & {r.id for r in held}
    assert sum(v for k, v in m.counts.items() if k.startswith("category.")) == tiny_cfg.select.num_prompts
    assert _accounted(m.counts) == m.counts["read"]
    assert {"train.jsonl", "eval.jsonl", "rejected.jsonl", "report.md"} <= set(m.names())


def test_smollm2_recipe_keeps_its_train_size_and_exact_eval(tmp_path):
    cfg = load_recipe(ROOT / "deployments" / "recipes" / "smollm2-cpu-eagle3.yaml")
    m = select_prompts(cfg.select, cfg.target, seed=cfg.seed, out_uri=str(tmp_path / "s"))
    assert (m.counts["train"], m.counts["eval"]) == (480, 24)
    assert m.counts["category.dialogue"] * 2 == pytest.approx(m.counts["category.math"], abs=2)
    assert _accounted(m.counts) == m.counts["read"]


def _corpus(tmp_path: Path) -> dict[str, str]:
    """A JSONL (ShareGPT, OpenAI, tools, bad rows), a Parquet file, an HF folder and a benchmark file."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [
        json.dumps({"category": "chat", "prompt": f"Tell me fact number {i} about the deep ocean floor."})
        for i in range(30)
    ]
    lines += [
        json.dumps({"category": "chat", "prompt": PARAPHRASE_BASE}),
        json.dumps({"category": "chat", "prompt": PARAPHRASE_BASE.replace("coinage", "currency")}),
        json.dumps({"category": "chat", "prompt": "Tell me fact number 3 about the deep ocean floor."}),
        json.dumps({"category": "math", "prompt": "Quick question: " + BENCH_QUESTION + "?"}),
        json.dumps(
            {
                "category": "tools",
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "conversations": [
                    {"from": "human", "value": "Call f for me please."},
                    {"from": "gpt", "value": "Done."},
                ],
            }
        ),
        '{"prompt": "broken json"',
        json.dumps({"messages": [{"role": "user", "content": 5}]}),
    ]
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_bytes(("\n".join(lines) + "\n").encode() + b'{"prompt": "bad \xff byte"}\n')
    rows = [
        {"category": "math", "messages": [{"role": "user", "content": f"Compute {i} times {i + 3} and explain."}]}
        for i in range(30)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "math.parquet")
    datasets.Dataset.from_list(
        [
            {"category": "code", "prompt": f"Write a function named task_{i} that reverses list number {i}."}
            for i in range(30)
        ]
    ).save_to_disk(str(tmp_path / "code_ds"))
    (tmp_path / "bench.jsonl").write_text(json.dumps({"question": BENCH_QUESTION, "answer": "72"}) + "\n")
    return {
        k: str(tmp_path / v)
        for k, v in {"jsonl": "chat.jsonl", "parquet": "math.parquet", "hf": "code_ds", "bench": "bench.jsonl"}.items()
    }


def _file_cfg(paths: dict[str, str], **overrides) -> SelectConfig:
    fields = {
        "sources": [
            {"kind": "jsonl", "path": paths["jsonl"]},
            {"kind": "parquet", "path": paths["parquet"]},
            {"kind": "hf_disk", "path": paths["hf"]},
        ],
        "benchmark_files": [paths["bench"]],
        "num_prompts": 60,
        "num_eval": 9,
        "mix": {"chat": 1.0, "math": 1.0, "code": 1.0},
        "max_rejected_share": 0.05,
    } | overrides
    return SelectConfig.model_validate(fields)


def test_file_sources_end_to_end(tiny_cfg, tmp_path):
    paths = _corpus(tmp_path)
    m = select_prompts(_file_cfg(paths), tiny_cfg.target, seed=0, out_uri=str(tmp_path / "s"))
    c = m.counts
    assert c["read"] == 38 + 30 + 30
    assert (c["train"], c["eval"]) == (51, 9)
    assert (c["category.chat"], c["category.math"], c["category.code"]) == (20, 20, 20)
    assert c["dropped.duplicate_exact"] == 1 and c["dropped.duplicate_near"] == 1
    assert c["dropped.contaminated"] >= 1 and c["dropped.over_mix_quota"] >= 1
    assert {k: v for k, v in c.items() if k.startswith("rejected.")} == {
        "rejected.malformed_json": 1,
        "rejected.non_string_content": 1,
        "rejected.invalid_utf8": 1,
    }
    assert _accounted(c) == c["read"]
    kept = read_prompts(m, "train") + read_prompts(m, "eval")
    texts = [r.turns[0] for r in kept]
    assert not any("Natalia" in t for t in texts)
    assert sum(PARAPHRASE_BASE[:40] in t for t in texts) <= 1
    rejected = storage.read_jsonl(m.path("rejected.jsonl"))
    assert [(r["source"], r["line"], r["reason"]) for r in rejected] == [
        (paths["jsonl"], 36, "malformed_json"),
        (paths["jsonl"], 37, "non_string_content"),
        (paths["jsonl"], 38, "invalid_utf8"),
    ]
    report = storage.read_bytes(m.path("report.md")).decode()
    assert (
        f"**{c['read']} rows read = 60 kept (51 train, 9 eval)" in report and "| rejected.invalid_utf8 | 1 |" in report
    )


def test_tools_rows_survive_and_length_filter_uses_the_tokenizer(tiny_cfg, tmp_path):
    paths = _corpus(tmp_path)
    cfg = _file_cfg(paths, mix=None, num_prompts=200, max_prompt_tokens=30)
    m = select_prompts(cfg, tiny_cfg.target, seed=0, out_uri=str(tmp_path / "s"))
    assert m.counts["dropped.too_long"] > 0 and m.counts["dropped.too_short"] == 0
    kept = read_prompts(m, "train") + read_prompts(m, "eval")
    assert any(r.tools == [{"type": "function", "function": {"name": "f"}}] for r in kept)
    assert not any("Rome" in r.turns[0] for r in kept)  # ~35 tokens: over the limit
    assert _accounted(m.counts) == m.counts["read"]


def test_rejected_share_over_threshold_fails_with_a_clear_message(tiny_cfg, tmp_path):
    paths = _corpus(tmp_path)
    with pytest.raises(RejectedShareError) as excinfo:
        select_prompts(_file_cfg(paths, max_rejected_share=0.01), tiny_cfg.target, seed=0, out_uri=str(tmp_path / "s"))
    message = str(excinfo.value)
    assert "select_prompts: 3 of 98 rows rejected (3.1%), above the threshold 1.0%" in message
    assert f"first: {paths['jsonl']}:36: invalid JSON" in message
    assert (tmp_path / "s" / "rejected.jsonl").is_file() and not (tmp_path / "s" / "manifest.json").exists()


def test_deterministic_by_seed_and_keyed_on_file_content(tiny_cfg, tmp_path):
    paths = _corpus(tmp_path)
    cfg = _file_cfg(paths)
    a = select_prompts(cfg, tiny_cfg.target, seed=3, out_uri=str(tmp_path / "a"))
    b = select_prompts(cfg, tiny_cfg.target, seed=3, out_uri=str(tmp_path / "b"))
    c = select_prompts(cfg, tiny_cfg.target, seed=4, out_uri=str(tmp_path / "c"))
    assert a.key == b.key and [f.digest for f in a.files] == [f.digest for f in b.files]
    assert read_prompts(a, "eval") != read_prompts(c, "eval")
    with open(paths["jsonl"], "ab") as fh:
        fh.write(json.dumps({"category": "chat", "prompt": "A brand new question about volcanoes."}).encode() + b"\n")
    d = select_prompts(cfg, tiny_cfg.target, seed=3, out_uri=str(tmp_path / "a"))
    assert d.key != a.key and d.counts["read"] == a.counts["read"] + 1


def test_missing_input_file_names_the_field(tiny_cfg, tmp_path):
    paths = _corpus(tmp_path)
    cfg = _file_cfg(paths, benchmark_files=[paths["bench"], str(tmp_path / "gone.jsonl")])
    with pytest.raises(
        FileNotFoundError, match=r"select\.benchmark_files\[1\]: .*gone\.jsonl: file or folder does not"
    ):
        select_prompts(cfg, tiny_cfg.target, seed=0, out_uri=str(tmp_path / "s"))


def test_report_artifact_is_a_no_op_outside_prefect(tiny_run):
    publish_report(tiny_run["select_prompts"])  # no flow or task run: nothing to attach to, and no error
