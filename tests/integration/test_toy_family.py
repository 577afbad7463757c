"""A new drafter family with no edit outside its own file (`tests/support/toy_family.py`): registered as a plugin, it
goes through `draftsmith validate` and `draftsmith plan`, the train stage (its torchrun rank loads the plugin
from the environment), the evaluate stage and `draftsmith export`, on the tiny target."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftsmith.core import plugins, storage
from draftsmith.core.config import drafter as drafter_config
from draftsmith.core.config import load_recipe
from draftsmith.drafters import families
from draftsmith.drafters.export.bundle import export_run
from draftsmith.tasks.evaluate import evaluate
from draftsmith.tasks.train import train
from tests.support.plugin_registry import plugin_loaded

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
TOY_MODULE = "tests.support.toy_family"
TOY = {"kind": "toy", "draft_vocab_size": 512, "heads": 2, "head_dim": 16}


@pytest.fixture
def toy_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with plugin_loaded(TOY_MODULE):
        yield os.environ.copy()


def test_the_family_is_gone_from_the_registries_once_the_plugin_is_unloaded():
    with plugin_loaded(TOY_MODULE):
        assert "toy" in families.kinds() and "toy" in drafter_config.drafter_kinds()
    assert "toy" not in families.kinds() and "toy" not in drafter_config.drafter_kinds()
    with pytest.raises(ValueError, match="'toy'"):
        drafter_config.parse_drafter(TOY)


def _recipe(tmp_path: Path) -> Path:
    recipe = yaml.safe_load((ROOT / "deployments" / "recipes" / "tiny-cpu.yaml").read_text())
    recipe["drafter"] = TOY
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    draftsmith = Path(sys.executable).parent / "draftsmith"
    return subprocess.run([str(draftsmith), *args], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_a_family_defined_in_tests_validates_plans_trains_evaluates_and_exports(toy_env, tiny_run, tmp_path):
    path = _recipe(tmp_path)
    checked = _cli(["validate", str(path)], toy_env)
    assert checked.returncode == 0, checked.stderr
    plan = _cli(["plan", str(path)], toy_env)
    assert plan.returncode == 0 and "toy (2 heads x 16, depth 2, draft vocab 512)" in plan.stdout, plan.stdout
    unknown = _cli(["validate", str(path)], toy_env | {plugins.ENV: ""})  # without the plugin, no such family
    assert unknown.returncode == 2 and "drafter" in unknown.stderr and "'toy'" in unknown.stderr, unknown.stderr

    cfg = load_recipe(path)
    assert type(cfg.drafter).__name__ == "ToyConfig" and "toy" in families.kinds()
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(path.read_text())
    ckpt = train(
        cfg.train, cfg.drafter, cfg.target, cfg.hidden_states, tiny_run["tokenize"], tiny_run["hidden_states"],
        seed=cfg.seed, out_uri=str(run / "train"),
    )  # fmt: skip
    assert ckpt.info["drafter"] == "toy"
    history = storage.read_jsonl(ckpt.path("metrics.jsonl"))
    assert [k for k in history[0] if k.startswith("acc_")] == ["acc_0", "acc_1"]  # its own depth, 2
    assert history[-1]["loss"] < history[0]["loss"]

    ev = evaluate(
        cfg.evaluate, cfg.drafter, cfg.target, tiny_run["select_prompts"], ckpt, out_uri=str(run / "evaluate")
    )
    results = storage.read_json(ev.path("results.json"))
    assert results["drafter"] == "toy" and results["mismatched_outputs"] == 0
    assert 1.0 <= results["acc_len"]["overall"] <= cfg.evaluate.num_draft_tokens + 1

    exported = export_run(str(run), "vllm", platform="cpu")
    assert exported.method == "eagle3" and exported.num_speculative_tokens == 2
    config = json.loads((Path(exported.folder) / "config.json").read_text())
    assert config["draftsmith"]["ttt_depth"] == 2 and config["architectures"] == ["LlamaForCausalLMEagle3"]
