"""MkDocs hook: the recipe reference, generated from the pydantic config models at build time.

`docs/recipe-reference.md` holds the prose and a `<!-- recipe-reference -->` marker; this hook replaces the
marker with one table per recipe section (field, type, default, description), walking `model_fields`
recursively from the root `PipelineConfig`: nested sections, lists of models and each family of the
`drafter` union. The `NightlyConfig` of the nightly regression flow follows. Models used at more than one
place (`Resources`, the vLLM engine settings) get one section of their own that every use links to.
Nothing here is written by hand, so the reference cannot drift from the code.
"""

from __future__ import annotations

import enum
import inspect
import json
import sys
import types
import typing
from pathlib import Path

MARKER = "<!-- recipe-reference -->"
PAGE = "recipe-reference.md"


def on_config(config, **kwargs):
    # The folder of mkdocs.yml (the repository root) on sys.path, so the config models import whether or not
    # the package is installed.
    root = str(Path(config["config_file_path"]).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return config


def on_page_markdown(markdown: str, page, config, files, **kwargs):
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE}: the marker {MARKER} is missing; the generated reference has nowhere to go")
    return markdown.replace(MARKER, render())


def render() -> str:
    from draftsmith.core.config import NightlyConfig, PipelineConfig

    out: list[str] = []
    for title, root, prefix, display in (
        ("The recipe (`PipelineConfig`)", PipelineConfig, "", ""),
        ("The nightly regression (`NightlyConfig`)", NightlyConfig, "nightly", "NightlyConfig."),
    ):
        ref = _Reference(root, prefix, display)
        out.append(ref.render(title))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- the walk


