"""What every part of the config package shares: its error, the annotated number types the schema reuses, the
plain-name rule for names that become paths, and the one walk through Annotated and Optional."""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ConfigError(ValueError):
    """A bad config file, key, value, override or path. The message is one line naming the field."""


Beta = typing.Annotated[float, Field(ge=0.0, lt=1.0)]
Seed = typing.Annotated[int, Field(ge=0, lt=2**63, description="A seed torch accepts: 0 <= seed < 2^63.")]

SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=@-]{0,99}$")


def safe_path_name(value: str) -> str:
    """A name the engine turns into a path (a run, a member) must be one plain path component: it can never
    escape or nest under the directory it is joined to."""
    if not SAFE_NAME.match(value):
        raise ValueError(f"{value!r} is not a plain file name (1-100 letters, digits and _ . + = @ -, not starting "
                         "with . + = @ or -)")
    return value


def unwrap(annotation: Any) -> tuple[tuple[Any, ...], bool]:
    """(the types a field's annotation admits, whether it admits None): Annotated's metadata taken off, and a Union
    (Optional, X | Y) opened into its members other than None, each unwrapped the same way. A plain type gives
    itself alone."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        inner: tuple[Any, ...] = ()
        optional = False
        for arg in typing.get_args(annotation):
            if arg is type(None):
                optional = True
                continue
            members, nullable = unwrap(arg)
            inner += members
            optional = optional or nullable
        return inner, optional
    return (annotation,), False


def number_type(annotation: Any) -> bool:
    """An int or float field (possibly Annotated, Optional or a Literal of numbers), which a YAML boolean must not
    fill: pydantic would take `yes` for 1 and `true` for 1.0."""
    def number(kind: Any) -> bool:
        if typing.get_origin(kind) is Literal:
            return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in typing.get_args(kind))
        return kind in (int, float)

    inner, _ = unwrap(annotation)
    return bool(inner) and all(number(kind) for kind in inner)


class Section(BaseModel):
    """A section of the run configuration: unknown keys refused, assignments checked, no YAML boolean taken for a
    number."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info) -> Any:
        if isinstance(value, bool) and number_type(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got the boolean {str(value).lower()} (YAML reads yes, no, on, off, "
                             "true and false as booleans)")
        return value
