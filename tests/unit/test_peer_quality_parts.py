"""The pieces of `benchmarks.peer_quality` that run without a server or a trainer: the peer's loss mask over our
store, the counter arithmetic behind each benchmark's row, the printed table, and bad input."""

import pytest
import torch

from benchmarks import peer_quality
from benchmarks.helpers import peer_data, peer_serve
from draftsmith.evals.sweep_bench import SpecDecode

pytestmark = pytest.mark.unit


def test_the_peer_keeps_our_mask_unless_the_store_lacks_its_teacher_row():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    assert peer_data.peer_mask(mask, "all").tolist() == [0, 0, 1, 1, 1, 0, 1, 1]
    # supervised: the target's state is stored only where a loss token follows; each span's last token goes
    assert peer_data.peer_mask(mask, "supervised").tolist() == [0, 0, 1, 1, 0, 0, 1, 0]
    assert peer_data.peer_mask(mask, "supervised").dtype == torch.uint8


def test_a_benchmarks_counters_are_the_difference_of_two_readings():
    before = SpecDecode(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=7, accepted_per_pos=[5, 2, 0])
    after = SpecDecode(num_drafts=14, num_draft_tokens=42, num_accepted_tokens=12, accepted_per_pos=[8, 3, 1])
    d = peer_serve.delta(after, before)
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens, d.accepted_per_pos) == (4, 12, 5, [3, 1, 1])
    assert peer_serve.delta(after, None) == after, "no reading before: the server had not drafted yet"
    with pytest.raises(RuntimeError, match="speculation is off"):
        peer_serve.delta(None, before)


def test_figures_give_tokens_per_round_and_each_positions_share_of_rounds():
    f = peer_serve.figures(
        SpecDecode(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=5, accepted_per_pos=[3, 1, 1])
    )
    assert f["tokens_per_round"] == pytest.approx(1 + 5 / 4) and f["accepted_per_round"] == pytest.approx(5 / 4)
    assert f["per_position"] == pytest.approx([0.75, 0.25, 0.25])
    assert peer_serve.figures(SpecDecode(0, 0, 0, [0, 0, 0]))["per_position"] == [0.0, 0.0, 0.0]


def _side(drafts: int, accepted: list[int]) -> dict:
    return peer_serve.figures(SpecDecode(drafts, 3 * drafts, sum(accepted), accepted))


def test_the_table_has_a_row_per_benchmark_and_the_training_lines():
    rows = {"held-out": {"prompts": 2, "ours": _side(10, [6, 3, 1]), "peer": _side(10, [5, 2, 1]), "ratio": 2.0 / 1.8}}
    rows["overall"] = rows["held-out"]
    idle = {"load_avg_1m": 0.5, "other_cores": 0.01, "cores": 2, "busy": False}
    busy = {"load_avg_1m": 6.0, "other_cores": 1.5, "steal_cores": 0.3, "cores": 2, "busy": True}
    train = {
        "ours": {"wall_s": 50.0, "steps": 3, "tokens": 900, "load": idle},
        "peer": {"wall_s": 80.0, "steps": 3, "tokens": 1000, "load": busy},
    }
    result = {"depth": 3, "benches": rows, "answers_compared": 2, "answers_differing": 0, "goal_met": True}
    lines = peer_quality.table(result | {"train": train | {"wall_ratio": 0.625}}).splitlines()
    assert lines[0].split()[:5] == ["benchmark", "prompts", "ours", "tok/round", "peer"]
    assert lines[1].split() == [
        "held-out",
        "2",
        "2.000",
        "1.800",
        "1.11x",
        "0.60",
        "0.30",
        "0.10",
        "0.50",
        "0.20",
        "0.10",
    ]
    assert lines[2].startswith("overall")
    assert "ours 50.0, peer 80.0 (ours/peer 0.62x)" in lines[3] and "ours 3, peer 3" in lines[5]
    ours_load, peer_load = lines[4].split("; peer ")
    assert "load avg 0.5, other processes 0.01 cores" in ours_load and "BUSY" not in ours_load
    assert "load avg 6.0, other processes 1.50 cores, host steal 0.30 cores BUSY" in peer_load
    assert lines[-1].endswith(": met")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--recipe", "deployments/recipes/smollm2-cpu-dspark.yaml"], "drafter.kind 'dspark'"),
        (["--set", "train.epochs"], "--set 'train.epochs': KEY=VALUE expected"),
        (["--set", "train.epochs=0"], "train.epochs"),
        (["--max-steps", "0"], "--max-steps: must be at least 1"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        peer_quality.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err


def test_the_data_stages_run_under_the_pipelines_keys(tiny_cfg, monkeypatch):
    """After `make run`, the benchmark must find the recipe's stages cached: its select call carries what the
    pipeline's does (the answer length too, which bounds prompts and keys the stage), not the task's defaults."""
    from draftsmith.flows.stages import key_here
    from draftsmith.tasks import hidden_states, regenerate, select_prompts, tokenization

    answer = select_prompts.DEFAULT_ANSWER_TOKENS + 7  # not the default
    cfg = tiny_cfg.model_copy(update={"regenerate": tiny_cfg.regenerate.model_copy(update={"max_new_tokens": answer})})
    calls: dict[str, dict] = {}

    def recorder(name: str):
        def call(*args, **kwargs):
            calls[name] = kwargs
            return name

        return call

    monkeypatch.setattr(select_prompts, "select_prompts", recorder("select"))
    monkeypatch.setattr(regenerate, "regenerate", recorder("regenerate"))
    monkeypatch.setattr(tokenization, "tokenize", recorder("tokenize"))
    monkeypatch.setattr(hidden_states, "capture_hidden_states", recorder("hidden"))
    peer_quality.upstream(cfg, "runs/x")
    select = {k: v for k, v in calls["select"].items() if k != "out_uri"}
    ours = select_prompts.select_prompts_key(cfg.select, cfg.target, **select)
    assert ours == key_here(cfg, "select_prompts", {})
