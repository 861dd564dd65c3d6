"""The end of an admitted request, owned in one place.

Admission makes one `RequestEnd` per request it takes, and the request is settled through it, exactly once
(`Settler.finish`: the upstream stopped, slots back, the bill, the event). Whoever holds it last calls it:

- the handler, as it leaves (`handler_exited`): a JSON answer, an error, a cancel, a shutdown;
- a stream's body, once dispatch has handed the end to it (`hand_to_body`, the `on_end` of relay.StreamResponse): the
  handler returns a stream before its body is sent, so the body is the last to know how the request ended
  (`body_ended`: the client gone, a shutdown) and settles it when it is over.

A request refused before admission never gets here: its one end is `Settler.finish_unadmitted` (reached from the
error handlers and the middleware, gateway/app.py). The end also holds what it must close: the upstream stream
of the hop being relayed (`stream`, relay.HopStream), so that whoever ends the request closes it; and what follows
it: `on_settled`, called with the output tokens billed once the request is settled (a mirror to its pool's shadow
pool, gateway/request/shadow.py, which asks no more than that).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tokenweir.common.logging import get_logger
from tokenweir.gateway.accounting.event_faults import unavailable
from tokenweir.gateway.request.background import BackgroundTasks
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.request.relay import HopStream
from tokenweir.gateway.request.settle import Settler

log = get_logger()


class RequestEnd:
    def __init__(self, ctx: RequestContext, settler: Settler, background: BackgroundTasks) -> None:
        self.ctx, self.settler, self.background = ctx, settler, background
        self.stream: HopStream | None = None  # the open upstream stream of the current hop, set by dispatch
        self.on_settled: Callable[[int], None] | None = None  # set by dispatch: called with the output tokens billed
        self.body_owns_end = False  # handed to a stream's body: the handler leaving no longer ends the request
        self.ended = False

    def hand_to_body(self) -> Callable[[bool, bool], Awaitable[None]]:
        """Pass the end to the stream response being returned: its body calls what this returns when it is over."""
        assert not self.body_owns_end and not self.ended, "the end is handed on once, before it is called"
        self.body_owns_end = True
        return self.body_ended

    async def handler_exited(self) -> None:
        """The handler is leaving (its `finally`): it ends the request, unless a stream's body now owns the end. An
        answer whose bill could not be made durable (gateway/request/billing.py) is not given: 503 instead."""
        if not self.body_owns_end:
            await self._settle()
            if self.ctx.unbilled:
                raise unavailable(self.settler.events.retry_after_s, answered=True)

    async def body_ended(self, disconnected: bool, shutdown: bool) -> None:
        """The stream's body is over: the client left, the server shut down past its grace, or it was sent whole."""
        ctx = self.ctx
        if disconnected:
            if ctx.outcome.decide("cancelled", "client_disconnected", 499, disconnected=True):
                ctx.upstream_may_run_on()
        elif shutdown and ctx.outcome.decide("cancelled", "shutdown", 503):
            ctx.upstream_may_run_on()
        await self._settle()

    async def drop_stream(self) -> None:
        """The current hop's stream is done with (the hop failed or refused the request): closed without reading
        its rest, and forgotten (what it made is billed from the engine's answer, not from its chunks)."""
        stream, self.stream = self.stream, None
        if stream is not None:
            await stream.close(drain=False)

    async def _settle(self) -> None:
        assert not self.ended, "a request ends once"
        self.ended = True
        await self.background.shielded(self._finish())

    async def _finish(self) -> None:
        completion = await self.settler.finish(self.ctx, self.stream)
        if self.on_settled is not None:
            try:
                self.on_settled(completion)
            except Exception:  # noqa: BLE001 - what follows a request never fails it
                log.exception("on_settled_failed", request_id=self.ctx.request_id)
