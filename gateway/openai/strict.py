"""How the /v1 request schemas are built: strict pydantic TypedDicts and unions tagged by a callable discriminator.

gateway.openai.schema (the request bodies), gateway.openai.messages and gateway.openai.tools all build
on these helpers.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import ConfigDict, Discriminator, Field, Tag

# TypedDicts, validated by pydantic in strict mode: no instances are built (twice as fast as models), and a field
# that may be left out is not thereby nullable. Unions are tagged by a callable discriminator (on the JSON kind, a
# part's `type` or a message's `role`), so a bad value gets one error at its own path rather than one per union
# branch. Tags start with "~": they are not fields, and `validation_error` drops them from `param`.


STRICT = ConfigDict(extra="allow", strict=True)


def _json_kind(value) -> str | None:
    if isinstance(value, str):
        return "~string"
    if isinstance(value, list):
        return "~array"
    if isinstance(value, dict):
        return "~object"
    return None


def one_of(expected: str, **members) -> Any:
    """A union picked by the value's JSON kind (string / array / object); anything else is one 'invalid_type'."""
    choices = tuple(Annotated[tp, Tag(f"~{kind}")] for kind, tp in members.items())
    return Annotated[
        Union[choices],  # noqa: UP007 - a tuple of members needs the subscript form
        Discriminator(_json_kind, custom_error_type="invalid_type", custom_error_message=f"expected {expected}"),
    ]


def between(lo, hi, description: str | None = None) -> Any:
    return Field(ge=lo, le=hi, description=description)
