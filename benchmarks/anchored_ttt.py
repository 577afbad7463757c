"""Dense EAGLE-3 TTT vs anchored TTT: forward + backward of attention and loss, side by side in one run.

Drafter at SmolLM2 shapes (H 576, 9 heads / 3 kv heads of 64, draft vocabulary 8192), TTT depth 7, one
sequence of 1024, 2048 and 4096 tokens with 60% loss tokens. Anchored uses 512 anchors with max_gap = depth
(TorchSpec's defaults). Prints dense time / anchored time per length; peers report about 2.4x at 4096 on GPU.

Run: `python -m benchmarks.anchored_ttt` (part of `make bench`).
"""

import functools

import torch

from benchmarks.helpers.timing import best_of
from draftsmith.drafters.anchors import strided_anchors
from draftsmith.drafters.eagle3.anchored import anchored_hidden, anchored_loss
from draftsmith.drafters.eagle3.loss import position_mask, ttt_loss
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec

DEPTH, ANCHORS, VD, HT = 7, 512, 8192, 576


def drafter() -> Eagle3Drafter:
    torch.manual_seed(0)
    spec = Eagle3Spec(
        hidden_size=576,
        target_hidden_size=HT,
        num_taps=3,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        draft_vocab_size=VD,
        rope_theta=100000.0,
        fc_norm=True,
        norm_output=True,
    )
    return Eagle3Drafter(spec)


def batch(S: int):
    g = torch.Generator().manual_seed(S)
    return {
        "ids": torch.randint(0, 49152, (1, S), generator=g),
        "feats": torch.randn(1, S, 3 * HT, generator=g),
        "loss_mask": torch.rand(1, S, generator=g) < 0.6,
        "last": torch.randn(1, S, HT, generator=g),
    }


def step_dense(model: Eagle3Drafter, b: dict, head: torch.Tensor) -> None:
    mask = position_mask(b["loss_mask"], torch.ones_like(b["loss_mask"]))
    hidden = model.ttt_hidden(b["ids"], b["feats"], DEPTH)
    with torch.no_grad():
        target = (b["last"][mask] @ head.T).log_softmax(-1)
    ttt_loss(model.logits, hidden, target, mask, 0.8).total.backward()


def step_anchored(model: Eagle3Drafter, b: dict, head: torch.Tensor) -> None:
    mask = position_mask(b["loss_mask"], torch.ones_like(b["loss_mask"]))
    anchors, keep = strided_anchors(b["loss_mask"], ANCHORS, DEPTH, DEPTH, torch.Generator().manual_seed(0))
    hidden = anchored_hidden(model, b["ids"], b["feats"], anchors, keep, DEPTH)
    anchored_loss(model, hidden, anchors, keep, b["last"], head, mask, 0.8).total.backward()


def main() -> None:
    torch.set_num_threads(2)
    model = drafter()
    head = torch.randn(VD, HT) * 0.05
    print(f"TTT depth {DEPTH}, {ANCHORS} anchors (max_gap {DEPTH}), forward + backward, fp32, 2 threads")
    for S in (1024, 2048, 4096):
        b = batch(S)
        dense = best_of(functools.partial(step_dense, model, b, head), 2)
        anchored = best_of(functools.partial(step_anchored, model, b, head), 2)
        model.zero_grad(set_to_none=True)
        print(f"seq {S}: dense {dense:.2f} s, anchored {anchored:.2f} s -> dense / anchored = {dense / anchored:.2f}x")


if __name__ == "__main__":
    main()
