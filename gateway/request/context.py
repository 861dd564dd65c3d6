"""One request's records as it moves through the gateway.

`RequestScope` is what is known before admission (its id, arrival time, who called, which model it named): created
once by the middleware, filled in by auth and body parsing, read by the event of a request refused before admission.
`RequestRecord` is what a request's event says (every request's: refused, admitted or recovered after a crash);
`RequestContext`, the record of an admitted request, created once by admission and passed down to dispatch and
settle, adds what it asked for, what it was granted and where it went. Both are data: a request's live I/O belongs
to the hop that opened it (gateway/request/relay.py HopStream), held by the request's end (request_end.py).

What admission decides (`ADMITTED_FACTS`: who asked, for which pool, within which limits, how many tokens it was
counted at and granted) is fixed once its reservation is taken (`RequestContext.seal`): dispatch, settle and the event
read them as admitted, and a later stage that assigns one raises instead of billing or routing on a changed fact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import MutableMapping
from dataclasses import FrozenInstanceError, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tokenweir.common.http.request_id import request_id_from
from tokenweir.gateway.accounting.request_event import clip
from tokenweir.gateway.openai.endpoints import UPSTREAM_KINDS, InferenceKind
from tokenweir.gateway.request.attempt import Attempt
from tokenweir.gateway.request.outcome import Outcome
from tokenweir.policies.limits import KeyLimits, TeamLimits

if TYPE_CHECKING:
    from starlette.requests import HTTPConnection

    from tokenweir.gateway.auth.authenticator import Principal
    from tokenweir.gateway.config import AliasConfig
    from tokenweir.gateway.request.queue import Ticket
    from tokenweir.gateway.request.tracing import RequestTrace
    from tokenweir.gateway.upstream.pools import Hop, Pool, Routes
    from tokenweir.policies.reservation import Reservation

# What admission decided, fixed once it reserved: no later stage may assign them (RequestContext.seal)
ADMITTED_FACTS = frozenset(
    {
        "request_id", "kind", "t0", "team_id", "key_id", "model", "priority", "stream", "user", "max_tokens",
        "choices", "alias", "variant", "steered", "limits", "key_limits", "body", "deadline_base", "client_usage",
        "client_continuous", "prompts", "prompt_tokens", "longest_prompt", "prompt_ids", "context_fallback",
        "cost_reserved", "routes", "responses_body",
    }
)  # fmt: skip

# Where the ASGI scope carries the request's RequestScope (a key of our own, not request.state's free-for-all).
_SCOPE_KEY = "tokenweir.request"


@dataclass(slots=True, eq=False)
class RequestScope:
    """What the gateway knows of a request before admission; its event, should it be refused before, says this."""

    request_id: str
    t0: float  # time.perf_counter() at arrival
    principal: Principal | None = None  # set by server.callers.require_key
    model: object = None  # the body's "model" as sent (maybe not a string): set by body.parse_body
    accounted: bool = False  # admission took it: its RequestEnd writes its event, not finish_unadmitted
    batch_id: str | None = None  # a batch line's batch (gateway/batches/line_call.py): named in its event
    # a /v1/responses request as its upstream gets it where its pool serves /v1/responses (passed through; its
    # `body` is the chat it is counted, and otherwise served, as): gateway/server/responses_create.py
    responses_body: dict[str, Any] | None = None


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


@dataclass(slots=True, eq=False, kw_only=True)
class RequestRecord:
    """What a request's event says: every request has one. A request refused before admission has only this (its
    team, key and model may be unknown: None), as has one a dead process left and its restart settles
    (gateway/request/inflight.py); an admitted one has the whole `RequestContext`."""

    request_id: str
    kind: InferenceKind
    t0: float  # time.perf_counter() at arrival: every duration is measured on it
    team_id: str | None = None
    key_id: str | None = None
    model: str | None = None  # the model the client named
    priority: int = 0
    stream: bool = False
    user: str | None = None  # the body's `user` (the client's end user), clipped, for the event and usage
    batch_id: str | None = None  # the batch whose line this request is (gateway/batches/), for the event
    outcome: Outcome = field(default_factory=Outcome)
    max_tokens: int | None = None  # output tokens reserved: choices x the body's max_tokens (0 for embeddings)
    choices: int = 1  # sequences the upstream generates: prompts x max(n, best_of)
    route: list[str] = field(default_factory=list)
    # why the first hop (policies/routing.py RouteReason.as_dict): for the event
    route_reason: dict[str, Any] | None = None
    served_model: str | None = None  # the pool of the last hop tried: its usage row
    # The id the upstream knows this attempt by (and /abort targets). Never the client's X-Request-Id: two
    # requests, maybe of two teams, could send the same one, and an abort must stop only its own request.
    upstream_id: str = ""
    upstream_error: str | None = None  # why the last hop that failed did, its address included: the event's only
    queue_s: float | None = None
    dispatched_at: float | None = None
    upstream_end: float | None = None
    ttft_s: float | None = None
    usage_source: str | None = None  # how the billed usage was obtained (gateway/request/settle.py): for the event
    # its bill reached neither the event log nor the store (gateway/request/billing.py): an answer not sent yet is not
    # given (503 events_unavailable)
    unbilled: bool = False
    finish_reason: str | None = None
    # speculative decoding, as the upstream's usage reported it (completion_tokens_details): drafts checked, accepted
    draft_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    # disaggregated prefill: the prefill member whose KV the decode hop fetched, and how long its hop took
    prefill_instance: str | None = None
    prefill_s: float | None = None
    # the decode hop's kv_transfer_params: the KV it fetched, bytes, milliseconds
    kv_transfer: dict[str, Any] | None = None
    model_revision: str | None = None  # the model version the last hop's instance serves
    # a request for an alias (weighted variants): the name the client asked for, and the variant it got (whose
    # pool is `model`)
    alias: str | None = None
    variant: str | None = None
    steered: bool = False  # the variant was picked by the x-tokenweir-variant header: no rollout judges it
    # Its spans when tracing is on (gateway/request/tracing.py), None when off: each tracing hook tests only this
    trace: RequestTrace | None = None

    @property
    def wire(self) -> InferenceKind:
        """The kind of request its upstream is sent (a Responses request goes as a chat): its body's shape and path."""
        return UPSTREAM_KINDS[self.kind]

    def note_drafts(self, details: dict[str, Any]) -> None:
        """The upstream's speculative decoding, from OpenAI's prediction-token counts (completion_tokens_details), if
        well formed."""
        accepted, rejected = details.get("accepted_prediction_tokens"), details.get("rejected_prediction_tokens")
        if type(accepted) is int and type(rejected) is int and accepted >= 0 and rejected >= 0:
            self.draft_tokens, self.accepted_draft_tokens = accepted + rejected, accepted


