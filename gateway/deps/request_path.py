"""The request path's stages, built once per app from the services they use: admission takes a request, dispatch
sends it hop by hop, settle ends it. Each stage is given what it uses and nothing else reaches through another; what
they share (the member slots, the journal, the token counters, the fail-open state, tracing) is made here once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tokenweir.gateway.accounting.events import EventWriter
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.accounting.usage import UsageRecorder
from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.openai.token_count import TokenCounters
from tokenweir.gateway.request.admission import Admission
from tokenweir.gateway.request.background import BackgroundTasks
from tokenweir.gateway.request.dispatch import Dispatcher
from tokenweir.gateway.request.inflight import InflightJournal, journal_path
from tokenweir.gateway.request.queue import DispatchQueue
from tokenweir.gateway.request.settle import Settler
from tokenweir.gateway.request.tracing import GatewayTracing, gateway_tracing
from tokenweir.gateway.runtime.rollouts import Rollouts
from tokenweir.gateway.state.backend import StateBackend
from tokenweir.gateway.state.member_slots import MemberSlots
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.state.outbox import StateOutbox
from tokenweir.gateway.upstream.client import UpstreamClient
from tokenweir.gateway.upstream.pools import Upstreams


@dataclass(eq=False)
class RequestPath:
    """Given the app's services (the fields up to `rollouts`), builds the stages (the fields after it)."""

    config: GatewayConfig
    upstreams: Upstreams
    state: StateBackend
    queues: dict[str, DispatchQueue]
    client: UpstreamClient
    events: EventWriter
    metrics: Metrics
    usage: UsageRecorder
    outbox: StateOutbox | None
    background: BackgroundTasks
    rollouts: Rollouts | None
    # built by __post_init__
    members: MemberSlots = field(init=False)
    journal: InflightJournal = field(init=False)  # not opened here: recovery reads the last run's first
    counters: TokenCounters = field(init=False)
    local: InMemoryState | None = field(init=False)
    tracing: GatewayTracing | None = field(init=False)
    settler: Settler = field(init=False)
    dispatcher: Dispatcher = field(init=False)
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        upstreams = self.upstreams
        self.members = MemberSlots(self.state)
        self.journal = InflightJournal(journal_path(self.events.path))
        self.counters = TokenCounters(lambda: list(upstreams.pools), lambda m: upstreams.pools[m].cfg.tokenizer)
        self.local = InMemoryState() if self.config.state.on_unavailable == "fail_open" else None
        self.tracing = gateway_tracing(self.config.tracing)
        self.settler = Settler(
            upstreams,
            self.state,
            self.local,
            self.queues,
            self.events,
            self.metrics,
            self.usage,
            self.outbox,
            self.counters,
            self.background,
            self.members,
            self.journal,
            self.rollouts,
        )
        self.dispatcher = Dispatcher(
            self.config,
            upstreams,
            self.client,
            self.metrics,
            self.members,
            self.background,
            self.counters,
            self.settler,
        )
        self.admission = Admission(
            self.config,
            upstreams,
            self.state,
            self.local,
            self.queues,
            self.counters,
            self.events,
            self.journal,
            self.settler,
            self.dispatcher,
            self.background,
            self.tracing,
        )

    async def close(self) -> None:
        """What the stages hold open: the journal's file, the member slots' renewals, the trace exporter's queue."""
        self.journal.close()
        await self.members.close()
        if self.tracing is not None:  # what its exporter still holds goes out now
            await asyncio.to_thread(self.tracing.provider.shutdown)
