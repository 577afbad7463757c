"""`evals.speedup` and `draftsmith speedup` without a server: run order and prompts, the summary's arithmetic,
the table, the recommendation and schedule, the plot, the command's errors and its cached answer."""

import json
from pathlib import Path

import pytest
from PIL import Image

from draftsmith import cli, cli_speedup
from draftsmith.core.config.sweep import SpeedupConfig
from draftsmith.evals import free_methods, plots, speedup, speedup_report
from draftsmith.evals.machine_load import Load
from draftsmith.evals.speedup import Server
from draftsmith.evals.sweep_bench import LevelResult, SpecDecode

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CFG = SpeedupConfig(concurrency=(4, 1), rounds=2, waves=2, max_tokens=8, warmup_requests=1)
LAT = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
SERVERS = [Server("plain", "plain", None, ()), Server("drafter-3", "drafter", 3, ("--speculative-config", "{}"))]


def _level(c: int, tps: float, spec: SpecDecode | None = None, n: int = 2) -> LevelResult:
    return LevelResult(c, n, n, 0, 1.0, 32, tps, 4.0, LAT, LAT, LAT, LAT, spec)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_every_server_warms_up_then_levels_and_rounds_take_turns_on_fresh_prompts(tmp_path):
    urls = {"plain": "http://127.0.0.1:1/v1", "drafter-3": "http://127.0.0.1:2/v1", "ngram": "http://127.0.0.1:3/v1"}
    prompts = [f"prompt {i}" for i in range(CFG.prompts_needed())]
    runs = speedup.plan_runs(urls, "m", "tok", tmp_path, CFG, prompts)
    names = [n for n, _ in runs]
    assert names[:3] == ["plain-warmup", "drafter-3-warmup", "ngram-warmup"]
    assert names[3:9] == [f"{s}-c1-r{r}" for r in range(2) for s in urls], "levels in increasing order"
    assert names[9:] == [f"{s}-c4-r{r}" for r in range(2) for s in urls]
    argv = dict(runs)
    assert [_flag(argv[f"{s}-c1-r0"], "--base-url") for s in urls] == [u.removesuffix("/v1") for u in urls.values()]
    assert all(_flag(a, "--num-warmups") == "0" for a in argv.values()), "warm-up is a run of its own prompts"
    assert _flag(argv["plain-c4-r1"], "--num-prompts") == "8" and _flag(argv["plain-c1-r0"], "--num-prompts") == "2"
    assert _flag(argv["plain-c4-r1"], "--max-concurrency") == "4"

    def sent(name: str) -> list[str]:
        rows = json.loads(Path(_flag(argv[name], "--dataset-path")).read_text())
        return [r["conversations"][0]["value"] for r in rows]

    # Every server gets the same requests in a round, and no request repeats anywhere in the measurement.
    assert sent("plain-c4-r0") == sent("ngram-c4-r0") != sent("plain-c4-r1")
    every = sent("plain-warmup") + [p for c in (1, 4) for r in range(2) for p in sent(f"plain-c{c}-r{r}")]
    assert sorted(every) == sorted(prompts)


def test_too_few_prompts_are_cycled_and_the_result_says_so():
    warmup, slices = speedup.split_prompts(["a", "b", "c"], CFG)
    assert warmup == ["a"] and slices[(1, 0)] == ["b", "c"] and slices[(1, 1)] == ["a", "b"]
    with pytest.raises(ValueError, match="^prompts: "):
        speedup.split_prompts(["ok", " "], CFG)
    lines = speedup_report.recommendation({"levels": [], "prompts": {"distinct": 3, "requests": 23, "repeated": True}})
    assert any("3 distinct prompts for 23 requests" in line for line in lines)


