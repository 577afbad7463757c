"""safetensors blobs with string metadata: the only tensor format on disk (never pickle)."""

import json

import torch
from safetensors.torch import load, save


def dumps(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


def loads(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and the header's `__metadata__` of a safetensors blob."""
    header_len = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    return load(data), metadata
