"""The JSON schemas loadtests/bench_grammar.py measures, each with a valid instance whose compact encoding is walked
token by token (SCHEMAS; None as the schema means response_format json_object).
"""

from __future__ import annotations

# (schema or None for json_object, a valid instance). Instances are what a model would plausibly write.
_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "geo": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
    },
    "required": ["street", "city", "geo"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, tuple[dict | None, object]] = {
    "flat": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "email": {"type": "string"},
                "active": {"type": "boolean"},
                "score": {"type": "number"},
            },
            "required": ["name", "age", "email", "active", "score"],
            "additionalProperties": False,
        },
        {"name": "Alice Johnson", "age": 34, "email": "alice@example.com", "active": True, "score": 87.5},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "person": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "address": _ADDRESS},
                    "required": ["name", "address"],
                    "additionalProperties": False,
                },
                "company": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "address": _ADDRESS},
                    "required": ["name", "address"],
                    "additionalProperties": False,
                },
            },
            "required": ["person", "company"],
            "additionalProperties": False,
        },
        {
            "person": {
                "name": "Bob Smith",
                "address": {"street": "12 Main St", "city": "Springfield", "geo": {"lat": 39.78, "lon": -89.65}},
            },
            "company": {
                "name": "Acme Corp",
                "address": {"street": "1 Market Sq", "city": "Chicago", "geo": {"lat": 41.88, "lon": -87.63}},
            },
        },
    ),
    "enums": (
        {
            "type": "object",
            "properties": {
                "status": {"type": "string", "enum": ["pending", "shipped", "delivered", "cancelled"]},
                "color": {"enum": ["red", "green", "blue", "light goldenrod yellow"]},
                "priority": {"type": "integer", "enum": [1, 2, 3, 5, 8]},
                "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            },
            "required": ["status", "color", "priority", "size"],
            "additionalProperties": False,
        },
        {"status": "shipped", "color": "light goldenrod yellow", "priority": 5, "size": "XL"},
    ),
    "array_of_objects": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer"},
                            "name": {"type": "string"},
                            "price": {"type": "number"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                        },
                        "required": ["id", "name", "price", "tags"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
        {
            "items": [
                {"id": 1, "name": "Widget", "price": 9.99, "tags": ["tools", "metal"]},
                {"id": 2, "name": "Gadget", "price": 24.5, "tags": ["electronics"]},
                {"id": 3, "name": "Doohickey", "price": 3.25, "tags": []},
                {"id": 4, "name": "Thingamajig", "price": 105.0, "tags": ["misc", "large", "heavy"]},
            ]
        },
    ),
    "optional_fields": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "year": {"type": "integer"},
                "director": {"type": "string"},
                "rating": {"type": "number"},
                "genres": {"type": "array", "items": {"type": "string"}},
                "sequel": {"type": "boolean"},
                "notes": {"type": "string"},
            },
            "required": ["title", "year"],
            "additionalProperties": False,
        },
        {"title": "The Matrix", "year": 1999, "rating": 8.7, "genres": ["action", "sci-fi"], "notes": "classic"},
    ),
    "json_object": (
        None,
        {
            "user": {"id": 42, "name": "Carol", "roles": ["admin", "dev"], "verified": True},
            "scores": [1.5, 2, -3e2],
            "meta": {"created": "2024-01-01", "parent": None},
        },
    ),
}
