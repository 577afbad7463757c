"""Run folders for `draftsmith doctor`'s tests: a healthy run written with the stages' own record formats, each
figure derived as the stages derive it, and a fake vLLM server with spec-decode counters.

`healthy_run(path)` writes manifests, `train/metrics.jsonl`, `train/config.json` (an EAGLE-3 serving config),
`train/model.safetensors` (fusion weights and a pruned vocabulary), the evaluation's plot, and its `prompts.jsonl` rows
simulated round by round with `Decoded.record`, summed by `harness.summarise_bench` and `evaluate.headline`.
Each keyword plants one defect; tests then assert the doctor names it.
"""

import json
import math
import random
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from PIL import Image

from draftsmith.core import tensorio
from draftsmith.core.manifest import StageManifest, entry
from draftsmith.drafters.speculative import Decoded, Draft
from draftsmith.drafters.verify import Sampling
from draftsmith.evals import harness
from draftsmith.tasks.evaluate import headline

VOCAB, DRAFT_VOCAB, TAPS, HIDDEN, G = 256, 64, [1, 2, 3], 64, 3
TEMPLATE = "a" * 64
GOOD_PROBS = (0.7, 0.6, 0.5)  # conditional acceptance of draft positions 1..3 in a healthy run


@dataclass
class Plan:
    """What the healthy run looks like; each field set otherwise plants one defect."""

    loss: str = "settling"  # settling | diverging | still-falling | flat | plateau | nan
    lr: str = "cosine"  # cosine | constant
    skipped_steps: int = 0
    train_acc: tuple[float, ...] = (0.72, 0.62, 0.52)
    probs: tuple[float, ...] = GOOD_PROBS
    long_probs: tuple[float, ...] | None = None  # acceptance in rows with long prompts
    copying: bool = False  # answers copied from the prompt
    # First-draft acceptance where the answer copies the prompt and elsewhere; answers alternate copied and
    # fresh spans. None: acceptance does not depend on copying.
    copy_rates: tuple[float, float] | None = None
    outside_vocab: float = 0.0  # share of answer tokens outside the draft vocabulary
    layer_ids: list[int] = field(default_factory=lambda: list(TAPS))
    idle_tap: int | None = None  # index of a tap whose fusion block is left at its start
    idle_start: str = "uniform"  # uniform (nn.Linear's init) | zero (drafter.init_fc_last_tap's)
    last_tap_identity: bool = False  # init_fc_last_tap's identity on the last tap, small trained weights on the others
    thinking: tuple[str, str] = ("off", "off")  # regenerate, tokenize
    eval_template: str = TEMPLATE
    loss_share: float = 0.4
    served_first: float | None = None  # speedup.json's first-draft acceptance
    system_prompts: tuple[float, float] = (0.2, 0.1)  # shares of training and evaluated prompts with a system message


def _manifest(run: Path, stage: str, **fields) -> None:
    files = [entry(p.name, p.read_bytes()) for p in sorted((run / stage).glob("*")) if p.name != "manifest.json"]
    m = StageManifest(stage=stage, key=f"{stage}-key", uri=".", files=files, **fields)
    (run / stage / "manifest.json").write_text(json.dumps(m.to_disk()))


def _losses(plan: Plan, steps: int) -> list[float]:
    out = []
    for s in range(steps):
        if plan.loss == "still-falling":
            out.append(5.0 - 2.5 * s / steps)
        elif plan.loss == "flat":
            out.append(5.0 - 0.1 * s / steps)
        elif plan.loss == "plateau":  # all of the fall in the first tenth
            out.append(2.0 + 3.0 * math.exp(-s / (steps / 40)))
        else:
            out.append(2.0 + 3.0 * math.exp(-s / (steps / 5)))
            if plan.loss == "diverging" and s > 0.8 * steps:
                out[-1] += 0.2 * (s - 0.8 * steps)
    return out


def _metrics(plan: Plan, steps: int = 200) -> list[dict]:
    records = []
    for s, loss in enumerate(_losses(plan, steps), 1):
        loss = math.nan if plan.loss == "nan" and s in (150, 151) else loss
        lr = 1e-3 if plan.lr == "constant" else 1e-4 + 0.45e-3 * (1 + math.cos(math.pi * s / steps))
        skipped = s > steps - plan.skipped_steps
        rec = {"step": s, "epoch": 0, "loss": loss, "lr": lr, "skipped": skipped, "tokens": 512, "loss_tokens": 200}
        rec |= {f"acc_{k}": a for k, a in enumerate(plan.train_acc)}
        rec["skipped_steps"] = max(0, s - (steps - plan.skipped_steps))
        records.append(rec)
    return records


