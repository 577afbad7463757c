"""`draftsmith doctor`: each check named on a run folder planted with exactly its defect, no false alarm on a
healthy run, the offline n-gram replay and context buckets to the token, and the command's exit codes."""

import json
from pathlib import Path

import pytest

from draftsmith import cli
from draftsmith.core.config.sweep import NgramSettings
from draftsmith.evals.doctor import acceptance, copying, diagnose
from tests.support.doctor_runs import FakeVLLM, Plan, healthy_run

pytestmark = pytest.mark.unit


def _bad(run: Path, check: str, **kwargs) -> list:
    """The warn and error findings of `check` on `run`."""
    report = diagnose(str(run), **kwargs)
    return [f for f in report.findings if f.check == check and f.severity in ("warn", "error")]


def _one(tmp_path: Path, check: str, **plan) -> str:
    """Plant one defect and return the single finding's title, evidence and fix as one text."""
    found = _bad(healthy_run(tmp_path / "run", Plan(**plan)), check)
    assert len(found) == 1, found
    f = found[0]
    return " ".join([f.severity, f.title, *f.evidence, f.fix])


def test_healthy_run_raises_no_alarm(tmp_path):
    report = diagnose(str(healthy_run(tmp_path / "run")))
    alarms = [f for f in report.findings if f.severity in ("warn", "error")]
    assert alarms == []
    assert {f.check for f in report.findings} >= {
        "training-health", "generalisation-gap", "position-acceptance", "long-context", "free-speculation",
        "copying", "tap-convention", "template", "draft-vocabulary", "train-serve",
    }  # fmt: skip
    assert not any(f.title.startswith("not checked") for f in report.findings if f.check != "train-serve")


def test_diverging_loss(tmp_path):
    text = _one(tmp_path, "training-health", loss="diverging")
    assert text.startswith("error") and "diverged" in text and "train.lr" in text


def test_loss_still_falling_at_the_end(tmp_path):
    text = _one(tmp_path, "training-health", loss="still-falling")
    assert "under-trained" in text and "train.epochs" in text


def test_lr_never_decayed(tmp_path):
    text = _one(tmp_path, "training-health", lr="constant")
    assert "never decayed" in text and "100% of peak" in text and "train.schedule" in text


def test_skipped_steps(tmp_path):
    text = _one(tmp_path, "training-health", skipped_steps=10)
    assert "non-finite" in text and "skipped_steps 10 of 200" in text


def test_generalisation_gap(tmp_path):
    text = _one(tmp_path, "generalisation-gap", train_acc=(0.97, 0.9, 0.85))
    assert "does not generalise" in text and "more data" in text and "0.970" in text
    assert "select.num_prompts" in text


def test_acceptance_lost_at_a_draft_position(tmp_path):
    run = healthy_run(tmp_path / "run", Plan(probs=(0.75, 0.08, 0.05)))
    found = _bad(run, "position-acceptance")
    assert [f.title for f in found] == ["drafts from position 2 are rarely accepted on held-out, math"]
    assert "serve 1 draft tokens" in found[0].fix and "benches[math].position_accept [0.7" in found[0].evidence[1]


def test_acceptance_collapses_at_long_context(tmp_path):
    text = _one(tmp_path, "long-context", long_probs=(0.15, 0.05, 0.05))
    assert "collapses beyond 256 tokens" in text and "tokenize.max_length" in text


def test_copying_beats_the_drafter(tmp_path):
    text = _one(tmp_path, "free-speculation", copying=True, probs=(0.3, 0.2, 0.1))
    assert "copying beats the drafter on held-out, math" in text and "--free-methods ngram" in text


def test_a_drafter_that_does_not_copy(tmp_path):
    text = _one(tmp_path, "copying", copy_rates=(0.1, 0.6))
    assert "does not copy from the context on held-out, math" in text and "select.sources" in text
    shown = text.split("held-out: ")[1]
    assert "first draft accepted there 1" in shown or "first draft accepted there 9%" in shown, shown