def test_each_server_is_compared_with_the_same_plain_runs_and_the_busiest_run_is_kept():
    spec = SpecDecode(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6, accepted_per_pos=[3, 2, 1])
    cfg = SpeedupConfig(concurrency=(1,), rounds=2, waves=2)
    servers = [*SERVERS, Server("ngram", "ngram", 3, ())]
    texts = ["a", "b"]
    runs = {
        "plain-c1-r0": (_level(1, 10.0), texts),
        "drafter-3-c1-r0": (_level(1, 12.0, spec), texts),
        "ngram-c1-r0": (_level(1, 9.0), ["a", "c"]),
        "plain-c1-r1": (_level(1, 10.0), texts),
        "drafter-3-c1-r1": (_level(1, 14.0, spec), texts),
        "ngram-c1-r1": (_level(1, 11.0), texts),
    }
    idle, busy = Load(5.0, 2.1, 0.01, 2, 0.0), Load(5.0, 3.9, 1.2, 2, 0.05)
    loads = dict.fromkeys(runs, idle) | {"ngram-c1-r1": busy}
    drafter, ngram = speedup.summarise(runs, cfg, servers, loads)
    assert (drafter["server"], drafter["method"], ngram["method"]) == ("drafter-3", "drafter", "ngram")
    assert drafter["tokens_per_s_off"] == ngram["tokens_per_s_off"] == [10.0, 10.0]
    assert drafter["speedup"] == pytest.approx(1.3) and ngram["speedup"] == pytest.approx(1.0)
    assert drafter["spec_decode"]["acceptance_length"] == pytest.approx(2.5) and ngram["spec_decode"] is None
    assert (drafter["outputs_differing"], ngram["outputs_differing"], ngram["outputs_compared"]) == (0, 1, 4)
    assert drafter["load"]["busy"] is False and ngram["load"] == {
        "load_avg_1m": 3.9, "other_cores": 1.2, "steal_cores": 0.05, "cores": 2, "busy": True
    }  # fmt: skip
    table = speedup_report.format_table({"levels": [drafter, ngram]})
    assert "| 1 | drafter-3 | 10.0, 10.0 | 12.0, 14.0 | ×1.30 | 2.500 | 75% | 0 of 4 | 2.1 / 0.01 / 0.00 |" in table
    assert (
        "| 1 | ngram | 10.0, 10.0 | 9.0, 11.0 | ×1.00 | no drafts | – | 1 of 4 | 3.9 / 1.20 / 0.05 **busy** |" in table
    )
    lines = speedup_report.recommendation({"levels": [drafter, ngram]})
    assert lines[0] == (
        "concurrency 1: fastest is drafter-3 ×1.30; the drafter (drafter-3) beats ngram: ×1.30 its tokens/s"
    )
    assert lines[-1].startswith(
        "warning: other processes used up to 1.20 and the host took up to 0.05 (steal) of 2 cores during 1 of 2 rows"
    )


def _row(c: int, server: str, method: str, depth: int | None, speedup_: float) -> dict:
    return {"concurrency": c, "server": server, "method": method, "draft_tokens": depth, "speedup": speedup_,
            "tokens_per_s_off": [10.0], "tokens_per_s_on": [10.0 * speedup_], "spec_decode": None,
            "outputs_differing": 0, "outputs_compared": 2}  # fmt: skip


def test_the_schedule_takes_the_fastest_depth_per_level_and_turns_speculation_off_where_none_pays():
    rows = [
        _row(1, "drafter-1", "drafter", 1, 1.30), _row(1, "drafter-3", "drafter", 3, 1.60),
        _row(2, "drafter-1", "drafter", 1, 1.20), _row(2, "drafter-3", "drafter", 3, 1.10),
        _row(4, "drafter-1", "drafter", 1, 1.01), _row(4, "drafter-3", "drafter", 3, 0.90),
        _row(8, "drafter-1", "drafter", 1, 0.80), _row(8, "drafter-3", "drafter", 3, 0.70),
        _row(8, "ngram", "ngram", 3, 1.05),
    ]  # fmt: skip
    per_level = speedup_report.schedule({"levels": rows})
    assert per_level == {1: 3, 2: 1, 4: 0, 8: 0}, "x1.01 is within noise of not paying"
    assert speedup_report.batch_size_ranges(per_level) == [[1, 1, 3], [2, 3, 1], [4, 8, 0]]
    assert speedup_report.batch_size_ranges({1: 2, 4: 2}) == [[1, 4, 2]]
    lines = speedup_report.recommendation({"levels": rows})
    assert lines[2].startswith("concurrency 4: fastest is drafter-1 ×1.01")
    assert lines[3] == (
        "concurrency 8: fastest is ngram ×1.05; the drafter (drafter-1) LOSES TO ngram: ×0.76 its tokens/s"
    )
    assert speedup_report.schedule({"levels": [_row(1, "drafter", "drafter", None, 1.5)]}) == {}, "a block drafter"
    slow = [_row(1, "drafter-2", "drafter", 2, 0.9)]
    assert speedup_report.recommendation({"levels": slow})[0].startswith("concurrency 1: serve plain")


