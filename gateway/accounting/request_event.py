"""A request's event, built by one pure function from the record of what the request did and what it was billed.

No I/O, no clock, no metrics: the caller (gateway/request/settle.py) measures the times, writes the line and observes
the metrics. The record is read through `EventFacts`, what a request's record holds (gateway/request/context.py
RequestRecord has it all; a request refused before admission leaves much of it None). The fields and their meaning
are gateway/accounting/events.py FIELDS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tokenweir.policies.pricing import femtos_to_usd

# Client strings copied into events, logs and metric labels are cut to this many characters.
MAX_CLIENT_STRING = 256
# the event's names for what a decode hop's kv_transfer_params say it fetched (engine/kv_transfer/params.py)
TRANSFER_FIELDS = {
    "kv_fetched_tokens": "fetched_tokens",
    "kv_fetched_bytes": "fetched_bytes",
    "kv_fetch_ms": "fetch_ms",
}


class EventOutcome(Protocol):
    @property
    def status(self) -> str: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def http_status(self) -> int: ...
    @property
    def disconnected(self) -> bool: ...


class EventTrace(Protocol):
    @property
    def trace_id(self) -> str: ...


class EventFacts(Protocol):
    """What the event says of a request, as its record holds it."""

    @property
    def request_id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def team_id(self) -> str | None: ...
    @property
    def key_id(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def stream(self) -> bool: ...
    @property
    def user(self) -> str | None: ...
    @property
    def outcome(self) -> EventOutcome: ...
    @property
    def max_tokens(self) -> int | None: ...
    @property
    def route(self) -> list[str]: ...
    @property
    def route_reason(self) -> dict[str, Any] | None: ...
    @property
    def served_model(self) -> str | None: ...
    @property
    def upstream_id(self) -> str: ...
    @property
    def upstream_error(self) -> str | None: ...
    @property
    def queue_s(self) -> float | None: ...
    @property
    def ttft_s(self) -> float | None: ...
    @property
    def usage_source(self) -> str | None: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def draft_tokens(self) -> int | None: ...
    @property
    def accepted_draft_tokens(self) -> int | None: ...
    @property
    def prefill_instance(self) -> str | None: ...
    @property
    def prefill_s(self) -> float | None: ...
    @property
    def model_revision(self) -> str | None: ...
    @property
    def alias(self) -> str | None: ...
    @property
    def variant(self) -> str | None: ...
    @property
    def steered(self) -> bool: ...
    @property
    def trace(self) -> EventTrace | None: ...
    @property
    def batch_id(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Billed:
    """What the request was billed: tokens, and its cost in femto-USD (None: its pool has no prices)."""

    prompt: int
    completion: int
    cached: int = 0
    cost: int | None = None


def clip(value: str | None) -> str | None:
    """A client string as it may appear in an event, a log line or a label."""
    if isinstance(value, str) and len(value) > MAX_CLIENT_STRING:
        return value[:MAX_CLIENT_STRING] + "..."
    return value


def overrun_tokens(record: EventFacts, completion: int) -> int:
    """Output beyond the reservation (an upstream that ignores the max_tokens it was sent): billed in full, and named
    in the event so that it can be found."""
    return max(0, completion - record.max_tokens) if record.max_tokens is not None and record.route else 0


def request_event(
    record: EventFacts,
    billed: Billed,
    ts: float,
    e2e_s: float,
    tpot_s: float | None,
    kv_transfer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The event of `record`, billed `billed`, ended at `ts` (epoch seconds) after `e2e_s`, its time per output token
    `tpot_s`; `kv_transfer`: what its decode hop's answer says it fetched (a disaggregated pool's)."""
    outcome = record.outcome
    event: dict[str, Any] = {
        "ts": ts,
        "request_id": record.request_id,
        "team": record.team_id,
        "key_id": record.key_id,
        "model": clip(record.model),
        "served_model": record.served_model,
        "route": record.route,
        "route_reason": record.route_reason,
        "upstream_error": record.upstream_error,
        "upstream_request_id": record.upstream_id or None,
        "instance": record.route[-1] if record.route else None,
        "model_revision": record.model_revision,
        "alias": record.alias,
        "variant": record.variant,
        "variant_steered": record.steered if record.variant is not None else None,
        "priority": record.priority,
        "status": outcome.status,
        "reason": outcome.reason,
        "http_status": outcome.http_status,
        "prompt_tokens": billed.prompt,
        "completion_tokens": billed.completion,
        "cached_tokens": billed.cached,
        "max_tokens": record.max_tokens,
        "overrun_tokens": overrun_tokens(record, billed.completion),
        "usage_source": record.usage_source,
        "queue_ms": ms(record.queue_s),
        "ttft_ms": ms(record.ttft_s),
        "tpot_ms": ms(tpot_s),
        "e2e_ms": ms(e2e_s),
        "finish_reason": record.finish_reason,
        "stream": record.stream,
        "kind": record.kind,
        "client_disconnected": outcome.disconnected,
        "user": record.user,
        "cost": None if billed.cost is None else femtos_to_usd(billed.cost),  # unrounded: a sum of events stays exact
        "trace_id": record.trace.trace_id if record.trace is not None else None,
        "batch_id": record.batch_id,
    }
    if record.prefill_instance is not None:
        event["prefill_instance"], event["prefill_ms"] = record.prefill_instance, ms(record.prefill_s)
        if isinstance(kv_transfer, dict):
            for key, field in TRANSFER_FIELDS.items():
                value = kv_transfer.get(field)
                event[key] = value if type(value) in (int, float) else None
    if record.draft_tokens and record.accepted_draft_tokens is not None:
        event["draft_tokens"] = record.draft_tokens
        event["draft_acceptance"] = round(record.accepted_draft_tokens / record.draft_tokens, 4)
    return event


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
