"""The import graph runs one way: every module of every floor (`core/layout.py`), deferred and typing-only
imports included, imports only from its own floor or the floors below it, through the one `draftsmith`
namespace, and no two files import each other round a cycle. A planted upward import and a planted cycle
must fail the same checks."""

import ast
from pathlib import Path

import pytest

from draftsmith.core import layout

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# The folders as bare import names: importing `tasks.x` instead of `draftsmith.tasks.x` loads a second copy.
BARE = {folder for folder in layout.PACKAGES.values()}


def modules(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Every module of the project: dotted name -> file."""
    out = {}
    for package, folder in packages.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(part == "__pycache__" for part in rel.parts):
                continue
            out[".".join([package, *parts])] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a project module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return None


def imports(path: Path, module: str, known: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(project module imported, line, the import as written) for every import statement in `path`."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [(alias.name, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [(f"{base}.{alias.name}", base) for alias in node.names]
        else:
            continue
        for full, written in names:
            target = _resolve(full, known)
            if target is not None and target != module:
                found.append((target, node.lineno, written))
            elif written.split(".")[0] in BARE:
                found.append((written, node.lineno, written))
    return found


def violations(root: Path, packages: dict[str, str], floors) -> list[str]:
    """Upward and bare imports, and cycles among files, each as one line naming the file and line."""
    known = modules(root, packages)
    package_of = {name: max((p for p in packages if name == p or name.startswith(p + ".")), key=len) for name in known}
    floor = {p: i for i, (_, members) in enumerate(floors) for p in members}
    bad: list[str] = []
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        where = path.relative_to(root)
        for target, line, written in imports(path, name, known):
            if target not in known:
                bad.append(f"{where}:{line}: imports {written!r}; import it as draftsmith.{written}")
                continue
            graph[name].add(target)
            mine, theirs = floor[package_of[name]], floor[package_of[target]]
            if theirs < mine:
                bad.append(
                    f"{where}:{line}: {name} ({floors[mine][0]}) imports {target} ({floors[theirs][0]}), a floor above"
                )
    bad += [f"import cycle among {len(c)} modules: {', '.join(c)}" for c in cycles(graph)]
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_import_runs_down_a_floor_and_no_files_import_each_other_round_a_cycle():
    assert violations(ROOT, layout.PACKAGES, layout.FLOORS) == []


def test_tests_and_benchmarks_import_the_project_through_its_namespace():
    known = modules(ROOT, layout.PACKAGES)
    bad = []
    for folder in ("tests", "benchmarks", "docs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for target, line, written in imports(path, f"{folder}.{path.stem}", known):
                if target not in known:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: imports {written!r}")
    assert bad == []


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


PLANTED = {"app": "app", "app.tasks": "tasks", "app.core": "core"}
PLANTED_FLOORS = (("app", ("app",)), ("tasks", ("app.tasks",)), ("core", ("app.core",)))


def test_a_planted_upward_import_fails_naming_the_file_and_line(tmp_path):
    _plant(tmp_path, {
        "app/__init__.py": "", "app/cli.py": "from app.tasks import train\n",
        "tasks/__init__.py": "", "tasks/train.py": "from app.core import storage\n",
        "core/__init__.py": "", "core/storage.py": "def write():\n    from app.tasks import train  # deferred\n",
    })  # fmt: skip
    assert violations(tmp_path, PLANTED, PLANTED_FLOORS) == [
        "core/storage.py:2: app.core.storage (core) imports app.tasks.train (tasks), a floor above",
        "import cycle among 2 modules: app.core.storage, app.tasks.train",
    ]


def test_a_planted_cycle_between_files_of_one_floor_and_a_bare_import_fail(tmp_path):
    _plant(tmp_path, {
        "app/__init__.py": "", "tasks/__init__.py": "", "core/__init__.py": "",
        "tasks/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.tasks.b import B\n",
        "tasks/b.py": "from app.tasks import a\nimport tasks.a\n",
    })  # fmt: skip
    assert violations(tmp_path, PLANTED, PLANTED_FLOORS) == [
        "tasks/b.py:2: imports 'tasks.a'; import it as draftsmith.tasks.a",
        "import cycle among 2 modules: app.tasks.a, app.tasks.b",
    ]
