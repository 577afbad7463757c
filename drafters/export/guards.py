"""Checks that stop a broken serving export before it is written.

Every failure raises `ExportError` naming the key, field or file at fault. The checks run on the final
`(tensors, config.json)` pair, so they catch a broken export however it was produced.
"""

from typing import TYPE_CHECKING

import torch

from draftsmith.drafters import vocab
from draftsmith.drafters.export import engines

if TYPE_CHECKING:
    from draftsmith.core.manifest import StageManifest


class ExportError(ValueError):
    """An export would load wrongly (or not at all) in the serving engine."""


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """Exactly the `expected` keys, each with its expected shape; floats finite."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise ExportError(f"{where}: missing key(s) {missing}")
    if unexpected:
        raise ExportError(f"{where}: unexpected key(s) {unexpected}")
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != tuple(shape):
            raise ExportError(f"{where}: key {name!r} has shape {list(got)}, the config implies {list(shape)}")
        value = tensors[name]
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ExportError(f"{where}: key {name!r} holds NaN or inf")


def check_draft_vocab(tensors: dict[str, torch.Tensor], where: str) -> None:
    """d2t (int64) and t2d (bool) present together and describing the same strictly increasing id set."""
    if ("d2t" in tensors) != ("t2d" in tensors):
        raise ExportError(f"{where}: keys 'd2t' and 't2d' must be exported together")
    if "d2t" not in tensors:
        return
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dtype != torch.int64:
        raise ExportError(f"{where}: key 'd2t' must be int64, got {d2t.dtype}")
    if t2d.dtype != torch.bool:
        raise ExportError(f"{where}: key 't2d' must be bool, got {t2d.dtype}")
    try:
        vocab.check_vocab(d2t, t2d)
    except ValueError as err:
        raise ExportError(f"{where}: 'd2t' is inconsistent with 't2d': {err}") from None


def check_aux_ids(
    method: str, engine: str, taps: list[int], config_ids: list[int], num_target_layers: int, field: str
) -> None:
    """The config's layer ids are the taps converted for `engine`, and every tap is a real target layer."""
    for tap in taps:
        if not 1 <= tap <= num_target_layers:
            raise ExportError(f"{field}: tap {tap} is outside the target's layers 1..{num_target_layers}")
    want = engines.aux_layer_ids(method, engine, taps)
    if list(config_ids) != want:
        convention = engines.aux_convention(method, engine)
        raise ExportError(
            f"{field}: {list(config_ids)} but taps {list(taps)} are {want} for {method} on {engine} ({convention})"
        )


def check_embedding(weight: torch.Tensor, target_embed_VH: torch.Tensor | None, name: str) -> None:
    """A drafter's embedding must be the target's: never zero or constant (a copy that never happened)."""
    w = weight.float()
    if w.numel() == 0 or bool((w == w.flatten()[0]).all()):
        raise ExportError(
            f"{name}: the embedding is constant ({float(w.flatten()[0]) if w.numel() else 'empty'}); "
            "it was never copied from the target"
        )
    if target_embed_VH is None:
        return
    if tuple(w.shape) != tuple(target_embed_VH.shape):
        raise ExportError(f"{name}: shape {list(w.shape)} differs from the target's {list(target_embed_VH.shape)}")
    # bf16 storage rounds each entry by at most 2^-8 relative; a different matrix differs by far more.
    target = target_embed_VH.float()
    if not torch.allclose(w, target.to(weight.dtype).float(), rtol=0.0, atol=0.0):
        if not torch.allclose(w, target, rtol=2**-7, atol=1e-6):
            raise ExportError(f"{name}: the embedding differs from the target's input embedding")


def check_checkpoint(train_dir: str) -> "StageManifest":
    """The train stage's manifest, after checking every file it lists against its recorded size and digest:
    an export of a damaged checkpoint would serve weights nobody trained."""
    from draftsmith.core.stage import IntegrityError, verify_stage

    try:
        manifest = verify_stage(train_dir)
    except IntegrityError as err:
        raise ExportError(str(err)) from None
    if manifest is None:
        raise ExportError(f"{train_dir}/manifest.json: the train stage has not finished")
    return manifest