def test_free_methods_have_their_vllm_configs_and_a_missing_package_is_a_reason():
    cfg = SpeedupConfig()
    assert free_methods.speculative_config("ngram", cfg) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4
    }  # fmt: skip
    assert free_methods.speculative_config("suffix", cfg) == {"method": "suffix"}
    tuned = SpeedupConfig(suffix={"num_speculative_tokens": 8, "max_cached_requests": 0})
    assert json.loads(free_methods.server_args("suffix", tuned)[1]) == {
        "method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 0
    }  # fmt: skip
    import sys

    assert free_methods.unavailable("ngram", sys.executable) is None
    why = free_methods.unavailable("suffix", sys.executable)
    assert why is None or why.startswith("suffix decoding needs arctic_inference in the vLLM environment")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeedupConfig(ngram={"prompt_lookup_min": 5, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="free_methods"):
        SpeedupConfig(free_methods=("ngram", "ngram"))


def test_requests_per_run_scale_with_concurrency_and_the_prompts_cover_every_request():
    cfg = SpeedupConfig(concurrency=(1, 2, 4, 8), rounds=2, waves=4, warmup_requests=2)
    assert [cfg.requests(c) for c in cfg.concurrency] == [4, 8, 16, 32]
    assert cfg.prompts_needed() == 2 + 2 * (4 + 8 + 16 + 32)


def test_plot_has_the_fixed_size_and_refuses_an_empty_result(tmp_path):
    rows = [_row(c, s, m, d, 1.0 + 0.1 * c) for c in (1, 4) for s, m, d in
            (("drafter-1", "drafter", 1), ("drafter-3", "drafter", 3), ("ngram", "ngram", 3))]  # fmt: skip
    plots.speedup_bars({"levels": rows}, tmp_path / "s.png")
    assert Image.open(tmp_path / "s.png").size == plots.PIXELS["speedup"]
    with pytest.raises(ValueError, match="no levels"):
        plots.speedup_bars({"levels": []}, tmp_path / "e.png")


def test_a_folder_that_is_not_a_finished_run_is_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["speedup", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"speedup: run: {tmp_path}/recipe.yaml not found; pass a finished run folder or its recipe"
    )
    assert cli.main(["speedup", "s3://bucket/run"]) == 2
    assert "is a URL" in capsys.readouterr().err


def _finished_run(tmp_path: Path) -> Path:
    recipe = ROOT / "deployments" / "recipes" / "tiny-cpu.yaml"
    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    (run / "recipe.yaml").write_text(recipe.read_text())
    (run / "train" / "manifest.json").write_text(json.dumps({"key": "k1"}))
    return run


def test_a_result_for_the_same_checkpoint_settings_and_prompts_is_printed_not_measured(tmp_path, monkeypatch, capsys):
    run = _finished_run(tmp_path)
    measured = []

    def fake_measure(run_dir, cfg, settings, prompts, key, train_key):
        measured.append(key)
        result = {"key": key, "train_key": train_key, "levels": []}
        (run_dir / "speedup").mkdir(exist_ok=True)
        (run_dir / "speedup" / cli_speedup.RESULT).write_text(json.dumps(result))
        return result

    monkeypatch.setattr(cli_speedup, "run_prompts", lambda cfg, run_dir, settings: ["p1", "p2"])
    monkeypatch.setattr(cli_speedup, "_measure", fake_measure)
    args = ["speedup", str(run), "--concurrency", "1", "--waves", "2"]
    assert cli.main(args) == 0 and len(measured) == 1
    assert cli.main(args) == 0 and len(measured) == 1, "same checkpoint and settings: the saved result"
    assert "(cached)" in capsys.readouterr().out
    assert cli.main([*args, "--max-tokens", "9"]) == 0 and len(measured) == 2, "other settings: measured again"
    (run / "train" / "manifest.json").write_text(json.dumps({"key": "k2"}))
    assert cli.main([*args, "--max-tokens", "9"]) == 0 and len(measured) == 3, "retrained drafter: measured again"
    assert cli.main([*args, "--max-tokens", "9", "--force"]) == 0 and len(measured) == 4


def test_draft_tokens_set_a_chains_serving_depths_and_a_block_drafter_refuses_them(tmp_path, capsys):
    from draftsmith.core.config import load_recipe

    recipes = ROOT / "deployments" / "recipes"
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
    recipe["speedup"] = {"concurrency": [1], "waves": 2, "draft_tokens": [1, 2], "free_methods": ["ngram"]}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    seen = []

    def fake_measure(run_dir, cfg, settings, prompts, key, train_key):
        seen.append((settings.concurrency, settings.waves, settings.draft_tokens, settings.free_methods))
        return {"key": key, "levels": []}

    monkeypatch.setattr(cli_speedup, "run_prompts", lambda cfg, run_dir, settings: ["p1"])
    monkeypatch.setattr(cli_speedup, "_measure", fake_measure)
    assert cli.main(["speedup", str(run)]) == 0
    assert cli.main(["speedup", str(run), "--draft-tokens", "3", "--waves", "4", "--free-methods", "none"]) == 0
    assert seen == [((1,), 2, (1, 2), ("ngram",)), ((1,), 4, (3,), ())]
    assert cli.main(["speedup", str(run), "--concurrency", "1,x"]) == 2
    assert capsys.readouterr().err.strip().endswith("--concurrency: expected a comma list of integers, got '1,x'")
    assert cli.main(["speedup", str(run), "--waves", "0"]) == 2
    assert "speedup: waves: " in capsys.readouterr().err
    assert cli.main(["speedup", str(run), "--free-methods", "ngram,lookahead"]) == 2
    assert "speedup: free_methods" in capsys.readouterr().err
    recipe["speedup"]["draft_tokens"] = [2]
    recipe["drafter"] = load_recipe(ROOT / "deployments/recipes/smollm2-cpu-dflash2.yaml").drafter.model_dump()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ValueError, match="speedup.draft_tokens: a dflash2 drafter"):
        load_recipe(bad)