def test_a_drafter_that_copies(tmp_path):
    report = diagnose(str(healthy_run(tmp_path / "run", Plan(copy_rates=(0.9, 0.5)))))
    (found,) = [f for f in report.findings if f.check == "copying"]
    assert found.severity == "ok" and "the drafter copies" in found.title


def test_copy_tally_walks_the_rounds_and_skips_tokens_outside_the_vocabulary():
    s = NgramSettings(prompt_lookup_min=2, prompt_lookup_max=2, num_speculative_tokens=3)
    prompt, output = [5, 6, 7, 8], [9, 5, 6, 7, 8, 3]
    # The prefill emits 9. Round 1 drafts for 5 after "8 9", never seen: other. Round 2 for 6 after "9 5": other.
    # Round 3 for 7 after "5 6", which the prompt holds followed by 7: copyable; it keeps 2 drafts and the target
    # adds 3, the last token, so a fourth recorded round finds nothing left to draft.
    t = copying.tally(prompt, output, [0, 0, 2, 0], s)
    assert (t.copyable, t.copied, t.other, t.other_hits) == (1, 1, 2, 0)
    draftable = [True] * 10
    draftable[7] = False  # round 3's next token: left out of both sides
    t = copying.tally(prompt, output, [0, 0, 2, 0], s, draftable)
    assert (t.copyable, t.copied, t.other, t.other_hits) == (0, 0, 2, 0)


def test_tap_ids_off_by_one(tmp_path):
    text = _one(tmp_path, "tap-convention", layer_ids=[0, 1, 2])
    assert text.startswith("error") and "off by -1 layer" in text and "expects [1, 2, 3]" in text
    assert "draftsmith export RUN --engine vllm" in text


@pytest.mark.parametrize("start", ["uniform", "zero"])
def test_fusion_block_never_exercised(tmp_path, start):
    text = _one(tmp_path, "tap-convention", idle_tap=1, idle_start=start)
    assert "fusion weights of tap 2 were never updated" in text and "fc.weight by tap" in text


def test_fusion_trained_from_the_last_tap_is_not_idle(tmp_path):
    """`drafter.init_fc_last_tap` starts the other taps at zero; trained, they stay below the init bound."""
    assert _bad(healthy_run(tmp_path / "run", Plan(last_tap_identity=True)), "tap-convention") == []


def test_thinking_mode_differs_from_the_evaluation(tmp_path):
    text = _one(tmp_path, "template", thinking=("on", "on"))
    assert text.startswith("warn") and "the data is in thinking mode" in text and "enable_thinking" in text


def test_thinking_mode_differs_between_stages(tmp_path):
    text = _one(tmp_path, "template", thinking=("off", "on"))
    assert text.startswith("error") and "thinking mode differs between stages" in text
    assert "regenerate/manifest.json info: template aaaaaaaaaaaa, thinking off" in text


def test_chat_template_differs_from_the_evaluation(tmp_path):
    text = _one(tmp_path, "template", eval_template="b" * 64)
    assert "another chat template" in text and "bbbbbbbbbbbb" in text


def test_system_messages_differ_between_data_and_evaluation(tmp_path):
    title = _one(tmp_path, "template", system_prompts=(0.0, 1.0))
    assert "differ in whether they set a system message" in title


def test_loss_mask_covers_the_template(tmp_path):
    text = _one(tmp_path, "template", loss_share=0.97)
    assert "covers nearly every token" in text and "97.0%" in text and "tokenize.renderer" in text


def test_draft_vocabulary_misses_target_tokens(tmp_path):
    text = _one(tmp_path, "draft-vocabulary", outside_vocab=0.25)
    assert "cannot propose" in text and "drafter.draft_vocab_size (now 64;" in text
    covering = int(text.split("tokens would cover 95%")[0].split()[-1])
    assert 64 < covering <= 256


def test_served_acceptance_below_the_harness(tmp_path):
    text = _one(tmp_path, "train-serve", served_first=0.3)
    assert "fewer first drafts" in text and "speedup.json server_counters[drafter-3]" in text


