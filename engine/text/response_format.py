"""An OpenAI `response_format` before it becomes a grammar (engine/text/structured.py compiles it): the spec checked
field by field, with errors a client can act on, and a json_schema's objects closed to the keys they list.
Pure data in and out: no llguidance, no torch."""

from __future__ import annotations

import json
from typing import cast


def parse_response_format(spec: dict) -> tuple[str, dict | None]:
    """(kind, schema) from a response_format dict; ValueError names the offending field."""
    if not isinstance(spec, dict):
        raise ValueError("response_format must be an object")
    kind = spec.get("type")
    if kind in ("text", "json_object"):
        return kind, None
    if kind == "grammar" and isinstance(spec.get("grammar"), str):  # the engine's own (tool calls): never a client's
        return kind, {"lark": spec["grammar"]}
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    js = spec.get("json_schema")
    if not isinstance(js, dict):
        raise ValueError("response_format.json_schema must be an object with a 'schema'")
    if "name" in js and not isinstance(js["name"], str):
        raise ValueError("response_format.json_schema.name must be a string")
    schema = js.get("schema")
    if schema is None:
        raise ValueError("response_format.json_schema.schema is required")
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
    return kind, schema


def close_objects(schema: dict) -> dict:
    """Copy of the schema with additionalProperties: false on objects that list properties and leave it unset.

    Output still validates against the original schema; it just cannot invent keys, which a small model otherwise
    does until max_tokens (OpenAI's strict mode and xgrammar's strict_mode make the same choice). Schemas using
    allOf are left alone: closing each branch could make their intersection unsatisfiable.
    """
    if "allOf" in json.dumps(schema):
        return schema
    # _close maps a dict to a dict; its object signature serves the recursion over any JSON value.
    return cast(dict, _close(schema))


# Keywords whose values are schemas (only these are walked: enum/const/default values stay as written).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _close(node: object) -> object:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for k in _SCHEMA_MAPS:
        if isinstance(node.get(k), dict):
            out[k] = {name: _close(sub) for name, sub in node[k].items()}
    for k in _SCHEMA_LISTS:
        if isinstance(node.get(k), list):
            out[k] = [_close(sub) for sub in node[k]]
    for k in _SCHEMA_ONE:
        if isinstance(node.get(k), dict):
            out[k] = _close(node[k])
    props = node.get("properties")
    required = node.get("required", [])
    if (
        isinstance(props, dict)
        and not any(k in node for k in _OPEN_KEYS)
        and isinstance(required, list)
        and set(required) <= set(props)
    ):
        out["additionalProperties"] = False
    return out
