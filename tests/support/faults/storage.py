"""Storage fault scenarios shared by `benchmarks/faults.py` and `tests/faults`: the S3 server killed while a
stage writes and started again, a bucket whose credentials may only read, a local disk that fills up.

The stage is the hidden-state store's writer (`draftsmith.transport.offline_store.ShardWriter`: shards, then their
commit records, then `index.jsonl` and `dataset.json`) inside the stage bookkeeping (`run_stage`: stage key,
manifest written last), fed deterministic samples instead of the target's forward, so a scenario takes
seconds and needs no model. Every item is counted by sample id against what a fault-free run stores.
`SCENARIOS` lists these functions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.faults.result import FaultResult
from tests.support.paths import ROOT

STAGE = "hidden_states"
SAMPLES, SHARD_SAMPLES, TAPS, HIDDEN = 32, 8, 3, 256
# An S3 identity (weed's `-s3.config` syntax) that may read and list the bucket, nothing else.
READ_ONLY: dict[str, Any] = {
    "name": "reader",
    "key": "draftsmith-reader",
    "secret": "reader-secret-7f3a9c2e41",
    "actions": ["Read:draftsmith", "List:draftsmith"],
}
# After the last sample's encoding and the shard's packing, so the kill usually lands while the shard's PUT
# is in flight; on a faster or busier machine it may hit the commit record or the next shard (the error
# names the object).
KILL_DELAY_S = 0.05
DISK_BYTES = 32 << 20

if TYPE_CHECKING:
    from draftsmith.core.manifest import StageManifest
    from draftsmith.transport.sample import HiddenSample, StoreCodec


class MountUnavailable(RuntimeError):
    """No small filesystem can be mounted here (neither `unshare -rm` nor `unshare -m` may mount a tmpfs)."""


def _result(**fields: Any) -> FaultResult:
    return FaultResult(**fields)


def _codec() -> StoreCodec:
    from draftsmith.transport.sample import StoreCodec

    return StoreCodec("bfloat16", "all", TAPS)


def samples(n: int = SAMPLES, seed: int = 0) -> list[HiddenSample]:
    """Deterministic samples of about 270 KB each in the store, so a shard is about 2 MB."""
    import torch

    from draftsmith.transport.sample import HiddenSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        seq = int(torch.randint(96, 160, (1,), generator=g))
        out.append(
            HiddenSample(
                id=f"row-{i:03d}",
                input_ids=torch.randint(0, 50_000, (seq,), generator=g),
                loss_mask=torch.rand(seq, generator=g) > 0.3,
                hidden_states=torch.randn(seq, TAPS * HIDDEN, generator=g),
                last_hidden=torch.randn(seq, HIDDEN, generator=g),
            )
        )
    return out


def store_stage(uri: str, data: Iterable[HiddenSample]) -> StageManifest:
    """Write `data` as a hidden-state store stage at `uri`, resuming after its committed shards."""
    from draftsmith.core.manifest import FileEntry, entry
    from draftsmith.core.stage import StageResult, run_stage, stage_key
    from draftsmith.transport import offline_store
    from draftsmith.transport.offline_store import ShardWriter, StoreInfo, skip

    info = StoreInfo(codec=_codec(), taps=[1, 2, 3], hidden_size=HIDDEN, target="fault-scenario")
    key = stage_key(STAGE, [offline_store], info=repr(info), samples=SAMPLES, shard=SHARD_SAMPLES)

    def compute(stage_uri: str):
        from draftsmith.core import storage

        writer = ShardWriter(stage_uri, info, SHARD_SAMPLES)
        for sample in skip(data, writer.committed_samples):
            writer.add(sample)
        dataset = writer.finish()
        files = [
            FileEntry(name=s["shard"], bytes=s["bytes"], digest=s["digest"], algo=s["algo"]) for s in dataset["shards"]
        ]
        for name in (offline_store.INDEX, offline_store.DATASET):
            files.append(entry(name, storage.read_bytes(storage.join(stage_uri, name))))
        return StageResult(files=files, counts={"samples": dataset["samples"]})

    return run_stage(STAGE, uri, key, compute)


def tally(uri: str, data: list[HiddenSample]) -> tuple[int, int, int]:
    """(lost, duplicated, corrupted) samples of the finished store at `uri`, against the bytes `data`
    encodes to: what a fault-free run stores."""
    import torch

    from draftsmith.transport.offline_reader import OfflineDataset
    from draftsmith.transport.sample import encode

    ds = OfflineDataset(uri)
    want = {s.id: encode(s, _codec()) for s in data}
    seen = Counter(ds.ids)
    corrupted = 0
    for sid, wire in zip(ds.ids, ds.wires(list(range(len(ds)))), strict=True):
        ref = want.get(sid)
        if ref is None or set(ref) != set(wire) or not all(torch.equal(ref[n], wire[n]) for n in ref):
            corrupted += 1
    lost = sum(1 for sid in want if seen[sid] == 0)
    duplicated = sum(n - 1 for n in seen.values()) + sum(1 for sid in seen if sid not in want)
    return lost, duplicated, corrupted


def entries(manifest: StageManifest) -> list[tuple[str, int, str]]:
    return [(f.name, f.bytes, f.digest) for f in manifest.files]


@contextmanager
def s3_env(env: dict[str, str]) -> Iterator[None]:
    """This process's S3 client settings (endpoint, keys) set to `env` for the block; s3fs reads them when
    it makes a filesystem, so its cached instances are dropped on the way in and out."""
    import s3fs

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()


def _firing(data: list[HiddenSample], at: int, event: threading.Event) -> Iterator[HiddenSample]:
    """`data`, setting `event` as sample `at` (the last of a shard) is handed to the writer."""
    for i, sample in enumerate(data):
        if i == at:
            event.set()
        yield sample


def after_crash(uri: str, clean: StageManifest) -> dict[str, int]:
    """What a reader finds in the stage folder after the failed run: a manifest listing a file that is not
    whole, commit records whose shard does not match, shards present with other bytes than the clean run's."""
    from draftsmith.core import storage
    from draftsmith.core.manifest import FileEntry
    from draftsmith.core.stage import load_manifest
    from draftsmith.transport.offline_store import COMMITS

    manifest = load_manifest(uri)
    found = {"manifest": int(manifest is not None), "manifest_problems": 0, "bad_commits": 0, "torn": 0}
    found["manifest_problems"] = int(manifest is not None and manifest.problem() is not None)
    commits = [storage.read_json(storage.join(uri, COMMITS, n)) for n in storage.list_names(storage.join(uri, COMMITS))]
    for c in commits:
        record = FileEntry(name=c["shard"], bytes=c["bytes"], digest=c["digest"], algo=c["algo"])
        found["bad_commits"] += record.problem(storage.join(uri, c["shard"])) is not None
    found["committed"], found["shards"] = len(commits), len(clean.names("shard-"))
    reference = {f.name: f for f in clean.files}
    for name in storage.list_names(uri):
        if name in reference and name.startswith("shard-"):
            found["torn"] += reference[name].problem(storage.join(uri, name)) is not None
    return found


