"""Recipes: every shipped recipe validates; bad ones fail with one line naming the dotted field."""

import subprocess
import sys

import pytest
import yaml

from draftsmith.core.config import DFlash2Config, DSparkConfig, Eagle3Config, PipelineConfig, RecipeError, load_recipe
from draftsmith.plan import render_plan
from tests.support.paths import RECIPES as RECIPE_DIR

pytestmark = pytest.mark.unit
RECIPES = [
    "smollm2-cpu-eagle3",
    "smollm2-cpu-dflash2",
    "smollm2-cpu-dspark",
    "tiny-cpu",
    "kimi-k3-eagle3",
    "kimi-k3-dflash2",
    "kimi-k3-dspark",
    "nightly-eagle3",
    "nightly-dflash2",
    "nightly-dspark",
]


@pytest.fixture
def recipe_dir(tmp_path):
    return tmp_path


def _write(tmp_path, data) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _tiny_data():
    from tests.support.paths import RECIPES as DIR

    return yaml.safe_load((DIR / "tiny-cpu.yaml").read_text())


@pytest.mark.parametrize("name", RECIPES)
def test_shipped_recipes_validate(name):
    from tests.support.paths import RECIPES as DIR

    cfg = load_recipe(DIR / f"{name}.yaml")
    assert cfg.name == name
    assert PipelineConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def _block_drafter(kind: str, **changes) -> dict:
    base = {"kind": kind, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    return base | {"intermediate_size": 128, "mask_token_id": 16} | changes


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["train"].update(bogus=1), "train.bogus: unknown key"),
        (
            lambda d: d["hidden_states"].update(taps=[1, 2, 4]),
            "hidden_states.taps[2]: tap 4 must be below target.num_layers (4)",
        ),
        (lambda d: d["select"].update(num_prompts=-5), "select.num_prompts: Input should be greater than 0"),
        (
            lambda d: d["select"].update(source="jsonl", path="/nonexistent/prompts.jsonl"),
            "select.path: file or folder '/nonexistent/prompts.jsonl' does not exist",
        ),
        (lambda d: d["hidden_states"].update(taps=[0, 2]), "hidden_states.taps: Value error, taps[0] = 0"),
        (
            lambda d: d["drafter"].update(num_kv_heads=3),
            "drafter.num_kv_heads: num_kv_heads (3) must divide num_heads (4)",
        ),
        (lambda d: d.pop("target"), "target: Field required"),
        (
            lambda d: d.update(drafter=_block_drafter("dspark", layer_types=["full_attention"])),
            "drafter: Value error, layer_types: 1 entries for num_layers 2",
        ),
        (
            lambda d: d.update(drafter=_block_drafter("dflash2", layer_types=["sliding_attention"] * 2)),
            "drafter: Value error, sliding_window: required when layer_types has sliding_attention layers",
        ),
        (
            lambda d: d.update(drafter=_block_drafter("dflash2", mask_token_id=49152)),
            "drafter.mask_token_id: 49152 is outside target.vocab_size (49152)",
        ),
        (
            lambda d: d.update(drafter=_block_drafter("dflash2", conv_group_size=5)),
            "drafter.conv_group_size: 5 must divide target.hidden_size (64)",
        ),
        (lambda d: d.update(drafter=_block_drafter("dspark", markov_rank=0)), "drafter.markov_rank: Input should be"),
        (
            lambda d: d.update(drafter=_block_drafter("dflash2", draft_vocab_size=512)),
            "drafter.draft_vocab_size: the DFlash2 candidate selector needs the full vocabulary",
        ),
        (lambda d: d["drafter"].update(attention="mla"), "drafter: Value error, mla: required when attention is 'mla'"),
        (lambda d: d["drafter"].update(kind="medusa"), "drafter: Input tag 'medusa' found using 'kind' does not"),
        (
            lambda d: d["hidden_states"].update(mode="online", online={"producers": "external"}),
            "hidden_states.online.producers: external producers need a fixed master_addr",
        ),
        (
            lambda d: d["hidden_states"].update(online={"master_addr": "10.0.0.1:50051"}),
            "hidden_states.online.metadata_url: set together with master_addr",
        ),
        (lambda d: d["hidden_states"].update(store_dtype="fp4"), "hidden_states.store_dtype: Input should be"),
        (lambda d: d["hidden_states"].update(tap_point="mlp"), "hidden_states.tap_point: Input should be"),
    ],
    ids=[
        "unknown-key",
        "tap-too-high",
        "negative-count",
        "missing-file",
        "tap-zero",
        "gqa",
        "missing-section",
        "layer-types-length",
        "sliding-without-window",
        "mask-token-outside-vocab",
        "conv-group",
        "markov-rank",
        "selector-needs-full-vocab",
        "mla-without-shapes",
        "unknown-kind",
        "external-producers-without-addresses",
        "master-without-metadata",
        "bad-store-dtype",
        "bad-tap-point",
    ],
)
def test_bad_recipe_names_the_field(tmp_path, mutate, expected):
    data = _tiny_data()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    assert expected.replace("Value error, ", "") in message


@pytest.mark.parametrize("field", ["hidden_states.taps", "train.bogus"])
def test_cli_bad_recipe_exits_2_with_one_line(tmp_path, field):
    data = _tiny_data()
    if field == "hidden_states.taps":
        data["hidden_states"]["taps"] = [1, 9]
    else:
        data["train"]["bogus"] = True
    path = _write(tmp_path, data)
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "validate", path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and field in lines[0], proc.stderr


