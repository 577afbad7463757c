"""safetensors blobs with string metadata: the only tensor format on disk (never pickle)."""

import json

import torch
from safetensors.torch import load, save


def dumps(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Serialize to safetensors bytes that depend only on the content.

    safetensors writes its header from a hash map, so the metadata order (and with it the bytes and their
    sha256) changes between processes. Manifests hash artifacts to keep downstream keys stable, so the
    header is re-serialized with sorted keys; data offsets are relative to the data section and survive.
    """
    blob = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    header_len = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8 : 8 + header_len]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the format pads the header to 8-byte alignment with spaces
    return len(header).to_bytes(8, "little") + header + blob[8 + header_len :]


def loads(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and the header's `__metadata__` of a safetensors blob."""
    header_len = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    return load(data), metadata
