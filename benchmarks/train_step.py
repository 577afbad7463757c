"""Drafter training-step throughput on CPU, the reference step against the fast one, side by side in one run.

Shapes (the ones used to compare with vllm-project/speculators): sequence 1024, batch 1, target hidden 576,
vocabulary 49152, fp32, fused AdamW, 2 threads. EAGLE-3: 3 taps, one layer (intermediate 1536, 9 heads, 3 KV
heads), draft vocabulary 8192, TTT 3 and 7. DFlash: 5 taps, 5 layers of the same width, block 8, 64 anchors
(`--anchors`; the peer's default is 512), the target's frozen lm_head. DSpark: the same backbone, block 7, its
default heads and loss mix.

The reference step (`old`) is what the trainer ran before the fast paths: head losses by plain autograd
(`kernels` mode `reference`), EAGLE-3's full-vocabulary `draftable` argmax and per-depth target logits, the
full-softmax TTT attention, and the block drafters' dense attention over every block's keys. The fast step
(`new`) is today's default; for EAGLE-3 `new 1st epoch` clears the per-sample argmax cache before every step
(a sample's first visit) and `new frozen head` adds `freeze_lm_head`. Every variant trains its own copy of one
initial model; the variants run in turn within each round, so machine load hits all of them alike. tokens/s is
the median over rounds; GFLOP per step is FlopCounterMode's forward + backward count
(`draftsmith.drafters.training.flops.flop_counter`: torch's CPU flash attention counted like SDPA).

`python -m benchmarks.train_step [--rounds 5] [--only eagle3-ttt3,dflash-block8] [--anchors 512] [--quick]`
(quick: toy sizes, a smoke test, figures not meaningful).
"""

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from draftsmith import kernels
from draftsmith.core.config import Eagle3Config
from draftsmith.drafters import vocab
from draftsmith.drafters.dflash import block_attention
from draftsmith.drafters.dflash import layers as dflash_layers
from draftsmith.drafters.dflash.loss import dflash_objective
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.dflash.spec import DFlashSpec
from draftsmith.drafters.eagle3 import chain_attention, family
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from draftsmith.drafters.training import flops


@dataclass(frozen=True)
class Shapes:
    S: int = 1024
    H: int = 576
    V: int = 49152
    VD: int = 8192
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    inter: int = 1536
    anchors: int = 64


QUICK = Shapes(S=64, H=32, V=512, VD=128, heads=4, kv_heads=2, head_dim=8, inter=64, anchors=4)


@dataclass
class Variant:
    """One way to run a step: its model copy, optimizer, loss closure and the context it runs in."""

    name: str
    model: torch.nn.Module
    loss: Callable[[], torch.Tensor]
    context: Callable[[], contextlib.AbstractContextManager]
    before: Callable[[], None] = lambda: None

    def __post_init__(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-5, fused=True)

    def step(self) -> float:
        self.before()
        start = time.perf_counter()
        with self.context():
            loss = self.loss()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return time.perf_counter() - start

    def gflop(self) -> float:
        self.before()
        with self.context(), flops.flop_counter() as counter:
            self.loss().backward()
        self.opt.zero_grad(set_to_none=True)
        return counter.get_total_flops() / 1e9


@contextlib.contextmanager
def reference_step() -> Iterator[None]:
    """Plain-autograd head losses, the full-softmax TTT attention and the block drafters' dense attention over
    every block's keys, as the trainer ran before."""
    real, real_block = chain_attention.chain_attention, dflash_layers.block_attention
    from draftsmith.drafters.eagle3 import model as eagle3_model

    eagle3_model.chain_attention = chain_attention.chain_attention_reference
    dflash_layers.block_attention = block_attention.block_attention_reference
    try:
        with kernels.use("reference"):
            yield
    finally:
        eagle3_model.chain_attention = real
        dflash_layers.block_attention = real_block


def _batch(sh: Shapes, taps: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, sh.V, (1, sh.S), generator=g),
        "features": torch.randn(1, sh.S, taps * sh.H, generator=g),
        "loss_mask": torch.ones(1, sh.S, dtype=torch.bool),
        "last_hidden": torch.randn(1, sh.S, sh.H, generator=g),
    }


