"""Serving methods: what an engine calls a drafter (`--speculative-config` method), and each method's
conventions. Every family's export module is one (`Family.export`); several families may share one (a
family exported as EAGLE-3 is served as EAGLE-3). A method module defines:

- `METHOD`: the name the engines know; `SGLANG_ALGORITHM`: SGLang's and TokenSpeed's name for it;
- `TAP_IDS_ENGINES`: the engines whose draft config lists our taps as they are (the others: tap - 1);
- `draft_tokens(depth=, block_size=)`, `num_speculative_tokens(config, depth)`: drafts per verification step;
- `speculative_args(engine, num_tokens)`: the method's own launch flags for SGLang and TokenSpeed;
- `notes(engine)`: caveats printed with the launch command;
- `recognizes(config)`: whether an exported `config.json` is this method's;
- `checkpoint_blobs`, `load_drafter(folder, embed, head)`, `config_layer_ids`, `expected_shapes` and
  `extra_files(blobs, run_dir, model)` (files beyond the weights, e.g. a calibration).
"""

from draftsmith.drafters import families
from draftsmith.drafters.families import ExportMethod


def modules() -> dict[str, ExportMethod]:
    """Every registered family's method module, by method name."""
    return {m.METHOD: m for m in (families.family(kind).export for kind in families.kinds())}


def names() -> tuple[str, ...]:
    return tuple(modules())


def module(method: str) -> ExportMethod:
    """The module of serving method `method`; a ValueError naming the known ones otherwise."""
    found = modules()
    if method not in found:
        raise ValueError(f"drafter method {method!r}: expected one of {', '.join(found)}")
    return found[method]


def method_of(kind: str) -> str:
    """The serving method of drafter family `kind`."""
    return families.family(kind).export.METHOD


def of_config(config: dict) -> str | None:
    """The method an exported `config.json` belongs to, or None if no method recognizes it."""
    return next((name for name, m in modules().items() if m.recognizes(config)), None)
