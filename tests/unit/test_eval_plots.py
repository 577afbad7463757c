"""Evaluation plots and report: valid PNGs of the promised pixel size, input errors that name the key, markdown
tables holding the figures, and Prefect artifacts created only inside a run."""

import base64
import sys
from typing import Any, cast

import pytest

from draftsmith.evals import plots, report
from tests.support.runs import check_png, png_chunks

pytestmark = pytest.mark.unit


def result(bench: str, drafter: str, acc_len: float, *, temperature: float = 0.0, rounds: int = 100) -> dict:
    accepted = round((acc_len - 1.0) * rounds)
    return {
        "bench": bench,
        "drafter": drafter,
        "temperature": temperature,
        "top_p": 1.0 if temperature == 0 else 0.95,
        "acc_len": acc_len,
        "rounds": rounds,
        "accepted": accepted,
        "accept_hist": [40, 30, 20, 10],
        "position_accept": [0.6, 0.5, 1 / 3],
        "tokens_per_s": {"baseline": 10.0, "speculative": 10.0 * acc_len * 0.8},
    }


RESULTS = [
    result("mt_bench", "eagle3", 2.5),
    result("gsm8k", "eagle3", 3.25),
    result("mt_bench", "dflash2", 2.75),
    result("gsm8k", "dflash2", 3.5),
    result("mt_bench", "dspark", 3.0, temperature=1.0),
]
SWEEPS = [
    {
        "drafter": d,
        "speculative": on,
        "levels": [
            {"concurrency": c, "output_tokens_per_s": c * (30.0 if on else 20.0), "ttft_ms": {"p50": 12.5}}
            for c in (1, 2, 4, 8)
        ],
    }
    for d in ("eagle3", "dspark")
    for on in (True, False)
]
BINS_AFTER = [(i / 10, (i + 1) / 10, i / 10 + 0.05, i / 10 + 0.04, 10 + i) for i in range(10)]
BINS_BEFORE = [(i / 10, (i + 1) / 10, i / 10 + 0.05, (i / 10) ** 2, 0 if i == 3 else 5 + i) for i in range(10)]


def test_every_plot_is_a_valid_png_of_the_fixed_size(tmp_path):
    written = {
        "acc_len_by_bench": plots.acc_len_by_bench(RESULTS, tmp_path / "a" / "acc.png"),
        "throughput_vs_concurrency": plots.throughput_vs_concurrency(SWEEPS, tmp_path / "tput.png"),
        "position_acceptance": plots.position_acceptance(RESULTS, tmp_path / "pos.png"),
        "reliability_diagram": plots.reliability_diagram(
            BINS_AFTER, tmp_path / "rel.png", ece_before=0.1234, ece_after=0.0123, bins_before=BINS_BEFORE
        ),
    }
    files = {"acc_len_by_bench": "a/acc.png", "throughput_vs_concurrency": "tput.png"}
    files |= {"position_acceptance": "pos.png", "reliability_diagram": "rel.png"}
    for name, data in written.items():
        path = tmp_path / files[name]
        assert path.read_bytes() == data  # the returned bytes are the file
        check_png(path, name)


def test_size_does_not_depend_on_the_data(tmp_path):
    many = [result(f"bench_{i}_with_a_long_name", d, 2.0 + i / 10) for i in range(10) for d in ("a", "b", "c")]
    plots.acc_len_by_bench(many, tmp_path / "many.png")
    plots.reliability_diagram(BINS_AFTER[:3], tmp_path / "few.png")
    check_png(tmp_path / "many.png", "acc_len_by_bench")
    check_png(tmp_path / "few.png", "reliability_diagram")


def test_the_hand_parser_rejects_a_corrupted_png(tmp_path):
    data = bytearray(plots.reliability_diagram(BINS_AFTER, tmp_path / "r.png"))
    data[20] ^= 0xFF  # inside IHDR's width field
    with pytest.raises(AssertionError, match="bad CRC"):
        png_chunks(bytes(data))


