"""The base of every config section: strict (unknown keys are errors), documented, immutable.

Numbers are strict too: a boolean is never a number (``rollout.group_size: true`` is refused,
not read as 1) and a float is never an integer (``2.0`` or ``2.5`` for an integer field is
refused, not truncated); an integer for a float field stays accepted. Everything else is
pydantic's usual validation (YAML lists for tuple fields, strings for literals). A dtype field
also takes the short names people type (``bf16``, ``fp16``, ``fp32``, ``half``, ``float``).
"""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
"""Short dtype names, as verl, TRL and torch users write them, for the names sluice's fields take."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _dtype_aliases(cls, value: Any, info: ValidationInfo) -> Any:
        """``bf16`` for ``bfloat16`` (and the like) where the field's choices hold the long name."""
        if not isinstance(value, str) or value not in DTYPE_ALIASES or info.field_name is None:
            return value
        annotation = cls.model_fields[info.field_name].annotation
        choices = get_args(annotation) if get_origin(annotation) is Literal else ()
        return DTYPE_ALIASES[value] if DTYPE_ALIASES[value] in choices else value

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None:
            return value
        wrong = _wrong_number(value, cls.model_fields[info.field_name].annotation)
        if wrong:
            raise PydanticCustomError("strict_number", "{message}", {"message": wrong})
        return value


_OK = ""
"""``_wrong_number``'s answer for a value the annotation takes (``None``: not a number field)."""


def _wrong_number(value: Any, annotation: Any) -> str | None:
    """Why ``value`` is the wrong kind of number for ``annotation``: ``_OK`` when it is not,
    ``None`` when ``annotation`` has no number in it (pydantic judges those)."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        answers = [_wrong_number(value, a) for a in get_args(annotation)]
        if _OK in answers:
            return _OK
        return next((a for a in answers if a is not None), None)
    if origin in (tuple, list) and isinstance(value, list | tuple):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        for k, item in enumerate(value):
            item_type = args[0] if len(args) == 1 or origin is list else args[k] if k < len(args) else Any
            reason = _wrong_number(item, item_type)
            if reason:
                return f"item {k + 1}: {reason}"
        return _OK
    if origin is Literal or annotation is Any or annotation is bool or not isinstance(value, bool | float):
        return _OK
    if annotation is int:
        kind = "a boolean" if isinstance(value, bool) else "a float"
        return f"Input should be a valid integer, got {kind}"
    if annotation is float:
        return "Input should be a valid number, got a boolean" if isinstance(value, bool) else _OK
    return None
