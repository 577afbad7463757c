"""Bad recipes and bad `--set` values: `validate`, `plan` and `run` print one line naming the file and the
field, exit with code 2, and show no traceback."""

import codecs
import json
import os
from pathlib import Path
from typing import Any

import pytest

from draftsmith import cli
from draftsmith.core.config import RecipeError, load_recipe
from tests.support.paths import RECIPES

pytestmark = pytest.mark.unit
COMMANDS = ["validate", "plan", "run"]
TINY = (RECIPES / "tiny-cpu.yaml").read_text()


@pytest.fixture(autouse=True)
def _own_environ(monkeypatch):
    # cli.main sets its environment defaults (PREFECT_HOME, ...) in this process: keep them from other tests.
    monkeypatch.setattr(os, "environ", os.environ.copy())


def _recipe(tmp_path: Path, text: str | bytes, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _one_error_line(capsys, argv: list[str], *needles: str) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def _fake_model(tmp_path: Path, **shape: int) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 49152} | shape
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# (recipe text, extra arguments, needles the error line must hold); the recipe path is a needle too.
CASES: dict[str, tuple[Any, list[str], list[str]]] = {
    "not-utf8": (TINY.encode() + b"# caf\xe9\n", [], ["not UTF-8", f"line {TINY.count(chr(10)) + 1}"]),
    "bad-set-path": (TINY, ["--set", "train.epochs.x=1"], ["train.epochs.x", "train.epochs"]),
    "unknown-set-field": (TINY, ["--set", "train.epoch=3"], ["train.epoch: unknown key", "--set"]),
    "bool-for-int": (TINY.replace("epochs: 2", "epochs: true"), [], ["train.epochs", "integer", "true"]),
    "int-for-bool-by-set": (TINY, ["--set", "select.near_dedupe=1"], ["select.near_dedupe", "true or false"]),
    "string-for-bool": (TINY.replace("select:\n", "select:\n  near_dedupe: 'no'\n"), [], ["select.near_dedupe"]),
    "bool-in-int-list": (TINY.replace("taps: [1, 2, 3]", "taps: [true, 2, 3]"), [], ["hidden_states.taps"]),
    "inf-lr": (TINY.replace("lr: 0.003", "lr: .inf"), [], ["train.lr", "finite"]),
    "nan-lr-by-set": (TINY, ["--set", "train.lr=.nan"], ["train.lr", "finite"]),
    "duplicate-key": (
        TINY.replace("  warmup_steps: 2\n", "  warmup_steps: 2\n  lr: 0.1\n"),
        [],
        ["train.lr: duplicate key on line", "first on line"],
    ),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_recipe_is_one_line_exit_2(capsys, tmp_path, command, case):
    text, extra, needles = CASES[case]
    path = _recipe(tmp_path, text)
    _one_error_line(capsys, [command, str(path), *extra], str(path), *needles)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_given_as_recipe_is_one_line_exit_2(capsys, tmp_path, command):
    _one_error_line(capsys, [command, str(tmp_path)], str(tmp_path), "folder")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("field", "declared", "actual"), [("num_layers", 7, 4), ("vocab_size", 1000, 49152)])
def test_target_shape_is_checked_against_config_json(capsys, tmp_path, command, field, declared, actual):
    model = _fake_model(tmp_path)
    text = TINY.replace("source: embedded:tiny-llama", f"source: {model}")
    path = _recipe(tmp_path, text.replace(f"  {field}: {actual}\n", f"  {field}: {declared}\n"))
    _one_error_line(capsys, [command, str(path)], f"target.{field}", str(declared), str(actual))


def test_a_matching_model_folder_validates(tmp_path):
    model = _fake_model(tmp_path)
    cfg = load_recipe(_recipe(tmp_path, TINY.replace("source: embedded:tiny-llama", f"source: {model}")))
    assert cfg.target.num_layers == 4


def test_yaml_1_1_exponents_and_bool_like_words_still_load(tmp_path):
    # YAML 1.1 reads `1e-4` as a string; numbers given so must keep working.
    text = TINY.replace("lr: 0.003", "lr: 1e-4").replace("tokenize:\n", "tokenize:\n  thinking: off\n")
    cfg = load_recipe(_recipe(tmp_path, text))
    assert cfg.train.lr == 1e-4 and cfg.tokenize.thinking == "off"
    with pytest.raises(RecipeError, match=r"train\.compile: expected true or false, got 'true'"):
        quoted = TINY.replace("  batch_tokens: 512\n", "  batch_tokens: 512\n  compile: 'true'\n")
        load_recipe(_recipe(tmp_path, quoted, "quoted.yaml"))


def test_a_recipe_that_opens_with_a_byte_order_mark_loads_as_without(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(codecs.BOM_UTF8 + TINY.encode())
    assert load_recipe(str(path)) == load_recipe(_recipe(tmp_path, TINY, "plain.yaml"))


def test_a_lost_time_shorter_than_two_heartbeats_is_refused_naming_both(tmp_path):
    text = TINY + "dispatch:\n  heartbeat_s: 10\n  lost_after_s: 15\n"
    with pytest.raises(
        RecipeError, match=r"dispatch: lost_after_s \(15.0 s\) is less than two heartbeats \(heartbeat_s"
    ):
        load_recipe(_recipe(tmp_path, text))
    assert load_recipe(_recipe(tmp_path, TINY + "dispatch:\n  retries: 2\n", "ok.yaml")).dispatch.retries == 2