def test_pooled_position_acceptance_weights_by_rounds_reaching_the_position():
    one = {"position_accept": [0.5, 0.5], "accept_hist": [50, 25, 25]}  # 100 rounds reach 1, 50 reach 2
    two = {"position_accept": [1.0, 0.0], "accept_hist": [0, 300, 0]}  # 300 reach 1, 300 reach 2
    assert plots.pooled_position_accept([one]) == [0.5, 0.5]
    assert plots.pooled_position_accept([one, two]) == pytest.approx([(50 + 300) / 400, 25 / 350])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: plots.acc_len_by_bench([{"bench": "x", "drafter": "d"}], p), r"results\[0\] has no 'acc_len'"),
        (
            lambda p: plots.position_acceptance([{k: v for k, v in RESULTS[0].items() if k != "accept_hist"}], p),
            r"results\[0\] has no 'accept_hist'",
        ),
        (lambda p: plots.throughput_vs_concurrency([{"drafter": "d", "levels": []}], p), r"'speculative'"),
        (
            lambda p: plots.throughput_vs_concurrency([{**SWEEPS[0], "levels": [{"concurrency": 1}]}], p),
            r"sweeps\[0\]\['levels'\]\[0\] has no 'output_tokens_per_s'",
        ),
        (lambda p: plots.reliability_diagram([(0.5, 0.2, 0.3, 0.3, 4)], p), r"bins\[0\] needs 0 <= lo < hi"),
        (
            lambda p: plots.reliability_diagram(BINS_AFTER, p, bins_before=[cast(Any, (0, 1, 0.5))]),
            r"bins_before\[0\] must be",
        ),
        (lambda p: plots.acc_len_by_bench([RESULTS[0], RESULTS[0]], p), "two results for drafter 'eagle3'"),
    ],
)
def test_bad_inputs_raise_naming_the_key(tmp_path, call, message):
    with pytest.raises((KeyError, ValueError), match=message):
        call(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_markdown_tables_hold_the_figures():
    md = report.markdown_tables(RESULTS, SWEEPS, {"ece_before": 0.1234, "ece_after": 0.0123, "auroc": 0.876})
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| drafter | temperature"))
    assert header == "| drafter | temperature | top_p | mt_bench | gsm8k | overall |"
    # overall pools rounds: eagle3 accepted 150 + 225 over 200 rounds
    assert "| eagle3 | 0 | 1 | 2.500 | 3.250 | **2.875** |" in lines
    assert "| dflash2 | 0 | 1 | 2.750 | 3.500 | **3.125** |" in lines
    assert "| dspark | 1 | 0.95 | 3.000 | – | **3.000** |" in lines
    assert "| eagle3 T=0 p=1 | gsm8k | 10.00 | 26.00 | x2.60 |" in lines
    assert "| drafter | speculation | concurrency | output_tokens_per_s | ttft_ms.p50 |" in lines
    assert "| dspark | off | 8 | 160 | 12.5 |" in lines
    assert "ECE 0.1234 before, 0.0123 after" in md and "AUROC 0.8760" in md


def test_markdown_tables_name_a_missing_key():
    with pytest.raises(KeyError, match=r"results\[1\] has no 'rounds'"):
        report.markdown_tables([RESULTS[0], {k: v for k, v in RESULTS[1].items() if k != "rounds"}])
    with pytest.raises(KeyError, match="calibration has no 'ece_after'"):
        report.markdown_tables(RESULTS, calibration={"ece_before": 0.1})


class Recorder:
    def __init__(self):
        self.calls = []

    def markdown(self, markdown, key=None, description=None):
        self.calls.append(("markdown", key, markdown))

    def image(self, image_url, key=None, description=None):
        self.calls.append(("image", key, image_url))


SERVER_MODULE = "prefect.server.api.server"  # holds the temporary server Prefect starts when no API is set


@pytest.fixture
def recorder(monkeypatch):
    """Records artifact calls; fails the test if a temporary Prefect server is started (or its module imported)."""
    from prefect import artifacts

    rec = Recorder()
    monkeypatch.setattr(artifacts, "create_markdown_artifact", rec.markdown)
    monkeypatch.setattr(artifacts, "create_image_artifact", rec.image)
    server_loaded = SERVER_MODULE in sys.modules
    if server_loaded:  # importing it just to patch it costs ~6 s, so only when another test already has

        def no_server(*args, **kwargs):
            raise AssertionError("publish started a Prefect server")

        monkeypatch.setattr(sys.modules[SERVER_MODULE].SubprocessASGIServer, "start", no_server)
    yield rec
    assert server_loaded or SERVER_MODULE not in sys.modules, "publish imported the Prefect server"


def test_publish_outside_a_run_does_nothing(tmp_path, recorder):
    png = tmp_path / "acc.png"
    plots.acc_len_by_bench(RESULTS, png)
    assert report.publish(RESULTS, SWEEPS, None, [png], key="eval-report") == []
    assert recorder.calls == []


def test_publish_inside_a_run_embeds_the_pngs(tmp_path, recorder, monkeypatch):
    from prefect.context import FlowRunContext

    monkeypatch.setattr(FlowRunContext, "get", classmethod(lambda cls: object()))
    acc, rel = tmp_path / "acc_len.png", tmp_path / "rel.png"
    plots.acc_len_by_bench(RESULTS, acc)
    plots.reliability_diagram(BINS_AFTER, rel)
    keys = report.publish(RESULTS, None, None, {"Acc len": acc, "reliability_diagram": rel}, key="eval-ab12")
    assert keys == ["eval-ab12", "eval-ab12-acc-len", "eval-ab12-reliability-diagram"]
    kinds = [c[0] for c in recorder.calls]
    assert kinds == ["markdown", "image", "image"]
    markdown, url = recorder.calls[0][2], recorder.calls[1][2]
    assert "| eagle3 | 0 | 1 | 2.500 | 3.250 | **2.875** |" in markdown
    assert url.startswith("data:image/png;base64,") and f"![Acc len]({url})" in markdown
    assert base64.b64decode(url.split(",", 1)[1]) == acc.read_bytes()


def test_publish_refuses_bad_keys_and_non_pngs(tmp_path, recorder, monkeypatch):
    from prefect.context import TaskRunContext

    with pytest.raises(ValueError, match="artifact key 'Eval_Report'"):
        report.publish(RESULTS, None, None, [], key="Eval_Report")
    monkeypatch.setattr(TaskRunContext, "get", classmethod(lambda cls: object()))
    fake = tmp_path / "fake.png"
    fake.write_bytes(b"GIF89a....")
    with pytest.raises(ValueError, match="fake.png is not a PNG"):
        report.publish(RESULTS, None, None, [fake], key="eval")
    assert recorder.calls == []
