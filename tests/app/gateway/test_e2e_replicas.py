"""Two gateway replicas sharing limits through Redis: a budget is not multiplied by the replica count."""

from __future__ import annotations

import asyncio
import time
import uuid

import openai
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.services import require_service
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

REDIS_URL = "redis://127.0.0.1:6379/0"
PROMPT = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def redis_up():
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as e:
        require_service("redis", f"{REDIS_URL}: {e}")


async def test_two_replicas_admit_one_budget_worth_together(redis_up, tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    per_request = len(PROMPT) + 6
    n_fit = 12
    team = store.create_team(f"shared-{uuid.uuid4().hex[:8]}", TeamLimits(tokens_per_day=per_request * n_fit + 3))
    secret, _ = store.create_key(team.id, "k")
    with ServerThread(FakeUpstream(model="m")) as upstream:

        def config(name: str) -> GatewayConfig:
            return GatewayConfig(
                port=0,
                state_url=REDIS_URL,
                pools=[PoolConfig(model="m", upstreams=[UpstreamConfig(upstream.url)])],
                events=EventsConfig(path=str(tmp_path / f"{name}.jsonl")),
            )

        with serve_app(config("a"), store=store) as a, serve_app(config("b"), store=store) as b:
            clients = [
                openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0, timeout=30) for gw in (a, b)
            ]

            async def one(i: int):
                try:
                    await clients[i % 2].completions.create(
                        model="m", prompt=PROMPT, max_tokens=6, extra_body={"fake": {"ttft_ms": 30}}
                    )
                    return i % 2
                except openai.RateLimitError as e:
                    assert e.code == "budget_exhausted"
                    return None

            for client in clients:  # warm each replica's auth cache so both race for the budget from the start
                await client.models.list()
            t0 = time.monotonic()
            results = await asyncio.gather(*(one(i) for i in range(60)))
            admitted = [r for r in results if r is not None]
            assert len(admitted) == n_fit, f"{len(admitted)} admitted by two replicas, budget fits {n_fit}"
            assert set(admitted) == {0, 1}, "both replicas served some"
            assert time.monotonic() - t0 < 20
    store.close()
