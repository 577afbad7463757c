"""Prompt sources on `s3://`, read through s3fs from a real S3 API (moto's server on loopback)."""

import json

import pytest

from draftsmith.core.config.select import PromptSource
from draftsmith.core.rejects import Rejects
from draftsmith.tasks.prompt_sources import load_sources, source_fingerprint

pytestmark = pytest.mark.integration


@pytest.fixture
def s3_bucket(monkeypatch):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    # s3fs (via aiobotocore) and fsspec read these, as a real deployment's env or Prefect block would set.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir("prompts")
    yield fs
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def test_jsonl_and_parquet_from_s3_with_rejects(s3_bucket):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "What is 2+2?"}]}),
        '{"id": "broken", ',
        json.dumps({"id": "b", "conversations": [{"from": "human", "value": "Name a prime."}]}),
    ]
    s3_bucket.pipe("prompts/chat.jsonl", ("\n".join(lines) + "\n").encode())
    with s3_bucket.open("prompts/code.parquet", "wb") as fh:
        pq.write_table(pa.Table.from_pylist([{"id": "c", "prompt": "Reverse a list in Python."}]), fh)

    rejects = Rejects("select")
    loaded = load_sources(
        [
            PromptSource(kind="jsonl", path="s3://prompts/chat.jsonl", category="dialogue"),
            PromptSource(kind="parquet", path="s3://prompts/code.parquet", category="coding"),
        ],
        synthetic_rows=0,
        mix=None,
        seed=0,
        rejects=rejects,
    )
    assert [(r.id, r.category, r.turns) for r in loaded.records] == [
        ("a", "dialogue", ["What is 2+2?"]),
        ("b", "dialogue", ["Name a prime."]),
        ("c", "coding", ["Reverse a list in Python."]),
    ]
    assert [(r["source"], r["line"], r["reason"]) for r in rejects.rows] == [
        ("s3://prompts/chat.jsonl", 2, "malformed_json")
    ]
    # The stage key sees remote content: rewriting the object changes its fingerprint.
    src = PromptSource(kind="jsonl", path="s3://prompts/chat.jsonl")
    before = source_fingerprint(src)
    s3_bucket.pipe("prompts/chat.jsonl", (lines[0] + "\n").encode())
    assert source_fingerprint(src) != before
