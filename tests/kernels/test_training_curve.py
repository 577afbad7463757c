"""`train.kernels` switch: the Triton kernels (interpreter) and the reference train the tiny recipe alike.

The EAGLE-3 drafter of `deployments/recipes/tiny-cpu.yaml` (with EAGLE-3.1's fc_norm and norm_output on, so the
multi-segment RMSNorm runs too), its real objective (`draftsmith.drafters.eagle3.family.objective`: TTT over 3 depths,
fused head loss) and AdamW, driven in-process for a few steps from the same initial weights.
"""

import copy

import pytest
import torch
import yaml
from torch.testing import assert_close

from draftsmith import kernels
from draftsmith.core.config.drafter import Eagle3Config, parse_drafter
from draftsmith.drafters import vocab
from draftsmith.drafters.eagle3 import family
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from tests.support.kernels import Tol

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS, B, S = 3, 2, 40
# Both runs are fp32; what differs is summation order inside softmax / norm reductions (a few fp32 ulps per
# step). The losses stay within ~1e-5 relative over these steps. (Weights are not compared: Adam divides by
# sqrt(v), so an element whose gradient is ~0 moves by ~lr on either side of an ulp-level difference.)
CURVE: Tol = {"rtol": 1e-4, "atol": 1e-5}


def _setup():
    recipe = yaml.safe_load(open("deployments/recipes/tiny-cpu.yaml"))
    cfg = parse_drafter({**recipe["drafter"], "fc_norm": True, "norm_output": True})
    assert isinstance(cfg, Eagle3Config) and cfg.draft_vocab_size is not None
    H, V = recipe["target"]["hidden_size"], recipe["target"]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    head = torch.randn(V, H, generator=g)
    common = torch.randperm(V, generator=g)[: 2 * cfg.draft_vocab_size]  # the corpus' tokens
    ids = common[torch.randint(0, common.numel(), (B, S + 1), generator=g)]
    counts = torch.bincount(ids.flatten(), minlength=V)
    # The target's last hidden state points at the next token's head row, so its argmax is usually draftable.
    batch = {
        "input_ids": ids[:, :S],
        "loss_mask": torch.rand(B, S, generator=g) > 0.2,
        "features": torch.randn(B, S, 3 * H, generator=g),
        "last_hidden": 0.5 * head[ids[:, 1:]] + 0.1 * torch.randn(B, S, H, generator=g),
    }
    torch.manual_seed(0)
    spec = Eagle3Spec(
        hidden_size=H,
        target_hidden_size=H,
        num_taps=3,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=V,
        draft_vocab_size=cfg.draft_vocab_size,
        rope_theta=10000.0,
        fc_norm=True,
        norm_output=True,
    )
    model = Eagle3Drafter(spec)
    d2t, t2d = vocab.build_draft_vocab(counts, cfg.draft_vocab_size)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    return cfg, model, head, batch


def _curve(mode: str, cfg, model, head, batch) -> tuple[torch.Tensor, Eagle3Drafter]:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    objective = family.objective(cfg, model, head, torch.Generator())
    losses = []
    with kernels.use(mode):
        for _ in range(STEPS):
            opt.zero_grad()
            out = objective(model, batch)
            out.total.backward()
            opt.step()
            losses.append(out.total.detach())
    assert int(out.step_count[0]) > 10  # the batch really counts positions
    return torch.stack(losses), model


def test_fused_kernels_and_reference_give_the_same_training_curve(interpreter):
    cfg, model, head, batch = _setup()
    ref_losses, _ = _curve("reference", cfg, model, head, batch)
    got_losses, _ = _curve("triton", cfg, model, head, batch)
    assert ref_losses[-1] < ref_losses[0]  # it trains
    assert_close(got_losses, ref_losses, **CURVE)