def test_engine_url_counters(tmp_path):
    run = healthy_run(tmp_path / "run")
    low, close = FakeVLLM(first=0.2), FakeVLLM(first=0.69)
    try:
        found = _bad(run, "train-serve", engine_url=low.url)
        assert len(found) == 1 and "fewer first drafts" in found[0].title
        # Only the difference over these requests counts: 32 turns of 48 tokens, round(0.2 * 48) = 10 accepted each.
        assert "0.208 over 1536 drafts" in " ".join(found[0].evidence)
        rows = [json.loads(line) for line in (run / "evaluate" / "prompts.jsonl").read_text().splitlines()]
        assert [c["prompt"] for c in low.completions] == [r["prompt_ids"] for r in rows]
        assert all(c["temperature"] == 0.0 and c["model"] == "tiny-target" for c in low.completions)
        assert {c["path"] for c in low.completions} == {"/v1/completions"}  # rendered ids: no template again
        assert _bad(run, "train-serve", engine_url=close.url) == []
        # Prompts of one's own: text goes to the chat endpoint (the server's template), ids to completions.
        mine = tmp_path / "mine.jsonl"
        mine.write_text('{"prompt": "hello", "max_tokens": 200}\n\n{"prompt_ids": [1, 2, 3]}\n')
        close.completions.clear()
        assert _bad(run, "train-serve", engine_url=close.url, prompts=str(mine)) == []
        assert [(c["path"], c["max_tokens"]) for c in close.completions] == [
            ("/v1/chat/completions", 200), ("/v1/completions", 64),
        ]  # fmt: skip
        assert close.completions[0]["messages"] == [{"role": "user", "content": "hello"}]
    finally:
        low.close()
        close.close()


