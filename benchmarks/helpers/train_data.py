"""Synthetic training data for `benchmarks.train` at a real target's shapes: lengths, samples, stores.

Values are random but shaped and distributed like chat data: token ids follow a Zipf law over the target
vocabulary (so the pruned draft vocabulary covers most loss tokens, as it does on text), the prompt part of a
sample carries no loss, and the last hidden state at p is near the target embedding of token p + 1 (so the
target's argmax mostly lands in the draft vocabulary, and the drafter's loss rows are as many as on real
captures). Tap features are plain Gaussians: the step's cost does not depend on their values.

Shape legend: S sequence, N taps, H target width.
"""

import torch

from draftsmith.core import storage
from draftsmith.core.manifest import StageManifest, file_entry
from draftsmith.tasks.hidden_states import codec_of
from draftsmith.tasks.token_encode import Encoded
from draftsmith.tasks.tokenization import pack_shard
from draftsmith.transport.offline_store import StoreInfo, write_store
from draftsmith.transport.sample import HiddenSample


def lognormal_lengths(n: int, *, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    """`n` lengths `exp(N(log median, sigma))`, rounded and clipped to `[lo, hi]`."""
    if n < 1 or median <= 0 or sigma < 0 or not 1 <= lo <= hi:
        raise ValueError(f"lognormal_lengths: bad arguments n={n} median={median} sigma={sigma} lo={lo} hi={hi}")
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.log(torch.tensor(float(median))) + sigma * torch.randn(n, generator=g, dtype=torch.float64))
    return x.round().clamp(lo, hi).long().tolist()


class SampleMaker:
    """Synthetic `HiddenSample`s for a target with embedding `embed_VH` and `num_taps` taps."""

    def __init__(self, embed_VH: torch.Tensor, num_taps: int, seed: int, zipf: float = 1.1):
        self.embed = embed_VH.float()
        self.num_taps = num_taps
        self.g = torch.Generator().manual_seed(seed)
        V = self.embed.shape[0]
        self.probs = torch.arange(1, V + 1, dtype=torch.float64).pow(-zipf)
        self.rank_to_id = torch.randperm(V, generator=self.g)  # frequent ids spread over the vocabulary

    def sample(self, sid: str, length: int) -> HiddenSample:
        S, H = length, self.embed.shape[1]
        ids = self.rank_to_id[torch.multinomial(self.probs, S, replacement=True, generator=self.g)]
        loss_mask = torch.zeros(S, dtype=torch.bool)
        loss_mask[int(0.3 * S) :] = True  # the assistant part of a chat: the last 70%
        nxt = torch.cat([ids[1:], ids[-1:]])
        unit = self.embed[nxt] / self.embed[nxt].norm(dim=-1, keepdim=True).clamp(min=1e-6)
        last = 8.0 * unit + 0.5 * torch.randn(S, H, generator=self.g)
        feats = torch.randn(S, self.num_taps * H, generator=self.g)
        return HiddenSample(sid, ids.long(), loss_mask, feats, last)

    def samples(self, lengths: list[int], prefix: str = "s"):
        for i, n in enumerate(lengths):
            yield self.sample(f"{prefix}{i:06d}", n)


def loss_counts(samples: list[HiddenSample], vocab_size: int) -> torch.Tensor:
    """`[V]` loss-token counts, as `draftsmith.tasks.train.loss_token_counts` computes them from a tokenize manifest."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.input_ids[s.loss_mask], minlength=vocab_size)
    return counts


def write_tokens(uri: str, samples: list[HiddenSample]) -> StageManifest:
    """A tokenize stage's output (one `tokens-00000.safetensors` shard) holding the samples' ids and masks."""
    rows = [
        ({"id": s.id, "category": "synthetic"}, Encoded(s.input_ids.int().numpy(), s.loss_mask.byte().numpy(), False))
        for s in samples
    ]
    entry = file_entry(uri, "tokens-00000.safetensors", pack_shard(rows))
    counts = {"samples": len(samples), "tokens": sum(len(s.input_ids) for s in samples)}
    return StageManifest(stage="tokenize", key="bench-synthetic-tokens", uri=uri, files=[entry], counts=counts)


def write_hidden_store(uri: str, samples: list[HiddenSample], hidden_cfg, target) -> StageManifest:
    """The offline store (`draftsmith.transport.offline_store`) of the samples, as the hidden-state stage writes it."""
    info = StoreInfo(codec=codec_of(hidden_cfg), taps=list(hidden_cfg.taps), hidden_size=target.hidden_size,
                     target=target.name, extra={"synthetic": "benchmarks.train"})  # fmt: skip
    dataset = write_store(uri, info, samples, hidden_cfg.shard_samples)
    if not storage.exists(storage.join(uri, "dataset.json")):
        raise RuntimeError(f"benchmarks.train: the store at {uri} has no dataset.json after write_store")
    counts = {"samples": dataset["samples"], "tokens": dataset["tokens"]}
    return StageManifest(stage="hidden_states", key="bench-synthetic-hidden", uri=uri, counts=counts)
