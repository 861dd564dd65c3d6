"""One batch line through the request path an HTTP request takes, unforked: its body parsed and checked as the route
does (gateway/server/routes.py inference_response), then `Admission.handle`, which reserves on the key's and team's
limits and budgets, queues it, dispatches it, settles and bills it and writes its one event, each as for any request.

Admission takes a Starlette Request; a line has no connection, so it is given one made from a synthetic ASGI scope:
its path is the endpoint's, its request id the line's own (deterministic: `<batch id>-<line number>`), and its
`receive` never says the client left (a batch line is cancelled only by its job's task). The request's scope names
its caller (the key that created the batch) and its batch, which its event carries.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import TypeAdapter
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.auth.authenticator import Principal
from tokenweir.gateway.batches.input_lines import InputLine
from tokenweir.gateway.openai.body import check_body, orjson_body
from tokenweir.gateway.openai.endpoints import KIND_PATHS, InferenceKind
from tokenweir.gateway.openai.schema import CHAT, COMPLETION, EMBEDDING
from tokenweir.gateway.request.admission import Admission
from tokenweir.gateway.request.context import open_scope
from tokenweir.gateway.request.settle import Settler
from tokenweir.policies.limits import PRIORITY_BATCH

TRANSIENT = frozenset(
    {"rate_limited", "concurrency", "queue_full", "queue_timeout", "displaced", "state_unavailable",
     "events_unavailable", "upstream_unavailable"}
)  # fmt: skip
_SCHEMAS: dict[InferenceKind, TypeAdapter[Any]] = {"chat": CHAT, "completions": COMPLETION, "embeddings": EMBEDDING}
# The endpoints a batch's lines may name: those whose bodies a line is checked against (not /v1/responses, whose
# requests are stored objects of their own)
BATCH_ENDPOINTS = tuple(KIND_PATHS[kind] for kind in _SCHEMAS)


@dataclass(frozen=True, slots=True)
class LineAnswer:
    status_code: int
    body: bytes  # the answer as the client would have had it: JSON
    error_code: str | None = None  # a refusal's code (budget_exhausted, rate_limited, ...); None when answered 2xx
    retry_after_s: float | None = None  # a refusal's Retry-After

    @property
    def transient(self) -> bool:
        """A refusal that says "not now" (a rate limit, a full queue, the state or event log away): the line waits
        and is tried again, as OpenAI's batches do, rather than failed."""
        return self.error_code in TRANSIENT


def line_request_id(batch_id: str, number: int) -> str:
    """A line's request id: the same on every run of the batch, so a restart can tell the line by its events."""
    return f"{batch_id}-{number}"


class LineCaller:
    def __init__(self, admission: Admission, settler: Settler) -> None:
        self.admission, self.settler = admission, settler

    async def call(self, line: InputLine, kind: InferenceKind, principal: Principal, batch_id: str) -> LineAnswer:
        request_id = line_request_id(batch_id, line.number)
        request = _synthetic_request(KIND_PATHS[kind], request_id)
        scope = open_scope(request.scope, request_id)
        scope.principal, scope.batch_id = principal, batch_id
        try:
            data = orjson_body(line.raw_body)
            scope.model = data.get("model")  # for the event of a line refused before admission
            body = check_body(data, line.raw_body, _SCHEMAS[kind])
            body["priority"] = PRIORITY_BATCH  # the batch band, whatever the line asked (admission may only lower it)
            response = await self.admission.handle(request, principal, body, kind)
        except APIError as e:
            if not scope.accounted:  # refused before admission: its one event is written here, as the app's would be
                self.settler.finish_unadmitted(scope, kind, e)
            retry = e.headers.get("retry-after")
            retry_s = float(retry) if retry is not None and retry.replace(".", "", 1).isdigit() else None
            return LineAnswer(e.status, orjson.dumps(e.body()), e.code or "error", retry_s)
        return LineAnswer(response.status_code, await _body_of(response))


def _synthetic_request(path: str, request_id: str) -> Request:
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())],
        "client": None,
        "server": None,
    }
    return Request(scope, receive=_never_disconnects)


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Future()  # a line has no client to leave: waits until the watch that asked is stopped
    raise AssertionError("unreachable")


async def _body_of(response: Response) -> bytes:
    if isinstance(response, StreamingResponse):  # not asked for (lines are refused a stream), read whole if sent
        return b"".join([c if isinstance(c, bytes) else str(c).encode() async for c in response.body_iterator])
    return bytes(response.body)
