"""The strict base model every config section derives from."""

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _mixup(annotation: Any, value: Any) -> str | None:
    """Why `value` is a boolean where a number belongs (or the reverse), or None when it is not.

    Pydantic's lax mode reads `true` as 1 and `1`, `"yes"` or `"on"` as true; a recipe that says
    `epochs: true` almost certainly means something else, so neither direction is converted. Numeric
    strings stay accepted for numbers: YAML 1.1 reads `1e-4` as a string.
    """
    if annotation is bool:
        return None if isinstance(value, bool) else f"expected true or false, got {_yaml(value)}"
    if annotation in (int, float) and isinstance(value, bool):
        return f"expected {'an integer' if annotation is int else 'a number'}, got {_yaml(value)}"
    if annotation in (int, float):
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _mixup(inner[0], value) if len(inner) == 1 and value is not None else None
    if origin in (list, tuple) and isinstance(value, list | tuple):
        items = args[:1] * len(value) if origin is list or args[-1:] == (Ellipsis,) else args
        for i, (item_type, item) in enumerate(zip(items, value, strict=False)):
            problem = _mixup(item_type, item)
            if problem:
                return f"item [{i}]: {problem}"
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        for key, item in value.items():
            problem = _mixup(args[1], item)
            if problem:
                return f"key {key!r}: {problem}"
    return None


class StrictModel(BaseModel):
    """Unknown keys are errors, values are immutable, defaults are validated too, floats are finite, and
    booleans and numbers are never converted into each other.

    Frozen models hash and serialise deterministically, which the stage cache keys rely on.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_number_mixups(cls, data: Any) -> Any:
        # A model validator, not a `"*"` field validator: pydantic refuses those on union discriminators.
        if not isinstance(data, dict):
            return data
        errors = []
        for name, field in cls.model_fields.items():
            problem = _mixup(field.annotation, data[name]) if name in data else None
            if problem:
                error = PydanticCustomError("bool_number_mixup", "{reason}", {"reason": problem})
                errors.append(InitErrorDetails(type=error, loc=(name,), input=data[name]))
        if errors:
            # Raised as a ValidationError so each problem keeps its field's dotted location.
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data
