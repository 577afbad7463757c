"""Plugins: modules that register drafter families from outside the project's own packages.

A plugin module registers its drafter config (`draftsmith.core.config.drafter.register_drafter`) and its
family (`draftsmith.drafters.families.register_family`) when it is imported. Two ways to have it imported, in
every process of a run (the CLI, Prefect workers, torchrun ranks, producers):

- an installed package declares it under the `draftsmith.plugins` entry-point group;
- `DRAFTSMITH_PLUGINS` names it (comma-separated module names), e.g. a family that lives in a checkout.
"""

import functools
import importlib
import os
from importlib.metadata import entry_points

ENV = "DRAFTSMITH_PLUGINS"
GROUP = "draftsmith.plugins"
_loaded: set[str] = set()


@functools.cache
def _entry_point_modules() -> tuple[str, ...]:
    # Reading the installed packages' metadata takes milliseconds, and registry look-ups call `load` often;
    # what is installed does not change while a process runs.
    return tuple(ep.value for ep in entry_points(group=GROUP))


def load() -> None:
    """Import every plugin not imported yet (cheap once they are)."""
    names = [*_entry_point_modules(), *(n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip())]
    for name in names:
        if name in _loaded:
            continue
        _loaded.add(name)
        try:
            importlib.import_module(name)
        except ImportError as err:
            _loaded.discard(name)
            raise ValueError(f"{ENV}: cannot import plugin module {name!r}: {err}") from err