@dataclass(slots=True, eq=False, kw_only=True)
class RequestContext(RequestRecord):
    """An admitted request: what it asked for, what it was granted, where it went, and what its event will say.
    Data only: the live things its end must close (an upstream stream) are its RequestEnd's
    (gateway/request/request_end.py)."""

    # Known for every admitted request (a RequestRecord's may be None)
    team_id: str
    key_id: str
    model: str
    limits: TeamLimits
    body: dict[str, Any]
    deadline_base: float  # loop.time() at arrival: deadlines are loop-time instants (uvloop's clock ticks in ms)
    client_usage: bool = False
    client_continuous: bool = False
    prompts: int = 1  # a /v1/completions batch's prompts, each completed on its own
    prompt_tokens: int = 0  # all prompts together
    longest_prompt: int = 0  # the batch's longest prompt: what the context window must hold
    # a chat prompt's ids as the engine computes them, where counting made them (else None), and the tokenizer (as
    # its pool names it) that made them: what prefix routing hashes, for a pool with that tokenizer
    prompt_ids: tuple[str, list[int]] | None = None
    reservation: Reservation | None = None
    slot: bool = False
    local_state: bool = False  # admitted under this replica's own limits while the shared state was away
    ticket: Ticket | None = None
    attempt: Attempt | None = None  # the last hop sent (gateway/request/attempt.py), live until released
    usage: dict[str, Any] | None = None
    # tokens made by hops that failed before their first token (the engine told us on /abort): billed too
    spilled_prompt_tokens: int = 0
    spilled_completion_tokens: int = 0
    # The API key's own limits (None: only the team's), enforced with the team's in the same reserve / slot
    key_limits: KeyLimits | None = None
    slot_key_id: str | None = None  # the key whose own concurrency slot this request holds beside the team's
    slot_lease: str | None = None  # that slot's lease id in a shared state: released by id (request/inflight.py)
    cost_reserved: int = 0  # micro-USD held on the spend budgets at admission (policies.pricing)
    # disaggregated prefill: the prefill members to try before the decode hop (route), and the answer that names the
    # prompt's KV (the decode hop's kv_transfer_params)
    prefill_hops: list[Hop] = field(default_factory=list)
    context_fallback: str | None = None  # the pool of a longer context that serves a prompt too long for `model`'s
    kv_transfer_params: dict[str, Any] | None = None
    prefill_pin: Attempt | None = None  # the prefill hop whose engine holds the KV (its /abort lets it go)
    routes: Routes | None = None  # the routing table it was admitted under: its pools to its end, whatever changes
    responses_body: dict[str, Any] | None = None  # a Responses request's own body (RequestScope.responses_body)

    sealed: ClassVar[bool] = False  # SealedRequestContext's is True

    def seal(self) -> None:
        """Admission has decided: ADMITTED_FACTS are read-only from now on. The context becomes a
        SealedRequestContext, whose __setattr__ guards them: before that, writes cost what a slot's always did (a
        __setattr__ of our own on every context would run for each of the ~60 fields __init__ sets)."""
        self.__class__ = SealedRequestContext

    def hop_kind(self, model: str) -> InferenceKind:
        """What a hop to pool `model` is sent: a Responses request as it is, to a pool that serves /v1/responses;
        else the kind its upstream gets (`wire`)."""
        if self.responses_body is not None and self.pools[model].cfg.serves_responses:
            return "responses"
        return self.wire

    def start_attempt(self, attempt: Attempt) -> None:
        """Dispatch sends `attempt`: what the event says of the last hop (its route, pool, model version, the
        upstream's id for it and when it left) follows it."""
        self.attempt = attempt
        self.route.append(attempt.hop.label)
        self.served_model, self.model_revision = attempt.hop.model, attempt.hop.instance.revision
        self.upstream_id, self.dispatched_at = attempt.upstream_id, attempt.dispatched_at

    def upstream_may_run_on(self) -> None:
        """The request ended while its hop may still be generating (a client gone, a shutdown, a failure in the
        gateway): its end aborts it there."""
        if self.attempt is not None and self.attempt.live:
            self.attempt.incomplete = True

    def rate_headers(self) -> dict[str, str]:
        """x-ratelimit-* as of the reservation, on successful responses too (as OpenAI sends them)."""
        return dict(getattr(self.reservation, "headers", None) or {})

    @property
    def live_attempt(self) -> Attempt | None:
        """The hop sent and not yet released, if any."""
        return self.attempt if self.attempt is not None and self.attempt.live else None

    @property
    def pools(self) -> dict[str, Pool]:
        assert self.routes is not None  # set first thing at admission
        return self.routes.pools

    @property
    def aliases(self) -> dict[str, AliasConfig]:
        assert self.routes is not None
        return self.routes.aliases

    @classmethod
    def admitted(
        cls, request_id: str, principal: Principal, body: dict[str, Any], kind: InferenceKind
    ) -> RequestContext:
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


class SealedRequestContext(RequestContext):
    """An admitted request once admission has decided (RequestContext.seal): ADMITTED_FACTS are read-only."""

    __slots__ = ()
    sealed: ClassVar[bool] = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ADMITTED_FACTS:
            raise FrozenInstanceError(f"{name} was fixed at admission; a later stage may read it, not assign it")
        object.__setattr__(self, name, value)
