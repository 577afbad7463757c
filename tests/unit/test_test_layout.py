"""The tests' and benchmarks' shape: every test module carries its tier (a module `pytestmark`, or a tier on each
of its tests where a module mixes tiers, as the faults tier does), and no module of `tests/` or `benchmarks/`
imports a test module or another module's private (`_`) names: what two modules share lives in
`tests/support` or `benchmarks/helpers`. A planted offence of each kind must fail the same checks."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TIERS = {"unit", "integration", "e2e"}
FOLDERS = ("tests", "benchmarks")


def _tiers(node: ast.expr) -> set[str]:
    """The tier markers named in a `pytestmark` value or a decorator (`pytest.mark.unit`, lists of them)."""
    names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    return names & TIERS


def tier_problems(path: Path) -> list[str]:
    """A test module with no module tier and a test without its own; one line per offence."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and _tiers(node.value):
            if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
                return []
    tests = [
        n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name.startswith(("test", "Test"))
    ]
    bare = [n for n in tests if not any(_tiers(d) for d in n.decorator_list)]
    if not tests:
        return [f"{path}: no tests and no tier marker"]
    return [f"{path}:{n.lineno}: {n.name} has no tier marker and its module sets none (pytestmark)" for n in bare]


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


def import_problems(path: Path, root: Path) -> list[str]:
    """Imports of a test module (other than itself) or of a private name of another module of the project."""
    own = _module_name(path, root)
    bad = []
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        pairs: list[tuple[str, str | None]]
        if isinstance(node, ast.Import):
            pairs = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            pairs = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in pairs:
            mine = module.split(".")[0] in FOLDERS
            full = f"{module}.{name}" if name else module
            if mine and any(p.startswith("test_") for p in full.split(".")) and full != own and module != own:
                bad.append(
                    f"{path}:{node.lineno}: imports the test module {full}; move what it shares to tests/support"
                )
            elif name and name.startswith("_") and not name.startswith("__") and mine:
                bad.append(f"{path}:{node.lineno}: imports the private {module}.{name}; make it a shared helper")
    return bad


def problems(root: Path) -> list[str]:
    out = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            if folder == "tests" and path.name.startswith("test_"):
                out += tier_problems(path)
            out += import_problems(path, root)
    return out


def test_every_test_module_has_its_tier_and_no_module_borrows_another_s_private_helpers():
    assert problems(ROOT) == []


def test_planted_offences_are_named(tmp_path):
    unit = tmp_path / "tests" / "unit"
    unit.mkdir(parents=True)
    (unit / "test_a.py").write_text("import pytest\n\npytestmark = pytest.mark.unit\n\n\ndef _helper():\n    pass\n")
    (unit / "test_b.py").write_text("from tests.unit.test_a import _helper\n\n\ndef test_b():\n    _helper()\n")
    (unit / "test_c.py").write_text("import pytest\n\n\n@pytest.mark.slow\ndef test_c():\n    pass\n")
    found = problems(tmp_path)
    assert any("test_b.py:1: imports the test module tests.unit.test_a._helper" in p for p in found), found
    assert any("test_b.py:4: test_b has no tier marker" in p for p in found), found
    assert any("test_c.py:5: test_c has no tier marker" in p for p in found), found
    (unit / "test_b.py").write_text(
        "from tests.support.x import _helper\n\npytestmark = 1\n\n\ndef test_b():\n    pass\n"
    )
    assert any("imports the private tests.support.x._helper" in p for p in problems(tmp_path))


def test_the_benchmarks_readme_lists_every_entry_point_and_make_bench_runs_no_helper():
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    entry_points = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    assert entry_points, "no entry point found"
    missing = [name for name in entry_points if f"python -m benchmarks.{name}`" not in readme]
    assert missing == [], f"benchmarks/README.md does not list {missing}"
    # make bench runs the top-level files only: helpers and workers sit in folders of their own.
    assert not [p.name for p in (ROOT / "benchmarks").glob("_*.py")]


def _imported(node: ast.AST) -> list[str]:
    """The dotted names an import statement may load (`from m import x` may name a submodule `m.x`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
    return []


def _import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of `tests/` and `benchmarks/` it imports, deferred imports included."""
    files = {
        _module_name(p, root).removesuffix(".__init__"): p
        for folder in FOLDERS
        for p in (root / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
            for target in _imported(node):
                parts = target.split(".")
                prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
                found = next((p for p in prefixes if p in files), None)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles among the modules of `tests/` and `benchmarks/` (each found once)."""
    graph = _import_graph(root)
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif state[nxt] == 0:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for start in sorted(graph):
        if state[start] == 0:
            visit(start, [start])
    return cycles


def test_no_two_modules_of_tests_or_benchmarks_import_each_other_round_a_cycle(tmp_path):
    assert import_cycles(ROOT) == []
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "benchmarks" / "a.py").write_text("def f():\n    from benchmarks.b import g\n")
    (tmp_path / "benchmarks" / "b.py").write_text("from benchmarks import a\n")
    assert import_cycles(tmp_path) == [["benchmarks.a", "benchmarks.b", "benchmarks.a"]]
