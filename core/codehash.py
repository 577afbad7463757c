"""The code a stage runs, as part of its key: the modules it names and every project module they import.

A stage names its entry modules; the key hashes those files and, followed through the import statements
of each (deferred imports inside functions included), every file of the project's packages they reach.
A change to a helper three imports down therefore recomputes the stage, while an edit elsewhere in the
checkout (the CLI, another stage's code, docs) leaves it cached. Modules outside the project packages
(the standard library, torch, a benchmark or a test that names itself) count by their own file only.
"""

import ast
import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from draftsmith.core import layout

ROOT = Path(__file__).resolve().parents[1]


def _project_file(name: str) -> Path | None:
    """The file of module `name` when it is one of the project's (`core.layout.PACKAGES`), else None."""
    package = layout.package_of(name)
    if package is None:
        return None
    rel = Path(layout.PACKAGES[package], *name[len(package) :].split(".")[1:])
    for path in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if path.is_file():
            return path
    return None


def _absolute(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


@functools.cache
def _imported(path: Path, name: str) -> frozenset[str]:
    """Every module name an import statement anywhere in `path` may load (a `from m import x` may name a
    submodule `m.x`, so both are listed; names that are not modules resolve to no file and drop out)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, path.name == "__init__.py", node)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    # Importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first.
    for full in list(found):
        parts = full.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(found)


def closure(roots: Iterable[tuple[str, Path]]) -> list[Path]:
    """The files of `roots` (module name, file) and of every project module reachable by their imports."""
    seen: dict[Path, str] = {}
    stack = list(roots)
    while stack:
        name, path = stack.pop()
        if path in seen:
            continue
        seen[path] = name
        for imported in _imported(path, name):
            found = _project_file(imported)
            if found is not None and found not in seen:
                stack.append((imported, found))
    return sorted(seen)


def _root(module: ModuleType) -> tuple[str, Path]:
    file = getattr(module, "__file__", None)
    if not file:
        raise ValueError(f"code: module {module.__name__} has no source file to hash")
    return module.__spec__.name if module.__spec__ else module.__name__, Path(file).resolve()


@functools.cache
def _file_digest(path: Path) -> bytes:
    # Read once per process: the key describes the code this process loaded, even if the checkout is
    # edited while it runs (a long-lived worker keeps running what it imported).
    return hashlib.sha256(path.read_bytes()).digest()


def code_digest(modules: Iterable[ModuleType]) -> str:
    """sha256 over the relative path and content of every file `modules` run (see the module docstring)."""
    h = hashlib.sha256()
    for path in closure(_root(m) for m in modules):
        label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        h.update(f"{label}\0".encode() + _file_digest(path))
    return h.hexdigest()
