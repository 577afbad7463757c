"""The peer's forward on this project's exports: `.venv-speculators/bin/python -m benchmarks.workers.peer_forward JOBS`.

JOBS is a JSON list of `{family, folder, verifier, inputs, out}`; `inputs` and `out` are safetensors files.
One process runs every job, so speculators is imported once. Per job it prints one JSON line: the load report
of `benchmarks.helpers.peer_models.load_exported`.

Inputs (all batch 1): `input_ids` `[1, S]` int64 (unshifted), `features` `[1, S, taps*H]`; EAGLE-3 also
`depth` `[1]`; block drafters also `anchors` `[N]`, `last_hidden` `[1, S, H]`, and for DFlash2 `pred` `[1, Q]`
and `cand` `[1, Q, K]`. Outputs: EAGLE-3 `logits` `[depth, 1, S, Vd]` (one per TTT step); block drafters
`logits` `[1, N*block, V]` (DSpark: with its Markov bias) and `hidden` (after the final norm); DSpark also
`confidence`; DFlash2 also `selector` `[1, Q, K]`, the selector's transition scores for `pred` and `cand`.
"""

import json
import sys
from contextlib import contextmanager
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

from benchmarks.helpers.peer_models import load_exported


@contextmanager
def _capture(module: torch.nn.Module, store: list):
    handle = module.register_forward_hook(lambda _m, _i, out: store.append(out.detach()))
    try:
        yield
    finally:
        handle.remove()


def eagle3(model, x: dict) -> dict:
    """TTT logits. The peer takes input_ids already shifted by one (its `shift_batch`): position t carries
    token t+1, which is what our drafter's depth 0 embeds; positions are passed so both rotate alike."""
    ids = x["input_ids"]
    shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    S = ids.shape[1]
    steps: list = []
    with _capture(model.lm_head, steps), torch.no_grad():
        model(
            hidden_states=x["features"],
            input_ids=shifted,
            document_ids=torch.zeros_like(ids),
            position_ids=torch.arange(S)[None],
            ttt_steps=int(x["depth"][0]),
        )
    return {"logits": torch.stack(steps)}


def block(family: str, model, x: dict) -> dict:
    """One training forward with our anchors in place of the peer's random ones; the logits are read where the
    peer hands them to its loss (DSpark: after the Markov bias)."""
    import speculators.models.dflash.core as dflash_core

    anchors = x["anchors"]
    ids = x["input_ids"]
    seen: dict = {}
    hidden: list = []
    metrics_module = {"dspark": "speculators.models.dspark.core", "dflash2": "speculators.models.dflash2.core"}

    def grab(*args, **kwargs):
        seen.update(kwargs, args=args)
        return torch.zeros(()), {}

    fixed = (anchors, torch.ones_like(anchors, dtype=torch.bool))
    with (
        mock.patch.object(dflash_core, "select_anchors", lambda *_a, **_k: fixed),
        mock.patch(f"{metrics_module.get(family, 'speculators.models.dflash.core')}.compute_metrics", grab),
        _capture(model.norm, hidden),
        torch.no_grad(),
    ):
        model(
            hidden_states=x["features"],
            input_ids=ids,
            loss_mask=torch.ones_like(ids),
            verifier_last_hidden_states=x["last_hidden"],
            document_ids=torch.zeros_like(ids),
            max_anchors=anchors.numel(),
        )
    logits = seen.get("unary_logits", seen["args"][0] if seen.get("args") else None)
    out = {"logits": logits, "hidden": hidden[-1]}
    if family == "dspark":
        out["confidence"] = seen["args"][2]
    if family == "dflash2":
        with torch.no_grad():
            out["selector"] = model.candidate_selector.transition_scores(hidden[-1], x["pred"], x["cand"])
    return out


def main(jobs_path: str) -> None:
    torch.manual_seed(0)
    for job in json.loads(open(jobs_path).read()):
        model, report = load_exported(job["family"], job["folder"], job["verifier"])
        x = load_file(job["inputs"])
        out = eagle3(model, x) if job["family"] == "eagle3" else block(job["family"], model, x)
        save_file({k: v.contiguous() for k, v in out.items()}, job["out"])
        print(json.dumps({"family": job["family"], "folder": job["folder"], **report}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
