"""The Responses API's test stack (tests/app/gateway/test_responses_*.py): the gateway under uvicorn in front of the
fake upstream, as our engine (MODEL: a Responses request goes to it as a chat) and as an external server that serves
/v1/responses itself (EXTERNAL: passed through), with its store on SQLite or PostgreSQL; and clients of new teams."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.store import open_store
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig

MODEL = "fake-model"
EXTERNAL = "responses-model"  # the same fake as an external server that serves /v1/responses itself


@contextmanager
def responses_stack(store_kind: str, tmp: Path) -> Iterator[dict[str, Any]]:
    fake = FakeUpstream(model=MODEL)
    with open_store(store_kind, tmp) as store, ServerThread(fake) as upstream:
        config = GatewayConfig(
            port=0,
            pools=[
                PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url)], max_context=4096),
                PoolConfig(
                    model=EXTERNAL,
                    upstreams=[UpstreamConfig(upstream.url, model=MODEL, engine=False)],
                    serves_responses=True,
                    cache_scope="shared",
                ),
            ],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
        )
        with serve_app(config, store=store) as gw:
            yield {
                "fake": fake,
                "store": store,
                "url": gw.url,
                "events": tmp / "events.jsonl",
                "upstream_url": upstream.url,
            }


class TeamClients:
    """Clients of new teams' keys (each test its own teams), all closed by `close`."""

    def __init__(self, stack: dict[str, Any]) -> None:
        self.stack, self.made = stack, []

    def __call__(self) -> openai.AsyncOpenAI:
        store = self.stack["store"]
        team = store.create_team(f"team-{time.monotonic_ns()}")
        secret, _ = store.create_key(team.id, "test")
        self.made.append(openai.AsyncOpenAI(base_url=self.stack["url"] + "/v1", api_key=secret, max_retries=0))
        return self.made[-1]

    async def close(self) -> None:
        for client in self.made:
            await client.close()
