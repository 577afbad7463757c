"""The code part of a stage key: a stage's modules and every project module their imports reach."""

import sys
import types

import pytest

from draftsmith.core import codehash, layout

pytestmark = pytest.mark.unit


def _tree(root) -> None:
    """`pkg.entry` imports `helper` inside a function; `helper` imports `deep` relatively; `other` is unreached."""
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "entry.py").write_text("import json\n\ndef run():\n    from pkg import helper\n    return helper.VALUE\n")
    (pkg / "helper.py").write_text("from .sub.deep import VALUE\n")
    (pkg / "sub" / "deep.py").write_text("VALUE = 1\n")
    (pkg / "other.py").write_text("X = 2\n")


def _module(root, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(root / (name.replace(".", "/") + ".py"))
    module.__spec__ = None
    return module


@pytest.fixture
def tree(tmp_path, monkeypatch):
    _tree(tmp_path)
    monkeypatch.setattr(codehash, "ROOT", tmp_path)
    monkeypatch.setattr(layout, "PACKAGES", {"pkg": "pkg"})
    return tmp_path


def test_the_closure_follows_deferred_and_relative_imports(tree) -> None:
    files = codehash.closure([("pkg.entry", tree / "pkg" / "entry.py")])
    assert [str(p.relative_to(tree)) for p in files] == [
        "pkg/__init__.py", "pkg/entry.py", "pkg/helper.py", "pkg/sub/__init__.py", "pkg/sub/deep.py",
    ]  # fmt: skip


def test_a_change_three_imports_down_changes_the_digest_and_one_elsewhere_does_not(tree) -> None:
    entry = _module(tree, "pkg.entry")
    before = codehash.code_digest([entry])
    (tree / "pkg" / "other.py").write_text("X = 3\n")
    codehash._file_digest.cache_clear()  # a process hashes each file once: this stands for a new process
    assert codehash.code_digest([entry]) == before
    (tree / "pkg" / "sub" / "deep.py").write_text("VALUE = 2\n")
    assert codehash.code_digest([entry]) == before  # this process still runs what it first read
    codehash._file_digest.cache_clear()
    assert codehash.code_digest([entry]) != before


def test_the_real_stages_reach_their_helpers_but_not_the_cli() -> None:
    import draftsmith.tasks.hidden_states
    import draftsmith.tasks.train
    from draftsmith.drafters import families

    def names(module) -> set[str]:
        return {str(p.relative_to(codehash.ROOT)) for p in codehash.closure([codehash._root(module)])}

    capture = names(draftsmith.tasks.hidden_states)
    assert {"engines/hf.py", "transport/offline_store.py", "core/storage.py"} <= capture
    assert "drafters/training/worker.py" in names(draftsmith.tasks.train)
    # Families load by name from a registry, so `train_key` names the family's modules as roots too.
    family = families.family("eagle3")
    assert "drafters/eagle3/model.py" in {
        str(p.relative_to(codehash.ROOT)) for p in codehash.closure(codehash._root(m) for m in family.code_modules())
    }
    assert not any(n.startswith(("flows/", "draftsmith/cli")) for n in capture | names(draftsmith.tasks.train))
    assert codehash.code_digest([sys.modules["draftsmith.tasks.train"]]) != codehash.code_digest(
        [draftsmith.tasks.hidden_states]
    )
