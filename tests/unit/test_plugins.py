"""Plugins are imported from `DRAFTSMITH_PLUGINS` and the `draftsmith.plugins` entry points, once each; one that
cannot be imported is named in one line."""

from types import SimpleNamespace

import pytest

from draftsmith.core import plugins

pytestmark = pytest.mark.unit


def test_modules_named_by_the_variable_and_the_entry_points_are_imported_once(tmp_path, monkeypatch):
    (tmp_path / "plugin_a.py").write_text("import builtins\nbuiltins.PLUGIN_A = getattr(builtins, 'PLUGIN_A', 0) + 1\n")
    (tmp_path / "plugin_b.py").write_text("import builtins\nbuiltins.PLUGIN_B = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(plugins.ENV, " plugin_a , ")
    monkeypatch.setattr(plugins, "entry_points", lambda group: [SimpleNamespace(value="plugin_b")])
    monkeypatch.setattr(plugins, "_loaded", set())
    plugins._entry_point_modules.cache_clear()
    plugins.load()
    plugins.load()
    import builtins

    assert vars(builtins)["PLUGIN_A"] == 1 and vars(builtins)["PLUGIN_B"] is True  # what the plugins set
    monkeypatch.delattr(builtins, "PLUGIN_A")
    monkeypatch.delattr(builtins, "PLUGIN_B")
    plugins._entry_point_modules.cache_clear()  # the next test sees the real entry points


def test_a_plugin_that_cannot_be_imported_is_named(monkeypatch):
    monkeypatch.setenv(plugins.ENV, "no_such_plugin_module")
    monkeypatch.setattr(plugins, "_loaded", set())
    with pytest.raises(ValueError, match=r"^DRAFTSMITH_PLUGINS: cannot import plugin module 'no_such_plugin_module'"):
        plugins.load()
