"""The inference endpoints the gateway serves, as one table: each kind of request and its path.

The path is both the client's and the upstream's: the gateway forwards a request to the path it came in on. The
routes (gateway/server/routes.py) are mounted at these paths, dispatch sends each kind to its path upstream, and a
request refused before admission is given its kind by its path (its event says which).
"""

from __future__ import annotations

from typing import Literal

InferenceKind = Literal["chat", "completions", "embeddings"]

KIND_PATHS: dict[InferenceKind, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}

# The kind of an inference path; a path not in it is no inference request (it writes no request event).
PATH_KINDS: dict[str, InferenceKind] = {path: kind for kind, path in KIND_PATHS.items()}
