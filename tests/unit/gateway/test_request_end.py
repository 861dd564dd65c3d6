"""The end of a request, on its own: the outcome is decided once (the first decisive setter wins), an admitted
request is settled exactly once by whoever holds its RequestEnd last (the handler, or a stream's body it was handed
to), and what a cancelled request started still runs to its end in the app's BackgroundTasks."""

from __future__ import annotations

import asyncio
import types

import pytest

from tokenweir.gateway.accounting.events import EventWriter, read_events
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.request.attempt import Attempt
from tokenweir.gateway.request.background import BackgroundTasks
from tokenweir.gateway.request.context import RequestContext
from tokenweir.gateway.request.inflight import InflightJournal, journal_path
from tokenweir.gateway.request.outcome import Outcome
from tokenweir.gateway.request.request_end import RequestEnd
from tokenweir.gateway.request.settle import Settler
from tokenweir.gateway.state.member_slots import MemberSlots
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.upstream import calls
from tokenweir.gateway.upstream.pools import Upstreams
from tokenweir.policies.limits import TeamLimits

# --- Outcome -----------------------------------------------------------------------------------------------------


def test_the_first_decisive_outcome_wins_and_a_disconnect_is_still_recorded():
    outcome = Outcome()
    assert not outcome.decided
    assert outcome.decide("timeout", "timeout", 504)
    assert not outcome.decide("cancelled", "client_disconnected", 499, disconnected=True)  # the client left after
    assert (outcome.status, outcome.reason, outcome.http_status) == ("timeout", "timeout", 504)
    assert outcome.disconnected


def test_a_note_on_an_ok_outcome_gives_way_to_a_later_decision():
    outcome = Outcome()
    outcome.note_ok("output_cut")
    assert (outcome.status, outcome.reason, outcome.decided) == ("ok", "output_cut", False)
    assert outcome.decide("cancelled", "client_disconnected", 499, disconnected=True)
    assert (outcome.status, outcome.reason, outcome.http_status) == ("cancelled", "client_disconnected", 499)
    with pytest.raises(AssertionError):
        outcome.note_ok("output_cut")  # a decided outcome keeps its own reason
    with pytest.raises(AssertionError):
        Outcome().decide("ok", None, 200)  # ok is no decision


# --- RequestEnd --------------------------------------------------------------------------------------------------


@pytest.fixture
async def settler(tmp_path):
    """A real Settler with nothing to give back: a request that took no reservation, slot or hop ends as its event."""
    config = GatewayConfig()
    metrics = Metrics()
    events = EventWriter(tmp_path / "events.jsonl")
    events.open()
    client = calls.make_client()
    background = BackgroundTasks()
    upstreams = Upstreams(config, metrics)
    state = InMemoryState()
    journal = InflightJournal(journal_path(events.path))  # not opened: it writes nothing
    yield Settler(
        upstreams, state, None, {}, events, metrics, None, None, None, background, MemberSlots(state), journal
    )
    await events.close()
    await client.aclose()


def admitted(request_id: str) -> RequestContext:
    return RequestContext(
        request_id=request_id,
        kind="chat",
        t0=0.0,
        team_id="t",
        key_id="k",
        model="m",
        limits=TeamLimits(),
        body={},
        deadline_base=0.0,
        stream=True,
    )


async def test_a_handler_that_keeps_the_end_settles_once(settler):
    ctx = admitted("r-handler")
    end = RequestEnd(ctx, settler, settler.background)
    ctx.outcome.decide("rejected", "rate_limited", 429)
    await end.handler_exited()
    (event,) = read_events(settler.events.path)
    assert (event["request_id"], event["status"], event["reason"], event["http_status"]) == (
        "r-handler",
        "rejected",
        "rate_limited",
        429,
    )
    with pytest.raises(AssertionError, match="ends once"):
        await end.handler_exited()
    assert len(read_events(settler.events.path)) == 1


async def test_a_stream_handed_the_end_settles_when_its_body_is_over(settler):
    ctx = admitted("r-stream")
    end = RequestEnd(ctx, settler, settler.background)
    on_end = end.hand_to_body()
    await end.handler_exited()  # the handler returns the stream before its body is sent: not the end yet
    assert read_events(settler.events.path) == []
    with pytest.raises(AssertionError):
        end.hand_to_body()  # handed on once
    ctx.outcome.decide("timeout", "timeout", 504)  # the relay's deadline fired, then the client left
    await on_end(True, False)
    (event,) = read_events(settler.events.path)
    assert (event["status"], event["reason"], event["http_status"], event["client_disconnected"]) == (
        "timeout",
        "timeout",
        504,
        True,
    )
    with pytest.raises(AssertionError, match="ends once"):
        await on_end(False, False)


def upstream_hop(served: list[bool]) -> types.SimpleNamespace:
    """A hop to an upstream that is not our engine (nothing to abort): what its instance heard goes to `served`."""
    instance = types.SimpleNamespace(cfg=types.SimpleNamespace(engine=False))
    return types.SimpleNamespace(instance=instance, error=None, done=lambda ok, now: served.append(ok))


async def test_a_body_cut_by_the_client_or_a_shutdown_decides_its_outcome(settler):
    gone, shut = admitted("r-gone"), admitted("r-shut")
    served: list[bool] = []
    # its hop was streaming when the client left (not our engine: nothing to abort, so no client is called)
    gone.attempt = Attempt(upstream_hop(served), None)
    await RequestEnd(gone, settler, settler.background).hand_to_body()(True, False)
    await RequestEnd(shut, settler, settler.background).hand_to_body()(False, True)
    events = {e["request_id"]: e for e in read_events(settler.events.path)}
    assert (events["r-gone"]["status"], events["r-gone"]["reason"], events["r-gone"]["http_status"]) == (
        "cancelled",
        "client_disconnected",
        499,
    )
    assert events["r-gone"]["client_disconnected"]
    # the hop may still be generating: marked so (an engine would be aborted), then released once, as served
    assert gone.attempt.incomplete and gone.attempt.released and served == [True]
    assert (events["r-shut"]["reason"], events["r-shut"]["http_status"], events["r-shut"]["client_disconnected"]) == (
        "shutdown",
        503,
        False,
    )


# --- BackgroundTasks ---------------------------------------------------------------------------------------------


async def test_shielded_work_outlives_its_cancelled_caller_and_shutdown_waits_for_it():
    background = BackgroundTasks()
    finished = asyncio.Event()

    async def settle() -> str:
        await asyncio.sleep(0.05)
        finished.set()
        return "settled"

    caller = asyncio.create_task(background.shielded(settle()))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert len(background) == 1 and not finished.is_set()
    await background.wait(timeout_s=5.0)
    assert finished.is_set() and len(background) == 0
