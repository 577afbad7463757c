"""A Mooncake stream producer in its own process, for `test_mooncake_stream.py`.

Run as a script: `python tests/integration/mooncake_producer_main.py --settings JSON --queue HOST:PORT ...`.
It puts `--count` samples from `make_sample(seed, i, ...)`, which the test recomputes to compare bitwise.
`--hang-after K` stops putting after K samples and sleeps (heartbeats keep flowing) so the test can kill it.
"""

import argparse
import json
import sys
import time

import torch

from draftsmith.transport.mooncake_store import MooncakeSettings
from draftsmith.transport.mooncake_stream import MooncakeProducer, StreamError
from draftsmith.transport.sample import HiddenSample, StoreCodec


def make_sample(seed: int, i: int, *, num_taps: int, hidden: int, min_len: int, max_len: int) -> HiddenSample:
    """Sample `i` of a seeded run: S in [min_len, max_len], `hidden_states` `[S, num_taps*hidden]` fp32."""
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    seq_len = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
    loss_mask = torch.rand(seq_len, generator=g) > 0.4
    return HiddenSample(
        id=f"sample-{seed}-{i}",
        input_ids=torch.randint(0, 50_000, (seq_len,), generator=g),
        loss_mask=loss_mask,
        hidden_states=torch.randn(seq_len, num_taps * hidden, generator=g) * 3,
        last_hidden=torch.randn(seq_len, hidden, generator=g),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--settings", required=True, help="MooncakeSettings as JSON")
    ap.add_argument("--queue", required=True, help="the consumer's HOST:PORT")
    ap.add_argument("--codec", required=True, help="StoreCodec as JSON")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--producer-id", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=80)
    ap.add_argument("--hang-after", type=int, default=-1, help="after this many samples, sleep forever")
    ap.add_argument("--full-timeout-s", type=float, default=60.0)
    a = ap.parse_args(argv)
    codec = StoreCodec(**json.loads(a.codec))
    settings = MooncakeSettings(**json.loads(a.settings))
    shape = dict(num_taps=codec.num_taps, hidden=a.hidden, min_len=a.min_len, max_len=a.max_len)
    try:
        with MooncakeProducer(
            settings, a.queue, codec, a.run_id, producer_id=a.producer_id, full_timeout_s=a.full_timeout_s
        ) as producer:
            for i in range(a.count):
                if i == a.hang_after:
                    print("HANGING", flush=True)
                    time.sleep(3600)
                producer.put(make_sample(a.seed, i, **shape))
    except StreamError as e:
        print(f"StreamError: {e}", file=sys.stderr, flush=True)
        return 3
    print(json.dumps({"count": a.count, "full_waits": producer.full_waits}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
