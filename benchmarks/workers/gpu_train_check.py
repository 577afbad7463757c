"""The FSDP2 trainer on one GPU at Kimi K3 drafter sizes: NCCL, FSDP2 bf16/fp32, fused AdamW, torch.compile.

Run by `benchmarks/gpu_train_check.sh` (see there for a GPU machine's set-up); `--smoke` runs the same logic on
CPU (gloo) at toy sizes, which `tests/integration/test_gpu_train_check_smoke.py` exercises.

    python -m benchmarks.workers.gpu_train_check [--smoke] [--families eagle3,dflash2,dspark] [--seq 4096]

Each family's drafter comes from its `deployments/recipes/kimi-k3-<family>.yaml` drafter section (the
recipe's target width 7168 and vocabulary 163840). Only the drafter is real: the target is a one-layer
DeepseekV3 config on the meta device plus random embedding/head tensors, passed through
`draftsmith.drafters.families.BuildInputs` as the worker passes the real target's. The drafter is built, sharded,
materialised and trained exactly as `draftsmith.drafters.training.worker` does (`fsdp.TrainModule`, `fsdp.shard`,
`fsdp.materialize`, `loop.Trainer`), except that rank 0's real copy is built on the GPU rather than the
CPU, which saves tens of seconds of CPU init per case.

Synthetic micro-batches: one sample of `--seq` tokens (the recipes train one long sample per micro-batch),
ids drawn from a Zipf law (so the draft vocabulary, ranked by the same counts, covers most of them), a
two-turn chat loss mask, random features `[1, S, taps*H]` and last hidden states `[1, S, H]` in the
compute dtype. MFU counts one step's FLOPs with `flops.flops_per_step` on the sharded module itself
(world 1: it holds the whole model) at the timed shape, over `flops.device_peak_flops`.

The last stdout line is one JSON object: `{"ok", "checks": [...], "cases": [...]}`; exit status 1 if any
check or case failed or was skipped for time.
"""

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from draftsmith.core.config import TargetConfig
from draftsmith.core.config.drafter import parse_drafter
from draftsmith.core.config.train import DistributedConfig, MixedPrecisionConfig, TrainConfig
from draftsmith.drafters import families
from draftsmith.drafters.training import flops, fsdp
from draftsmith.drafters.training.loop import Micro, Trainer, micro_seed

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("eagle3", "dflash2", "dspark")
# Toy shapes for --smoke: every structural switch of the K3 recipes kept (MLA, anchors, sliding layers,
# selector, Markov and confidence heads), every width shrunk.
SMOKE_TARGET = {"hidden_size": 64, "vocab_size": 512}
SMOKE_MLA = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
SMOKE_DRAFTER = {
    "eagle3": {"num_heads": 4, "num_kv_heads": 4, "head_dim": 24, "intermediate_size": 128, "mla": SMOKE_MLA,
               "draft_vocab_size": 128, "ttt_depth": 3, "anchored": {"num_anchors": 16, "max_gap": 4}},
    "dflash2": {"num_layers": 2, "num_heads": 4, "num_kv_heads": 4, "head_dim": 24, "intermediate_size": 128,
                "mla": SMOKE_MLA, "mask_token_id": 510, "num_anchors": 8, "block_size": 4,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
                "selector_rank": 8, "selector_top_k": 4},
    "dspark": {"num_layers": 2, "num_heads": 4, "num_kv_heads": 4, "head_dim": 24, "intermediate_size": 128,
               "mla": SMOKE_MLA, "mask_token_id": 510, "num_anchors": 8, "block_size": 4, "markov_rank": 8},
}  # fmt: skip


@dataclass
class Case:
    """One family in one mode (eager or compiled) and what its run measured."""

    family: str
    compiled: bool
    status: str = "pending"  # ok | FAIL | SKIPPED
    error: str | None = None
    params_trainable: int = 0
    params_frozen: int = 0
    tokens_per_s: float | None = None
    step_ms: float | None = None
    warmup_s: float | None = None
    peak_mem_gib: float | None = None
    fused: bool | None = None
    flops_per_step: float | None = None
    mfu: float | None = None
    losses: list[float] = field(default_factory=list)


