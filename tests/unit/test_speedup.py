"""`evals.speedup` and `draftsmith speedup` without a server: run order, the summary's arithmetic, the table, the
plot, the command's errors and its cached answer."""

import json
from pathlib import Path

import pytest
from PIL import Image

from draftsmith import cli, cli_speedup
from draftsmith.core.config.sweep import SpeedupConfig
from draftsmith.evals import plots, speedup
from draftsmith.evals.sweep_bench import LevelResult, SpecDecode

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CFG = SpeedupConfig(concurrency=(4, 1), rounds=2, requests=4, max_tokens=8, warmup_requests=1)
LAT = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}


def _level(c: int, tps: float, spec: SpecDecode | None = None) -> LevelResult:
    return LevelResult(c, 4, 4, 0, 1.0, 32, tps, 4.0, LAT, LAT, LAT, LAT, spec)


def test_runs_alternate_off_and_on_level_by_level_with_one_warm_up_per_server(tmp_path):
    urls = {"off": "http://127.0.0.1:1/v1", "on": "http://127.0.0.1:2/v1"}
    argvs, names = speedup.plan_runs(urls, "m", "tok", tmp_path / "p.json", tmp_path, CFG)
    assert names == [
        "off-c1-r0", "on-c1-r0", "off-c1-r1", "on-c1-r1", "off-c4-r0", "on-c4-r0", "off-c4-r1", "on-c4-r1"
    ]  # fmt: skip

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    assert [flag(a, "--base-url") for a in argvs[:2]] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert [int(flag(a, "--num-warmups")) for a in argvs] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert [flag(a, "--max-concurrency") for a in argvs] == ["1"] * 4 + ["4"] * 4
    assert all(flag(a, "--num-prompts") == "4" and "--save-detailed" in a and "--ignore-eos" in a for a in argvs)
    assert [flag(a, "--result-filename") for a in argvs] == [f"{n}.json" for n in names]


def test_several_depths_take_turns_with_the_plain_server_each_round():
    depths = (1, 3)
    urls = {m: f"http://127.0.0.1:{i + 1}/v1" for i, m in enumerate(speedup.modes(depths))}
    assert list(urls) == ["off", "on1", "on3"]
    cfg = SpeedupConfig(concurrency=(2,), rounds=2, requests=2, warmup_requests=1)
    argvs, names = speedup.plan_runs(urls, "m", "tok", Path("p.json"), Path("."), cfg)
    assert names == ["off-c2-r0", "on1-c2-r0", "on3-c2-r0", "off-c2-r1", "on1-c2-r1", "on3-c2-r1"]
    assert [int(a[a.index("--num-warmups") + 1]) for a in argvs] == [1, 1, 1, 0, 0, 0]
    for bad in ((), (2, 2), (None, 3)):
        with pytest.raises(ValueError, match="^depths: "):
            speedup.modes(bad)


def test_each_depth_is_compared_with_the_same_plain_runs():
    spec = SpecDecode(num_drafts=4, num_draft_tokens=4, num_accepted_tokens=2, accepted_per_pos=[2])
    cfg = SpeedupConfig(concurrency=(1,), rounds=2, requests=2)
    texts = ["a", "b"]
    runs = {
        "off-c1-r0": (_level(1, 10.0), texts),
        "on1-c1-r0": (_level(1, 12.0, spec), texts),
        "on3-c1-r0": (_level(1, 9.0), ["a", "c"]),
        "off-c1-r1": (_level(1, 10.0), texts),
        "on1-c1-r1": (_level(1, 14.0, spec), texts),
        "on3-c1-r1": (_level(1, 11.0), texts),
    }
    one, three = speedup.summarise(runs, cfg, (1, 3))
    assert (one["draft_tokens"], three["draft_tokens"]) == (1, 3)
    assert one["tokens_per_s_off"] == three["tokens_per_s_off"] == [10.0, 10.0]
    assert one["speedup"] == pytest.approx(1.3) and three["speedup"] == pytest.approx(1.0)
    assert one["spec_decode"]["acceptance_length"] == pytest.approx(1.5) and three["spec_decode"] is None
    assert (one["outputs_differing"], three["outputs_differing"], three["outputs_compared"]) == (0, 1, 4)
    table = speedup.format_table({"levels": [one, three]})
    assert "| 1 | 1 | 10.0, 10.0 | 12.0, 14.0 | ×1.30 | 1.500 | 0 of 4 |" in table
    assert "| 1 | 3 | 10.0, 10.0 | 9.0, 11.0 | ×1.00 | no drafts | 1 of 4 |" in table


