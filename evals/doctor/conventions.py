"""Conventions between stages and engines: the tap layer ids an export declares, the fusion weights the taps
feed, the chat template and thinking mode of the data against the evaluation's, the loss mask, and the draft
vocabulary's coverage of what the target actually writes.

Thresholds, and why they sit where they do, are in `docs/doctor.md`.
"""

from collections import Counter

from draftsmith.evals.doctor import findings as F
from draftsmith.evals.doctor.facts import RunFacts
from draftsmith.evals.doctor.findings import Finding

FUSION_ZERO = 1e-6  # largest |weight| of a block still at `drafter.init_fc_last_tap`'s zero start
FUSION_INIT_MAX = (0.97, 1.01)  # largest |weight| over nn.Linear's init bound 1/sqrt(fan_in), when never updated
FUSION_INIT_STD = 0.03  # relative distance of the block's std from the uniform init's bound/sqrt(3)
MASK_TEMPLATE = 0.9  # loss tokens over all tokens above which the mask must cover prompts and template
MASK_THIN = 0.05  # ... below which answers are mostly cut or unmasked
TRUNCATED_WARN = 0.1  # samples cut at tokenize.max_length
SYSTEM_SHARE_GAP = 0.5  # training and evaluated prompts' shares that set a system message, further apart than this
VOCAB_MISS_WARN = 0.05  # share of evaluated target tokens outside the draft vocabulary
VOCAB_TARGET = 0.95  # coverage the suggested vocabulary size reaches


def _configs(f: RunFacts) -> dict[str, tuple[str, dict]]:
    """Checkpoint configs by file: the trained checkpoint and every export, with the engine each is for."""
    out = {}
    if f.draft_config is not None:
        out["train/config.json"] = ((f.draft_config.get("draftsmith") or {}).get("engine", "vllm"), f.draft_config)
    for engine, config in f.exports.items():
        out[f"export/{engine}/config.json"] = (engine, config)
    return out


def tap_convention(f: RunFacts) -> list[Finding]:
    """Each config's layer ids against the taps converted for its engine (the off-by-one between "output of
    layer k" and "input of layer k"), the taps against the hidden-state store, and the fusion weights."""
    from draftsmith.drafters.export import engines, methods

    check = "tap-convention"
    configs = _configs(f)
    if not configs:
        return [F.missing(check, "no train/config.json or export/<engine>/config.json", "draftsmith run RECIPE")]
    out: list[Finding] = []
    stored = (f.manifests["hidden_states"].info.get("taps") if "hidden_states" in f.manifests else None) or ""
    for name, (engine, config) in configs.items():
        method = methods.of_config(config)
        taps = [int(t) for t in (config.get("draftsmith") or {}).get("taps") or []]
        if method is None or not taps:
            out.append(F.info(check, f"{name}: not a draftsmith checkpoint config (no method or taps)", name))
            continue
        ids = list(methods.module(method).config_layer_ids(config))
        want = engines.aux_layer_ids(method, engine, taps)
        layers = (config.get("draftsmith") or {}).get("num_target_layers") or (
            f.recipe.target.num_layers if f.recipe is not None else None
        )
        where = f"{name}: layer ids {ids}, draftsmith.taps {taps}; {method} on {engine} expects {want} " \
                f"({engines.aux_convention(method, engine)})"  # fmt: skip
        if ids != want:
            shift = {i - w for i, w in zip(ids, want, strict=False)} if len(ids) == len(want) else set()
            kind = f"off by {shift.pop():+d} layer" if len(shift) == 1 else "not the trained taps"
            out.append(F.error(check, f"{name}: the engine will feed the drafter other layers ({kind})", where,
                               fix=f"draftsmith export RUN --engine {engine} (writes its ids)"))  # fmt: skip
        if layers and any(not 1 <= t < int(layers) for t in taps):
            out.append(F.error(check, f"{name}: a tap is outside the target's layers 1..{int(layers) - 1}", where,
                               fix="hidden_states.taps"))  # fmt: skip
        if stored and [int(t) for t in stored.split(",")] != taps:
            store = f"hidden_states/manifest.json info.taps {stored}"
            out.append(F.error(check, f"{name}: the taps differ from the hidden-state store's", where, store,
                               fix="retrain on this store"))  # fmt: skip
    out += _fusion(check, f)
    if not any(x.severity in ("warn", "error") for x in out):
        shown = ", ".join(f"{n} {c.get('draftsmith', {}).get('taps')}" for n, (_, c) in configs.items())
        out.append(F.ok(check, "every checkpoint's layer ids are its taps in its engine's convention", shown))
    return out