def recipe(kind: str, smoke: bool) -> tuple[TargetConfig, object, int, MixedPrecisionConfig]:
    """The K3 recipe's target declaration, drafter section, tap count and FSDP dtypes (toy-sized for smoke)."""
    path = ROOT / "deployments" / "recipes" / f"kimi-k3-{kind}.yaml"
    data = yaml.safe_load(path.read_text())
    target, drafter = dict(data["target"]), dict(data["drafter"])
    mp = MixedPrecisionConfig.model_validate(data["train"]["mixed_precision"])
    if smoke:
        target |= SMOKE_TARGET
        drafter |= SMOKE_DRAFTER[kind]
        mp = MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32")
    if mp.param_dtype != "bfloat16" and not smoke:
        raise ValueError(f"{path}: train.mixed_precision.param_dtype is {mp.param_dtype}; this check is for bf16")
    return TargetConfig.model_validate(target), parse_drafter(drafter), len(data["hidden_states"]["taps"]), mp


def target_skeleton(target: TargetConfig):
    """A one-layer DeepseekV3 (K3's attention family) with the target's width and vocabulary, on meta."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(  # type: ignore[call-arg]  # rope_* go to PretrainedConfig's **kwargs; the stub omits them
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=max(1, target.hidden_size // 112),
        num_key_value_heads=max(1, target.hidden_size // 112),
        intermediate_size=4 * target.hidden_size,
        first_k_dense_replace=1,
        rope_theta=50000.0,
        rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def zipf_probs(vocab: int, device) -> torch.Tensor:
    """`[V]` token frequencies ~ 1/rank (ids shuffled): what real loss-token counts look like."""
    g = torch.Generator().manual_seed(1)
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return (probs / probs.sum())[torch.randperm(vocab, generator=g)].float().to(device)


def synthetic_batch(S: int, H: int, taps: int, probs_V: torch.Tensor, dtype, device) -> dict[str, torch.Tensor]:
    """One collated sample `[1, S]`: prompt, answer, follow-up prompt, answer (loss on the answers)."""
    g = torch.Generator(device=device).manual_seed(2)
    ids = torch.multinomial(probs_V, S, replacement=True, generator=g)[None]
    loss_mask = torch.zeros(1, S, dtype=torch.bool, device=device)
    cuts = [int(S * f) for f in (0.1, 0.55, 0.6)]
    loss_mask[:, cuts[0] : cuts[1]] = True
    loss_mask[:, cuts[2] :] = True
    features = torch.randn(1, S, taps * H, generator=g, device=device, dtype=dtype)
    last_hidden = torch.randn(1, S, H, generator=g, device=device, dtype=dtype)
    in_draft = loss_mask.clone()
    return {"input_ids": ids, "loss_mask": loss_mask, "in_draft": in_draft, "features": features,
            "last_hidden": last_hidden}  # fmt: skip


def train_config(lr: float, mp: MixedPrecisionConfig, backend: str) -> TrainConfig:
    gpus = 1 if backend == "nccl" else 0
    return TrainConfig.model_validate(
        {
            "lr": lr,
            "schedule": "constant",
            "warmup_steps": 0,
            "optimizer_impl": "fused",
            "distributed": {"backend": backend},
            "mixed_precision": mp.model_dump(),
            "resources": {"gpus": gpus},
        }
    )


def _check_backend(d: fsdp.Dist, backend: str) -> str:
    name = dist.get_backend()
    if name != backend:
        raise RuntimeError(f"process group backend is {name}, expected {backend}")
    return f"{name}, world {d.world}, device {d.device}"


def _check_all_reduce(d: fsdp.Dist) -> str:
    x = torch.arange(1024, dtype=torch.float32, device=d.device)
    dist.all_reduce(x)
    if not torch.equal(x.cpu(), torch.arange(1024, dtype=torch.float32) * d.world):
        raise RuntimeError("all_reduce(SUM) returned wrong values")
    return f"sum of {x.numel()} floats over {d.world} rank(s) exact"


def _check_fsdp2(d: fsdp.Dist) -> str:
    """Two `fully_shard`ed Linears under the root with the recipes' policy: sharded fp32 masters, bf16 compute."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(d.device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    y = model(torch.randn(8, 256, device=d.device))
    y.float().square().mean().backward()
    w = model[0].weight
    problems = []
    if not isinstance(w, DTensor) or "Shard(dim=0)" not in str(w.placements):
        problems.append(f"weight is {type(w).__name__} {getattr(w, 'placements', '')}")
    if y.dtype != torch.bfloat16:
        problems.append(f"forward output {y.dtype}, expected bfloat16")
    if w.dtype != torch.float32 or w.grad is None or w.grad.dtype != torch.float32:
        problems.append(f"master {w.dtype}, grad {None if w.grad is None else w.grad.dtype}; expected float32")
    if w.device.type != d.device.type:
        problems.append(f"weight on {w.device}")
    if problems:
        raise RuntimeError("; ".join(problems))
    return f"Shard(0) DTensor on {w.device.type}, bf16 compute, fp32 master and grad"


