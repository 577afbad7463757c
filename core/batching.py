"""Token-budget batching shared by hidden-state capture and training."""


def group_by_length(lengths: list[int], budget: int) -> list[list[int]]:
    """Sample indices grouped longest first so that `batch_size * max_len <= budget` (one sample at least).

    Ties keep index order, so the grouping is deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
