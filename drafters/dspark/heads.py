"""DSpark's two small heads on top of the DFlash block backbone: the Markov head and the confidence head.

Names and shapes follow vLLM's `DSparkMarkovHead` / `DSparkConfidenceHead` (`qwen3_dspark.py`), so the
checkpoint keys are `markov_head.markov_w1.weight` `[V, r]`, `markov_head.markov_w2.weight` `[Vout, r]`,
`confidence_head.proj.weight` `[1, H (+ r)]` and `confidence_head.proj.bias` `[1]`.

Shape legend: V target vocabulary (the Markov head embeds *target* ids, as vLLM feeds it sampled ids after
the draft-to-target map), Vout output vocabulary (draft vocabulary when pruned, else V), r Markov rank,
H drafter width.
"""

import torch
from torch import nn

from draftsmith.drafters.dspark.loss import outside_column
from draftsmith.drafters.layers import HeadLossCall, OutputHead, RMSNorm, apply_head_loss
from draftsmith.kernels import HeadLossOut


class MarkovHead(nn.Module):
    """Low-rank bigram bias `W2 W1[x_prev]` added to the backbone's logits of the next slot.

    As built, `markov_w2` starts at zero, so a fresh DSpark drafter proposes exactly what its DFlash backbone
    does and the head only ever learns a *correction*; `markov_w1` keeps its random init (N(0, 1)) so that
    `markov_w2` receives a non-zero gradient from the first step (with both at zero neither would ever move).
    `normal_init` replaces both with DeepSpec's small random init.
    """

    def __init__(self, vocab_size: int, out_vocab_size: int, rank: int) -> None:
        super().__init__()
        if min(vocab_size, out_vocab_size, rank) < 1:
            raise ValueError(
                f"MarkovHead: vocab_size {vocab_size}, out_vocab_size {out_vocab_size} and rank {rank} must be >= 1"
            )
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """Markov embedding `[..., r]` of the previous tokens' target ids `[...]`."""
        return self.markov_w1(prev_ids)

    def project(self, markov_emb: torch.Tensor) -> torch.Tensor:
        """Transition bias `[..., Vout]` from a Markov embedding `[..., r]`."""
        return self.markov_w2(markov_emb)

    def bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """Transition bias `[..., Vout]` for the previous tokens' target ids `[...]`."""
        return self.project(self.embed(prev_ids))


class ConfidenceHead(nn.Module):
    """Per-slot acceptance logit `w . [h; W1[x_prev]] + b` (vLLM builds `proj` with a bias, fp32 input).

    With `with_markov=False` the input is `h` alone (vLLM's `confidence_head_with_markov: false`).
    """

    def __init__(self, hidden_size: int, markov_rank: int, with_markov: bool = True) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (markov_rank if with_markov else 0), 1, bias=True)

    def forward(self, h: torch.Tensor, markov_emb: torch.Tensor) -> torch.Tensor:
        """Confidence logit `[...]` from the backbone output `h` `[..., H]` (after the final norm) and the
        previous token's Markov embedding `[..., r]` (ignored without `with_markov`)."""
        x = torch.cat([h, markov_emb], dim=-1) if self.with_markov else h
        return self.proj(x.to(self.proj.weight.dtype)).float().squeeze(-1)


class FullVocabHead(OutputHead):
    """A pruned lm_head (same weight, same key) whose fused loss can also score against the target's
    full-vocabulary distribution (`loss.outside_column`); registered with FSDP like `fused_loss`, so the weight
    is gathered for it."""

    fsdp_forward_methods = ("fused_loss", "fused_loss_with_outside")

    def reset_parameters(self) -> None:
        # The backbone's head weight is taken over (`DSparkDrafter`): drawing a fresh one would only shift the
        # random stream every later initialisation reads.
        pass

    def fused_loss_with_outside(self, x_nD: torch.Tensor, call: HeadLossCall, outside_n: torch.Tensor) -> HeadLossOut:
        """`fused_loss` over the draft columns plus the outside column, `outside_n` `[n]` its target logit."""
        weight, call = outside_column(self.weight, call, outside_n)
        return apply_head_loss(x_nD, weight, call)


@torch.no_grad()
def normal_init(module: nn.Module, std: float) -> None:
    """DeepSpec's init (Hugging Face `_init_weights` run by `post_init`): every Linear and Embedding weight
    N(0, std), every bias 0, every RMSNorm weight 1; the Markov head's `markov_w1` / `markov_w2` included.
    The shared embedding and lm_head are drawn too and then overwritten from the target, as DeepSpec does."""
    for m in module.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            m.weight.normal_(0.0, std)
            bias = getattr(m, "bias", None)
            if bias is not None:
                bias.zero_()
        elif isinstance(m, RMSNorm):
            m.weight.fill_(1.0)
