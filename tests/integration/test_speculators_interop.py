"""Our exported drafters in the vLLM project's drafter library (speculators 0.9.0, `.venv-speculators`).

Tiny drafters with random weights (norm gains too, so that a swapped norm shows) are exported with our code
for the tiny target, then loaded by the peer (`benchmarks/helpers/peer_models.py`: its EAGLE-3 and DFlash converters;
its DFlash2 and DSpark classes, which take our names unchanged, as it has no loader for the vLLM layout of
those). One subprocess of the peer's venv runs the forward of every export on the same inputs (safetensors
files both ways); the outputs must equal ours, which are computed from the export reloaded (bf16 weights)
in fp32, the precision the peer runs in. A control export with two tensors swapped must differ.
"""

import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.drafters import vocab
from draftsmith.drafters.dflash import export as dflash_export
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.dflash.spec import DFlashSpec
from draftsmith.drafters.dspark import export as dspark_export
from draftsmith.drafters.dspark.model import DSparkDrafter, DSparkSpec
from draftsmith.drafters.eagle3 import export as eagle3_export
from draftsmith.drafters.eagle3.model import Eagle3Drafter, Eagle3Spec
from draftsmith.drafters.export import bundle
from tests.support import venvs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
TAPS = [1, 2, 3]
S, ANCHORS, DEPTH = 24, [2, 7, 11, 15], 3
# Both sides run the same bf16-rounded weights in fp32; they differ only in the order of float operations
# (SDPA against our explicit softmax for EAGLE-3; the block drafters matched bit for bit here). fp32 rounding
# over these few-hundred-term sums stays near 1e-6 on logits of size ~5 (4.4e-6 measured), so 1e-4 has 20x
# headroom, while one swapped or misplaced tensor moves the logits by 0.1 or more (the control below).
ATOL = RTOL = 1e-4
SWAPS = {  # control exports: two same-shaped tensors exchanged
    "eagle3": ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight"),
    "dspark": ("layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"),
}


def _msg(where: str, message: str) -> str:
    return f"{where}: {message}"


def _spec_args(V: int) -> dict[str, Any]:
    return dict(
        hidden_size=64, target_hidden_size=64, num_taps=len(TAPS), num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=V,
    )  # fmt: skip


def _drafters(V: int) -> dict[str, tuple[str, torch.nn.Module]]:
    """`{case: (export method, model)}`; EAGLE-3.1 adds the per-tap fc norms and the normed hidden feedback."""
    block = _spec_args(V) | {"num_layers": 2, "block_size": 4, "mask_token_id": 16}
    dflash2: dict[str, Any] = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    return {
        "eagle3": ("eagle3", Eagle3Drafter(Eagle3Spec(**_spec_args(V), draft_vocab_size=512))),
        "eagle3.1": (
            "eagle3",
            Eagle3Drafter(Eagle3Spec(**_spec_args(V), draft_vocab_size=512, fc_norm=True, norm_output=True)),
        ),
        "dflash": ("dflash", DFlashDrafter(DFlashSpec(**block))),
        "dflash2": ("dflash", DFlashDrafter(DFlashSpec(**block, **dflash2))),
        "dspark": ("dspark", DSparkDrafter(DSparkSpec(**block, markov_rank=8))),
    }


