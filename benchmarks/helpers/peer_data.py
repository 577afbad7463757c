"""Our hidden-state store as the peer's training samples (`benchmarks/workers/peer_fit.py` reads them).

One safetensors file per store sample (`NNNNN.safetensors`: `input_ids`, `loss_mask`, `hidden_states`,
`last_hidden`, as stored: no conversion beyond decoding), `lengths.json` (sample lengths, for the peer's packing
sampler) and `token_freq.pt` (`{token id: count}` over loss tokens, the peer's vocabulary-mapping input; its own
`prepare_data` counts the same tokens).

A store written with `hidden_states.positions: supervised` holds the last hidden state only at rows whose next
token is a loss token. The peer reads it at every loss token (its `shift_batch` pairs the row of token t with
the target state at t + 1), so its loss mask is narrowed to the rows the store holds: the prediction of the
token after the answer's last one drops out.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.transport.offline_reader import OfflineDataset
from draftsmith.transport.sample import supervised_rows


def peer_mask(loss_mask: torch.Tensor, positions: str) -> torch.Tensor:
    """The loss mask the peer trains with, `[S]` uint8 (see the module docstring)."""
    mask = loss_mask.bool()
    if positions == "supervised":
        mask = mask & supervised_rows(mask)
    return mask.to(torch.uint8)


def write_peer_data(store_uri: str, folder: Path, counts: torch.Tensor, positions: str) -> dict:
    """Every sample of the store at `store_uri` into `folder`; `counts` `[V]` are the loss-token counts our
    trainer builds its draft vocabulary from. Returns `{"samples", "tokens", "loss_tokens"}`."""
    folder.mkdir(parents=True, exist_ok=True)
    store = OfflineDataset(store_uri)
    lengths = store.lengths
    loss_tokens = 0
    for i in range(len(store)):
        s = store[i]
        mask = peer_mask(s.loss_mask, positions)
        loss_tokens += int(mask.sum())
        tensors = {"input_ids": s.input_ids, "loss_mask": mask, "hidden_states": s.hidden_states}
        save_file(
            {k: v.contiguous() for k, v in (tensors | {"last_hidden": s.last_hidden}).items()},
            str(folder / f"{i:05d}.safetensors"),
        )
    (folder / "lengths.json").write_text(json.dumps(lengths))
    nonzero = counts.nonzero().flatten().tolist()
    torch.save({int(t): int(counts[t]) for t in nonzero}, folder / "token_freq.pt")
    return {"samples": len(store), "tokens": sum(lengths), "loss_tokens": loss_tokens}