def test_overrides_apply_before_validation():
    from tests.support.paths import RECIPES as DIR

    cfg = load_recipe(DIR / "tiny-cpu.yaml", {"train.epochs": 7})
    assert cfg.train.epochs == 7
    with pytest.raises(RecipeError, match="train.epochs"):
        load_recipe(DIR / "tiny-cpu.yaml", {"train.epochs": 0})


@pytest.mark.parametrize(
    ("recipe", "taps", "drafter", "drafts"),
    [
        ("kimi-k3-eagle3", 3, "eagle3 (1 layer, mla attention + fc_norm, anchored TTT (1024 anchors) depth 7", 3),
        ("kimi-k3-dflash2", 5, "dflash2 (5 layers (4 sliding-window 2048), mla attention + fc_norm, block 8", 7),
        ("kimi-k3-dspark", 5, "dspark (5 layers, mla attention + fc_norm, block 7", 7),
    ],
)
def test_kimi_plan_names_every_stage_pool_and_size(recipe, taps, drafter, drafts):
    from tests.support.paths import RECIPES as DIR

    cfg = load_recipe(DIR / f"{recipe}.yaml")
    plan = render_plan(cfg, "s3://bucket/run")
    for stage in ["select_prompts", "regenerate", "tokenize", "hidden_states", "train", "evaluate"]:
        assert f"s3://bucket/run/{stage}" in plan
    for pool in ["pool=gb200 ", "pool=gb200-train", "pool=cpu "]:
        assert pool in plan
    # taps + last hidden, H = 7168, bf16, plus a 4-byte id and 1-byte mask per token.
    assert f"{(taps + 1) * 7168 * 2 + 5:,} bytes/token" in plan
    assert drafter in plan
    assert f"{drafts} draft tokens per round" in plan


def test_kimi_drafters_match_the_seed_cards():
    """The K3 configs the seeds release: eagle3.1-mla aux ids [2, 46, 90]; DSpark taps (2, 23, 47, 71, 89) of 93."""
    from tests.support.paths import RECIPES as DIR

    eagle = load_recipe(DIR / "kimi-k3-eagle3.yaml")
    assert isinstance(eagle.drafter, Eagle3Config)
    assert eagle.hidden_states.taps == [2, 46, 90] and eagle.drafter.attention == "mla"
    assert eagle.drafter.fc_norm and eagle.drafter.norm_output
    dspark = load_recipe(DIR / "kimi-k3-dspark.yaml")
    assert isinstance(dspark.drafter, DSparkConfig)
    assert dspark.hidden_states.taps == [2, 23, 47, 71, 89] and dspark.target.num_layers == 93
    assert (dspark.drafter.num_layers, dspark.drafter.block_size, dspark.drafter.attention) == (5, 7, "mla")
    assert dspark.drafter.fc_norm
    dflash = load_recipe(DIR / "kimi-k3-dflash2.yaml").drafter
    assert isinstance(dflash, DFlash2Config) and dflash.layer_types is not None
    assert dflash.layer_types.count("sliding_attention") == 4 and dflash.layer_types[-1] == "full_attention"
    assert dflash.attention == "mla" and dflash.block_size == 8


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (ConnectionResetError("reset by peer"), True),
        (TimeoutError("read timed out"), True),
        (ValueError("select.path: bad row"), False),
        (MemoryError(), False),
        (RuntimeError("loss is NaN"), False),
    ],
)
def test_only_transient_errors_are_retried(exc, transient):
    from prefect.states import Failed

    from draftsmith.core.retry import is_transient, transient_only

    assert is_transient(exc) is transient
    assert transient_only(None, None, Failed(data=exc)) is transient
    try:
        raise RuntimeError("stage failed") from exc
    except RuntimeError as wrapped:
        assert is_transient(wrapped) is transient


@pytest.mark.unit
def test_thinking_modes_of_regenerate_and_tokenize_must_agree(tmp_path):
    recipe = (RECIPE_DIR / "tiny-cpu.yaml").read_text() + "\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.replace("regenerate:\n", "regenerate:\n  thinking: true\n"))
    with pytest.raises(RecipeError, match=r"tokenize.thinking: 'off' disagrees with regenerate.thinking \(True\)"):
        load_recipe(bad)
    ok = tmp_path / "ok.yaml"
    ok.write_text(
        recipe.replace("regenerate:\n", "regenerate:\n  thinking: true\n").replace(
            "tokenize:\n", "tokenize:\n  thinking: on\n"
        )
    )
    assert load_recipe(ok).tokenize.thinking == "on"


def test_the_three_smollm2_recipes_share_their_data():
    """`benchmarks.drafters_acc_len` compares the families on one corpus and refuses recipes whose data sections
    differ; the EAGLE-3 default's prompt mix is the one the block recipes must follow."""
    first, *others = (load_recipe(RECIPE_DIR / f"smollm2-cpu-{k}.yaml") for k in ("eagle3", "dflash2", "dspark"))
    for other in others:
        for section in ("seed", "target", "select", "regenerate", "tokenize"):
            assert getattr(other, section) == getattr(first, section), (other.name, section)