def check_collectives(d: fsdp.Dist, backend: str) -> list[dict]:
    """The process group's backend, an all_reduce, and FSDP2 sharding with bf16 compute / fp32 masters."""
    checks = {
        "backend": lambda: _check_backend(d, backend),
        "all_reduce": lambda: _check_all_reduce(d),
        "fsdp2": lambda: _check_fsdp2(d),
    }
    out = []
    for name, fn in checks.items():
        try:
            out.append({"check": name, "ok": True, "detail": fn()})
        except Exception as exc:  # a check's failure is reported, the others still run
            out.append({"check": name, "ok": False, "detail": f"{type(exc).__name__}: {exc}"})
    return out


def build_module(kind: str, smoke: bool, d: fsdp.Dist, compiled: bool, case: Case):
    """The sharded `TrainModule` with its objective, as `worker.build` makes it; returns (module, cfg, generator)."""
    target, dcfg, taps, mp = recipe(kind, smoke)
    family = families.family(kind)
    V, H = target.vocab_size, target.hidden_size
    torch.manual_seed(0)
    parts = target_skeleton(target)
    probs = zipf_probs(V, d.device)
    with torch.device(d.device):
        embed = torch.nn.Parameter(torch.randn(V, H) * 0.02, requires_grad=False)
        head = torch.nn.Parameter(torch.randn(V, H) / H**0.5, requires_grad=False)
        parts.get_input_embeddings().weight, parts.get_output_embeddings().weight = embed, head
        counts = (probs.double() * 1e9).long()
        full = fsdp.TrainModule(family.build(dcfg, families.BuildInputs(target, parts, taps, counts)), None)
    skeleton = target_skeleton(target)
    with torch.device("meta"):
        meta = family.build(dcfg, families.BuildInputs(target, skeleton, taps, torch.zeros(V, dtype=torch.long)))
    module = fsdp.shard(fsdp.TrainModule(meta, None), mp, compile_layers=compiled)
    fsdp.materialize(module, full, d)
    del full, parts, embed
    dtype = fsdp.DTYPES[mp.param_dtype]
    generator = torch.Generator(device="cpu")
    module.objective = family.objective(dcfg, module.drafter, head.detach().to(d.device, dtype), generator)
    case.params_trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    case.params_frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return module, (target, taps, mp, probs), generator


def _sync(d: fsdp.Dist) -> None:
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)


