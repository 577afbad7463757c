"""safetensors blobs must be byte-stable: manifests hash them to keep downstream cache keys stable."""

import subprocess
import sys

import pytest
import torch

from draftsmith.core import storage, tensorio

pytestmark = pytest.mark.unit

_SNIPPET = """
import torch
from draftsmith.core import storage, tensorio
t = {"ids": torch.arange(7, dtype=torch.int32), "h": torch.linspace(0, 1, 12).to(torch.bfloat16).view(3, 4)}
print(storage.sha256(tensorio.dumps(t, {f"key{i}": str(i) * i for i in range(12)})))
"""


def test_bytes_identical_across_processes():
    # safetensors' own header order comes from a per-process hash map, so compare separate interpreters.
    hashes = {
        subprocess.run([sys.executable, "-c", _SNIPPET], capture_output=True, text=True, check=True).stdout
        for _ in range(3)
    }
    assert len(hashes) == 1


def test_roundtrip_keeps_tensors_and_metadata():
    t = {"b": torch.arange(5), "a": torch.randn(3, 2).to(torch.bfloat16)}
    meta = {"z": "1", "a": "two"}
    blob = tensorio.dumps(t, meta)
    back, back_meta = tensorio.loads(blob)
    assert back_meta == meta
    assert torch.equal(back["b"], t["b"]) and torch.equal(back["a"], t["a"])
    assert int.from_bytes(blob[:8], "little") % 8 == 0
    assert storage.sha256(blob) == storage.sha256(
        tensorio.dumps(dict(reversed(t.items())), dict(reversed(meta.items())))
    )
