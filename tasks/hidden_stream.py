"""Online hidden states: producers capture samples and put them into Mooncake; the trainer reads the stream.

A producer (`produce`) runs the recipe's capture engine over its share of the tokenized samples (every
n-th), once per epoch, and puts each sample through `transport.mooncake_stream.MooncakeProducer`. It runs as
`python -m draftsmith.tasks.hidden_stream --spec FILE` (the training stage starts it so on one node) or inside the
`hidden-states` flow in online mode (external producers on the GPU pool).

The trainer's side, which starts these producers, is `draftsmith.transport.online_source.OnlineSource`.
"""

import argparse
import json
import logging
import sys
from pathlib import Path

from prefect import task

from draftsmith.core import ui
from draftsmith.core.config import HiddenStatesConfig, TargetConfig
from draftsmith.core.gpus import gpu_slots
from draftsmith.core.manifest import StageManifest
from draftsmith.core.progress import Progress, prefect_sink
from draftsmith.engines import hidden_capture
from draftsmith.tasks.hidden_states import capture_windows
from draftsmith.transport.mooncake_store import MooncakeSettings
from draftsmith.transport.mooncake_stream import MooncakeProducer, StreamError
from draftsmith.transport.online_source import ProducerSpec, codec_of, producer_settings
from draftsmith.transport.token_shards import token_samples

log = logging.getLogger(__name__)


def produce(spec: ProducerSpec) -> int:
    """Capture this producer's samples `epochs` times and stream them; returns how many were put."""
    cfg = HiddenStatesConfig.model_validate(spec.hidden)
    target = TargetConfig.model_validate(spec.target)
    tokens = StageManifest.model_validate(spec.tokens)
    settings = MooncakeSettings(**spec.settings)
    engine = hidden_capture.make_capture(cfg, target)
    n = 0
    name = f"{spec.run_id}-p{spec.index}"
    # A producer process started by the trainer has no Prefect run: its progress is a no-op there.
    share = len(range(spec.index, tokens.counts.get("samples", 0), spec.count))
    sink = prefect_sink(ui.artifact_key(name, "stream-progress"), f"hidden states streamed by producer {spec.index}")
    desc = f"hidden_states producer {spec.index}"
    with Progress(spec.epochs * share, sink, desc=desc, unit="sample") as progress:
        try:
            with MooncakeProducer(settings, spec.queue, codec_of(cfg), spec.run_id, producer_id=name) as producer:
                for _ in range(spec.epochs):
                    mine = (s for i, s in enumerate(token_samples(tokens)) if i % spec.count == spec.index)
                    for sample in capture_windows(engine, mine, cfg):
                        producer.put(sample)
                        n += 1
                        progress.advance()
        finally:
            engine.close()
    return n


def produce_external(
    cfg: HiddenStatesConfig, target: TargetConfig, tokens: StageManifest, *, epochs: int, run_id: str
) -> int:
    """One producer of a run whose trainer waits at `online.queue_addr` (producers: external)."""
    if cfg.online.producers != "external":
        raise ValueError("hidden_states.online.producers: the hidden-states flow streams only for external producers")
    spec = ProducerSpec(
        hidden=cfg.model_dump(mode="json"),
        target=target.model_dump(mode="json"),
        tokens=tokens.model_dump(mode="json"),
        settings=producer_settings(cfg, None).to_json_dict(),
        queue=cfg.online.queue_addr,
        run_id=run_id,
        epochs=epochs,
        count=cfg.online.num_producers,
    )
    return produce(spec)


@task(name="stream-hidden-states", task_run_name="stream-hidden-states[{run_id}]")
def stream_hidden_states_task(
    cfg: HiddenStatesConfig, target: TargetConfig, tokens: StageManifest, epochs: int, run_id: str
) -> int:
    with gpu_slots(cfg.resources):
        return produce_external(cfg, target, tokens, epochs=epochs, run_id=run_id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m draftsmith.tasks.hidden_stream", description="an online hidden-state producer"
    )
    ap.add_argument("--spec", required=True, help="ProducerSpec as a JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = ProducerSpec(**json.loads(Path(args.spec).read_text()))
    try:
        n = produce(spec)
    except StreamError as e:
        log.error("StreamError: %s", e)
        return 3
    log.info("produced %d samples", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