def _steps(trainer: Trainer, batch: dict, first: int, n: int, case: Case) -> None:
    """`n` optimizer steps (one micro-batch each); the deferred metrics of earlier steps land in `case.losses`."""
    for i in range(first, first + n):
        raw = trainer.train_step([Micro(batch, micro_seed(0, 0, [i]))])
        if raw is not None:
            _check_record(raw, case)


def _check_record(raw: dict, case: Case) -> None:
    if raw["skipped"] or raw["loss"] != raw["loss"]:
        raise RuntimeError(f"step {raw['step']}: non-finite loss or gradient (loss {raw['loss']})")
    case.losses.append(round(raw["loss"], 5))


def run_case(case: Case, args, d: fsdp.Dist, peak: float, flops_cache: dict) -> None:
    """Build, (count FLOPs,) warm up and time one family in one mode; fills `case`."""
    if case.family == args.inject_failure:
        raise RuntimeError(f"injected failure (--inject-failure {case.family})")
    module, (target, taps, mp, probs), generator = build_module(case.family, args.smoke, d, case.compiled, case)
    if d.device.type == "cuda":  # the training footprint: rank 0's real copy is gone by now
        gc.collect()
        torch.cuda.reset_peak_memory_stats(d.device)
    dtype = fsdp.DTYPES[mp.param_dtype]
    batch = synthetic_batch(args.seq, target.hidden_size, taps, probs, dtype, d.device)
    if case.family not in flops_cache and not case.compiled:
        generator.manual_seed(micro_seed(0, 0, [0]))
        flops_cache[case.family] = flops.flops_per_step(lambda: module(batch)[0])
        module.zero_grad(set_to_none=True)
    cfg = train_config(args.lr, mp, args.backend)
    trainer = Trainer(module, cfg, d, args.warmup + args.steps, generator)
    case.fused = bool(trainer.fused) and all(g.get("fused") for g in trainer.opt.param_groups)
    start = time.perf_counter()
    _steps(trainer, batch, 0, args.warmup, case)
    _sync(d)
    case.warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    _steps(trainer, batch, args.warmup, args.steps, case)
    _sync(d)
    seconds = (time.perf_counter() - start) / args.steps
    last = trainer.flush()
    if last is not None:
        _check_record(last, case)
    case.step_ms = seconds * 1e3
    case.tokens_per_s = batch["input_ids"].numel() / seconds
    if d.device.type == "cuda":
        case.peak_mem_gib = torch.cuda.max_memory_allocated(d.device) / 2**30
    case.flops_per_step = flops_cache.get(case.family)
    if case.flops_per_step:
        case.mfu = flops.mfu(case.flops_per_step, seconds, peak)
    if not case.fused and args.backend == "nccl":
        raise RuntimeError("AdamW is not fused on CUDA")


