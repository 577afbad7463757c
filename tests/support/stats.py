"""Statistics for the sampling tests: whether draws match an exact distribution."""

import math

import torch


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson statistic, degrees of freedom and p-value of `counts` against exact `probs` (same shape).

    Cells expected fewer than 5 times are pooled into one bin (the chi-square approximation needs it); a
    count in a cell of probability 0 is an outright failure (statistic inf).
    """
    counts, probs = counts.flatten(), probs.flatten()
    if counts[probs == 0].sum() > 0:
        return math.inf, 0, 0.0
    expected = probs * counts.sum()
    big, small = expected >= 5, (expected < 5) & (probs > 0)
    obs = torch.cat([counts[big], counts[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1
    return stat, dof, float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))