def _answer(rng: random.Random, prompt: list[int], n: int, plan: Plan) -> list[int]:
    if plan.copying:
        start = rng.randrange(0, len(prompt) - n)
        return prompt[start : start + n]
    out = []
    for _ in range(n):
        outside = rng.random() < plan.outside_vocab
        out.append(rng.randrange(DRAFT_VOCAB, VOCAB) if outside else rng.randrange(0, DRAFT_VOCAB))
    return out


SPAN = 8  # tokens in each copied or fresh span of a `copy_rates` answer


def _spans(rng: random.Random, prompt: list[int], n: int) -> list[int]:
    """Copied spans of the prompt alternating with fresh tokens (which the prompt never holds)."""
    out: list[int] = []
    while len(out) < n:
        start = rng.randrange(0, len(prompt) - SPAN)
        out += prompt[start : start + SPAN]
        out += [rng.randrange(DRAFT_VOCAB // 2, DRAFT_VOCAB) for _ in range(SPAN)]
    return out[:n]


def _first_prob(plan: Plan, probs: tuple[float, ...], pos: int) -> float:
    """The first draft's acceptance at output position `pos`; inside a copied span from its third token on, the
    context holds the next token (prompt lookup needs two matching tokens before it)."""
    if plan.copy_rates is None:
        return probs[0]
    copied = (pos // SPAN) % 2 == 0 and pos % SPAN >= 2
    return plan.copy_rates[0] if copied else plan.copy_rates[1]


def _row(rng: random.Random, bench: str, i: int, prompt_len: int, plan: Plan, probs: tuple[float, ...]) -> dict:
    top = DRAFT_VOCAB // 2 if plan.copy_rates else DRAFT_VOCAB  # a copy plan's fresh spans use the other half
    prompt = [rng.randrange(0, top) for _ in range(prompt_len)]
    output = _spans(rng, prompt, 48) if plan.copy_rates else _answer(rng, prompt, 48, plan)
    spec = Decoded(tokens=output, seconds=0.5)
    emitted = 1  # the prefill's token
    while emitted < len(output):
        n_acc = 0
        while n_acc < G and rng.random() < (_first_prob(plan, probs, emitted) if n_acc == 0 else probs[n_acc]):
            n_acc += 1
        n_acc = min(n_acc, len(output) - emitted - 1)  # the last round emits what is left
        spec.record(Draft(torch.zeros(G, dtype=torch.long)), n_acc)
        emitted += n_acc + 1
    # A row as `evals.harness` writes it into prompts.jsonl.
    return {
        "id": f"{bench}-{i}", "category": bench, "turn": 0, "tokens": len(output), "baseline_tokens": len(output),
        "rounds": spec.rounds, "accepted": spec.accepted, "drafted": spec.drafted, "accept_hist": spec.accept_hist,
        "position_tries": spec.position_tries, "position_accepts": spec.position_accepts,
        "round_accepts": spec.round_accepts, "confidence": [], "identical": True, "output_ids": output,
        "baseline_seconds": 1.0, "speculative_seconds": 0.5, "prompt_tokens": len(prompt), "prompt_ids": prompt,
        "bench": bench,
    }  # fmt: skip


def _evaluation(plan: Plan, seed: int = 0) -> tuple[dict, list[dict]]:
    rng = random.Random(seed)
    settings = harness.EvalSettings(Sampling(0.0, 1.0), "greedy", 48, G, seed)
    results, rows = [], []
    for bench in ("held-out", "math"):
        bench_rows = []
        for i in range(16):
            long = i % 2 == 1
            probs = plan.long_probs if long and plan.long_probs else plan.probs
            bench_rows.append(_row(rng, bench, i, 700 if long else 120, plan, probs))
        results.append(harness.summarise_bench(bench, "eagle3", bench_rows, settings) | {"seconds": 8.0})
        rows += bench_rows
    out = headline("eagle3", results, G) | {"benches": results, "temperature": 0.0, "top_p": 1.0, "batch_size": 1}
    asked = {"system_prompts": int(out["prompts"] * plan.system_prompts[1]), "prompts": out["prompts"]}
    return out | {"chat_template": {"sha256": plan.eval_template, "thinking": "template default"} | asked}, rows


def _config(plan: Plan) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "eagle_aux_hidden_state_layer_ids": plan.layer_ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": plan.layer_ids, "use_aux_hidden_state": True},
        "draftsmith": {"taps": TAPS, "engine": "vllm", "num_target_layers": 4, "ttt_depth": G},
    }


def _weights(plan: Plan) -> bytes:
    g = torch.Generator().manual_seed(0)
    fan_in = len(TAPS) * HIDDEN
    fc = torch.randn(HIDDEN, fan_in, generator=g)
    if plan.last_tap_identity:  # trained from init_fc_last_tap's start: small, below the default init's bound
        fc = 0.3 * fc / fan_in**0.5
        fc[:, -HIDDEN:] += torch.eye(HIDDEN)
    if plan.idle_tap is not None:
        block = fc[:, plan.idle_tap * HIDDEN : (plan.idle_tap + 1) * HIDDEN]
        bound = 1 / fan_in**0.5
        block.copy_(
            torch.zeros_like(block)
            if plan.idle_start == "zero"
            else torch.rand(block.shape, generator=g) * 2 * bound - bound
        )
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[:DRAFT_VOCAB] = True
    tensors = {"fc.weight": fc, "midlayer.mlp.weight": torch.randn(64, 64, generator=g), "t2d": t2d}
    return tensorio.dumps(tensors | {"d2t": torch.zeros(DRAFT_VOCAB, dtype=torch.long)})


def healthy_run(run: Path, plan: Plan | None = None) -> Path:
    """Write a finished run folder at `run` as `plan` says (default: healthy) and return it."""
    plan = plan or Plan()
    for stage in ("regenerate", "tokenize", "hidden_states", "train", "evaluate"):
        (run / stage).mkdir(parents=True, exist_ok=True)
    system = {"prompts": 500, "system_prompts": int(500 * plan.system_prompts[0])}
    _manifest(run, "regenerate", counts=system, info={"chat_template_sha256": TEMPLATE, "thinking": plan.thinking[0]})
    tokens = 100_000
    counts = {"samples": 500, "tokens": tokens, "loss_tokens": int(plan.loss_share * tokens), "truncated": 3}
    _manifest(run, "tokenize", counts=counts, info={"chat_template_sha256": TEMPLATE, "thinking": plan.thinking[1]})
    _manifest(run, "hidden_states", info={"taps": ",".join(map(str, TAPS))})
    records = _metrics(plan)
    (run / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "train" / "config.json").write_text(json.dumps(_config(plan)))
    (run / "train" / "model.safetensors").write_bytes(_weights(plan))
    metrics = {f"acc_{k}": a for k, a in enumerate(plan.train_acc)} | {"loss": records[-1]["loss"]}
    _manifest(run, "train", counts={"steps": len(records), "skipped_steps": plan.skipped_steps}, metrics=metrics)
    results, rows = _evaluation(plan)
    (run / "evaluate" / "results.json").write_text(json.dumps(results))
    (run / "evaluate" / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Image.new("RGB", (4, 3), "white").save(run / "evaluate" / "acc_len_by_bench.png")
    _manifest(run, "evaluate", counts={"prompts": results["prompts"]})
    if plan.served_first is not None:
        write_speedup(run, plan.served_first)
    return run


def write_speedup(run: Path, first: float, drafts: int = 4000) -> None:
    """`speedup/speedup.json` with a drafter server whose counters accept `first` of first drafts."""
    accepted = [int(first * drafts), int(first * 0.6 * drafts), int(first * 0.3 * drafts)]
    counters = {"num_drafts": drafts, "num_draft_tokens": G * drafts, "num_accepted_tokens": sum(accepted),
                "accepted_per_pos": accepted}  # fmt: skip
    servers = [{"name": "plain", "method": "plain", "draft_tokens": None, "args": []},
               {"name": "drafter-3", "method": "drafter", "draft_tokens": G, "args": []}]  # fmt: skip
    (run / "speedup").mkdir(exist_ok=True)
    (run / "speedup" / "speedup.json").write_text(json.dumps({"servers": servers, "server_counters":
                                                              {"plain": None, "drafter-3": counters}}))  # fmt: skip


class FakeVLLM:
    """`/v1/models`, `/v1/completions` and `/metrics` of a vLLM server with a drafter: each completion of
    `max_tokens` adds drafts whose first position is accepted `first` of the time."""

    def __init__(self, first: float) -> None:
        self.first, self.drafts, self.accepted = first, 100, [50, 30, 10]
        self.completions: list[dict] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def metrics(self) -> str:
        lines = [f'vllm:spec_decode_num_drafts_total{{engine="0"}} {self.drafts}.0',
                 f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {G * self.drafts}.0',
                 f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {sum(self.accepted)}.0']  # fmt: skip
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{k}"}} {a}.0'
                  for k, a in enumerate(self.accepted)]  # fmt: skip
        return "\n".join(lines) + "\n"

    def complete(self, path: str, body: dict) -> None:
        with self.lock:
            self.completions.append(body | {"path": path})
            n = int(body["max_tokens"])
            self.drafts += n
            self.accepted[0] += round(self.first * n)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, text: str, kind: str = "application/json") -> None:
                data = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(fake.metrics(), "text/plain")
                else:
                    self._send(json.dumps({"data": [{"id": "tiny-target"}]}))

            def do_POST(self) -> None:
                fake.complete(self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self._send(json.dumps({"choices": [{"text": "x"}]}))

        return Handler

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
