"""The hidden-state store on a real S3 server (SeaweedFS `weed mini` on loopback), through s3fs.

Write, read (ranged), resume, and a writer SIGKILLed in the middle of a multipart shard upload: the torn
shard never becomes visible and the next run resumes after the last committed shard.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from draftsmith.core import storage
from draftsmith.transport.offline_reader import OfflineDataset
from draftsmith.transport.offline_store import COMMITS, ShardWriter, shard_name, write_store
from draftsmith.transport.sample import StoreCodec, decode, encode
from tests.support.runs import assert_same_sample, store_info, store_samples
from tests.support.s3 import weed_s3

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
CODEC = StoreCodec("bfloat16", "all", 3)


@pytest.fixture
def s3(tmp_path, monkeypatch):
    import s3fs

    with weed_s3(tmp_path) as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        yield env
        s3fs.S3FileSystem.clear_instance_cache()


def test_write_read_and_resume_shards_on_s3(s3, tmp_path):
    uri = "s3://draftsmith/runs/unit/hidden_states"
    data = store_samples(10, seed=4)
    reference = write_store(str(tmp_path / "local"), store_info(CODEC), data, shard_samples=3)
    writer = ShardWriter(uri, store_info(CODEC), 3)
    for s in data[:8]:
        writer.add(s)
    assert storage.list_names(storage.join(uri, COMMITS)) == ["00000.json", "00001.json"]
    resumed = ShardWriter(uri, store_info(CODEC), 3)  # a new process would see the same
    assert resumed.committed_samples == 6
    for s in data[6:]:
        resumed.add(s)
    dataset = resumed.finish()
    assert [s["sha256"] for s in dataset["shards"]] == [s["sha256"] for s in reference["shards"]]
    ds = OfflineDataset(uri)
    ds.verify()
    for i in (9, 0, 4):
        assert_same_sample(ds[i], decode(data[i].id, encode(data[i], CODEC), CODEC))


# Runs in a child process: shard 0 is small (one PUT, committed); shard 1 is ~12 MiB and goes up as a
# multipart upload in 5 MiB parts. The child announces when its parts are uploaded and then waits before
# CompleteMultipartUpload, so the parent can kill it exactly mid-write.
CHILD = textwrap.dedent(
    """
    import functools, sys, time
    import s3fs.core
    from draftsmith.transport.offline_store import ShardWriter
    from draftsmith.transport.sample import StoreCodec
    from tests.support.runs import store_info, store_samples
    import torch

    fs_cls = s3fs.core.S3FileSystem
    fs_cls._pipe_file = functools.partialmethod(fs_cls._pipe_file, chunksize=5 * 2**20)
    real_call = fs_cls._call_s3

    async def call(self, method, *args, **kwargs):
        if method == "complete_multipart_upload":
            print("PARTS-UPLOADED", flush=True)
            time.sleep(600)
        return await real_call(self, method, *args, **kwargs)

    fs_cls._call_s3 = call
    data = store_samples(4, seed=5)
    for s in data[2:]:  # shard 1 big enough for a multipart upload
        s.hidden_states = torch.randn(1024, 3 * 1024)
        s.last_hidden = torch.randn(1024, 1024)
        s.input_ids = torch.arange(1024)
        s.loss_mask = torch.ones(1024, dtype=torch.bool)
    writer = ShardWriter(sys.argv[1], store_info(StoreCodec("bfloat16", "all", 3)), 2)
    for s in data:
        writer.add(s)
    print("FINISHED", flush=True)
    """
)


def test_a_writer_killed_mid_upload_leaves_no_partial_shard(s3):
    uri = "s3://draftsmith/runs/killed/hidden_states"
    env = os.environ | {"PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", CHILD, uri], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        assert line == "PARTS-UPLOADED", f"child said {line!r} (exit {child.poll()})"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    names = storage.list_names(uri)
    assert shard_name(0) in names and shard_name(1) not in names, names
    assert storage.list_names(storage.join(uri, COMMITS)) == ["00000.json"]
    resumed = ShardWriter(uri, store_info(CODEC), 2)
    assert resumed.committed_samples == 2


def test_the_stage_writes_the_same_store_to_s3_as_to_disk(s3, tiny_cfg, tiny_run):
    from draftsmith.tasks.hidden_states import capture_hidden_states

    c = tiny_cfg
    m = capture_hidden_states(c.hidden_states, c.target, tiny_run["tokenize"], out_uri="s3://draftsmith/tiny/hs")
    local = tiny_run["hidden_states"]
    assert m.counts == local.counts
    assert {f.name: f.digest for f in m.files if f.name.startswith("shard-")} == {
        f.name: f.digest for f in local.files if f.name.startswith("shard-")
    }
    OfflineDataset(m.uri).verify()
