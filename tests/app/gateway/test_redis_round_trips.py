"""How many times a request waits on Redis (issue 25: at most 2 round trips for a request that does not queue for a
concurrency slot: one at admission, one at settle). The gateway runs on the real Redis with a counting hook around its
state's client (tests only): every command sent on its own and every pipeline is one round trip, whatever it carries
(one EVALSHA of a script that does ten things is one trip; a NOSCRIPT retry would be two).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.state import URL, drop_redis_prefix, fresh_redis_prefix
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, StateConfig, UpstreamConfig
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.state.redis_wire import HotScript
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import KeyLimits, TeamLimits

MODEL = "m"
PROMPT = [101, 102, 103, 104, 105, 106]


class TripCounter:
    """Counts the round trips a `RedisState`'s client makes: a hook on that one client instance (no other client,
    and nothing outside this test, sees it). Each trip is named by its command (a script by its name)."""

    def __init__(self, state: RedisState) -> None:
        self.trips: list[str] = []
        self.counting = False
        client = state.client
        scripts = dict(_script_shas(state))
        send, make_pipeline = client.execute_command, client.pipeline

        async def execute_command(*args, **options):
            if self.counting:
                name = str(args[0]).upper()
                if name == "EVALSHA":
                    name = scripts.get(args[1], "EVALSHA")
                self.trips.append(str(name))
            return await send(*args, **options)

        def pipeline(*args, **kwargs):
            pipe = make_pipeline(*args, **kwargs)
            run = pipe.execute

            async def execute(*a, **kw):
                if self.counting:
                    self.trips.append("pipeline:" + ",".join(str(c[0][0]) for c in pipe.command_stack))
                return await run(*a, **kw)

            pipe.execute = execute
            return pipe

        client.execute_command = execute_command  # type: ignore[method-assign]
        client.pipeline = pipeline  # type: ignore[method-assign]
        # the request's two scripts go past execute_command (gateway/state/redis_wire.py): counted where they are sent
        for attribute, script in vars(state).items():
            if isinstance(script, HotScript):
                script.call = self._counted(script.call, attribute.strip("_"))  # type: ignore[method-assign]

    def _counted(self, call, name: str):
        async def counted(*args):
            if self.counting:
                self.trips.append(name)
            return await call(*args)

        return counted

    @contextmanager
    def counting_trips(self) -> Iterator[list[str]]:
        self.trips.clear()
        self.counting = True
        try:
            yield self.trips
        finally:
            self.counting = False


def _script_shas(state: RedisState) -> Iterator[tuple[str, str]]:
    """The registered scripts of the state and of what it holds (one level down), by attribute name."""
    for owner in (state, *vars(state).values()):
        for name, value in vars(owner).items() if hasattr(owner, "__dict__") else ():
            if isinstance(getattr(value, "sha", None), str):
                yield value.sha, name.strip("_")


@pytest.fixture
def gateway(tmp_path):
    prefix = fresh_redis_prefix()
    state = RedisState(URL, prefix=prefix)
    counter = TripCounter(state)
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    fake = FakeUpstream(model=MODEL)
    with ServerThread(fake) as upstream:
        pool = PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url, engine=False)], capacity=1)
        pool.max_queued = 64
        config = GatewayConfig(
            port=0,
            pools=[pool],
            events=EventsConfig(path=str(tmp_path / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.2,
            state=StateConfig(watch_s=3600.0),  # the epoch watch stays out of the count
            prefix_index_sync_s=0,  # and the shared prefix index's background sync (one pipeline an interval)
        )
        with serve_app(config, store=store, state_backend=state) as gw:
            yield {"url": gw.url, "store": store, "counter": counter, "fake": fake, "state": state, "server": gw}
    store.close()
    drop_redis_prefix(prefix)


def make_key(gateway, key_limits: KeyLimits | None = None) -> tuple[str, str]:
    """A team with every limit (so every check runs) and its key: (secret, team id)."""
    limits = TeamLimits(rpm=10_000, tpm=10**7, tokens_per_day=10**8, max_concurrency=50)
    team = gateway["store"].create_team(f"team-{uuid.uuid4().hex[:8]}", limits)
    secret, _ = gateway["store"].create_key(team.id, "k", limits=key_limits)
    return secret, team.id


def snapshot(gateway, team_id: str) -> dict:
    return gateway["server"].call(gateway["state"].snapshot(team_id))


async def post(client: httpx.AsyncClient, secret: str, stream: bool = False, **fake) -> httpx.Response:
    payload = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": stream, "fake": {"tokens": 5, **fake}}
    return await client.post("/v1/completions", json=payload, headers={"authorization": f"Bearer {secret}"})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("key_limits", [None, KeyLimits(max_concurrency=5, tokens_per_day=10**6)])
async def test_a_request_that_does_not_queue_makes_at_most_two_round_trips(gateway, stream, key_limits):
    (secret, team_id), n = make_key(gateway, key_limits), 20
    async with httpx.AsyncClient(base_url=gateway["url"], timeout=30) as client:
        assert (await post(client, secret, stream)).status_code == 200  # the team's first request seeds it
        await asyncio.sleep(0.3)  # a stream's end settles after its last chunk went out
        with gateway["counter"].counting_trips() as trips:
            for _ in range(n):
                r = await post(client, secret, stream)
                assert r.status_code == 200, r.text
            await asyncio.sleep(0.3)
    per_request = len(trips) / n
    assert per_request <= 2, (per_request, Counter(trips))
    assert Counter(trips)["reserve_script"] == Counter(trips)["settle"] == n, Counter(trips)  # both were counted
    # and both trips did their work: every slot back, every hold settled at what was made
    snap = await asyncio.to_thread(snapshot, gateway, team_id)
    assert (snap["in_flight"], snap["open_reservations"], snap["reserved_tokens"]) == (0, 0, 0), snap
    assert snap["spent_today"] == (n + 1) * (len(PROMPT) + 5)


async def test_queued_requests_still_acquire_and_settle(gateway):
    """The pool has one dispatch slot: concurrent requests queue in the gateway and are all served; each still makes
    its two trips."""
    (secret, _), n = make_key(gateway), 8
    async with httpx.AsyncClient(base_url=gateway["url"], timeout=30) as client:
        assert (await post(client, secret)).status_code == 200
        with gateway["counter"].counting_trips() as trips:
            rs = await asyncio.gather(*(post(client, secret, ttft_ms=50) for _ in range(n)))
    assert [r.status_code for r in rs] == [200] * n
    assert len(trips) <= 2 * n, Counter(trips)
    assert gateway["fake"].totals() == ((n + 1) * len(PROMPT), (n + 1) * 5)


async def test_a_request_over_its_concurrency_cap_is_refused_in_two_trips(gateway):
    """The key's one slot is taken: the next request is refused (429 concurrency) after its reservation was taken
    and given back, all in two trips; the running one is unaffected."""
    secret, team_id = make_key(gateway, KeyLimits(max_concurrency=1))
    async with httpx.AsyncClient(base_url=gateway["url"], timeout=30) as client:
        assert (await post(client, secret)).status_code == 200
        running = asyncio.create_task(post(client, secret, ttft_ms=1500))
        await asyncio.sleep(0.5)
        with gateway["counter"].counting_trips() as trips:
            r = await post(client, secret)
        assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency", r.text
        assert len(trips) <= 2, Counter(trips)
        assert (await running).status_code == 200
        assert (await post(client, secret)).status_code == 200  # its slot came back
    await asyncio.sleep(0.3)
    snap = await asyncio.to_thread(snapshot, gateway, team_id)
    assert (snap["in_flight"], snap["open_reservations"], snap["reserved_tokens"]) == (0, 0, 0), snap
    assert snap["requests_last_minute"] == 4  # the refused one counts on rpm: its reservation was taken first
