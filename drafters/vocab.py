"""Draft-vocabulary pruning: the most frequent loss tokens, with vLLM's d2t/t2d buffers.

`d2t[i]` is an offset: target id = i + d2t[i] (what vLLM loads as `draft_id_to_target_id`).
`t2d[v]` is True when target id v is in the draft vocabulary. Draft ids are target ids sorted.
"""

import torch


def build_draft_vocab(counts_V: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d2t [Vd] int64, t2d [V] bool)` keeping the `draft_vocab_size` most counted target ids.

    Ties (including never-seen tokens, when the corpus has fewer distinct tokens than Vd) go to the
    smaller id, so the result is deterministic.
    """
    vocab_size = counts_V.numel()
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocabulary ({vocab_size})")
    order = torch.argsort(counts_V.to(torch.int64), descending=True, stable=True)
    kept = order[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=counts_V.device)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab_size, device=kept.device), t2d


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id, `[Vd]`."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ValueError unless d2t and t2d describe the same strictly increasing id set."""
    ids = draft_ids(d2t)
    if ids.numel() != int(t2d.sum()):
        raise ValueError(f"d2t has {ids.numel()} entries but t2d marks {int(t2d.sum())} target ids")
    if ids.numel() and (ids.min() < 0 or ids.max() >= t2d.numel()):
        raise ValueError("d2t maps outside the target vocabulary")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("d2t target ids are not strictly increasing")
    if not bool(t2d[ids].all()):
        raise ValueError("d2t names target ids that t2d does not mark")


def target_to_draft(t2d: torch.Tensor) -> torch.Tensor:
    """Draft index of each target id, -1 where the id is not draftable, `[V]`."""
    # The rank of each kept id among the kept ids, by a cumulative sum: no host sync, no boolean indexing,
    # so it stays on t2d's device (and runs on meta tensors, as device-placement tests need).
    kept = t2d.bool()
    rank = kept.to(torch.int64).cumsum(0) - 1
    return torch.where(kept, rank, torch.full_like(rank, -1))
