"""Where acceptance is lost (per draft position, per benchmark, and by context length) and what copying alone
would reach on the same answers (n-gram prompt lookup, simulated offline from the evaluation's outputs).

Thresholds, and why they sit where they do, are in `docs/doctor.md`.
"""

from collections.abc import Sequence

from draftsmith.core.config.sweep import NgramSettings
from draftsmith.evals.doctor import findings as F
from draftsmith.evals.doctor.facts import RunFacts
from draftsmith.evals.doctor.findings import Finding

RESULTS, ROWS = "evaluate/results.json", "evaluate/prompts.jsonl"
POSITION_DEAD = 0.2  # conditional acceptance below which a further draft position costs more than it brings
MIN_TRIES = 30  # verifications of a position (or rounds in a bucket) below which its rate is noise
LONG_CONTEXT_DROP = 0.5  # accepted drafts per round in a bucket, as a share of the shortest bucket's
BUCKET_EDGES = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
NGRAM_CLOSE = 0.9  # n-gram acc_len over the drafter's at which copying is worth a look


def position_loss(f: RunFacts) -> list[Finding]:
    """Per-position conditional acceptance, per benchmark: the first position where it falls below
    `POSITION_DEAD` is where drafting deeper stops paying."""
    check = "position-acceptance"
    if f.results is None:
        return [F.missing(check, f"{RESULTS} is absent", "draftsmith run RECIPE (the evaluate stage)")]
    # First position (from 0) where acceptance falls below the bar -> the benchmarks and their evidence lines.
    dead: dict[int, list[tuple[str, str]]] = {}
    lines = []
    for b in f.results.get("benches", []):
        pos, tries = b.get("position_accept") or [], _tries(b)
        line = f"{RESULTS} benches[{b['bench']}].position_accept [{', '.join(f'{p:.2f}' for p in pos)}]"
        lines.append(line)
        low = [k for k, p in enumerate(pos) if p < POSITION_DEAD and (tries is None or tries[k] >= MIN_TRIES)]
        if low:
            dead.setdefault(low[0], []).append((b["bench"], line))
    out = []
    for k, benches in sorted(dead.items()):
        fix = (
            f"serve {k} draft tokens (speedup.draft_tokens, evaluate.num_draft_tokens)"
            if k > 0
            else "the first draft is rarely right: see the generalisation-gap, template and tap-convention findings"
        )
        depth = _trained_depth(f)
        if depth is not None and k >= depth:
            fix += f"; positions from {k + 1} are beyond the trained depth: raise drafter.ttt_depth"
        names = ", ".join(name for name, _ in benches)
        evidence = [line for _, line in benches] + ["(conditional on reaching the position)"]
        out.append(F.warn(check, f"drafts from position {k + 1} are rarely accepted on {names}", *evidence, fix=fix))
    if not out and lines:
        return [F.ok(check, f"every draft position is accepted at least {POSITION_DEAD:.0%} of the time", *lines)]
    return out


def _tries(bench: dict) -> list[int] | None:
    """Verifications of each position: rounds that reached it, from the acceptance histogram."""
    hist = bench.get("accept_hist")
    if not hist:
        return None
    return [sum(hist[k:]) for k in range(len(hist) - 1)]


def _trained_depth(f: RunFacts) -> int | None:
    if f.draft_config is None:
        return None
    depth = (f.draft_config.get("draftsmith") or {}).get("ttt_depth")
    return int(depth) if depth else None


def context_buckets(rows: Sequence[dict]) -> dict[int, tuple[int, int]]:
    """Bucket upper edge -> (rounds, accepted drafts): each round placed by the context length it drafted at
    (prompt tokens plus tokens emitted before it)."""
    out: dict[int, tuple[int, int]] = {}
    for r in rows:
        context = int(r["prompt_tokens"]) + 1  # the prefill emits the first token; rounds follow it
        for n_acc in r["round_accepts"]:
            edge = next((e for e in BUCKET_EDGES if context < e), BUCKET_EDGES[-1] * 2)
            rounds, accepted = out.get(edge, (0, 0))
            out[edge] = (rounds + 1, accepted + int(n_acc))
            context += int(n_acc) + 1
    return dict(sorted(out.items()))


def long_context(f: RunFacts) -> list[Finding]:
    """Accepted drafts per round by context-length bucket: a collapse at long context."""
    check = "long-context"
    if not f.rows:
        return [F.missing(check, f"{ROWS} is absent", "draftsmith run RECIPE (the evaluate stage)")]
    if any("prompt_tokens" not in r or "round_accepts" not in r for r in f.rows):
        return [F.missing(check, f"{ROWS} has no prompt_tokens/round_accepts (written by newer evaluations)",
                          "rerun evaluate (remove RUN/evaluate, then draftsmith run RECIPE)")]  # fmt: skip
    buckets = {e: v for e, v in context_buckets(f.rows).items() if v[0] >= MIN_TRIES}
    shown = ", ".join(f"<{e}: {1 + a / n:.2f} ({n} rounds)" for e, (n, a) in buckets.items())
    if len(buckets) < 2:
        return [F.info(check, "the evaluation covers one context-length bucket: long context untested",
                       f"{ROWS}: acc_len by context length {shown or 'none with enough rounds'}",
                       fix="evaluate.bench_files with long prompts")]  # fmt: skip
    edges = list(buckets)
    base = buckets[edges[0]][1] / buckets[edges[0]][0]
    low = [e for e in edges[1:] if base > 0 and buckets[e][1] / buckets[e][0] < LONG_CONTEXT_DROP * base]
    if not low:
        return [F.ok(check, "acceptance holds across context lengths", f"{ROWS}: acc_len by context length {shown}")]
    trained = f.recipe.tokenize.max_length if f.recipe is not None else None
    beyond = f" (training sequences: tokenize.max_length {trained})" if trained else ""
    prev = edges[edges.index(low[0]) - 1]
    return [F.warn(check, f"acceptance collapses beyond {prev} tokens of context{beyond}",
                   f"{ROWS}: acc_len by context length {shown}",
                   fix="tokenize.max_length and long-context prompts in select.sources")]  # fmt: skip


