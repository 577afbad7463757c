"""YAML recipe loading with one-line errors that name the file and the dotted field."""

import json
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


_SHAPE_KEYS = (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"))


def _local_model_config(source: str) -> dict[str, Any] | None:
    """The target's config.json when its folder is on this machine; None for a served or unbuilt model."""
    from draftsmith.target_setup import EMBEDDED_PREFIX, embedded_folder

    if source.startswith(EMBEDDED_PREFIX):
        folder = embedded_folder(source)
        path = folder / "config.json" if folder else None
    else:
        path = None if "://" in source else Path(source).expanduser() / "config.json"
    if path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a broken folder is the loader's to report, with its own error
    return config if isinstance(config, dict) else None


def _check_target_shape(cfg: PipelineConfig, origin: str) -> None:
    """The declared target shape must be the model's: taps and heads are sized from it before any load."""
    config = _local_model_config(cfg.target.source)
    if config is None:
        return
    text = config.get("text_config")  # multimodal models nest the language model's shape
    for field, key in _SHAPE_KEYS:
        actual = config.get(key, text.get(key) if isinstance(text, dict) else None)
        declared = getattr(cfg.target, field)
        if isinstance(actual, int) and actual != declared:
            raise RecipeError(
                f"{origin}: target.{field}: the recipe says {declared} but the model's config.json says {actual} "
                f"({key}, {cfg.target.source})"
            )


def parse_recipe(data: Any, origin: str = "<recipe>") -> PipelineConfig:
    """Validate an already-parsed recipe mapping."""
    if not isinstance(data, dict):
        raise RecipeError(f"{origin}: a recipe must be a YAML mapping, got {type(data).__name__}")
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format(err, origin)) from None
    _check_files(cfg, origin)
    _check_target_shape(cfg, origin)
    return cfg


class _DuplicateKeyError(yaml.YAMLError):
    """A mapping names one key twice; the message is `dotted.key: duplicate key on line N (first on line M)`."""


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error, not "last one wins"."""

    def construct_document(self, node: yaml.Node) -> Any:
        # Checked on the node tree before construction, where the dotted path and the lines are known.
        _check_duplicates(node, "")
        return super().construct_document(node)


def _check_duplicates(node: yaml.Node, path: str) -> None:
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicates(item, f"{path}[{i}]")
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[tuple[str, str], int] = {}
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` keys may be overridden by the mapping's own; complex keys are not recipe keys
        dotted = f"{path}.{key.value}" if path else key.value
        line = key.start_mark.line + 1
        if (key.tag, key.value) in seen:
            first = seen[(key.tag, key.value)]
            raise _DuplicateKeyError(f"{dotted}: duplicate key on line {line} (first on line {first})")
        seen[(key.tag, key.value)] = line
        _check_duplicates(value, dotted)


def _read_yaml(origin: str) -> Any:
    try:
        with fsspec.open(origin, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise RecipeError(f"{origin}: recipe file not found") from None
    except IsADirectoryError:
        raise RecipeError(f"{origin}: is a folder; give the recipe's YAML file") from None
    except OSError as err:
        raise RecipeError(f"{origin}: cannot read the recipe: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise RecipeError(f"{origin}: not UTF-8 text: byte 0x{raw[err.start]:02x} on line {line}") from None
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader: no Python objects from the file
    except _DuplicateKeyError as err:
        raise RecipeError(f"{origin}: {err}") from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{origin}: not valid YAML: {str(err).splitlines()[0]}") from None


def _apply_override(data: dict, dotted: str, value: Any, origin: str) -> None:
    node, where = data, []
    *parents, leaf = dotted.split(".")
    for part in parents:
        where.append(part)
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(
                f"{origin}: {dotted}: cannot set it: {'.'.join(where)} is {_kind(node)}, not a section of fields"
            )
    node[leaf] = value


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    return f"the value {json.dumps(value)}" if isinstance(value, bool | int | float | str | None) else "not a mapping"


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Load and validate a YAML recipe (local path or fsspec URL).

    Args:
        path: the recipe file.
        overrides: dotted keys to replace before validation, e.g. `{"train.epochs": 1}`.
    """
    origin = str(path)
    data = _read_yaml(origin)
    if overrides and isinstance(data, dict):
        for dotted, value in overrides.items():
            _apply_override(data, dotted, value, origin)
    return parse_recipe(data, origin)


def note_overrides(err: RecipeError, keys: list[str], origin: str, note: str) -> RecipeError:
    """`err` with `note` after each problem at a field `keys` wrote, which the file itself may not even have."""
    lines = []
    for line in str(err).splitlines():
        field = line.removeprefix(f"{origin}: ").split(": ", 1)[0]
        hit = any(k == field or k.startswith(f"{field}.") or field.startswith(f"{k}.") for k in keys)
        lines.append(f"{line} ({note})" if hit else line)
    return RecipeError("\n".join(lines))


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