def s3_restart(workdir: str | Path | None = None, *, kill_in_shard: int = 1) -> FaultResult:
    """SIGKILL the S3 server while the stage writes shard `kill_in_shard`, start it again, rerun the stage."""
    from draftsmith.core import retry
    from tests.support.s3 import WeedServer

    data = samples()
    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        clean = store_stage(str(work / "clean" / STAGE), data)
        uri = f"s3://draftsmith/run/{STAGE}"
        with WeedServer(work / "weed") as weed, s3_env(weed.env):
            fire, killed = threading.Event(), []

            def kill() -> None:
                fire.wait()
                time.sleep(KILL_DELAY_S)
                killed.append(time.monotonic())
                weed.kill()

            killer = threading.Thread(target=kill, daemon=True)
            killer.start()
            error, noticed = None, time.monotonic()
            try:
                store_stage(uri, _firing(data, (kill_in_shard + 1) * SHARD_SAMPLES - 1, fire))
            except Exception as err:  # the scenario reports whatever the stage raised
                error, noticed = err, time.monotonic()
            fire.set()
            killer.join(timeout=10)
            weed.start()
            found = after_crash(uri, clean)
            rerun = store_stage(uri, data)
            lost, duplicated, corrupted = tally(uri, data)
        corrupted += found["manifest_problems"] + found["bad_commits"] + found["torn"]
        return _result(
            fault="S3 server killed mid-write",
            units=len(data),
            lost=lost,
            duplicated=duplicated,
            corrupted=corrupted,
            injected=1,
            detected_within_s=noticed - killed[0] if error is not None and killed else 0.0,
            detail=found
            | {
                "error": error,
                "transient": retry.is_transient(error),
                "files_differ": entries(rerun) != entries(clean),
            },
        )


def read_only_bucket(workdir: str | Path | None = None) -> FaultResult:
    """A finished stage in a bucket, then credentials that may only read it: a new stage there must be
    refused at its first write, a delete of the finished one refused too, and nothing of it lost."""
    from draftsmith.core import retry, storage
    from tests.support.s3 import WeedServer

    data, reader = samples(), READ_ONLY
    done_uri, new_uri = f"s3://draftsmith/done/{STAGE}", f"s3://draftsmith/new/{STAGE}"
    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        with WeedServer(work / "weed", identities=[reader]) as weed:
            with s3_env(weed.env):
                finished = store_stage(done_uri, data)
            with s3_env(weed.env | {"AWS_ACCESS_KEY_ID": reader["key"], "AWS_SECRET_ACCESS_KEY": reader["secret"]}):
                cached = store_stage(done_uri, data)  # a finished stage needs only reads
                start = time.monotonic()
                write_error = _raised(lambda: store_stage(new_uri, data))
                took = time.monotonic() - start
                delete_error = _raised(lambda: storage.remove_tree(done_uri))
                lost, duplicated, corrupted = tally(done_uri, data)
            with s3_env(weed.env):
                left_new = storage.list_names(new_uri)
        return _result(
            fault="read-only S3 bucket",
            units=len(data),
            lost=lost,
            duplicated=duplicated,
            corrupted=corrupted + int(entries(cached) != entries(finished)),
            injected=1,
            detected_within_s=took,
            detail={
                "write_error": write_error,
                "delete_error": delete_error,
                "transient": retry.is_transient(write_error),
                "written_by_reader": left_new,
                "secrets": [reader["key"], reader["secret"]],
            },
        )


