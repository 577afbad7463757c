"""One writer per object-store run folder: a lease object taken and renewed with conditional puts.

`<run>/.lock` holds the holder record (host, pid, start time, command) and when the lease expires. It is
created with `If-None-Match: *`, so of two runs starting together exactly one gets it; the other reads the
record and fails naming the holder. The holder renews it every third of the lease with `If-Match` on the
ETag it wrote, so nobody else's write is overwritten; a run that is killed stops renewing, and once its lease
has expired the next run takes it over (again conditionally: of two runs taking over, one wins). The
lease is deleted, conditionally, when the run ends. Expiry compares wall clocks across hosts, so the lease
should be much longer than any clock skew between them (`storage.lock_lease_s`).
"""

import json
import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

log = logging.getLogger("draftsmith.core.runlock")

LOCK_NAME = ".lock"


def _client() -> Any:
    # botocore reads the endpoint (AWS_ENDPOINT_URL), region and credentials from the environment, as s3fs does.
    import botocore.session

    return botocore.session.get_session().create_client("s3")


def _bucket_key(url: str) -> tuple[str, str]:
    from draftsmith.core import storage

    _, path = storage.filesystem(url)
    bucket, _, key = path.partition("/")
    return bucket, key


def _error_code(err: Exception) -> str:
    return str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))


class RunFolderBusy(ValueError):
    """Another live process holds the run folder. A ValueError, so `draftsmith run` exits 2."""

    def __init__(self, run_dir: str, holder: dict | None) -> None:
        self.run_dir, self.holder = run_dir, holder or {}
        h = self.holder
        super().__init__(
            f"run folder {run_dir} is in use by pid {h.get('pid', '?')} on {h.get('host', '?')} "
            f"since {h.get('started', '?')} (started by: {h.get('command', '?')})"
        )


class S3Lease:
    """The lease on one object-store run folder, renewed in a background thread while held."""

    def __init__(self, run_dir: str, record: dict, lease_s: float) -> None:
        from draftsmith.core import storage

        self.run_dir, self.record, self.lease_s = run_dir, record, lease_s
        self.url = storage.join(run_dir, LOCK_NAME)
        self.bucket, self.key = _bucket_key(self.url)
        self.client = _client()
        self.etag: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        expires = datetime.now(UTC) + timedelta(seconds=self.lease_s)
        return json.dumps(self.record | {"expires": expires.isoformat(timespec="seconds")}).encode() + b"\n"

    def _put(self, **condition: str) -> bool:
        """One conditional put of a fresh record; False when the condition failed (someone else holds it)."""
        from draftsmith.core import storage

        try:
            # A refusal (read-only bucket, bad credentials) becomes one line naming the lease object.
            with storage.reported("write", self.url):
                put = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=self._body(), **condition)
            self.etag = put["ETag"]
            return True
        except Exception as err:  # botocore's ClientError; anything else is re-raised
            if _error_code(err) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return False
            raise

    def _current(self) -> tuple[dict | None, str | None]:
        from draftsmith.core import storage

        try:
            with storage.reported("read", self.url):
                got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except Exception as err:
            if _error_code(err) in ("NoSuchKey", "404"):
                return None, None
            raise
        try:
            record = json.loads(got["Body"].read())
        except ValueError:
            record = None
        return (record if isinstance(record, dict) else None), got["ETag"]

    def acquire(self) -> None:
        """Take the lease, or raise `RunFolderBusy` naming a holder whose lease has not expired."""
        for _ in range(3):  # the holder may release or renew between our put and our read
            if self._put(IfNoneMatch="*"):
                break
            holder, etag = self._current()
            if etag is None:
                continue
            if not _expired(holder):
                raise RunFolderBusy(self.run_dir, holder)
            if self._put(IfMatch=etag):
                log.info(
                    "run folder %s: taking over the lease of pid %s on %s, which expired at %s",
                    self.run_dir, (holder or {}).get("pid"), (holder or {}).get("host"), (holder or {}).get("expires"),
                )  # fmt: skip
                break
        else:
            raise RunFolderBusy(self.run_dir, self._current()[0])
        self._thread = threading.Thread(target=self._renew, name="run-folder-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if not self._put(IfMatch=self.etag or "*"):
                    self.lost = f"another run replaced the lease at {datetime.now(UTC).isoformat(timespec='seconds')}"
                    log.error("run folder %s: %s; this run is no longer its only writer", self.run_dir, self.lost)
                    return
            except Exception as err:  # a blip: the lease has two more renewals before it expires
                log.warning("run folder %s: renewing the lease failed (%s); retrying", self.run_dir, type(err).__name__)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None and self.etag is not None:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)
            except Exception as err:  # it expires on its own
                log.warning("run folder %s: could not delete the lease (%s)", self.run_dir, type(err).__name__)


def _expired(holder: dict | None) -> bool:
    """A lease without a readable expiry counts as expired: nothing live wrote it whole."""
    try:
        expires = datetime.fromisoformat(str((holder or {})["expires"]))
    except (KeyError, ValueError):
        return True
    return datetime.now(UTC) >= expires
