"""`draftsmith submit` checks a recipe whole before any flow run exists: rules across fields and the target's
shape, which the deployment's JSON schema cannot express; local files are left to the workers that read them."""

from pathlib import Path

import pytest
import yaml

from draftsmith import cli
from draftsmith.cli_submit import recipe_for
from draftsmith.core.config import RecipeError

pytestmark = pytest.mark.unit

RECIPE = Path(__file__).resolve().parents[2] / "deployments" / "recipes" / "tiny-cpu.yaml"


def test_a_tap_beyond_the_target_is_refused_naming_the_field():
    with pytest.raises(RecipeError) as err:
        recipe_for("kimi-k3/eagle3", RECIPE, {"hidden_states.taps": [1, 2, 40]})
    assert "hidden_states.taps[2]" in str(err.value) and "(from --set)" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_the_target_shape_is_checked_against_its_config(tmp_path):
    data = yaml.safe_load(RECIPE.read_text())
    data["target"]["hidden_size"] += 8
    (recipe := tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match=r"target.hidden_size: the recipe says \d+ but the model's config.json"):
        recipe_for("kimi-k3/eagle3", recipe, {})


def test_local_files_are_the_workers_to_check(tmp_path):
    data = yaml.safe_load(RECIPE.read_text())
    data["select"]["path"] = "/data/on/the/cluster/prompts.jsonl"
    (recipe := tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    assert recipe_for("kimi-k3/eagle3", recipe, {}).select.path == "/data/on/the/cluster/prompts.jsonl"


def test_without_a_server_nothing_is_started(monkeypatch, capsys):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert cli.main(["submit", "kimi-k3/eagle3", str(RECIPE)]) == 2
    assert "PREFECT_API_URL is not set" in capsys.readouterr().err


def test_a_flow_run_refuses_a_wrong_target_shape_before_any_stage(tmp_path):
    """A run created from the UI or `prefect deployment run` got the schema's checks only: the flow checks the
    target's shape before it takes the run folder's lock or starts a stage."""
    from draftsmith.core.config import load_recipe
    from draftsmith.flows.pipeline import kimi_k3

    cfg = load_recipe(RECIPE)
    bad = cfg.model_copy(update={"target": cfg.target.model_copy(update={"num_layers": cfg.target.num_layers + 1})})
    with pytest.raises(RecipeError, match=r"recipe 'tiny-cpu': target.num_layers: the recipe says"):
        kimi_k3.fn(config=bad, run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
