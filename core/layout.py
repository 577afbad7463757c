"""The floors of the codebase, top first, and the folder each installed package comes from.

Every package installs under the one import name `draftsmith`: `draftsmith.tasks` is the `tasks/` folder,
`draftsmith.core` the `core/` folder, and `draftsmith` itself the `draftsmith/` folder (the command line,
deployment and planning). A module imports only from its own floor or the floors below it, and never in
a cycle (`tests/unit/test_import_floors.py`). `draftsmith/<name>` is a relative link to each folder
(`draftsmith/core -> ../core`), which the build, Python and static tools follow alike
(`tests/unit/test_wheel_namespace.py` checks the links against `PACKAGES`).
"""

# (floor, packages on it), top floor first. drafters, engines and transport share a floor in the design;
# they are listed apart because they import one another in this order only.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("app", ("draftsmith",)),
    ("flows", ("draftsmith.flows",)),
    ("tasks", ("draftsmith.tasks",)),
    ("evals", ("draftsmith.evals",)),
    ("drafters", ("draftsmith.drafters",)),
    ("engines", ("draftsmith.engines",)),
    ("transport", ("draftsmith.transport",)),
    ("kernels", ("draftsmith.kernels",)),
    ("core", ("draftsmith.core",)),
)

# Installed package -> its folder, relative to the repository root.
PACKAGES: dict[str, str] = {
    "draftsmith": "draftsmith",
    "draftsmith.flows": "flows",
    "draftsmith.tasks": "tasks",
    "draftsmith.evals": "evals",
    "draftsmith.drafters": "drafters",
    "draftsmith.engines": "engines",
    "draftsmith.transport": "transport",
    "draftsmith.kernels": "kernels",
    "draftsmith.core": "core",
}


def package_of(module: str) -> str | None:
    """The package of `PACKAGES` that holds `module` (the longest prefix), or None outside the project."""
    best = None
    for name in PACKAGES:
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


def floor_of(module: str) -> int | None:
    """The index in `FLOORS` (0 = top) of `module`'s floor, or None outside the project."""
    package = package_of(module)
    return next((i for i, (_, packages) in enumerate(FLOORS) if package in packages), None)
