"""DFlash2's candidate selector: re-rank each slot's unary top-K by a low-rank, context-gated bigram score.

`S_t(a, b) = U_t(b) + <A(a) * P(h_t), B(b)>` for predecessor token a and candidate b at slot t, with
`A = predecessor_codebook [V, r]`, `B = successor_codebook [V, r]`, `P = hidden_projection` (H -> r) and
`h_t` the drafter's output after the final norm (vLLM `CandidateSelector`, `qwen3_dflash2.py`).

Shape legend: B batch, L drafted slots, K candidates per slot, H width, V vocabulary, r rank, n rows.
"""

import torch
from torch import nn


class CandidateSelector(nn.Module):
    """The selector's parameters and scores (vLLM names). Codebooks start small (std 0.02) and train."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def pair(self, pred_ids: torch.Tensor, h_H: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
        """`<A(pred) * P(h), B(cand)>` `[..., K]` for one predecessor `[...]`, hidden `[..., H]`, cands `[..., K]`."""
        gate = self.predecessor_codebook[pred_ids] * self.hidden_projection(h_H)  # [..., r]
        return torch.einsum("...r,...kr->...k", gate, self.successor_codebook[cand_ids])

    def edge_scores(
        self, cand_BLK: torch.Tensor, unary_BLK: torch.Tensor, h_BLH: torch.Tensor, anchor_B: torch.Tensor
    ) -> torch.Tensor:
        """`[B, L, K(predecessor), K(candidate)]`: slot 0's predecessor is the anchor (every row alike), slot
        l's predecessors are slot l-1's candidates."""
        K = cand_BLK.shape[-1]
        pred = torch.cat([anchor_B[:, None, None].expand(-1, 1, K), cand_BLK[:, :-1]], dim=1)  # [B, L, K]
        gate = self.predecessor_codebook[pred] * self.hidden_projection(h_BLH)[:, :, None]  # [B, L, K, r]
        pair = torch.einsum("blpr,blcr->blpc", gate, self.successor_codebook[cand_BLK])
        return unary_BLK[:, :, None] + pair


def walk(scores_BLKK: torch.Tensor, cand_BLK: torch.Tensor) -> torch.Tensor:
    """Greedy path `[B, L]` (token ids) through the edge scores, as vLLM's `_selector_walk_kernel` at T=0.

    vLLM starts from predecessor row 0 (slot 0's rows are all the anchor), takes the argmax over row
    `previous` at each slot and moves `previous` to the chosen candidate's index. It is the greedy walk,
    not a Viterbi search; temperature > 0 (Gumbel sampling over the same row) is not implemented here.
    """
    B, L, K, _ = scores_BLKK.shape
    rows = torch.arange(B, device=scores_BLKK.device)
    previous = torch.zeros(B, dtype=torch.long, device=scores_BLKK.device)
    tokens = []
    for step in range(L):
        index = scores_BLKK[rows, step, previous].argmax(-1)
        tokens.append(cand_BLK[rows, step, index])
        previous = index
    return torch.stack(tokens, dim=1)


def candidates_with_gold(logits_nV: torch.Tensor, gold_n: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unary top-`k` ids `[n, k]` (descending) with the gold token put in the last (lowest) place when it
    is missing, and the gold's index `[n]`."""
    cand = logits_nV.detach().topk(k, dim=-1).indices
    hit = cand == gold_n[:, None]
    missing = ~hit.any(-1)
    cand[missing, k - 1] = gold_n[missing]
    index = torch.where(missing, k - 1, hit.int().argmax(-1))
    return cand, index


def selector_loss(
    selector: CandidateSelector,
    logits_nV: torch.Tensor,
    h_nH: torch.Tensor,
    pred_n: torch.Tensor,
    gold_n: torch.Tensor,
) -> torch.Tensor:
    """Mean K-way cross-entropy of the gold token among the unary top-K (gold injected when missing).

    Rows are valid slots only; the predecessor is the gold previous token (teacher forcing, the anchor for
    the first drafted slot). The unary term keeps its gradient, so the backbone also learns to rank the gold
    token inside the candidate set.
    """
    if logits_nV.shape[0] == 0:
        return logits_nV.sum() * 0.0
    cand, index = candidates_with_gold(logits_nV, gold_n, selector.top_k)
    scores = logits_nV.gather(-1, cand).float() + selector.pair(pred_n, h_nH, cand).float()
    return nn.functional.cross_entropy(scores, index)
