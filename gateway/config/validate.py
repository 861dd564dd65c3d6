"""The config's one validator: pydantic over the section dataclasses (each strict about unknown keys: base.STRICT),
the same that reads the admin API's bodies, reads the file, the env's overrides and the store's entries too. A
section's own checks (its `__post_init__`) run there; their ValueErrors say where they are. pydantic's other
complaints are told in the config's own words (`config_error`): the key, its place (`pools[0].upstreams[1].engine`,
or the env variable it came from) and what was expected."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")
Loc = tuple[str | int, ...]  # a place in the data, as pydantic names it: keys and list positions

_UNKNOWN = ("extra_forbidden", "unexpected_keyword_argument")
_BOOLEAN = "expected a boolean (true/false, 1/0, yes/no, on/off)"
# pydantic's error type -> what the config says, before the value it got
_EXPECTED = {
    "bool_parsing": _BOOLEAN,
    "bool_type": _BOOLEAN,
    "int_parsing": "expected int",
    "int_type": "expected int",
    "int_from_float": "expected int",
    "int_parsing_size": "expected int",
    "float_parsing": "expected float",
    "float_type": "expected float",
    "string_type": "expected str",
}
# ... and where the value it got is not worth repeating
_SHAPES = {
    "list_type": "expected a list",
    "dataclass_type": "expected a mapping",
    "dataclass_exact_type": "expected a mapping",
    "dict_type": "expected a mapping",
    "missing": "a required setting, missing",
}


def parse_section(cls: type[T], data: object, where: str = "", sources: Mapping[Loc, str] | None = None) -> T:
    """`data` (a mapping from YAML, TOML or JSON) as the config section `cls`, as strictly as the file is read:
    an unknown key or a value of the wrong type is a ValueError naming it (prefixed by `where`; a value that came
    from an env variable, `sources`: its place -> the variable, is named by its variable)."""
    try:
        return _adapter(cls).validate_python(data)
    except ValidationError as e:
        raise ValueError(config_error(cls, e, where, sources or {})) from None


_ADAPTERS: dict[type, TypeAdapter[Any]] = {}  # one per section type, built at its first use


def _adapter(cls: type) -> TypeAdapter[Any]:
    if (adapter := _ADAPTERS.get(cls)) is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


def config_error(cls: type, error: ValidationError, where: str = "", sources: Mapping[Loc, str] | None = None) -> str:
    """pydantic's complaint about data for `cls` in the config's words: unknown keys (all those of the first section
    that has some, each with the closest valid name), else its first problem."""
    sources = sources or {}
    problems = error.errors()
    if unknown := [p for p in problems if p["type"] in _UNKNOWN]:
        section = unknown[0]["loc"][:-1]
        known = [f.name for f in fields(_section_type(cls, section))]
        hints = []
        for key in sorted((p["loc"][-1] for p in unknown if p["loc"][:-1] == section), key=str):
            close = difflib.get_close_matches(str(key), known, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        at = _place(section, where, sources)
        if at and not at.endswith("."):
            at += "."  # the section's keys are named after it: `timeouts.`, `pools[0].`
        return f"unknown config key(s) {', '.join(hints)} in {at or 'top level'}"
    first = problems[0]
    if first["type"] in ("value_error", "assertion_error"):  # a section's own check: its message says where
        return str(first["ctx"]["error"])
    at = _place(first["loc"], where, sources) or "top level"
    if first["type"] in _EXPECTED:
        return f"{at}: {_EXPECTED[first['type']]}, got {first['input']!r}"
    return f"{at}: {_SHAPES.get(first['type'], first['msg'])}"


def _place(loc: Loc, where: str, sources: Mapping[Loc, str]) -> str:
    """`pools[0].upstreams[1].engine`, after `where`; what came from an env variable, after the variable's name."""
    head, rest = where, loc
    for n in range(len(loc), 0, -1):
        if (name := sources.get(loc[:n])) is not None:
            head, rest = name, loc[n:]
            break
    for part in rest:
        head += f"[{part}]" if isinstance(part, int) else f".{part}" if head and not head.endswith(".") else str(part)
    return head


def _section_type(cls: type, loc: Loc) -> Any:
    """The section (a dataclass) at `loc` in data for `cls`."""
    tp: Any = cls
    for part in loc:
        tp = optional_inner(tp)
        tp = typing.get_args(tp)[0] if isinstance(part, int) else typing.get_type_hints(tp)[part]
    return optional_inner(tp)


def optional_inner(tp: Any) -> Any:
    """T from T | None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp
