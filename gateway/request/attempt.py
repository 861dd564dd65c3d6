"""One try of one hop: where it went, the id the upstream knows it by, since when, the member slot it holds, and the
calls that talk to it (the whole answer, a stream opened to its headers, our engine's /abort).

Dispatch makes one per hop it sends (gateway/request/dispatch.py); the stream relay and the non-stream call read
and write it, not the whole request; the request's end releases it once (gateway/request/settle.py). The request's
event keeps the last one's id and dispatch time (RequestRecord), since a recovered request has no Attempt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenweir.common.http.fairness_id import FAIRNESS_ID_HEADER
from tokenweir.common.ids import random_hex
from tokenweir.gateway.upstream import calls
from tokenweir.gateway.upstream.client import UpstreamClient
from tokenweir.gateway.upstream.pools import Hop
from tokenweir.gateway.upstream.sse import SSEStream


def new_upstream_id() -> str:
    """An id of our own for one attempt: never the client's X-Request-Id, which two requests (maybe of two teams)
    could share, so that an /abort stops only its own attempt."""
    return "tw-" + random_hex()


@dataclass(slots=True, eq=False)
class Attempt:
    hop: Hop
    client: UpstreamClient
    # the member's slot under its max_parallel_requests (member, lease id), given back when the attempt is released
    member_lease: tuple[str, str] | None = None
    upstream_id: str = field(default_factory=new_upstream_id)
    dispatched_at: float = field(default_factory=time.perf_counter)
    incomplete: bool = False  # the upstream may still be generating: the request's end aborts it
    instance_ok: bool = True  # what the instance's circuit hears when the attempt is released
    released: bool = False
    fairness_id: str | None = None  # whose service it is, for our engine's scheduler: the request's team

    @property
    def engine(self) -> bool:
        """Our engine: it takes /abort and answers it with the exact usage made."""
        return self.hop.instance.cfg.engine

    @property
    def live(self) -> bool:
        """Sent and not yet released: its instance counts it in flight."""
        return not self.released

    async def call(
        self, path: str, body: dict[str, Any], deadline: float, traceparent: str | None
    ) -> tuple[dict[str, Any], bytes]:
        """The whole answer (gateway/upstream/calls.py call_json)."""
        extra = self.headers(traceparent)
        return await calls.call_json(self.client, self.hop, path, body, self.upstream_id, deadline, extra)

    async def open(self, path: str, body: dict[str, Any], deadline: float, traceparent: str | None) -> SSEStream:
        """A stream, opened up to its headers (gateway/upstream/calls.py open_stream)."""
        extra = self.headers(traceparent)
        return await calls.open_stream(self.client, self.hop, path, body, self.upstream_id, deadline, extra)

    def headers(self, traceparent: str | None) -> dict[str, str]:
        """What the gateway adds to the hop's request: the trace it continues, and for our engine the team it
        schedules fairly (another upstream is not told who our tenants are)."""
        extra = {"traceparent": traceparent} if traceparent is not None else {}
        if self.fairness_id is not None and self.engine:
            extra[FAIRNESS_ID_HEADER] = self.fairness_id
        return extra

    async def abort(self) -> dict[str, Any] | None:
        """Stop it on our engine; the engine's answer (its usage: the exact count made), or None where it cannot
        say or the hop is not our engine."""
        if not self.engine:
            return None
        return await calls.abort(self.client, self.hop, self.upstream_id)

    def release(self, ok: bool) -> tuple[str, str] | None:
        """Done with (once): its instance hears whether it served (`ok`); returns the member slot to give back."""
        assert not self.released, "an attempt is released once"
        self.released = True
        self.hop.done(ok, time.monotonic())
        lease, self.member_lease = self.member_lease, None
        return lease
