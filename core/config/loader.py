"""YAML recipe loading with one-line errors that name the file and the dotted field."""

import codecs
import json
import re
from pathlib import Path
from typing import Any

import fsspec
import yaml
from pydantic import ValidationError

from draftsmith.core.config.drafter import drafter_kinds
from draftsmith.core.config.pipeline import PipelineConfig


class RecipeError(ValueError):
    """A recipe is invalid. `str(err)` is one line per problem: `file: dotted.path: message`."""


def _union_tag(parent: Any, part: Any) -> bool:
    """A tagged union puts its tag in the location (`drafter.dspark.block_size`); the recipe has no such key."""
    return parent == "drafter" and part in drafter_kinds()


# A key of these characters reads as itself in a dotted path; any other key is quoted, so that a key holding a
# newline, a dot or a control character keeps the error on one line and the path unambiguous.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(part: Any) -> str:
    if part == "[key]":  # pydantic's marker of a mapping key (rather than its value) in a location
        return part
    return part if isinstance(part, str) and _PLAIN_KEY.fullmatch(part) else f"[{part!r}]"


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for i, part in enumerate(loc):
        if not (i and _union_tag(loc[i - 1], part)):
            out = _join(out, part)
    return out


def _shown(value: Any) -> str:
    """`repr(value)`, cut to about 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _one_line(text: str) -> str:
    """`text` with line breaks and other control characters escaped: one problem, one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _format(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        where = _dotted(tuple(e["loc"]))
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(_one_line(f"{origin}: {where}: {msg}" if where else f"{origin}: {msg}"))
    return "\n".join(lines)


def _check_files(cfg: PipelineConfig, origin: str) -> None:
    """Local files named by a recipe must exist now, not halfway through a run."""
    checks = [("select.path", cfg.select.path, "")]
    for i, src in enumerate(cfg.select.sources or []):
        if src.kind != "hf":  # a dataset name, not a path
            checks.append((f"select.sources[{i}].path", src.path, ""))
    checks += [(f"select.benchmark_files[{i}]", f, "") for i, f in enumerate(cfg.select.benchmark_files)]
    if not cfg.target.source.startswith("embedded:") and cfg.regenerate.engine == "hf":
        # Said, since the engine may be the default: a served model's name is fine for the other engines.
        checks.append(("target.source", cfg.target.source, " (regenerate.engine 'hf' loads it from this machine)"))
    for field, value, why in checks:
        if value and "://" not in value:
            problem = _path_problem(value)
            if problem:
                raise RecipeError(f"{origin}: {field}: {problem}{why}")


def _path_problem(value: str) -> str | None:
    """Why the local path `value` cannot be used, or None when it exists."""
    try:
        if Path(value).expanduser().exists():
            return None
    except RuntimeError:  # `~user/...` for a user this machine does not know
        return f"cannot expand {_shown(value)}: no such user's home folder"
    except (OSError, ValueError) as err:  # a name too long for the file system, a NUL byte
        return f"cannot use {_shown(value)} as a path: {getattr(err, 'strerror', None) or err}"
    return f"file or folder {value!r} does not exist"


_SHAPE_KEYS = (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"))


def _local_model_config(source: str) -> dict[str, Any] | None:
    """The target's config.json when its folder is on this machine; None for a served or unbuilt model."""
    from draftsmith.core.target_setup import EMBEDDED_PREFIX, embedded_folder

    try:
        if source.startswith(EMBEDDED_PREFIX):
            folder = embedded_folder(source)
        else:
            folder = None if "://" in source else Path(source).expanduser()
        path = folder / "config.json" if folder else None
        if path is None or not path.is_file():
            return None
        config = json.loads(path.read_text())
    except (OSError, ValueError, RuntimeError, RecursionError):
        # No folder this machine can read (a served model's name, a broken folder): the engine says so when it
        # loads the model, with its own error.
        return None
    return config if isinstance(config, dict) else None


def check_target_shape(cfg: PipelineConfig, origin: str = "<recipe>") -> None:
    """The declared target shape must be the model's: taps and heads are sized from it before any load. Checked
    when the model's folder is on this machine; `RecipeError` naming the field otherwise."""
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


def parse_recipe(data: Any, origin: str = "<recipe>", *, files: bool = True) -> PipelineConfig:
    """Validate an already-parsed recipe mapping: the model's rules, then (with `files`) that its local files
    exist, then the target's shape against its config.json when the model is on this machine."""
    cfg = parse_model(data, origin)
    if files:
        _check_files(cfg, origin)
    check_target_shape(cfg, origin)
    return cfg


def parse_model(data: Any, origin: str = "<recipe>") -> PipelineConfig:
    """The recipe model's rules only (every field and every rule across fields); `RecipeError` naming the path."""
    if data is None:
        raise RecipeError(f"{origin}: the recipe is empty (no YAML mapping in the file)")
    if not isinstance(data, dict):
        raise RecipeError(f"{origin}: a recipe must be a YAML mapping, got {type(data).__name__}")
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format(err, origin)) from None
    return cfg


class _TreeError(yaml.YAMLError):
    """A mapping names one key twice, the document nests past `_MAX_DEPTH` or aliases expand it past
    `_MAX_VALUES`; the message starts with the dotted path."""


# A recipe holds a few hundred values. Aliases of aliases ("billion laughs") expand a short file into billions,
# which validation would pass (`extra_body` takes any mapping) and every later dump or hash would walk.
_MAX_VALUES = 100_000
# A recipe nests five levels or so. Deeper documents are refused at a fixed depth rather than wherever the
# caller's stack runs out (PyYAML composes recursively), so a recipe's validity does not depend on its caller.
_MAX_DEPTH = 64


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error, not "last one wins",
    aliases cannot expand the document past `_MAX_VALUES` values, and a scalar that cannot be read (an
    integer of 5000 digits, a date with month 13) is a YAML error with its line, not a bare ValueError."""

    def construct_document(self, node: yaml.Node) -> Any:
        # Checked on the node tree before construction, where the dotted path and the lines are known.
        _check_tree(node, "", {})
        return super().construct_document(node)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except ValueError as err:
            # The first clause only: Python's advice on its integer digit limit is not the recipe author's to take.
            reason = str(err).split(";")[0]
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {_shown(node.value)} ({node.tag}): {reason}", node.start_mark
            ) from None


def _join(path: str, part: Any) -> str:
    if isinstance(part, int) and not isinstance(part, bool):
        return f"{path}[{part}]"
    key = _key(part)
    return key if not path else f"{path}{key}" if key.startswith("[") else f"{path}.{key}"


def _check_tree(node: yaml.Node, path: str, sizes: dict[int, int], depth: int = 0) -> int:
    """The number of values `node` expands to; raises `_TreeError` on a duplicate key, too many values or
    too deep a nesting.

    `sizes` holds each node already counted, so an alias costs one lookup, not another walk, and a node in
    progress counts as too many, so an alias to itself stops the walk.
    """
    if id(node) in sizes:
        return sizes[id(node)]
    if depth > _MAX_DEPTH:
        raise _TreeError(f"{path}: collections nested too deeply for a recipe (more than {_MAX_DEPTH} levels)")
    sizes[id(node)] = _MAX_VALUES + 1
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_check_tree(item, _join(path, i), sizes, depth + 1) for i, item in enumerate(node.value))
    elif isinstance(node, yaml.MappingNode):
        seen: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            # `<<: *anchor` keys may be overridden by the mapping's own; complex keys are not recipe keys.
            plain = isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge"
            dotted = _join(path, key.value) if plain else path
            if plain and (key.tag, key.value) in seen:
                line, first = key.start_mark.line + 1, seen[(key.tag, key.value)]
                raise _TreeError(f"{dotted}: duplicate key on line {line} (first on line {first})")
            if plain:
                seen[(key.tag, key.value)] = key.start_mark.line + 1
            size += _check_tree(key, dotted, sizes, depth + 1) + _check_tree(value, dotted, sizes, depth + 1)
    if size > _MAX_VALUES:
        raise _TreeError(f"{path or 'the document'}: YAML aliases expand it to more than {_MAX_VALUES} values")
    sizes[id(node)] = size
    return size


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's problem and where it is, on one line (its own message spreads over several)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return problem + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else "")


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
        raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark opening the file is not part of the recipe
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise RecipeError(f"{origin}: not UTF-8 text: byte 0x{raw[err.start]:02x} on line {line}") from None
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader: no Python objects from the file
    except _TreeError as err:
        raise RecipeError(_one_line(f"{origin}: {err}")) from None
    except yaml.YAMLError as err:
        raise RecipeError(_one_line(f"{origin}: not valid YAML: {_yaml_problem(err)}")) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise RecipeError(f"{origin}: not valid YAML: collections nested too deeply for a recipe") from None


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


def apply_overrides(data: Any, overrides: dict[str, Any] | None, origin: str) -> None:
    """Replace dotted keys of a parsed recipe in place, e.g. `{"train.epochs": 1}`."""
    if overrides and isinstance(data, dict):
        for dotted, value in overrides.items():
            _apply_override(data, dotted, value, origin)


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None, *, files: bool = True) -> PipelineConfig:
    """Load and validate a YAML recipe (local path or fsspec URL).

    Args:
        path: the recipe file.
        overrides: dotted keys to replace before validation, e.g. `{"train.epochs": 1}`.
        files: check that the local files it names exist here (off where other machines read them).
    """
    origin = str(path)
    data = _read_yaml(origin)
    apply_overrides(data, overrides, origin)
    return parse_recipe(data, origin, files=files)


def note_overrides(err: RecipeError, keys: list[str], origin: str, note: str) -> RecipeError:
    """`err` with `note` after each problem at a field `keys` wrote, which the file itself may not even have."""
    lines = []
    for line in str(err).splitlines():
        field = line.removeprefix(f"{origin}: ").split(": ", 1)[0]
        hit = any(k == field or k.startswith(f"{field}.") or field.startswith((f"{k}.", f"{k}[")) for k in keys)
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
    from draftsmith.core import storage

    url = storage.join(run_dir, "recipe.yaml")
    storage.write_bytes(url, dump_recipe(cfg).encode())
    return url