class PromptLookup:
    """n-gram prompt lookup over one growing sequence, as vLLM's `ngram` method drafts: the longest suffix
    n-gram (prompt_lookup_max down to _min) seen earlier proposes up to `num_speculative_tokens` tokens that
    followed its latest earlier occurrence."""

    def __init__(self, seq: Sequence[int], s: NgramSettings) -> None:
        self.seq, self.s, self.known = seq, s, 0
        self.index: list[dict[tuple, int]] = [{} for _ in range(s.prompt_lookup_max + 1)]

    def propose(self, end: int) -> list[int]:
        """The draft for position `end` from `seq[:end]` (positions must come in increasing order)."""
        seq, s = self.seq, self.s
        for j in range(max(self.known, 1), end):  # n-grams ending before j, each followed by seq[j]
            for n in range(s.prompt_lookup_min, s.prompt_lookup_max + 1):
                if j >= n:
                    self.index[n][tuple(seq[j - n : j])] = j
        self.known = max(self.known, end)
        for n in range(s.prompt_lookup_max, s.prompt_lookup_min - 1, -1):
            start = self.index[n].get(tuple(seq[end - n : end])) if end >= n else None
            if start is not None:
                return list(seq[start : min(start + s.num_speculative_tokens, end)])
        return []


def ngram_rounds(prompt: Sequence[int], output: Sequence[int], s: NgramSettings) -> tuple[int, int]:
    """(rounds, accepted drafts) of n-gram prompt lookup (`PromptLookup`) replaying `output` after `prompt`:
    the target keeps the draft's matching prefix and adds one token of its own."""
    seq = [*prompt, *output]
    lookup = PromptLookup(seq, s)
    # The prefill emits the first token; rounds draft after it, as in the evaluation and in vLLM.
    end, rounds, accepted = len(prompt) + 1, 0, 0
    while end < len(seq):
        draft = lookup.propose(end)
        n_acc = 0
        while n_acc < len(draft) and end + n_acc < len(seq) and draft[n_acc] == seq[end + n_acc]:
            n_acc += 1
        rounds, accepted, end = rounds + 1, accepted + n_acc, end + n_acc + 1
    return rounds, accepted


def free_speculation(f: RunFacts) -> list[Finding]:
    """Offline n-gram acc_len per benchmark on the evaluation's own prompts and answers, against the drafter's."""
    check = "free-speculation"
    if f.results is None or not f.rows:
        return [F.missing(check, f"{RESULTS} or {ROWS} is absent", "draftsmith run RECIPE (the evaluate stage)")]
    if any("prompt_ids" not in r for r in f.rows):
        return [F.missing(check, f"{ROWS} has no prompt_ids (written by newer evaluations)",
                          "rerun evaluate (remove RUN/evaluate, then draftsmith run RECIPE)")]  # fmt: skip
    s = f.recipe.speedup.ngram if f.recipe is not None else NgramSettings()
    drafter = {b["bench"]: float(b["acc_len"]) for b in f.results.get("benches", [])}
    per: dict[str, tuple[int, int]] = {}
    for r in f.rows:
        n, a = ngram_rounds(r["prompt_ids"], r["output_ids"], s)
        rounds, acc = per.get(r["bench"], (0, 0))
        per[r["bench"]] = (rounds + n, acc + a)
    ngram = {b: 1 + a / max(1, n) for b, (n, a) in per.items()}
    shown = "; ".join(f"{b}: n-gram {ngram[b]:.3f}, drafter {drafter[b]:.3f}" for b in ngram if b in drafter)
    how = (f"n-gram {s.prompt_lookup_min}..{s.prompt_lookup_max}, {s.num_speculative_tokens} tokens "
           "(speedup.ngram), replayed on the evaluation's outputs")  # fmt: skip
    evidence = (f"{ROWS} output_ids: {shown}", how)
    beaten = [b for b in ngram if b in drafter and ngram[b] >= drafter[b]]
    close = [b for b in ngram if b in drafter and b not in beaten and ngram[b] >= NGRAM_CLOSE * drafter[b]]
    temperature = float(f.results.get("temperature", 0.0) or 0.0)
    sampled = " (sampled outputs: an estimate)" if temperature else ""
    if beaten:
        return [F.warn(check, f"copying beats the drafter on {', '.join(beaten)}{sampled}", *evidence,
                       fix="draftsmith speedup RUN --free-methods ngram (measure it served); train on data like these "
                           "benchmarks (select.sources) or serve n-gram for such workloads")]  # fmt: skip
    if close:
        return [F.info(check, f"copying comes within {1 - NGRAM_CLOSE:.0%} of the drafter on {', '.join(close)}",
                       *evidence, fix="draftsmith speedup RUN --free-methods ngram")]  # fmt: skip
    return [F.ok(check, "the drafter beats n-gram prompt lookup on every benchmark", *evidence)]
