"""A request's bill made durable: its event line, the in-flight journal's "done", then its usage row; or, where the
event log or the journal cannot take their line (a full disk, an I/O error), the usage straight to the store.

The event is the write-ahead record of usage (gateway/accounting/events.py): a usage row counted in memory reaches the
store with the next flush, and a process killed before that flush has its events replayed at start. So the row is
counted only once the event landed and the journal's "done" did too, with no await between (a flush between them
could move the watermark past an event whose journal still says unfinished, and the in-flight recovery would bill it
again). If either line did not land, the request is billed to the store at once instead (UsageRecorder.bill_now), with
a row that keeps start-up from billing it again through either file (gateway/store/usage.py `settled_requests`).

If the store cannot take it either, the bill is counted in memory as before (the store gets it once it answers, if
the process lives), and a request whose event did not land is marked `unbilled`: its answer, if not sent yet (a JSON
answer: its handler's end settles it first), is refused with 503 events_unavailable (gateway/request/request_end.py).
Meanwhile admission refuses new requests while the event log is failing (gateway/accounting/event_faults.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenweir.common.logging import get_logger
from tokenweir.gateway.accounting.events import EventWriter
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.accounting.usage import UsageRecorder
from tokenweir.gateway.request.context import RequestContext, RequestRecord
from tokenweir.gateway.request.inflight import InflightJournal

log = get_logger()


@dataclass(slots=True, frozen=True)
class Bill:
    """What a request is billed: its usage row's fields."""

    team_id: str
    model: str  # the pool that served it
    prompt: int
    completion: int
    cached: int
    day: str
    key_id: str | None
    user: str | None
    cost_femtos: int

    def row(self) -> dict[str, Any]:
        """The usage row's fields, as UsageRecorder.add and .bill_now take them by name."""
        return {
            "team_id": self.team_id, "model": self.model, "prompt_tokens": self.prompt,
            "completion_tokens": self.completion, "cached_tokens": self.cached, "day": self.day,
            "key_id": self.key_id, "user": self.user, "cost_femtos": self.cost_femtos,
        }  # fmt: skip


async def record(
    ctx: RequestRecord,
    event: dict[str, Any],
    bill: Bill | None,
    *,
    events: EventWriter,
    journal: InflightJournal,
    usage: UsageRecorder,
    metrics: Metrics,
) -> None:
    """Write the request's event, close its journal entry, and bill it (`bill` None: nothing to bill, no upstream was
    tried). Returns once the bill is durable, or known not to be (`ctx.unbilled`)."""
    seq = None
    try:
        seq = await events.commit(event)
    except Exception as e:  # noqa: BLE001 - an event that cannot be written (disk full) must not drop the bill too
        log.warning("event_write_failed", request_id=ctx.request_id, error=f"{type(e).__name__}: {e}")
    try:
        # right after the event: see InflightJournal.done (a record the recovery bills has no entry of this run)
        closed = journal.done(ctx) if isinstance(ctx, RequestContext) else True
    except Exception:  # noqa: BLE001
        log.exception("finish_step_failed", step="journal_done", request_id=ctx.request_id)
        closed = False
    if bill is None:
        return
    if seq is not None and closed:
        _count(usage, bill, seq)  # no await since the event: the usual way, the event covers it until the flush
        return
    try:
        await usage.bill_now(**bill.row(), upstream_request_id=ctx.upstream_id, seq=seq)
        metrics.direct_bills.labels("stored").inc()
        return
    except Exception:  # noqa: BLE001 - kept in memory below: the store takes it when it answers again
        log.exception("direct_bill_failed", request_id=ctx.request_id, event_written=seq is not None)
    metrics.direct_bills.labels("failed").inc()
    ctx.unbilled = seq is None  # its event did land: the replay bills it should this process die first
    _count(usage, bill, seq)


def _count(usage: UsageRecorder, bill: Bill, seq: int | None) -> None:
    usage.add(**bill.row(), seq=seq)
