"""Canary rollouts on two gateway replicas sharing Redis (limits) and one store file (routing): a canary that fails
(its upstream answers 503) or is 10x slower to a first token is rolled back on both replicas within its window while
every request still succeeds (the canary pool falls back to the stable one); a healthy one is stepped up and
promoted. The decision is an event, a log line, a metric and the /admin/rollouts state."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.canary import canary_config
from tests.support.metrics import gateway_metrics
from tests.support.serve_thread import ServerThread, two_replicas
from tests.support.stack import team
from tests.support.state import URL as REDIS_URL
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import (
    GatewayConfig,
    RolloutConfig,
)

PROMPT = [101, 102, 103]


@contextlib.contextmanager
def stack(tmp_path, canary: FakeUpstream, rollout: RolloutConfig, redis_prefix: str):
    """Two replicas, alias `chat` = stable (pool `v1`) + canary (pool `v2`, falling back to v1) under `rollout`."""
    from tokenweir.gateway.state.redis import RedisState

    with ServerThread(FakeUpstream(model="m")) as stable, ServerThread(canary) as canary_thread:

        def config(name: str) -> GatewayConfig:
            events = str(tmp_path / f"events-{name}.jsonl")
            return canary_config(stable.url, canary_thread.url, rollout, events, ["v1"], state_url=REDIS_URL)

        def state() -> RedisState:
            return RedisState(REDIS_URL, prefix=redis_prefix)

        with two_replicas(tmp_path, config, state) as (store, apps, admin):
            _, secret = team({"store": store})
            yield {
                "urls": [app.url for app in apps],
                "admin": admin,
                "key": {"authorization": f"Bearer {secret}"},
                "decisions": [tmp_path / "events-a.rollouts.jsonl", tmp_path / "events-b.rollouts.jsonl"],
            }


async def load(info: dict, until, seconds: float) -> Counter:
    """Requests from many users through both replicas until `until()` holds (checked every 0.2 s) or time is up."""
    statuses: Counter = Counter()
    stop = asyncio.Event()

    async def client(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, headers=info["key"], timeout=30) as c:
            while not stop.is_set():
                body = {"model": "chat", "prompt": PROMPT, "max_tokens": 2, "user": uuid.uuid4().hex}
                r = await c.post("/v1/completions", json=body | {"fake": {"tokens": 2, "ttft_ms": 10}})
                statuses[r.status_code] += 1

    tasks = [asyncio.create_task(client(url)) for url in info["urls"] * 4]
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and not await until():
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return statuses


async def rollout_states(info: dict) -> list[dict]:
    """/admin/rollouts' entry for `chat`, as each replica sees it."""
    out = []
    async with httpx.AsyncClient(headers=info["admin"], timeout=30) as c:
        for url in info["urls"]:
            data = (await c.get(f"{url}/admin/rollouts")).json()["data"]
            out.append(next(a for a in data if a["model"] == "chat"))
    return out


@pytest.mark.parametrize("fault", ["errors", "slow"])
async def test_a_failing_or_slow_canary_is_rolled_back_on_both_replicas_and_requests_keep_succeeding(
    tmp_path, redis_prefix, fault
):
    # slow: 110 ms more than the stable one's ~10 ms, well past the ratio and the absolute floor (50 ms) of a breach
    canary = FakeUpstream(model="m", down=fault == "errors", ttft_ms=110 if fault == "slow" else 0)
    rollout = RolloutConfig(canary="canary", baseline="stable", steps=[50, 100], step_s=3600, window_s=30)
    rollout.min_requests = 15
    with stack(tmp_path, canary, rollout, redis_prefix) as info:

        async def rolled_back() -> bool:
            return all(s["rollout"]["status"] == "rolled_back" for s in await rollout_states(info))

        started = time.monotonic()
        statuses = await load(info, rolled_back, seconds=30)
        took = time.monotonic() - started
        states = await rollout_states(info)
        assert all(s["rollout"]["status"] == "rolled_back" for s in states), states
        assert took < rollout.window_s  # within the window
        assert all(s["weights"] == {"stable": 100.0, "canary": 0.0} for s in states)
        reason = states[0]["rollout"]["reason"]
        # a canary whose every request fails is rolled back once its circuit opens (no healthy member), if its error
        # rate did not do it first
        assert reason.startswith(("error rate", "no healthy member") if fault == "errors" else "TTFT p95"), reason
        assert set(statuses) == {200}, statuses  # the canary's failures fell back to the stable pool
        # after the rollback (both replicas applied it) no subject gets the canary
        seen = canary.requests_seen
        after = await load(info, lambda: asyncio.sleep(0, False), seconds=1.0)
        assert set(after) == {200} and canary.requests_seen == seen
        decisions = [e for path in info["decisions"] for e in read_events(path)]
        assert [e["transition"] for e in decisions if e["transition"] != "started"] == ["rolled_back"]
        assert decisions[-1]["reason"] == reason
        if not reason.startswith("no healthy member"):
            assert decisions[-1]["canary_window"]["requests"] >= 15
        await asyncio.sleep(0.5)  # a controller tick after the decision reports the share
        metrics = await asyncio.to_thread(gateway_metrics, info["urls"][1])
        assert metrics[("tokenweir_gateway_rollout_canary_share", (("alias", "chat"), ("variant", "canary")))] == 0.0


async def test_a_healthy_canary_is_stepped_up_then_promoted(tmp_path, redis_prefix):
    rollout = RolloutConfig(canary="canary", baseline="stable", steps=[30, 60, 100], step_s=1.0, window_s=30)
    # Two fakes of one speed, but every server here is a thread of this one process: the one with the larger share
    # waits for the GIL more, and p95s of ~10 ms then differ up to 5x by scheduling alone. The thresholds are the
    # failing tests' business; this one checks the steps, so only errors may stop it.
    rollout.min_requests, rollout.max_ttft_p95_ratio, rollout.max_tpot_p95_ratio = 5, 100.0, 100.0
    with stack(tmp_path, FakeUpstream(model="m"), rollout, redis_prefix) as info:

        async def promoted() -> bool:
            return all(s["rollout"]["status"] == "promoted" for s in await rollout_states(info))

        statuses = await load(info, promoted, seconds=40)
        states = await rollout_states(info)
        assert set(statuses) == {200}
        assert all(s["rollout"]["status"] == "promoted" and s["weights"]["canary"] == 100.0 for s in states), [
            s["rollout"] for s in states
        ]
        decisions = sorted((e for path in info["decisions"] for e in read_events(path)), key=lambda e: e["ts"])
        assert [e["transition"] for e in decisions] == ["started", "step", "step", "promoted"]
