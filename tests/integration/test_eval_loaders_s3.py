"""Benchmark files on a real S3 server (SeaweedFS `weed mini` on loopback), read through draftsmith.core.storage."""

import json

import pytest

from draftsmith.evals.loaders import BenchFileError, load_bench
from tests.support.s3 import weed_s3

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
BUCKET = "s3://draftsmith/benchmarks"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    import s3fs

    # One server for the module: starting weed costs ~3 s, stopping it ~2 s.
    with weed_s3(tmp_path_factory.mktemp("weed")) as env, pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        yield s3fs.S3FileSystem()
        s3fs.S3FileSystem.clear_instance_cache()


def test_mtbench_jsonl_and_speedbench_parquet_from_s3(s3):
    import pyarrow as pa
    import pyarrow.parquet as pq

    mt = [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]},
        {"question_id": 82, "category": "math", "turns": ["What is 7 * 6?"]},
    ]
    s3.pipe(f"{BUCKET}/mt_bench.jsonl", "".join(json.dumps(r) + "\n" for r in mt).encode())
    speed = [
        {"question_id": "t1k-0", "category": "low_entropy", "sub_category": "", "turns": ["Sort these words."]},
        {"question_id": "t1k-1", "category": "high_entropy", "sub_category": "", "turns": ["Invent a myth."]},
    ]
    with s3.open(f"{BUCKET}/speed/throughput_1k.parquet", "wb") as fh:
        pq.write_table(pa.Table.from_pylist(speed), fh)

    got = load_bench("mt_bench", f"{BUCKET}/mt_bench.jsonl")
    assert [(p.id, p.category, p.turns, p.source) for p in got] == [
        ("81", "writing", ["Write a haiku.", "Now a limerick."], f"{BUCKET}/mt_bench.jsonl"),
        ("82", "math", ["What is 7 * 6?"], f"{BUCKET}/mt_bench.jsonl"),
    ]
    got = load_bench("speed_1k", f"{BUCKET}/speed/throughput_1k.parquet", limit=1)
    assert [(p.id, p.category, p.turns) for p in got] == [("t1k-0", "low_entropy", ["Sort these words."])]


def test_s3_errors_name_the_url_and_line(s3):
    s3.pipe(f"{BUCKET}/gsm8k.jsonl", b'{"question": "Q?", "answer": "1"}\n{"answer": "2"}\n')
    with pytest.raises(BenchFileError, match=r"s3://draftsmith/benchmarks/gsm8k\.jsonl:2: .*missing field 'question'"):
        load_bench("gsm8k", f"{BUCKET}/gsm8k.jsonl")
    with pytest.raises(FileNotFoundError, match=r"s3://draftsmith/benchmarks/absent\.jsonl does not exist"):
        load_bench("absent", f"{BUCKET}/absent.jsonl")
