"""What a run folder records, read once for every check: stage manifests, the recipe, training metrics, the
evaluation's results and per-turn rows, the checkpoint's config and the speed-up measurement.

Only files stages already write are read; each is optional except that the folder must hold at least one
finished stage. A file that exists but does not parse is an input error naming the file.
"""

import json
from dataclasses import dataclass, field
from typing import Any

from draftsmith.core import storage
from draftsmith.core.config import PipelineConfig, RecipeError, load_recipe
from draftsmith.core.manifest import StageManifest
from draftsmith.core.stage import load_manifest

STAGES = ("select_prompts", "regenerate", "tokenize", "hidden_states", "train", "evaluate")
ENGINES = ("vllm", "sglang", "tokenspeed")


class DoctorInputError(ValueError):
    """The run folder is missing, holds no finished stage, or one of its files does not parse."""


@dataclass
class RunFacts:
    """Everything the checks read. `where` maps a fact to the file it came from, for the evidence lines."""

    run: str
    manifests: dict[str, StageManifest]
    recipe: PipelineConfig | None = None
    metrics: list[dict] = field(default_factory=list)
    results: dict | None = None
    rows: list[dict] = field(default_factory=list)
    draft_config: dict | None = None
    exports: dict[str, dict] = field(default_factory=dict)
    speedup: dict | None = None
    weights: dict[str, Any] | None = None  # train/model.safetensors, read on demand by `tensors()`

    def path(self, *parts: str) -> str:
        return storage.join(self.run, *parts)

    def rel(self, *parts: str) -> str:
        """A file's name for evidence: relative to the run folder."""
        return "/".join(parts)

    def tensors(self) -> dict[str, Any]:
        """The trained checkpoint's tensors (`train/model.safetensors`), {} when there is none."""
        if self.weights is None:
            from draftsmith.core import tensorio

            url = self.path("train", "model.safetensors")
            self.weights = tensorio.loads(storage.read_bytes(url))[0] if storage.exists(url) else {}
        return self.weights


def _json(url: str, what: str) -> Any:
    try:
        return json.loads(storage.read_bytes(url))
    except (ValueError, UnicodeDecodeError) as err:
        raise DoctorInputError(f"{what}: not valid JSON ({err})") from None


def _jsonl(url: str, what: str) -> list[dict]:
    rows = []
    for i, line in enumerate(storage.read_bytes(url).decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as err:
            raise DoctorInputError(f"{what}:{i}: not valid JSON ({err})") from None
    return rows


def _optional_json(run: str, *parts: str) -> Any:
    url = storage.join(run, *parts)
    return _json(url, "/".join(parts)) if storage.exists(url) else None


def _manifests(run: str) -> dict[str, StageManifest]:
    out = {}
    for stage in STAGES:
        try:
            found = load_manifest(storage.join(run, stage))
        except ValueError as err:  # pydantic's ValidationError and JSON errors are ValueErrors
            raise DoctorInputError(
                f"{stage}/manifest.json: not a stage manifest ({str(err).splitlines()[0]})"
            ) from None
        if found is not None:
            out[stage] = found
    return out


def _recipe(run: str) -> PipelineConfig | None:
    url = storage.join(run, "recipe.yaml")
    if not storage.exists(url):
        return None
    try:
        return load_recipe(url)
    except RecipeError as err:
        raise DoctorInputError(f"recipe.yaml: {err}") from None


def read_run(run: str) -> RunFacts:
    """The run folder's facts; `DoctorInputError` (one line) for a folder that is missing or holds no stage."""
    run = run.rstrip("/") or run
    try:
        present = storage.exists(run)
    except (OSError, ValueError) as err:
        raise DoctorInputError(f"{run}: cannot be read ({err})") from None
    if not present:
        raise DoctorInputError(f"{run}: no such run folder")
    manifests = _manifests(run)
    if not manifests:
        raise DoctorInputError(f"{run}: not a run folder (no finished stage: no <stage>/manifest.json for any of "
                               f"{', '.join(STAGES)})")  # fmt: skip
    facts = RunFacts(run=run, manifests=manifests, recipe=_recipe(run))
    if "train" in manifests and storage.exists(storage.join(run, "train", "metrics.jsonl")):
        facts.metrics = _jsonl(storage.join(run, "train", "metrics.jsonl"), "train/metrics.jsonl")
    if "train" in manifests:
        facts.draft_config = _optional_json(run, "train", "config.json")
    if "evaluate" in manifests:
        facts.results = _optional_json(run, "evaluate", "results.json")
        url = storage.join(run, "evaluate", "prompts.jsonl")
        facts.rows = _jsonl(url, "evaluate/prompts.jsonl") if storage.exists(url) else []
    for engine in ENGINES:
        config = _optional_json(run, "export", engine, "config.json")
        if config is not None:
            facts.exports[engine] = config
    facts.speedup = _optional_json(run, "speedup", "speedup.json")
    return facts