@torch.no_grad()
def _randomise(model: torch.nn.Module, embed: torch.Tensor, head: torch.Tensor, seed: int) -> None:
    """Random weights everywhere (gains 1 +- 0.2), the target's embedding, and its head where it is shared."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight":
            p.copy_(embed)
        elif name == "lm_head.weight" and p.shape == head.shape:
            p.copy_(head)
        else:
            p.copy_(
                (1.0 if p.dim() == 1 else 0.0) + (0.2 if p.dim() == 1 else 0.15) * torch.randn(p.shape, generator=g)
            )
    if isinstance(model, Eagle3Drafter):
        d2t, t2d = vocab.build_draft_vocab(torch.arange(embed.shape[0]).flip(0), model.spec.draft_vocab_size)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)


@torch.no_grad()
def _ours(case: str, folder: Path, embed, head, x: dict) -> dict[str, torch.Tensor]:
    """Our outputs from the export folder reloaded by our own loader (the weights the peer reads)."""
    ids, feats = x["input_ids"], x["features"]
    if case.startswith("eagle3"):
        model, _ = eagle3_export.load_drafter(str(folder), embed)
        return {"logits": torch.stack(model.ttt_forward(ids, feats, DEPTH))}
    module = dspark_export if case == "dspark" else dflash_export
    model, _ = module.load_drafter(str(folder), embed, head)
    anchors = x["anchors"][None]
    h = model.train_hidden(ids, feats, anchors, torch.ones_like(anchors, dtype=torch.bool))
    flat = h.reshape(1, -1, h.shape[-1])
    out = {"hidden": flat}
    if case == "dspark":
        logits, conf, _ = model.heads(h, model.prev_tokens(ids, anchors))
        return out | {"logits": logits.reshape(1, flat.shape[1], -1), "confidence": conf.reshape(1, -1)}
    out["logits"] = model.logits(flat)
    if case == "dflash2":
        out["selector"] = model.candidate_selector.pair(x["pred"], flat, x["cand"])
    return out


def _inputs(case: str, V: int, H: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = {
        "input_ids": torch.randint(0, V, (1, S), generator=g),
        "features": torch.randn(1, S, len(TAPS) * H, generator=g),
    }
    if case.startswith("eagle3"):
        return x | {"depth": torch.tensor([DEPTH])}
    x |= {"anchors": torch.tensor(ANCHORS), "last_hidden": torch.randn(1, S, H, generator=g)}
    if case == "dflash2":
        Q = len(ANCHORS) * 4
        x |= {"pred": torch.randint(0, V, (1, Q), generator=g), "cand": torch.randint(0, V, (1, Q, 4), generator=g)}
    return x


def _swapped(folder: Path, out: Path, names: tuple[str, str]) -> Path:
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    a, b = names
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def interop(tmp_path_factory) -> dict:
    """`{job: (our outputs, peer outputs, load report)}` for every case and for the swapped controls."""
    venvs.require("speculators")
    from draftsmith.core.target_setup import resolve_target

    target = resolve_target("embedded:tiny-llama")
    embed, head = bundle.target_weights(target)
    V, H = embed.shape
    tmp = tmp_path_factory.mktemp("interop")
    jobs, ours = [], {}
    for seed, (case, (method, model)) in enumerate(_drafters(V).items()):
        _randomise(model, embed, head, seed)
        blobs = bundle.export_drafter(
            method, model.eval(), TAPS, {}, engine="vllm", num_target_layers=4, target_embed_VH=embed
        )
        folder = bundle.write_folder(tmp / case, blobs)
        x = _inputs(case, V, H)
        save_file(x, str(tmp / f"{case}.in.safetensors"))
        folders = {case: folder}
        if case in SWAPS:
            folders[f"{case}-swapped"] = _swapped(folder, tmp / f"{case}-swapped", SWAPS[case])
        for job, path in folders.items():
            family = "dflash2" if case == "dflash2" else method
            jobs.append({"family": family, "folder": str(path), "verifier": str(target)})
            jobs[-1] |= {"inputs": str(tmp / f"{case}.in.safetensors"), "out": str(tmp / f"{job}.out.safetensors")}
            ours[job] = _ours(case, folder, embed, head, x)
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    cmd = [str(PEER_PYTHON), "-m", "benchmarks.workers.peer_forward", str(tmp / "jobs.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    reports = {r["folder"]: r for r in map(json.loads, filter(None, proc.stdout.splitlines()))}
    return {job: (ours[job], load_file(j["out"]), reports[j["folder"]]) for job, j in zip(ours, jobs, strict=True)}


@pytest.mark.parametrize("case", ["eagle3", "eagle3.1", "dflash", "dflash2", "dspark"])
def test_peer_loads_our_export_and_computes_the_same(interop, case):
    ours, peer, report = interop[case]
    # Every tensor we export has a peer parameter of that name, and the peer has none we leave unset.
    assert report["unexpected"] == [] and report["unfilled"] == [] and report["nan"] == [], report
    # The peer's EAGLE-3 converter drops the per-tap fc norms (its intermediate model has none); nothing else
    # may arrive changed. `benchmarks.helpers.peer_models` puts the dropped ones back by name, so the forward
    # still compares.
    expected = [f"fc_norm.{i}.weight" for i in range(len(TAPS))] if case == "eagle3.1" else []
    assert report["dropped"] == expected, report
    assert set(peer) == set(ours)
    for name, value in ours.items():
        torch.testing.assert_close(
            peer[name], value, atol=ATOL, rtol=RTOL, msg=functools.partial(_msg, f"{case} {name}")
        )


@pytest.mark.parametrize("case", list(SWAPS))
def test_a_swapped_tensor_is_caught(interop, case):
    ours, peer, report = interop[f"{case}-swapped"]
    assert report["unexpected"] == [] and report["unfilled"] == []
    assert (peer["logits"] - ours["logits"]).abs().max() > 100 * ATOL