def _untouched(block_max: float, block_std: float, bound: float) -> bool:
    """A fusion block still at its start: all zeros (`drafter.init_fc_last_tap` zeroes every tap but the last), or
    nn.Linear's U(-bound, bound) draw, whose largest |weight| sits at the bound and whose std is bound/sqrt(3).
    Adam moves a weight only when its gradient is non-zero, so a block whose tap carried no signal stays there."""
    if block_max < FUSION_ZERO:
        return True
    lo, hi = FUSION_INIT_MAX
    return lo * bound <= block_max <= hi * bound and abs(block_std / (bound / 3**0.5) - 1) < FUSION_INIT_STD


def _fusion(check: str, f: RunFacts) -> list[Finding]:
    """The fusion layer (`fc.weight [H, N*Ht]`): a tap's block that training never updated is a tap whose
    features never reached the loss (a zero or constant capture, a tap the fusion does not see)."""
    weight = f.tensor("fc.weight")
    taps = ((f.draft_config or {}).get("draftsmith") or {}).get("taps") or []
    if weight is None or not taps or weight.shape[1] % len(taps):
        return []
    blocks = weight.float().reshape(weight.shape[0], len(taps), -1).transpose(0, 1).reshape(len(taps), -1)
    bound = 1 / weight.shape[1] ** 0.5
    stats = [(float(b.abs().max()), float(b.std())) for b in blocks]
    idle = [t for t, (m, s) in zip(taps, stats, strict=True) if _untouched(m, s, bound)]
    if not idle:
        return []
    shown = ", ".join(f"tap {t}: max {m:.3g}, std {s:.3g}" for t, (m, s) in zip(taps, stats, strict=True))
    return [F.warn(check, f"the fusion weights of tap {', '.join(map(str, idle))} were never updated",
                   f"train/model.safetensors fc.weight by tap: {shown} (initial bound {bound:.3g}, or 0)",
                   fix="check the hidden-state store's values at that tap (hidden_states), or choose another "
                       "hidden_states.taps")]  # fmt: skip


def _on(value: object) -> str:
    return "on" if str(value).lower() in ("on", "true", "1") else "off"


def template_mode(f: RunFacts) -> list[Finding]:
    """Chat template and thinking mode: regenerate, tokenize and the evaluation must agree; the loss mask
    must cover the answers and not the template."""
    check = "template"
    reg, tok = f.manifests.get("regenerate"), f.manifests.get("tokenize")
    if reg is None or tok is None:
        return [F.missing(check, "needs the regenerate and tokenize manifests", "draftsmith run RECIPE")]
    out: list[Finding] = []
    sha = {"regenerate": reg.info.get("chat_template_sha256", ""), "tokenize": tok.info.get("chat_template_sha256", "")}
    mode = {"regenerate": _on(reg.info.get("thinking")), "tokenize": _on(tok.info.get("thinking"))}
    served = (f.results or {}).get("chat_template") or {}
    if served:
        # The harness renders with the template's default mode, which some templates set on: not comparable
        # with an explicit on/off, only worth a warning when the data was made in thinking mode.
        sha["evaluate"], mode["evaluate"] = served.get("sha256", ""), str(served.get("thinking", ""))
    where = {"regenerate": "regenerate/manifest.json info", "tokenize": "tokenize/manifest.json info",
             "evaluate": "evaluate/results.json chat_template"}  # fmt: skip
    shown = "; ".join(f"{where[k]}: template {v[:12]}, thinking {mode[k]}" for k, v in sha.items())
    if len({v for v in sha.values() if v}) > 1:
        out.append(F.error(check, "the data was rendered with another chat template than the evaluation's", shown,
                           fix="regenerate with the served template (regenerate.chat_template_sha256, "
                               "tokenize.allow_provenance_mismatch: false)"))  # fmt: skip
    explicit = {k: v for k, v in mode.items() if v in ("on", "off")}
    if len(set(explicit.values())) > 1:
        out.append(F.error(check, "thinking mode differs between stages", shown,
                           fix="regenerate.thinking and tokenize.thinking as the target is served"))  # fmt: skip
    elif mode.get("evaluate") not in (None, "on", "off") and "on" in explicit.values():
        title = "the data is in thinking mode; the evaluation renders prompts in the template's default mode"
        fix = "serve with the data's mode (enable_thinking), or regenerate.thinking: false"
        out.append(F.warn(check, title, shown, fix=fix))
    out += _system(check, reg.counts, served)
    out += _mask(check, tok.counts)
    if not any(x.severity in ("warn", "error") for x in out):
        out.append(F.ok(check, "one chat template and thinking mode from data to evaluation", shown))
    return out


