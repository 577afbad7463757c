"""Whether the drafter copies: its first drafts on the rounds where the next token repeats the context, against
the other rounds.

Where prompt lookup (`acceptance.PromptLookup`, the engine's free `ngram` method) would propose the right next
token, the token is in the context for the drafter too: its attention over the prompt and the answer so far can
find it. A drafter that has learned to copy is right there more often than elsewhere; one that has learned its
training prompts' wording instead (names, passages and code it saw many times, so it never had to look them up)
is right there less often, on new requests. That is the gap that makes copying beat it on requests that carry
material to reuse. Only rounds whose next token the pruned draft vocabulary holds count (when the checkpoint
has one): copied names and identifiers are often outside it, and that loss is the draft-vocabulary check's.
Thresholds are in `docs/doctor.md`.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from draftsmith.core.config.sweep import NgramSettings
from draftsmith.evals.doctor import findings as F
from draftsmith.evals.doctor.acceptance import MIN_TRIES, ROWS, PromptLookup
from draftsmith.evals.doctor.facts import RunFacts
from draftsmith.evals.doctor.findings import Finding

COPY_MARGIN = 0.05  # first-draft acceptance on copyable rounds must beat the other rounds' by this much


@dataclass
class CopyTally:
    """Rounds whose next token the context holds (prompt lookup proposes it) and the others, with how many of
    each had their first draft accepted."""

    copyable: int = 0
    copied: int = 0
    other: int = 0
    other_hits: int = 0

    def add(self, t: "CopyTally") -> None:
        self.copyable, self.copied = self.copyable + t.copyable, self.copied + t.copied
        self.other, self.other_hits = self.other + t.other, self.other_hits + t.other_hits

    @property
    def copy_rate(self) -> float:
        return self.copied / max(1, self.copyable)

    @property
    def other_rate(self) -> float:
        return self.other_hits / max(1, self.other)

    def describe(self) -> str:
        share = self.copyable / max(1, self.copyable + self.other)
        return (f"next token in the context on {share:.0%} of {self.copyable + self.other} rounds; first draft "
                f"accepted there {self.copy_rate:.0%}, elsewhere {self.other_rate:.0%}")  # fmt: skip


def tally(
    prompt: Sequence[int],
    output: Sequence[int],
    round_accepts: Sequence[int],
    s: NgramSettings,
    draftable: Sequence[bool] | None = None,
) -> CopyTally:
    """Walk the evaluation's rounds over `output`: the prefill gives token 0, then round i drafts from position p,
    the target keeps `round_accepts[i]` drafts and adds one token, so the next round starts that many + 1 later.
    `draftable` (indexed by token id, the checkpoint's t2d): rounds whose next token it excludes are skipped."""
    seq = [*prompt, *output]
    lookup, t = PromptLookup(seq, s), CopyTally()
    end = len(prompt) + 1
    for accepted in round_accepts:
        if end >= len(seq):
            break
        draft = lookup.propose(end)
        if draftable is not None and not (0 <= seq[end] < len(draftable) and draftable[seq[end]]):
            pass
        elif draft and draft[0] == seq[end]:
            t.copyable, t.copied = t.copyable + 1, t.copied + (accepted > 0)
        else:
            t.other, t.other_hits = t.other + 1, t.other_hits + (accepted > 0)
        end += accepted + 1
    return t


def copying(f: RunFacts) -> list[Finding]:
    """Per benchmark, first-draft acceptance where the context holds the next token against elsewhere."""
    check = "copying"
    if not f.rows:
        return [F.missing(check, f"{ROWS} is absent", "draftsmith run RECIPE (the evaluate stage)")]
    if any("prompt_ids" not in r or "round_accepts" not in r for r in f.rows):
        return [F.missing(check, f"{ROWS} has no prompt_ids/round_accepts (written by newer evaluations)",
                          "rerun evaluate (remove RUN/evaluate, then draftsmith run RECIPE)")]  # fmt: skip
    s = f.recipe.speedup.ngram if f.recipe is not None else NgramSettings()
    t2d = f.tensor("t2d")
    draftable = None if t2d is None else t2d.bool().tolist()
    per: dict[str, CopyTally] = {}
    for r in f.rows:
        t = tally(r["prompt_ids"], r["output_ids"], r["round_accepts"], s, draftable)
        per.setdefault(r["bench"], CopyTally()).add(t)
    counted = {b: t for b, t in per.items() if t.copyable >= MIN_TRIES and t.other >= MIN_TRIES}
    if not counted:
        return [F.info(check, f"too few rounds to tell whether the drafter copies (under {MIN_TRIES} a side)",
                       f"{ROWS}: " + "; ".join(f"{b}: {t.describe()}" for b, t in per.items()))]  # fmt: skip
    evidence = [f"{ROWS} output_ids, round_accepts: {b}: {t.describe()}" for b, t in counted.items()]
    evidence.append(f"the context holds the next token: n-gram {s.prompt_lookup_min}..{s.prompt_lookup_max} "
                    "prompt lookup (speedup.ngram) proposes it, replayed on the evaluation's outputs"
                    + ("" if draftable is None else "; rounds whose next token is outside the draft "
                       "vocabulary (train/model.safetensors t2d) left out"))  # fmt: skip
    weak = [b for b, t in counted.items() if t.copy_rate < t.other_rate + COPY_MARGIN]
    if weak:
        return [F.warn(check, f"the drafter does not copy from the context on {', '.join(weak)}", *evidence,
                       fix="train on requests whose answers reuse material the drafter cannot have memorised "
                           "(real traffic in select.sources; select.mix reuse kinds), or serve n-gram or suffix "
                           "decoding for such workloads (draftsmith speedup RUN)")]  # fmt: skip
    return [F.ok(check, "the drafter copies: its first drafts do better where the context holds the next token",
                 *evidence)]  # fmt: skip