def test_ngram_replay_counts_each_round():
    s = NgramSettings(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    # After the prefill's 7, the suffix [6, 7] was seen followed by 8, 9: drafts 8 9 5 (5 follows in the prompt's
    # own continuation), the answer goes 8 9 1: two accepted, then the bonus 1; [9, 1] was never seen: a plain round.
    rounds, accepted = acceptance.ngram_rounds([6, 7, 8, 9, 5, 6], [7, 8, 9, 1, 2], s)
    assert (rounds, accepted) == (2, 2)
    assert acceptance.ngram_rounds([1, 2], [3], s) == (0, 0)


def test_context_buckets_place_each_round_at_its_context():
    rows = [{"prompt_tokens": 250, "round_accepts": [2, 0, 3, 1]}]
    # Contexts 251 (prefill token), 254, 255, 259: three rounds under 256, one under 512.
    assert acceptance.context_buckets(rows) == {256: (3, 5), 512: (1, 1)}


def test_doctor_command_report_and_json(tmp_path, capsys):
    run = healthy_run(tmp_path / "run", Plan(layer_ids=[0, 1, 2]))
    assert cli.main(["doctor", str(run)]) == 0
    text = capsys.readouterr().out
    assert "[error] tap-convention" in text and "fix: draftsmith export RUN --engine vllm" in text
    assert cli.main(["doctor", str(run), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["worst"] == "error" and body["headline"]["acc_len"] > 1
    assert {"check", "severity", "title", "evidence", "fix"} <= set(body["findings"][0])


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p / "absent", "no such run folder"),
        (lambda p: p, "not a run folder (no finished stage"),
    ],
)
def test_doctor_command_refuses_a_folder_that_is_not_a_run(tmp_path, capsys, make, says):
    assert cli.main(["doctor", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: doctor: ") and says in err and "\n" not in err


def test_doctor_command_names_a_broken_file(tmp_path, capsys):
    run = healthy_run(tmp_path / "run")
    (run / "evaluate" / "results.json").write_text("{not json")
    assert cli.main(["doctor", str(run)]) == 2
    assert "evaluate/results.json: not valid JSON" in capsys.readouterr().err


def test_doctor_reads_a_run_through_fsspec(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    run = healthy_run(tmp_path / "run", Plan(layer_ids=[0, 1, 2]))
    memory = fsspec.filesystem("memory")
    for path in run.rglob("*"):
        if path.is_file():
            memory.pipe(f"/doctor-run/{path.relative_to(run)}", path.read_bytes())
    report = diagnose("memory://doctor-run")
    assert [f.severity for f in report.findings if f.check == "tap-convention"] == ["error"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--prompts", "p.jsonl"], "--prompts needs --engine-url"),
        (["--engine-url", "http://127.0.0.1:9/v1"], "--engine-url: GET http://127.0.0.1:9/v1/models"),
        (["--engine-url", "URL", "--prompts", "bad.jsonl"], "bad.jsonl:2: expected a JSON object with prompt"),
    ],
)
def test_doctor_command_refuses_an_unusable_engine_or_prompts(tmp_path, capsys, argv, says):
    run = healthy_run(tmp_path / "run")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{"prompt_ids": "not ids"}\n')
    server = FakeVLLM(first=0.5)
    try:
        argv = [a.replace("URL", server.url).replace("bad.jsonl", str(tmp_path / "bad.jsonl")) for a in argv]
        assert cli.main(["doctor", str(run), *argv]) == 2
    finally:
        server.close()
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: doctor: ") and says in err and "\n" not in err
    assert server.completions == []  # a bad prompts file is refused before anything is sent


def test_the_doctor_switch_does_not_key_the_evaluation(tiny_cfg):
    from draftsmith.core.manifest import StageManifest
    from draftsmith.tasks.evaluate import evaluate_key

    prompts, checkpoint = (
        StageManifest(stage="select_prompts", key="p", uri="."),
        StageManifest(stage="train", key="t", uri="."),
    )
    on, off = tiny_cfg.evaluate, tiny_cfg.evaluate.model_copy(update={"doctor": False})
    key = evaluate_key(on, tiny_cfg.drafter, tiny_cfg.target, prompts, checkpoint)
    assert on.doctor and evaluate_key(off, tiny_cfg.drafter, tiny_cfg.target, prompts, checkpoint) == key
    more = on.model_copy(update={"max_new_tokens": on.max_new_tokens + 1})
    assert evaluate_key(more, tiny_cfg.drafter, tiny_cfg.target, prompts, checkpoint) != key


def test_block_drafter_export_with_taps_as_ids(tmp_path):
    """DSpark configs list 0-based layer outputs (tap - 1); an export that wrote the taps themselves is off by +1."""
    run = healthy_run(tmp_path / "run")
    export = run / "export" / "vllm"
    export.mkdir(parents=True)

    def write(ids: list[int]) -> None:
        config = {"target_layer_ids": ids, "dflash_config": {"target_layer_ids": ids},
                  "draftsmith": {"method": "dspark", "taps": [1, 2, 3], "num_target_layers": 4}}  # fmt: skip
        (export / "config.json").write_text(json.dumps(config))

    write([1, 2, 3])
    found = _bad(run, "tap-convention")
    assert [f.title for f in found] == [
        "export/vllm/config.json: the engine will feed the drafter other layers (off by +1 layer)"
    ]
    assert "expects [0, 1, 2]" in found[0].evidence[0] and found[0].fix.startswith(
        "draftsmith export RUN --engine vllm"
    )
    write([0, 1, 2])
    assert _bad(run, "tap-convention") == []


def test_loss_that_barely_moved(tmp_path):
    text = _one(tmp_path, "training-health", loss="flat")
    assert "barely moved" in text and "raise train.lr" in text


def test_loss_flat_from_early_on(tmp_path):
    report = diagnose(str(healthy_run(tmp_path / "run", Plan(loss="plateau"))))
    found = [f for f in report.findings if f.check == "training-health"]
    assert [(f.severity, f.title) for f in found] == [
        ("info", "the loss was flat from early on: more epochs will not help")
    ]


def test_non_finite_loss_applied_and_skipped(tmp_path):
    text = _one(tmp_path, "training-health", loss="nan")
    assert text.startswith("error") and "2 steps recorded a non-finite loss" in text and "[150, 151]" in text
    # The same losses on steps the trainer skipped were dropped, not applied: a warning about skips, no error.
    skipped = Plan(loss="nan", skipped_steps=51)  # steps 150..200 skipped
    found = _bad(healthy_run(tmp_path / "skipped", skipped), "training-health")
    assert [f.severity for f in found] == ["warn"] and "dropped" in found[0].title
