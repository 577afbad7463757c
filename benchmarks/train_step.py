"""EAGLE-3 TTT training-step throughput on CPU at SmolLM2-like shapes, the ones used to compare with speculators.

Shapes: target hidden 576, vocab 49152, 3 taps, draft vocab 8192, one draft layer (intermediate 1536,
9 heads, 3 KV heads), batch 1, sequence 1024, AdamW, fp32. Two loss paths are timed side by side:
logits for every position (what a straightforward implementation does) and logits only for the
positions that count (what the trainer does). A peer (vllm-project/speculators) measured 395 tokens/s
at TTT 3 and 147 at TTT 7 on this machine class; those figures are printed for context only.
"""

import time
from collections.abc import Callable

import torch

from drafters.eagle3.loss import position_mask, ttt_loss
from drafters.eagle3.model import Eagle3Drafter, Eagle3Spec, shift_left

PEER = {3: 395.0, 7: 147.0}
S, H, V, VD = 1024, 576, 49152, 8192


def _full_logits_loss(
    model: Eagle3Drafter,
    ids: torch.Tensor,
    feats: torch.Tensor,
    target_full: torch.Tensor,
    mask: torch.Tensor,
    depth: int,
) -> torch.Tensor:
    """Reference path: `[B, S, Vd]` logits at every position and depth, masked afterwards."""
    total = 0.0
    for k, logits in enumerate(model.ttt_forward(ids, feats, depth)):
        target = shift_left(target_full, 1 + k)
        m = shift_left(mask, 1 + k, False)
        ce = -(target.exp() * logits.log_softmax(-1)).sum(-1)
        total = total + 0.8**k * (ce * m).sum() / m.sum().clamp(min=1)
    return total


def _step_time(opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor], steps: int = 3) -> float:
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    spec = Eagle3Spec(
        hidden_size=H,
        target_hidden_size=H,
        num_taps=3,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=V,
        draft_vocab_size=VD,
    )
    model = Eagle3Drafter(spec)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, V, (1, S))
    feats = torch.randn(1, S, 3 * H)
    loss_mask = torch.ones(1, S, dtype=torch.bool)
    loss_mask[:, : S // 3] = False  # a prompt third carries no loss, as in chat data
    mask = position_mask(loss_mask, torch.ones(1, S, dtype=torch.bool))
    target_full = torch.randn(1, S, VD).log_softmax(-1)
    print(f"{'TTT depth':<10}{'full logits tok/s':>19}{'counted rows tok/s':>20}{'ratio':>8}{'peer tok/s':>12}")
    for depth in (3, 7):
        full = _step_time(opt, lambda d=depth: _full_logits_loss(model, ids, feats, target_full, mask, d))
        ours = _step_time(
            opt,
            lambda d=depth: ttt_loss(model.logits, model.ttt_hidden(ids, feats, d), target_full[mask], mask, 0.8).total,
        )
        print(f"{depth:<10}{S / full:>19.0f}{S / ours:>20.0f}{full / ours:>8.2f}{PEER[depth]:>12.0f}")


if __name__ == "__main__":
    main()