def _system(check: str, counts: dict[str, int], served: dict) -> list[Finding]:
    """Prompts with a system message in the training data against the evaluated ones: a template that adds a
    default system message where none is given renders the two kinds with different prefixes."""
    trained, evaluated = counts.get("system_prompts"), served.get("system_prompts")
    if trained is None or evaluated is None or not counts.get("prompts") or not served.get("prompts"):
        return []  # recorded since regenerate and evaluate count system messages; older runs are not compared
    a, b = trained / counts["prompts"], evaluated / served["prompts"]
    if abs(a - b) <= SYSTEM_SHARE_GAP:
        return []
    line = (
        f"regenerate/manifest.json counts: system_prompts {trained} of {counts['prompts']} ({a:.0%}); "
        f"evaluate/results.json chat_template: system_prompts {evaluated} of {served['prompts']} ({b:.0%})"
    )
    title = "the training prompts and the evaluated ones differ in whether they set a system message"
    fix = (
        "train on prompts with the system message your requests carry (select.sources, select.writing.system), "
        "or serve requests the way the data was made"
    )
    return [F.warn(check, title, line, fix=fix)]  # fmt: skip


def _mask(check: str, counts: dict[str, int]) -> list[Finding]:
    tokens, loss = counts.get("tokens", 0), counts.get("loss_tokens", 0)
    if not tokens:
        return []
    share = loss / tokens
    line = f"tokenize/manifest.json counts: loss_tokens {loss} of tokens {tokens} ({share:.1%})"
    out = []
    if share > MASK_TEMPLATE:
        out.append(F.error(check, "the loss mask covers nearly every token: prompts and template are trained", line,
                           fix="tokenize.renderer (an assistant-only mask for this template)"))  # fmt: skip
    elif share < MASK_THIN:
        out.append(F.warn(check, "the loss mask covers few tokens: answers are cut or missed", line,
                          fix="tokenize.max_length, or tokenize.renderer if answers are not masked"))  # fmt: skip
    samples, cut = counts.get("samples", 0), counts.get("truncated", 0)
    if samples and cut / samples > TRUNCATED_WARN:
        out.append(F.warn(check, "many samples were cut at tokenize.max_length", line,
                          f"tokenize/manifest.json counts: truncated {cut} of {samples} samples",
                          fix="tokenize.max_length"))  # fmt: skip
    return out


def vocab_coverage(f: RunFacts) -> list[Finding]:
    """Share of the evaluation's target tokens the pruned draft vocabulary cannot propose, and the size
    that would cover `VOCAB_TARGET` of them (the current vocabulary plus the most frequent missing tokens)."""
    check = "draft-vocabulary"
    t2d = f.tensor("t2d")
    if t2d is None:
        size = (f.draft_config or {}).get("draft_vocab_size")
        if f.draft_config is not None and size == f.draft_config.get("vocab_size"):
            return [F.ok(check, "the drafter proposes from the full target vocabulary", f"train/config.json {size}")]
        return [F.missing(check, "train/model.safetensors holds no t2d", "draftsmith run RECIPE")]
    if not f.rows:
        return [F.missing(check, "evaluate/prompts.jsonl is absent", "draftsmith run RECIPE (the evaluate stage)")]
    seen = Counter(t for r in f.rows for t in r["output_ids"])
    total = sum(seen.values())
    inside = t2d.bool().tolist()
    missed = {t: n for t, n in seen.items() if not (0 <= t < len(inside) and inside[t])}
    share = sum(missed.values()) / max(1, total)
    size = int(t2d.sum())
    need, covered = 0, total - sum(missed.values())
    for n in sorted(missed.values(), reverse=True):
        if covered >= VOCAB_TARGET * total:
            break
        need, covered = need + 1, covered + n
    evidence = (
        f"evaluate/prompts.jsonl output_ids: {sum(missed.values())} of {total} target tokens ({share:.1%}) are outside "
        f"the {size}-token draft vocabulary (train/model.safetensors t2d)",
        f"{size + need} tokens would cover {VOCAB_TARGET:.0%} (adding the {need} most frequent missing ones)",
    )
    if share > VOCAB_MISS_WARN:
        return [F.warn(check, f"the drafter cannot propose {share:.1%} of what the target writes", *evidence,
                       fix=f"drafter.draft_vocab_size (now {size}; {size + need} covers {VOCAB_TARGET:.0%}), "
                           "or training data closer to these benchmarks")]  # fmt: skip
    return [F.ok(check, f"the draft vocabulary covers {1 - share:.1%} of the evaluated target tokens", *evidence)]
