"""Builders and checks of run-folder contents: hidden-state samples and store descriptions for the offline
store, and the PNG check of the evaluation's plots."""

import struct
import zlib
from typing import Any

import matplotlib.image as mpimg
import numpy as np
import torch

from draftsmith.core.manifest import StageManifest
from draftsmith.core.stage import load_manifest
from draftsmith.evals import plots
from draftsmith.tasks.token_encode import Encoded
from draftsmith.tasks.tokenization import encode
from draftsmith.transport.offline_store import StoreInfo
from draftsmith.transport.sample import HiddenSample, StoreCodec

STORE_TAPS, STORE_H = 3, 8


def store_samples(n: int, seed: int = 0) -> list[HiddenSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        seq = int(torch.randint(3, 30, (1,), generator=g))
        mask = torch.rand(seq, generator=g) > 0.4
        out.append(
            HiddenSample(
                id=f"row-{i}",
                input_ids=torch.randint(0, 50_000, (seq,), generator=g),
                loss_mask=mask,
                hidden_states=torch.randn(seq, STORE_TAPS * STORE_H, generator=g),
                last_hidden=torch.randn(seq, STORE_H, generator=g),
            )
        )
    return out


def store_info(codec: StoreCodec) -> StoreInfo:
    return StoreInfo(codec=codec, taps=[1, 2, 3], hidden_size=STORE_H, target="unit", tokenizer_sha256="abc")


def assert_same_sample(a: HiddenSample, b: HiddenSample) -> None:
    assert a.id == b.id
    for name in ("input_ids", "loss_mask", "hidden_states", "last_hidden"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """Walk a PNG by hand: the signature, then (length, type, data, CRC) chunks; every CRC must verify."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "no PNG signature"
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r} chunk"
        chunks.append((kind, body))
        pos += 12 + length
    return chunks


def check_png(path, name: str) -> None:
    data = path.read_bytes()
    chunks = png_chunks(data)
    assert chunks[0][0] == b"IHDR" and len(chunks[0][1]) == 13 and chunks[-1][0] == b"IEND"
    width, height, bit_depth, colour_type = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (width, height) == plots.PIXELS[name]
    assert bit_depth == 8 and colour_type in (2, 6)  # 8-bit RGB or RGBA
    pixels = mpimg.imread(path)
    assert pixels.shape[:2] == (height, width)
    rgb = pixels[..., :3].reshape(-1, 3)
    assert rgb.var(axis=0).sum() > 1e-3, "the image is (nearly) a single colour"
    packed = (rgb * 255).round().astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], dtype=np.uint32)
    assert len(np.unique(packed)) > 20, "too few colours for a chart with axes, text and data"


def manifest(uri: str) -> StageManifest:
    """The finished stage's manifest under `uri` (`load_manifest`, which says None when there is none)."""
    found = load_manifest(uri)
    assert found is not None, f"no manifest under {uri}"
    return found


def encoded(*args: Any, **kwargs: Any) -> Encoded:
    """`tokenization.encode` of a conversation that fits (`encode` says None for one that does not)."""
    enc = encode(*args, **kwargs)
    assert enc is not None, "the conversation does not fit"
    return enc


def finished(manifests: dict[str, StageManifest | None]) -> dict[str, StageManifest]:
    """A run's stage manifests (`kimi_k3`'s result), every stage having finished."""
    missing = [stage for stage, m in manifests.items() if m is None]
    assert not missing, f"stages without a manifest: {missing}"
    return {stage: m for stage, m in manifests.items() if m is not None}
