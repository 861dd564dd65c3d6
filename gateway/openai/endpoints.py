"""The inference endpoints the gateway serves, as one table: each kind of request and its path.

The path is the client's, and the upstream's for every kind but one: a Responses request (/v1/responses) is
translated into a chat (gateway/openai/responses_input.py) and goes upstream as one (`UPSTREAM_KINDS`), so admission,
budgets and routing are chat's, while its event says "responses". The routes (gateway/server/routes.py,
gateway/server/responses.py) are mounted at these paths, dispatch sends each kind to its upstream kind's path, and a
request refused before admission is given its kind by its path (its event says which).
"""

from __future__ import annotations

from typing import Literal

InferenceKind = Literal["chat", "completions", "embeddings", "responses"]

KIND_PATHS: dict[InferenceKind, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}

# The kind of request the upstream is sent for each kind the client made: its body's shape and its path.
UPSTREAM_KINDS: dict[InferenceKind, InferenceKind] = {
    "chat": "chat",
    "completions": "completions",
    "embeddings": "embeddings",
    "responses": "chat",
}

# The kind of an inference path; a path not in it is no inference request (it writes no request event).
PATH_KINDS: dict[str, InferenceKind] = {path: kind for kind, path in KIND_PATHS.items()}