def eagle3_variants(sh: Shapes, depth: int) -> list[Variant]:
    g = torch.Generator().manual_seed(0)
    spec = Eagle3Spec(hidden_size=sh.H, target_hidden_size=sh.H, num_taps=3, num_heads=sh.heads,
                      num_kv_heads=sh.kv_heads, head_dim=sh.head_dim, intermediate_size=sh.inter,
                      vocab_size=sh.V, draft_vocab_size=sh.VD)  # fmt: skip
    torch.manual_seed(0)
    base = Eagle3Drafter(spec)
    d2t, t2d = vocab.build_draft_vocab(torch.randint(0, 1000, (sh.V,), generator=g), sh.VD)
    base.d2t.copy_(d2t)
    base.t2d.copy_(t2d)
    head = torch.randn(sh.V, sh.H, generator=g) * sh.H**-0.5
    head[~t2d] *= 0.6  # as on real data, the target's argmax is nearly always a draft id
    with torch.no_grad():
        base.lm_head.weight.copy_(head[vocab.draft_ids(d2t)])
    batch = _batch(sh, 3, g)
    cfg = Eagle3Config(draft_vocab_size=sh.VD, ttt_depth=depth, num_heads=sh.heads, num_kv_heads=sh.kv_heads,
                       head_dim=sh.head_dim, intermediate_size=sh.inter)  # fmt: skip

    def variant(name: str, *, fast: bool, frozen: bool = False, first_visit: bool = False) -> Variant:
        model = copy.deepcopy(base)
        model.lm_head.weight.requires_grad_(not frozen)
        objective = family.objective(cfg, model, head, torch.Generator(), shared=fast)
        shared = objective.shared_target
        before = (lambda: shared.cache.clear()) if first_visit and shared else (lambda: None)
        context = contextlib.nullcontext if fast else reference_step
        return Variant(name, model, lambda: objective(model, batch).total, context, before)

    return [
        variant("old", fast=False),
        variant("new 1st epoch", fast=True, first_visit=True),
        variant("new", fast=True),
        variant("new frozen head", fast=True, frozen=True),
    ]


def dflash_variants(sh: Shapes) -> list[Variant]:
    g = torch.Generator().manual_seed(1)
    spec = DFlashSpec(hidden_size=sh.H, target_hidden_size=sh.H, num_taps=5, num_layers=5, num_heads=sh.heads,
                      num_kv_heads=sh.kv_heads, head_dim=sh.head_dim, intermediate_size=sh.inter,
                      vocab_size=sh.V, block_size=8, mask_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    base = DFlashDrafter(spec)
    batch = _batch(sh, 5, g)

    def variant(name: str, fast: bool) -> Variant:
        model = copy.deepcopy(base)

        def loss() -> torch.Tensor:
            gen = torch.Generator().manual_seed(0)
            return dflash_objective(
                model, batch, target_head_VH=None, generator=gen, num_anchors=sh.anchors, gamma=4.0, selector_alpha=0.0
            ).total  # the timed DFlash step has no selector

        return Variant(name, model, loss, contextlib.nullcontext if fast else reference_step)

    return [variant("old", False), variant("new", True)]


def dspark_variants(sh: Shapes) -> list[Variant]:
    from draftsmith.drafters.dspark.model import DSparkDrafter, DSparkSpec, dspark_objective

    g = torch.Generator().manual_seed(2)
    spec = DSparkSpec(hidden_size=sh.H, target_hidden_size=sh.H, num_taps=5, num_layers=5, num_heads=sh.heads,
                      num_kv_heads=sh.kv_heads, head_dim=sh.head_dim, intermediate_size=sh.inter,
                      vocab_size=sh.V, block_size=7, mask_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    base = DSparkDrafter(spec)
    head = torch.randn(sh.V, sh.H, generator=g) * sh.H**-0.5
    with torch.no_grad():
        base.lm_head.weight.copy_(head)
    batch = _batch(sh, 5, g)

    def variant(name: str, fast: bool) -> Variant:
        model = copy.deepcopy(base)

        def loss() -> torch.Tensor:
            gen = torch.Generator().manual_seed(0)
            return dspark_objective(model, batch, target_head_VH=head, generator=gen, num_anchors=sh.anchors).total

        return Variant(name, model, loss, contextlib.nullcontext if fast else reference_step)

    return [variant("old", False), variant("new", True)]


def measure(variants: list[Variant], rounds: int) -> dict[str, tuple[float, float]]:
    """Per variant `(median seconds per step, GFLOP per step)`; one warm-up step each, then rounds in turn."""
    for v in variants:
        v.step()
    gflop = {v.name: v.gflop() for v in variants}
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            times[v.name].append(v.step())
    return {name: (statistics.median(ts), gflop[name]) for name, ts in times.items()}


def cases(sh: Shapes) -> dict[str, Callable[[], list[Variant]]]:
    return {
        "eagle3-ttt3": lambda: eagle3_variants(sh, 3),
        "eagle3-ttt7": lambda: eagle3_variants(sh, 7),
        "dflash-block8": lambda: dflash_variants(sh),
        "dspark-block7": lambda: dspark_variants(sh),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="Comma-separated cases (default: all).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--anchors", type=int, default=Shapes.anchors, help="Anchors per sequence, block drafters.")
    parser.add_argument("--quick", action="store_true", help="Toy sizes (smoke test); figures not meaningful.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sh = QUICK if args.quick else Shapes(anchors=args.anchors)
    table = cases(sh)
    chosen = [c for c in args.only.split(",") if c] or list(table)
    print(f"{'case':<15}{'variant':<17}{'tok/s':>8}{'s/step':>8}{'GFLOP':>8}{'x old':>7}")
    results = {}
    for case in chosen:
        results[case] = res = measure(table[case](), args.rounds)
        old = res["old"][0]
        for name, (sec, gflop) in res.items():
            print(f"{case:<15}{name:<17}{sh.S / sec:>8.1f}{sec:>8.2f}{gflop:>8.1f}{old / sec:>7.2f}", flush=True)
    return results


if __name__ == "__main__":
    main()