def _raised(call) -> Exception | None:
    try:
        call()
    except Exception as err:  # the scenario reports whatever was raised
        return err
    return None


def _mount_command(mountpoint: Path) -> list[str]:
    """The `unshare` prefix under which a tmpfs mounts at `mountpoint` (a private mount namespace, gone
    with the process); `MountUnavailable` naming both attempts when neither may mount."""
    tried = []
    for prefix in (["unshare", "-rm"], ["unshare", "-m"]):
        probe = [*prefix, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mountpoint)]
        try:
            done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as err:
            tried.append(f"{' '.join(prefix)}: {err}")
            continue
        if done.returncode == 0:
            return prefix
        tried.append(f"{' '.join(prefix)}: {(done.stderr or done.stdout).strip() or f'exit {done.returncode}'}")
    raise MountUnavailable("cannot mount a small tmpfs here (" + "; ".join(tried) + ")")


def disk_full(workdir: str | Path | None = None) -> FaultResult:
    """The stage on a tmpfs with half the room it needs: it must fail naming the file and the lack of
    space, leave only whole files, and after the space is freed a rerun must store what a clean run does."""
    with tempfile.TemporaryDirectory(prefix="draftsmith-fault-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        mountpoint = work / "disk"
        mountpoint.mkdir(parents=True, exist_ok=True)
        prefix = _mount_command(mountpoint)
        code = "import sys; from tests.support.faults.storage import disk_child; disk_child(sys.argv[1])"
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        done = subprocess.run([*prefix, sys.executable, "-c", code, str(work)], cwd=ROOT, env=env, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the disk-full scenario's process exited with {done.returncode}")
        found = json.loads((work / "disk-full.json").read_text())
        return _result(
            fault="full local disk",
            units=SAMPLES,
            lost=found.pop("lost"),
            duplicated=found.pop("duplicated"),
            corrupted=found.pop("corrupted") + len(found["torn"]) + len(found["files_differ"]),
            injected=1,
            detected_within_s=found.pop("detected_within_s"),
            detail=found,
        )


def disk_child(work: str) -> None:
    """`disk_full`'s body, run in its own mount namespace: mount, fill, fail, free, rerun; results to JSON."""
    from draftsmith.core.stage import MANIFEST

    root = Path(work)
    disk = root / "disk"
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(disk)], check=True)
    data = samples()
    clean_dir = root / "clean" / STAGE
    clean = store_stage(str(clean_dir), data)
    reference = {p.relative_to(clean_dir): p.read_bytes() for p in clean_dir.rglob("*") if p.is_file()}
    need = sum(len(b) for b in reference.values())
    filler = disk / "filler"
    with filler.open("wb") as fh:  # leaves half the room the stage needs
        fh.write(bytes(shutil.disk_usage(disk).free - need // 2))
    stage_dir = disk / "run" / STAGE
    start = time.monotonic()
    error = _raised(lambda: store_stage(str(stage_dir), data))
    took = time.monotonic() - start
    present = {p.relative_to(stage_dir): p.read_bytes() for p in stage_dir.rglob("*") if p.is_file()}
    found: dict[str, Any] = {
        "error": None if error is None else str(error),
        "error_type": type(error).__name__,
        "stage_dir": str(stage_dir),
        "temps": sorted(str(p) for p in present if p.name.endswith(".tmp")),
        "manifest_after_failure": Path(MANIFEST) in present,
        "whole_after_failure": sorted(str(p) for p, b in present.items() if reference.get(p) == b),
        "torn": sorted(str(p) for p, b in present.items() if p.name != MANIFEST and reference.get(p) != b),
        "detected_within_s": took,
    }
    filler.unlink()
    rerun = store_stage(str(stage_dir), data)
    final = {p.relative_to(stage_dir): p.read_bytes() for p in stage_dir.rglob("*") if p.is_file()}
    found["files_differ"] = sorted(
        str(p) for p in set(final) | set(reference) if p.name != MANIFEST and final.get(p) != reference.get(p)
    )
    found["manifest_differs"] = entries(rerun) != entries(clean)
    found["lost"], found["duplicated"], found["corrupted"] = tally(str(stage_dir), data)
    found["corrupted"] += int(found["manifest_differs"])
    (root / "disk-full.json").write_text(json.dumps(found))


SCENARIOS = {"s3-restart": s3_restart, "read-only-bucket": read_only_bucket, "disk-full": disk_full}