def test_summary_is_mean_on_over_mean_off_with_counters_and_differing_outputs_pooled_over_rounds():
    spec = SpecDecode(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=12, accepted_per_pos=[6, 4, 2])
    texts = ["a", "b", "c", "d"]
    runs = {
        "off-c1-r0": (_level(1, 10.0), texts),
        "on-c1-r0": (_level(1, 14.0, spec), texts),
        "off-c1-r1": (_level(1, 12.0), texts),
        "on-c1-r1": (_level(1, 18.0, spec), ["a", "x", "c"]),  # one answer changed, one missing
        "off-c4-r0": (_level(4, 40.0), texts),
        "on-c4-r0": (_level(4, 30.0), texts),
        "off-c4-r1": (_level(4, 40.0), texts),
        "on-c4-r1": (_level(4, 30.0), texts),
    }
    one, four = speedup.summarise(runs, CFG)
    assert one["speedup"] == pytest.approx(16.0 / 11.0)
    assert one["tokens_per_s_off"] == [10.0, 12.0] and one["tokens_per_s_on"] == [14.0, 18.0]
    assert one["spec_decode"]["num_drafts"] == 20 and one["spec_decode"]["accepted_per_pos"] == [12, 8, 4]
    assert one["spec_decode"]["acceptance_length"] == pytest.approx(1 + 24 / 20)
    assert (one["outputs_differing"], one["outputs_compared"]) == (2, 8)
    assert four["speedup"] == pytest.approx(0.75) and four["spec_decode"] is None
    table = speedup.format_table({"levels": [one, four]})
    assert "| 1 | export | 10.0, 12.0 | 14.0, 18.0 | ×1.45 | 2.200 | 2 of 8 |" in table
    assert "| 4 | export | 40.0, 40.0 | 30.0, 30.0 | ×0.75 | no drafts | 0 of 8 |" in table


@pytest.mark.parametrize("depths", [(None,), (1, 2, 3)])
def test_plot_has_the_fixed_size_and_refuses_an_empty_result(tmp_path, depths):
    runs = {
        f"{m}-c{c}-r{r}": (_level(c, 10.0 * c + (m != "off")), ["a"] * 4)
        for m in speedup.modes(depths)
        for c in (1, 4)
        for r in range(2)
    }
    plots.speedup_bars({"levels": speedup.summarise(runs, CFG, depths)}, tmp_path / "s.png")
    assert Image.open(tmp_path / "s.png").size == plots.PIXELS["speedup"]
    with pytest.raises(ValueError, match="no levels"):
        plots.speedup_bars({"levels": []}, tmp_path / "e.png")


def test_settings_need_requests_for_the_highest_level():
    with pytest.raises(ValueError, match="requests: 2 cannot keep concurrency 4 busy"):
        SpeedupConfig(concurrency=(1, 4), requests=2)


def test_a_folder_that_is_not_a_finished_run_is_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["speedup", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"speedup: run: {tmp_path}/recipe.yaml not found; pass a finished run folder or its recipe"
    )
    assert cli.main(["speedup", "s3://bucket/run"]) == 2
    assert "is a URL" in capsys.readouterr().err


def _finished_run(tmp_path: Path) -> Path:
    recipe = Path(__file__).resolve().parents[2] / "deployments" / "recipes" / "tiny-cpu.yaml"
    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    (run / "recipe.yaml").write_text(recipe.read_text())
    (run / "train" / "manifest.json").write_text(json.dumps({"key": "k1"}))
    return run


