"""Fuzzed recipes through the real recipe loader and `draftsmith validate`.

Every recipe either loads, meaning what it says, or fails with one line per problem naming the file and the
field, exit code 2 and no traceback. Examples are derandomized, so a run is the same everywhere.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from draftsmith import cli
from draftsmith.core.config import RecipeError, load_recipe
from tests.support.fuzz import FUZZ
from tests.support.paths import RECIPES, ROOT

pytestmark = pytest.mark.unit

RECIPE_TEXT = {p.name: p.read_text() for p in sorted(RECIPES.glob("*.yaml"))}
RECIPE_DATA = {name: yaml.safe_load(text) for name, text in RECIPE_TEXT.items()}
TINY = RECIPE_TEXT["tiny-cpu.yaml"]
PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),  # NaN and the infinities too
    st.text(max_size=12),
    st.sampled_from(["1e-4", "on", "", "tiny\n", "~nobody-here/x.jsonl", "a" * 5000, "a\x00b", "embedded:nope"]),
    st.lists(st.integers(-3, 40), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.integers(1, 120).map(lambda depth: json.loads("[" * depth + "]" * depth)),
)


def _nodes(data, path=()):
    """Every `(path, value)` of a parsed recipe, sections and leaves."""
    yield path, data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        yield from _nodes(value, (*path, key))


def _dotted(path: tuple) -> str:
    """A field's path as the loader prints it: `a.b[0].c`, a key of other characters as `['x y']`."""
    out = ""
    for part in path:
        plain = isinstance(part, str) and PLAIN_KEY.fullmatch(part)
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part) if plain else f"[{part!r}]"
    return out


def _at(data, path: tuple):
    for part in path:
        data = data[part]
    return data


@st.composite
def recipe_edit(draw) -> tuple[str, str, str, tuple, object]:
    """A shipped recipe with one value replaced, one key added, one key removed or nothing changed: `(name, text,
    kind, path, value)`."""
    name = draw(st.sampled_from(sorted(RECIPE_DATA)))
    data = json.loads(json.dumps(RECIPE_DATA[name]))
    kind = draw(st.sampled_from(["replace", "replace", "unknown", "delete", "none"]))
    value = draw(VALUES)
    if kind == "none":  # as shipped, written out again
        path, value = (), data
    elif kind == "unknown":
        section = draw(st.sampled_from([p for p, v in _nodes(data) if isinstance(v, dict)]))
        key = draw(st.from_regex(r"[a-z_]{1,10}", fullmatch=True) | st.text(min_size=1, max_size=6))
        key = key if key not in _at(data, section) else f"{key}_x"
        path = (*section, key)
        _at(data, section)[key] = value
    else:
        path = draw(st.sampled_from([p for p, _ in _nodes(data) if p]))
        if kind == "delete":
            del _at(data, path[:-1])[path[-1]]
        else:
            _at(data, path[:-1])[path[-1]] = value
    return name, yaml.safe_dump(data, sort_keys=False, allow_unicode=draw(st.booleans())), kind, path, value


def _means(written, got) -> bool:
    """Whether a loaded value is the one written: numbers may widen and YAML 1.1 numeric strings become numbers,
    but nothing else is converted (a boolean is never a number, nor the reverse)."""
    number = isinstance(got, int | float) and not isinstance(got, bool)
    if written is None or isinstance(written, bool):
        return got is written or (isinstance(written, bool) and got == ("on" if written else "off"))
    if isinstance(written, int | float):
        return number and got == written
    if isinstance(written, str):
        with contextlib.suppress(ValueError):
            return got == written or (number and float(written) == got)
        return False
    if isinstance(written, list):
        return isinstance(got, list | tuple) and len(got) == len(written) and all(map(_means, written, got))
    # A section fills in the fields not written with their defaults.
    return isinstance(got, dict) and set(written) <= set(got) and all(_means(v, got[k]) for k, v in written.items())


def _load_and_validate(path: Path):
    """The loaded recipe, or the loader's error lines; `draftsmith validate`, run in this process, must say the
    same."""
    out_io, err_io = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out_io), contextlib.redirect_stderr(err_io):
        code = cli.main(["validate", str(path)])
    out, err = out_io.getvalue(), err_io.getvalue()
    try:
        cfg = load_recipe(path)
    except RecipeError as exc:
        lines = str(exc).splitlines()
        assert code == 2 and not out and err == f"error: {exc}\n", (code, out, err)
        for line in lines:  # one problem a line, each naming the file, none spilling over
            assert line.startswith(f"{path}: ") and line.isprintable(), line
        return lines
    assert code == 0 and out == f"{path}: valid recipe {cfg.name!r}\n" and not err, (code, out, err)
    return cfg


@pytest.fixture
def recipe_dir(monkeypatch, tmp_path_factory):
    # cli.main sets its environment defaults (PREFECT_HOME, ...) in this process: keep them from other tests.
    monkeypatch.setattr(os, "environ", os.environ.copy())
    return tmp_path_factory.mktemp("recipes")


@FUZZ
@given(edit=recipe_edit())
@example(edit=("tiny-cpu.yaml", TINY.replace("tiny-cpu", '"tiny-cpu\\n"', 1), "replace",
               ("name",), "tiny-cpu\n"))  # fmt: skip
