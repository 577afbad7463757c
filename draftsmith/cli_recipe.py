"""Recipe arguments shared by the commands that take a recipe: `--set dotted.key=value` overrides."""

from typing import Any

import yaml

from draftsmith.core.config import RecipeError


def overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set` pairs as dotted keys and YAML values; `RecipeError` naming the pair that does not parse."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {pair!r}: expected dotted.key=value")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise RecipeError(f"--set {pair!r}: the value is not valid YAML: {str(err).splitlines()[0]}") from None
    return out