def test_a_result_for_the_same_checkpoint_settings_and_prompts_is_printed_not_measured(tmp_path, monkeypatch, capsys):
    run = _finished_run(tmp_path)
    measured = []

    def fake_measure(run_dir, cfg, settings, prompts, key):
        measured.append(key)
        result = {"key": key, "levels": []}
        (run_dir / "speedup").mkdir(exist_ok=True)
        (run_dir / "speedup" / cli_speedup.RESULT).write_text(json.dumps(result))
        return result

    monkeypatch.setattr(cli_speedup, "run_prompts", lambda cfg, run_dir, limit: ["p1", "p2"])
    monkeypatch.setattr(cli_speedup, "_measure", fake_measure)
    args = ["speedup", str(run), "--concurrency", "1", "--requests", "2"]
    assert cli.main(args) == 0 and len(measured) == 1
    assert cli.main(args) == 0 and len(measured) == 1, "same checkpoint and settings: the saved result"
    assert "(cached)" in capsys.readouterr().out
    assert cli.main([*args, "--max-tokens", "9"]) == 0 and len(measured) == 2, "other settings: measured again"
    (run / "train" / "manifest.json").write_text(json.dumps({"key": "k2"}))
    assert cli.main([*args, "--max-tokens", "9"]) == 0 and len(measured) == 3, "retrained drafter: measured again"
    assert cli.main([*args, "--max-tokens", "9", "--force"]) == 0 and len(measured) == 4


def test_draft_tokens_set_a_chains_serving_depths_and_a_block_drafter_refuses_them(tmp_path, capsys):
    from draftsmith.core.config import load_recipe

    recipes = Path(__file__).resolve().parents[2] / "deployments" / "recipes"
    chain = load_recipe(recipes / "tiny-cpu.yaml")
    assert chain.drafter.kind == "eagle3"
    assert cli_speedup.serving_depths(chain, SpeedupConfig()) == [chain.evaluate.num_draft_tokens]
    assert cli_speedup.serving_depths(chain, SpeedupConfig(draft_tokens=(3, 1))) == [1, 3]
    block = load_recipe(recipes / "smollm2-cpu-dflash2.yaml")
    assert cli_speedup.serving_depths(block, SpeedupConfig()) == [None]
    with pytest.raises(ValueError, match="^draft_tokens: a dflash2 drafter"):
        cli_speedup.serving_depths(block, SpeedupConfig(draft_tokens=(2,)))
    for bad in ((0,), (2, 2), ()):
        with pytest.raises(ValueError, match="draft_tokens"):
            SpeedupConfig(draft_tokens=bad)
    run = _finished_run(tmp_path)
    (run / "recipe.yaml").write_text((recipes / "smollm2-cpu-dflash2.yaml").read_text())
    assert cli.main(["speedup", str(run), "--draft-tokens", "2"]) == 2
    assert capsys.readouterr().err.startswith("speedup: draft_tokens: a dflash2 drafter")


def test_a_recipes_speedup_section_is_the_default_and_flags_override_it(tmp_path, monkeypatch, capsys):
    import yaml

    from draftsmith.core.config import load_recipe

    run = _finished_run(tmp_path)
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["speedup"] = {"concurrency": [1], "requests": 2, "draft_tokens": [1, 2]}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    seen = []

    def fake_measure(run_dir, cfg, settings, prompts, key):
        seen.append((settings.concurrency, settings.requests, settings.draft_tokens))
        return {"key": key, "levels": []}

    monkeypatch.setattr(cli_speedup, "run_prompts", lambda cfg, run_dir, limit: ["p1"])
    monkeypatch.setattr(cli_speedup, "_measure", fake_measure)
    assert cli.main(["speedup", str(run)]) == 0
    assert cli.main(["speedup", str(run), "--draft-tokens", "3", "--requests", "4"]) == 0
    assert seen == [((1,), 2, (1, 2)), ((1,), 4, (3,))]
    assert cli.main(["speedup", str(run), "--concurrency", "1,x"]) == 2
    assert capsys.readouterr().err.strip().endswith("--concurrency: expected a comma list of integers, got '1,x'")
    assert cli.main(["speedup", str(run), "--requests", "0"]) == 2
    assert "speedup: requests: " in capsys.readouterr().err
    recipe["speedup"]["draft_tokens"] = [2]
    recipe["drafter"] = load_recipe(ROOT / "deployments/recipes/smollm2-cpu-dflash2.yaml").drafter.model_dump()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ValueError, match="speedup.draft_tokens: a dflash2 drafter"):
        load_recipe(bad)
