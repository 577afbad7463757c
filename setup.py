"""Packages and their folders: one import name, `draftsmith`, over the top-level folders (core/layout.py)."""

import runpy

from setuptools import find_packages, setup

PACKAGES = runpy.run_path("core/layout.py")["PACKAGES"]

setup(
    package_dir=PACKAGES,
    packages=[p for name, folder in PACKAGES.items() for p in [name, *(f"{name}.{s}" for s in find_packages(folder))]],
)