def _is_model(tp) -> bool:
    from pydantic import BaseModel

    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _strip(tp):
    """`Annotated[X, ...]` → X."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _union_args(tp) -> tuple | None:
    tp = _strip(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _models_in(tp) -> list[type]:
    """Every model class an annotation mentions (through unions, lists, dicts, Annotated)."""
    tp = _strip(tp)
    if _is_model(tp):
        return [tp]
    found: list[type] = []
    for arg in typing.get_args(tp):
        if arg is Ellipsis or isinstance(arg, (str, int, float, bool)):
            continue
        found.extend(_models_in(arg))
    return found


def _kind(model) -> str | None:
    """The discriminator value of a union member (`kind: Literal["eagle3"]`)."""
    field = model.model_fields.get("kind")
    if field is None:
        return None
    args = typing.get_args(_strip(field.annotation))
    return str(args[0]) if len(args) == 1 else None


class _Reference:
    def __init__(self, root, prefix: str, display: str) -> None:
        self.root = root
        self.prefix = prefix  # of anchors: two roots share the page
        self.display = display  # of section headings
        self.uses: dict[type, list[str]] = {}
        self._count(root, "")
        # Models met at more than one path are documented once, under their class name.
        self.shared = [m for m, paths in self.uses.items() if len(paths) > 1 and m is not root]
        self.sections: list[str] = []

    # -- where every model is used

    def _count(self, model, path: str) -> None:
        for name, field in model.model_fields.items():
            sub = f"{path}.{name}" if path else name
            members = _models_in(field.annotation)
            for m in members:
                member_path = sub
                if len(members) > 1 and _kind(m):
                    member_path = f"{sub}[kind={_kind(m)}]"
                self.uses.setdefault(m, []).append(member_path)
                if len(self.uses[m]) == 1:
                    self._count(m, sub)

    # -- anchors and links

    def anchor(self, path_or_model) -> str:
        if isinstance(path_or_model, str):
            text = path_or_model
        else:
            text = f"type-{path_or_model.__name__}"
        text = f"{self.prefix}-{text}" if self.prefix else text
        return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")

    def link(self, model, path: str, kind: str | None = None) -> str:
        if model in self.shared:
            return f"[{model.__name__}](#{self.anchor(model)})"
        if kind:
            return f"[{model.__name__}](#{self.anchor(f'{path}-{kind}')}) (`kind: {kind}`)"
        return f"[{model.__name__}](#{self.anchor(path)})"

    # -- rendering

    def render(self, title: str) -> str:
        lines = [f"## {title} {{#{self.anchor('root') if self.prefix else 'recipe'}}}", ""]
        lines += _paragraphs(_doc(self.root))
        lines += self.table(self.root, "")
        self._walk(self.root, "")
        lines += self.sections
        for model in self.shared:
            where = ", ".join(f"`{self.display}{p}`" for p in dict.fromkeys(self.uses[model]))
            lines += [f"### {model.__name__} {{#{self.anchor(model)}}}", "", f"Used by {where}.", ""]
            lines += _paragraphs(_doc(model))
            lines += self.table(model, model.__name__)
            self.sections = []
            self._walk(model, model.__name__)
            lines += self.sections
        return "\n".join(lines) + "\n"

    def _walk(self, model, path: str) -> None:
        for name, field in model.model_fields.items():
            sub = f"{path}.{name}" if path else name
            members = _models_in(field.annotation)
            for m in members:
                if m in self.shared:
                    continue
                kind = _kind(m) if len(members) > 1 else None
                heading = f"`{self.display}{sub}` with `kind: {kind}`" if kind else f"`{self.display}{sub}`"
                anchor = self.anchor(f"{sub}-{kind}" if kind else sub)
                self.sections += [f"### {heading} {{#{anchor}}}", ""]
                text = _doc(m) or (field.description or "").strip()
                if typing.get_origin(_strip(field.annotation)) is list:
                    text = f"Each item of the `{sub}` list. {text}"
                self.sections += _paragraphs(text)
                self.sections += self.table(m, sub)
                self._walk(m, sub)

    def table(self, model, path: str) -> list[str]:
        rows = ["| field | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            sub = f"{path}.{name}" if path else name
            rows.append(
                f"| `{name}` | {self.type_cell(field.annotation, sub)}{_constraints(field)} "
                f"| {_default(field)} | {_cell(field.description or '')} |"
            )
        return rows + [""]

    def type_cell(self, tp, path: str) -> str:
        tp = _strip(tp)
        if _is_model(tp):
            return self.link(tp, path)
        union = _union_args(tp)
        if union:
            models = [a for a in union if _is_model(a)]
            if len(models) > 1 and all(_kind(m) for m in models):
                # A discriminated union (the drafter families): one section per member.
                return " or ".join(self.link(m, path, _kind(m)) for m in models)
            return " or ".join(self.type_cell(a, path) for a in union)
        origin = typing.get_origin(tp)
        if origin is typing.Literal:
            return " or ".join(f"`{json.dumps(a)}`" for a in typing.get_args(tp))
        if origin in (list, tuple, dict):
            args = typing.get_args(tp)
            inner = ", ".join(self.type_cell(a, path) for a in args if a is not Ellipsis)
            return f"{origin.__name__}[{inner}]"
        if tp is type(None):
            return "`null`"
        if tp is typing.Any:
            return "any"
        if isinstance(tp, type):
            return f"`{tp.__name__}`"
        return f"`{tp}`"


def _doc(model) -> str:
    """A model's own docstring (not one inherited from the base model)."""
    doc = model.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if doc else ""


def _paragraphs(text: str) -> list[str]:
    return [text, ""] if text else []


def _constraints(field) -> str:
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "min length", "max_length": "max length"}
    found = []
    for meta in field.metadata:
        for attr, sign in signs.items():
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return f", {', '.join(found)}" if found else ""


def _default(field) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(the section's defaults)"
    if isinstance(value, enum.Enum):
        value = value.value
    repo = str(_repo_root())
    if isinstance(value, str) and value.startswith(repo):
        # Defaults computed from the checkout's location (the nightly's folders) are shown relative to it.
        value = value[len(repo) + 1 :] or "."
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _repo_root() -> Path:
    import draftsmith

    return Path(draftsmith.__file__).resolve().parents[1]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