def _cleanup(d: fsdp.Dist, compiled: bool) -> None:
    gc.collect()
    if compiled:
        torch._dynamo.reset()
    if d.device.type == "cuda":
        torch.cuda.empty_cache()


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(checks: list[dict], cases: list[Case]) -> str:
    lines = ["| check | ok | detail |", "| --- | --- | --- |"]
    lines += [f"| {c['check']} | {'yes' if c['ok'] else 'NO'} | {c['detail']} |" for c in checks]
    lines += [
        "",
        "| family | mode | status | trainable M | frozen M | tokens/s | step ms | warm-up s | peak GiB | fused "
        "| TFLOP/step | MFU | losses |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in cases:
        tflop = None if c.flops_per_step is None else c.flops_per_step / 1e12
        lines.append(
            f"| {c.family} | {'compiled' if c.compiled else 'eager'} | {c.status} | {c.params_trainable / 1e6:.1f} "
            f"| {c.params_frozen / 1e6:.1f} | {_fmt(c.tokens_per_s, ',.0f')} | {_fmt(c.step_ms, '.1f')} "
            f"| {_fmt(c.warmup_s, '.1f')} | {_fmt(c.peak_mem_gib, '.1f')} | {c.fused} | {_fmt(tflop, '.4g')} "
            f"| {_fmt(c.mfu, '.3f')} | {c.losses[0] if c.losses else '-'} -> {c.losses[-1] if c.losses else '-'} |"
        )
    for fam in dict.fromkeys(c.family for c in cases):
        eager = next((c for c in cases if c.family == fam and not c.compiled and c.status == "ok"), None)
        comp = next((c for c in cases if c.family == fam and c.compiled and c.status == "ok"), None)
        if eager and comp and eager.tokens_per_s and comp.tokens_per_s:
            lines.append(f"compile speed-up {fam}: {comp.tokens_per_s / eager.tokens_per_s:.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, toy widths, fp32, no compile.")
    p.add_argument("--families", default=",".join(FAMILIES), help="Comma-separated drafter families.")
    p.add_argument("--modes", default=None, help="eager,compiled (default; smoke: eager).")
    p.add_argument("--seq", type=int, default=None, help="Tokens per micro-batch (default 4096; smoke 64).")
    p.add_argument("--warmup", type=int, default=None, help="Untimed steps (default 2; smoke 1).")
    p.add_argument("--steps", type=int, default=None, help="Timed steps (default 5; smoke 2).")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--inject-failure", default=None, help="Fail this family's cases at once (self-test).")
    p.add_argument("--budget-s", type=float, default=300.0, help="Start no case after this many seconds.")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.modes = (args.modes or ("eager" if smoke else "eager,compiled")).split(",")
    args.seq = args.seq or (64 if smoke else 4096)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 2)
    args.steps = args.steps or (2 if smoke else 5)
    args.backend = "gloo" if smoke else "nccl"
    args.families = args.families.split(",")
    bad = [f for f in args.families if f not in FAMILIES] + [m for m in args.modes if m not in ("eager", "compiled")]
    if bad:
        p.error(f"unknown family or mode: {', '.join(bad)}")
    return args


def environment(d: fsdp.Dist) -> str:
    import transformers

    parts = [f"torch {torch.__version__}", f"transformers {transformers.__version__}", f"device {d.device}"]
    if d.device.type == "cuda":
        parts += [torch.cuda.get_device_name(d.device), f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}"]
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.smoke:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    d = fsdp.init_distributed(DistributedConfig(backend=args.backend, timeout_s=600))
    print(f"gpu_train_check: {environment(d)}", flush=True)
    checks = check_collectives(d, args.backend)
    for c in checks:
        print(f"check {c['check']}: {'ok' if c['ok'] else 'FAILED'}: {c['detail']}", flush=True)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    peak, source = flops.device_peak_flops(d.device, dtype, override=None)
    print(f"peak {peak / 1e12:.1f} TFLOP/s ({source})", flush=True)
    # Eager cases first: if compilation eats the budget, the compiled cases are the ones skipped.
    cases = [Case(f, m == "compiled") for m in args.modes for f in args.families]
    flops_cache: dict[str, float] = {}
    for case in cases:
        if time.perf_counter() - t0 > args.budget_s:
            case.status, case.error = "SKIPPED", f"time budget {args.budget_s:.0f} s spent"
            continue
        try:
            run_case(case, args, d, peak, flops_cache)
            case.status = "ok"
        except Exception as exc:  # one family's failure must not hide the others'
            case.status, case.error = "FAIL", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        _cleanup(d, case.compiled)
        mode = "compiled" if case.compiled else "eager"
        print(f"case {case.family} {mode}: {case.status} {case.error or ''} {_fmt(case.tokens_per_s, ',.0f')} tok/s "
              f"({time.perf_counter() - t0:.0f} s elapsed)", flush=True)  # fmt: skip
    print(table(checks, cases), flush=True)
    ok = all(c["ok"] for c in checks) and all(c.status == "ok" for c in cases)
    report = {"ok": ok, "environment": environment(d), "peak_flops": peak, "peak_source": source, "checks": checks,
              "cases": [vars(copy.copy(c)) for c in cases], "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
