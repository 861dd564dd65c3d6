"""One request's records as it moves through the gateway.

`RequestScope` is what is known before admission (its id, arrival time, who called, which model it named): created
once by the middleware, filled in by auth and body parsing, read by the event of a request refused before admission.
`RequestContext`, created once by admission and passed down to dispatch and settle, is what it asked for, what it
was granted, where it went, and what its event says.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenweir.common.http.request_id import request_id_from
from tokenweir.policies.limits import KeyLimits, TeamLimits

if TYPE_CHECKING:
    from starlette.requests import HTTPConnection

    from tokenweir.gateway.auth.authenticator import Principal
    from tokenweir.gateway.request.queue import Ticket
    from tokenweir.gateway.request.relay import SSEStream
    from tokenweir.gateway.request.stream_chunks import ChunkFilter
    from tokenweir.gateway.upstream.pools import Hop
    from tokenweir.policies.reservation import Reservation

# Client strings copied into events, logs and metric labels are cut to this many characters.
MAX_CLIENT_STRING = 256


# Where the ASGI scope carries the request's RequestScope (a key of our own, not request.state's free-for-all).
_SCOPE_KEY = "tokenweir.request"


@dataclass(slots=True, eq=False)
class RequestScope:
    """What the gateway knows of a request before admission; its event, should it be refused before, says this."""

    request_id: str
    t0: float  # time.perf_counter() at arrival
    principal: Principal | None = None  # set by server.callers.require_key
    model: object = None  # the body's "model" as sent (maybe not a string): set by body.parse_body
    accounted: bool = False  # admission took the request: settle writes its event, not the refusal path


def open_scope(asgi_scope: MutableMapping[str, Any], request_id: str) -> RequestScope:
    """The middleware's one call per request: the record every later step reaches through `request_scope`."""
    record = asgi_scope[_SCOPE_KEY] = RequestScope(request_id, time.perf_counter())
    return record


def request_scope(conn: HTTPConnection) -> RequestScope:
    """The request's RequestScope. An app without the middleware (a router mounted alone in a test) gets one made
    here, on first use."""
    record = conn.scope.get(_SCOPE_KEY)
    if record is None:
        record = open_scope(conn.scope, request_id_from(None))
    return record


@dataclass(eq=False)
class RequestContext:
    """Everything one request carries through the steps, and what its event will say."""

    request_id: str
    kind: str  # "chat" | "completions" | "embeddings"
    body: dict
    team_id: str
    key_id: str
    limits: TeamLimits
    model: str
    stream: bool
    t0: float  # time.perf_counter() at arrival: every duration is measured on it
    deadline_base: float  # loop.time() at arrival: deadlines are loop-time instants (uvloop's clock ticks in ms)
    priority: int
    client_usage: bool = False
    client_continuous: bool = False
    max_tokens: int | None = None  # output tokens reserved: choices x the body's max_tokens (0 for embeddings)
    choices: int = 1  # sequences the upstream generates: prompts x max(n, best_of)
    prompts: int = 1  # a /v1/completions batch's prompts, each completed on its own
    prompt_tokens: int = 0  # all prompts together
    longest_prompt: int = 0  # the batch's longest prompt: what the context window must hold
    reservation: Reservation | None = None
    slot: bool = False
    local_state: bool = False  # admitted under this replica's own limits while the shared state was away
    ticket: Ticket | None = None
    queue_s: float | None = None
    hop: Hop | None = None
    served_model: str | None = None  # the pool of the last hop tried: its usage row
    # The id the upstream knows this attempt by (and /abort targets). Never the client's X-Request-Id: two
    # requests, maybe of two teams, could send the same one, and an abort must stop only its own request.
    upstream_id: str = ""
    route: list[str] = field(default_factory=list)
    upstream_error: str | None = None  # why the last hop that failed did, its address included: the event's only
    route_reason: dict | None = None  # why the first hop (policies/routing.py RouteReason.as_dict): for the event
    dispatched_at: float | None = None
    upstream_end: float | None = None
    ttft_s: float | None = None
    usage: dict | None = None
    usage_source: str | None = None  # how the billed usage was obtained (gateway/request/settle.py): for the event
    finish_reason: str | None = None
    incomplete: bool = False  # the upstream may still be generating: abort it in finish
    instance_ok: bool = True
    sse: SSEStream | None = None
    chunks: ChunkFilter | None = None
    status: str = "ok"
    reason: str | None = None
    http_status: int = 200
    disconnected: bool = False
    # tokens made by hops that failed before their first token (the engine told us on /abort): billed too
    spilled_prompt_tokens: int = 0
    spilled_completion_tokens: int = 0
    watching: bool = True  # a client disconnect may still cancel the handler
    # The API key's own limits (None: only the team's), enforced with the team's in the same reserve / slot
    key_limits: KeyLimits | None = None
    slot_key_id: str | None = None  # the key whose own concurrency slot this request holds beside the team's
    slot_lease: str | None = (
        None  # that slot's lease id in a shared state: released by id (gateway/request/inflight.py)
    )
    user: str | None = None  # the body's `user` (the client's end user), clipped, for the event and usage
    cost_reserved: int = 0  # micro-USD held on the spend budgets at admission (policies.pricing)

    @classmethod
    def admitted(cls, request_id: str, principal: Principal, body: dict, kind: str) -> RequestContext:
        """The context of a request admission takes: what the body asks for, within what its team's key grants."""
        team = principal.team
        assert team is not None  # Admission.new_context refuses a key without a team
        priority = team.limits.priority
        asked = body.get("priority")
        if isinstance(asked, int) and not isinstance(asked, bool):
            priority = max(priority, asked)  # a request may lower its own priority, never raise it above its team's
        opts = body.get("stream_options") or {}
        return cls(
            request_id=request_id,
            kind=kind,
            body=body,
            team_id=team.id,
            key_id=principal.key.id,
            limits=team.limits,
            model=body["model"],
            stream=bool(body.get("stream")),
            t0=time.perf_counter(),
            deadline_base=asyncio.get_running_loop().time(),
            priority=priority,
            client_usage=bool(opts.get("include_usage")),
            client_continuous=bool(opts.get("continuous_usage_stats")),
            key_limits=principal.key.limits,
            user=clip(body.get("user")) if isinstance(body.get("user"), str) else None,
        )

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


def clip(value: str | None) -> str | None:
    """A client string as it may appear in an event, a log line or a label."""
    if isinstance(value, str) and len(value) > MAX_CLIENT_STRING:
        return value[:MAX_CLIENT_STRING] + "..."
    return value
