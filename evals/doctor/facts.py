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
    """Everything the checks read; the checkpoint's tensors are read one at a time, when a check asks."""

    run: str
    manifests: dict[str, StageManifest]
    recipe: PipelineConfig | None = None
    metrics: list[dict] = field(default_factory=list)
    results: dict | None = None
    rows: list[dict] = field(default_factory=list)
    draft_config: dict | None = None
    exports: dict[str, dict] = field(default_factory=dict)
    speedup: dict | None = None
    header: dict[str, Any] | None = None  # train/model.safetensors' header, read on demand
    header_len: int = 0

    def path(self, *parts: str) -> str:
        return storage.join(self.run, *parts)

    def shapes(self) -> dict[str, tuple[str, list[int]]]:
        """Tensor name -> (safetensors dtype, shape) of the trained checkpoint, {} when there is none. Only the
        header is read: a large drafter's weights stay where they are (on S3 too)."""
        return {k: (v["dtype"], v["shape"]) for k, v in self._header().items() if k != "__metadata__"}

    def tensor(self, name: str) -> Any:
        """One tensor of the trained checkpoint (only its bytes are read), or None when it has no such tensor."""
        import torch

        entry = self._header().get(name)
        if entry is None or name == "__metadata__":
            return None
        start, end = entry["data_offsets"]
        base = 8 + self.header_len
        (data,) = storage.read_ranges(self.path("train", "model.safetensors"), [(base + start, base + end)])
        dtype = _dtype(entry["dtype"])
        flat = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        return flat.reshape(entry["shape"])

    def _header(self) -> dict[str, Any]:
        if self.header is not None:
            return self.header
        url = self.path("train", "model.safetensors")
        header: dict[str, Any] = {}
        if "train" in self.manifests and storage.exists(url):
            (size,) = storage.read_ranges(url, [(0, 8)])
            self.header_len = int.from_bytes(size, "little")
            (raw,) = storage.read_ranges(url, [(8, 8 + self.header_len)])
            header = _json_bytes(raw, "train/model.safetensors header")
        self.header = header
        return header


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip


def _dtype(name: str) -> Any:
    """The torch dtype of a safetensors dtype name (torch is imported only when a tensor is read)."""
    import torch

    if name not in _SAFETENSORS_DTYPES:
        raise DoctorInputError(f"train/model.safetensors: tensor dtype {name} is not supported here")
    return getattr(torch, _SAFETENSORS_DTYPES[name])


def _json_bytes(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise DoctorInputError(f"{what}: not valid JSON ({err})") from None


def _json(url: str, what: str) -> Any:
    return _json_bytes(storage.read_bytes(url), what)


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
