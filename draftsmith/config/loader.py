"""YAML recipe loading with one-line errors that name the file and the dotted field."""

from pathlib import Path
from typing import Any

import fsspec
import yaml
from pydantic import ValidationError

from draftsmith.config.pipeline import PipelineConfig


class RecipeError(ValueError):
    """A recipe is invalid. `str(err)` is one line per problem: `file: dotted.path: message`."""


# A tagged union puts its tag in the location (`drafter.dspark.block_size`); the recipe has no such key.
_UNION_TAGS = {("drafter", "eagle3"), ("drafter", "dflash2"), ("drafter", "dspark")}


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for i, part in enumerate(loc):
        if i and (loc[i - 1], part) in _UNION_TAGS:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _format(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        where = _dotted(tuple(e["loc"]))
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{origin}: {where}: {msg}" if where else f"{origin}: {msg}")
    return "\n".join(lines)


def _check_files(cfg: PipelineConfig, origin: str) -> None:
    """Local files named by a recipe must exist now, not halfway through a run."""
    checks = [("select.path", cfg.select.path)]
    for i, src in enumerate(cfg.select.sources or []):
        if src.kind != "hf":  # a dataset name, not a path
            checks.append((f"select.sources[{i}].path", src.path))
    checks += [(f"select.benchmark_files[{i}]", f) for i, f in enumerate(cfg.select.benchmark_files)]
    if not cfg.target.source.startswith("embedded:") and cfg.regenerate.engine == "hf":
        checks.append(("target.source", cfg.target.source))
    for field, value in checks:
        if value and "://" not in value and not Path(value).expanduser().exists():
            raise RecipeError(f"{origin}: {field}: file or folder {value!r} does not exist")


def parse_recipe(data: Any, origin: str = "<recipe>") -> PipelineConfig:
    """Validate an already-parsed recipe mapping."""
    if not isinstance(data, dict):
        raise RecipeError(f"{origin}: a recipe must be a YAML mapping, got {type(data).__name__}")
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format(err, origin)) from None
    _check_files(cfg, origin)
    return cfg


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Load and validate a YAML recipe (local path or fsspec URL).

    Args:
        path: the recipe file.
        overrides: dotted keys to replace before validation, e.g. `{"train.epochs": 1}`.
    """
    origin = str(path)
    try:
        with fsspec.open(origin, "rt", encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise RecipeError(f"{origin}: recipe file not found") from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{origin}: not valid YAML: {str(err).splitlines()[0]}") from None
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return parse_recipe(data, origin)


def dump_recipe(cfg: PipelineConfig) -> str:
    """The recipe as YAML, every default spelled out."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def record_recipe(cfg: PipelineConfig, run_dir: str) -> str:
    """Write the resolved recipe to `<run_dir>/recipe.yaml` (atomically) and return its URL.

    What later tools read back: `draftsmith export RUN` takes the target and taps from it, and anyone can
    rerun exactly this run with `draftsmith run <run_dir>/recipe.yaml`.
    """
    from draftsmith import storage

    url = storage.join(run_dir, "recipe.yaml")
    storage.write_bytes(url, dump_recipe(cfg).encode())
    return url
