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
        (["--family", "dflash", "--set", "drafter.selector_rank=64"], "drafter.selector_rank 64: --family dflash"),
        (["--family", "dflash", "--set", "drafter.attention=mla"], "mla: required"),
        (["--family", "dflash", "--recipe", "deployments/recipes/smollm2-cpu-eagle3.yaml"], "drafter.kind 'eagle3'"),
        (["--family", "dflash", "--set", "hidden_states.positions=supervised"], "positions 'supervised'"),
        (["--set", "drafter.attention=mla", "--set", "drafter.mla={kv_lora_rank: 64}"], "drafter.mla"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        peer_quality.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err


@pytest.mark.parametrize(
    ("family", "depth", "shape"),
    [
        ("eagle3", 3, {"draft_vocab_size": 4096}),
        ("dflash", 7, {"draft_vocab_size": None, "num_layers": 2, "block_size": 8, "mask_token_id": 16}),
    ],
)
def test_each_family_trains_the_peer_on_our_shape_and_serves_both_at_one_depth(family, depth, shape, tmp_path):
    cfg = peer_quality.recipe(family, None, [], quick=False)
    assert peer_quality.family_of(cfg) == family and peer_quality.depth_of(cfg) == depth
    job = peer_quality.peer_job(cfg, tmp_path, steps=5)
    assert job["family"] == family and job["max_steps"] == 5 and job["taps"] == list(cfg.hidden_states.taps)
    assert {k: job.get(k) for k in shape} == shape
    assert job["total_seq_len"] == cfg.train.batch_tokens * cfg.train.world_size * cfg.train.grad_accum
    if family == "eagle3":
        assert "block_size" not in job, "the peer's EAGLE-3 takes no block"
    quick = peer_quality.recipe(family, None, [], quick=True)
    assert quick.name == f"{cfg.name}-peer-quick", "toy stages get their own run folder"