@example(edit=("tiny-cpu.yaml", TINY.replace("source: synthetic", "source: jsonl\n  path: "
               "~nobody-here/x.jsonl"), "replace", ("select", "path"), "~nobody-here/x.jsonl"))  # fmt: skip
@example(edit=("tiny-cpu.yaml", TINY + '"a\\nb": 1\n', "unknown", ("a\nb",), 1))
def test_recipe_edits_load_as_written_or_name_the_field(recipe_dir, edit):
    name, text, kind, path, value = edit
    file = recipe_dir / name
    file.write_text(text, errors="surrogatepass")  # a recipe may spell a lone surrogate as a YAML escape only
    loaded = _load_and_validate(file)
    assert kind != "none" or not isinstance(loaded, list), loaded
    if not isinstance(loaded, list):
        if kind != "delete":
            got = _at(loaded.model_dump(), path)
            assert _means(value, got), f"{_dotted(path)}: written {value!r}, loaded {got!r}"
        return
    # A list that lost an item is short at its end, wherever the item was.
    dotted = _dotted(path[:-1] if kind == "delete" and isinstance(path[-1], int) else path)
    wheres = [line.removeprefix(f"{file}: ").split(": ")[0] for line in loaded]
    assert any(w == dotted or w.startswith((f"{dotted}.", f"{dotted}[")) or dotted.startswith((f"{w}.", f"{w}["))
               for w in wheres) or dotted in "\n".join(loaded), (dotted, loaded)  # fmt: skip


POISON = [
    "x: " + "[" * 600 + "]" * 600,
    "x: " + "9" * 5000,
    "x: 2020-13-01",
    "x: !!python/object/apply:os.system ['true']",
    "x: &a [1, *a]",
    "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 10)).replace("*l0", "1"),
    "\tseed: 1",
    "---\nname: other",
    "x: *nowhere",
    "? [a, b]\n: c",
    "name: !!binary dGlueQ==",
    "seed: 0b101",
    "seed: 190:20:30",
    "train: {lr: 1.0e400}",
    "x: \x00",
]


@st.composite
def recipe_bytes(draw) -> tuple[str, bytes, str | None]:
    """A shipped recipe's bytes broken at the text level, and a phrase its error must hold (None: any error)."""
    name = draw(st.sampled_from(sorted(RECIPE_TEXT)))
    text = RECIPE_TEXT[name]
    lines = text.splitlines(keepends=True)
    kind = draw(st.sampled_from(["dup", "bytes", "empty", "cut", "poison", "random"]))
    if kind == "dup":
        i = draw(st.sampled_from([i for i, line in enumerate(lines) if re.match(r"\s*[A-Za-z_]+: \S", line)]))
        data = "".join([*lines[: i + 1], lines[i], *lines[i + 1 :]]).encode()
        return name, data, f"duplicate key on line {i + 2} (first on line {i + 1})"
    if kind == "bytes":
        i = draw(st.integers(0, len(lines)))
        junk = draw(st.sampled_from([b"\xff", b"\xc3(", b"\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
        data = "".join(lines[:i]).encode() + junk + "".join(lines[i:]).encode()
        return name, data, f"not UTF-8 text: byte 0x{junk[0]:02x} on line {i + 1}"
    if kind == "empty":
        return name, draw(st.sampled_from([b"", b"\n\n", b"# nothing\n", b"---\n", b"   \n"])), "the recipe is empty"
    if kind == "cut":
        return name, text.encode()[: draw(st.integers(0, len(text)))], None
    if kind == "poison":
        return name, (text + draw(st.sampled_from(POISON)) + "\n").encode(), None
    return name, draw(st.binary(max_size=300)), None


@FUZZ
@given(broken=recipe_bytes())
@example(broken=("tiny-cpu.yaml", (TINY + POISON[0]).encode(), "nested too deeply"))
@example(broken=("tiny-cpu.yaml", (TINY + POISON[1]).encode(), "cannot read"))
@example(broken=("tiny-cpu.yaml", (TINY + POISON[2]).encode(), "month must be"))
@example(broken=("tiny-cpu.yaml", (TINY + POISON[5]).encode(), "more than 100000 values"))
def test_broken_recipe_files_fail_on_one_line_each(recipe_dir, broken):
    name, data, phrase = broken
    file = recipe_dir / name
    file.write_bytes(data)
    loaded = _load_and_validate(file)
    if phrase is not None:
        assert isinstance(loaded, list) and phrase in loaded[0], (phrase, loaded)


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        (TINY, None),
        (TINY + POISON[0], "nested too deeply"),
        (TINY.replace("source: synthetic", "source: jsonl\n  path: " + "p" * 5000), "select.path"),
    ],
    ids=["valid", "deep-nesting", "path-too-long"],
)
def test_validate_command(tmp_path, text, phrase):
    """The installed entry point, as a user runs it: exit 0, or 2 with one `error:` line and no traceback."""
    file = tmp_path / "r.yaml"
    file.write_text(text)
    script = Path(sys.executable).with_name("draftsmith")  # the console script `make` installs
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "draftsmith.cli"]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*command, "validate", str(file)], capture_output=True, text=True, env=env)
    if phrase is None:
        assert proc.returncode == 0 and "valid recipe 'tiny-cpu'" in proc.stdout, proc.stderr
        return
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"error: {file}: ") and phrase in line, line