def test_the_speedup_prompts_are_distinct_suite_turns_drawn_as_deep_as_needed(tmp_path):
    from draftsmith.core.config import load_recipe
    from draftsmith.evals import suites

    cfg = load_recipe(ROOT / "deployments" / "recipes" / "tiny-cpu.yaml")
    settings = SpeedupConfig(concurrency=(1, 2, 4, 8), rounds=2, waves=4)
    run = tmp_path / "run"
    (run / "select_prompts").mkdir(parents=True)  # no manifest: held-out prompts are not asked for
    prompts = cli_speedup.run_prompts(cfg, run, settings)
    assert len(prompts) == len(set(prompts)) == settings.prompts_needed()
    first_turns = {p.turns[0] for items in suites.builtin_suites(30, cfg.seed).values() for p in items}
    assert set(prompts) <= first_turns, "the built-in suites only: they share no template with training prompts"


def test_the_written_result_records_its_plot_and_the_results_page_checks_it(tmp_path):
    from draftsmith.core.manifest import FileEntry

    rows = [_row(1, "drafter-3", "drafter", 3, 1.30), _row(1, "ngram", "ngram", None, 1.10)]
    result = cli_speedup.write_result(tmp_path / "speedup", {"train_key": "k", "levels": rows})
    saved = json.loads((tmp_path / "speedup" / cli_speedup.RESULT).read_text())
    assert saved["files"] == result["files"] and saved["schedule"]["per_level"] == {"1": 3}
    record = FileEntry.model_validate({"name": "speedup.png", **saved["files"]["speedup.png"]})
    assert record.problem(str(tmp_path / "speedup" / "speedup.png")) is None
    assert "drafter-3" in (tmp_path / "speedup" / "speedup.md").read_text()
    (tmp_path / "speedup" / "speedup.png").write_bytes(b"\x89PNG other")
    assert "bytes where" in (record.problem(str(tmp_path / "speedup" / "speedup.png")) or "")
