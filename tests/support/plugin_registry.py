"""A plugin loaded into the test process for one test: afterwards the drafter registries are as they were."""

import contextlib
import os
import sys
from collections.abc import Iterator

from draftsmith.core import plugins
from draftsmith.core.config import drafter as drafter_config
from draftsmith.drafters import families


@contextlib.contextmanager
def plugin_loaded(module: str) -> Iterator[None]:
    """Load plugin `module` as `DRAFTSMITH_PLUGINS` would; on exit unregister what it registered.

    Registration has no inverse in the product (a process never drops a family), so the registries are restored
    here: otherwise the family would show up in later tests of the same pytest worker (the recipe reference, the
    known kinds, the `drafter:` union)."""
    configs, fams, loaded = dict(drafter_config._REGISTRY), dict(families._REGISTERED), set(plugins._loaded)
    before = os.environ.get(plugins.ENV)
    os.environ[plugins.ENV] = module
    try:
        plugins.load()
        yield
    finally:
        if before is None:
            os.environ.pop(plugins.ENV, None)
        else:
            os.environ[plugins.ENV] = before
        drafter_config._REGISTRY.clear()
        drafter_config._REGISTRY.update(configs)
        families._REGISTERED.clear()
        families._REGISTERED.update(fams)
        plugins._loaded.clear()
        plugins._loaded.update(loaded)
        for rebuild in drafter_config._on_register:
            rebuild()
        sys.modules.pop(module, None)
