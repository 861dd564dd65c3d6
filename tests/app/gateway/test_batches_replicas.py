"""Two gateway replicas on one store: a batch is run by one of them at a time (a lease in the store), and when that
replica stops mid-batch the other takes the batch over and finishes it, each line answered once."""

from __future__ import annotations

import asyncio
import contextlib
import time

import openai
import orjson

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import BatchesConfig, EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store

MODEL, CHAT, LINES = "fake-model", "/v1/chat/completions", 30


def input_file() -> bytes:
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": CHAT,
         "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2,
                  "fake": {"ttft_ms": 80}}}
        for i in range(LINES)
    ]  # fmt: skip
    return b"\n".join(orjson.dumps(line) for line in lines)


async def test_one_replica_runs_a_batch_and_the_other_takes_it_over_when_it_stops(tmp_path):
    fake = FakeUpstream(model=MODEL)
    stores = [Store.open(f"sqlite:///{tmp_path}/store.db") for _ in range(2)]
    team = stores[0].create_team("t")
    secret, _ = stores[0].create_key(team.id, "k")
    with ServerThread(fake) as upstream, contextlib.ExitStack() as running:

        def config(name: str) -> GatewayConfig:
            return GatewayConfig(
                port=0,
                pools=[PoolConfig(model=MODEL, upstreams=[UpstreamConfig(upstream.url)])],
                events=EventsConfig(path=str(tmp_path / f"events-{name}.jsonl"), flush_interval_s=0.05),
                batches=BatchesConfig(concurrency=2, poll_interval_s=0.05, lease_s=1.0),
                shutdown_grace_s=5,
            )

        servers = [
            running.enter_context(serve_app(config(name), store=store, state_backend=InMemoryState()))
            for name, store in zip("ab", stores, strict=True)
        ]
        clients = [openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=secret, max_retries=0) for s in servers]
        uploaded = await clients[0].files.create(file=("in.jsonl", input_file()), purpose="batch")
        batch = await clients[0].batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        while (await clients[1].batches.retrieve(batch.id)).request_counts.completed < 6:
            await asyncio.sleep(0.05)

        def ran_by(name: str) -> list[dict]:
            return [e for e in read_events(tmp_path / f"events-{name}.jsonl") if e.get("batch_id") == batch.id]

        first = "a" if ran_by("a") else "b"
        other = "b" if first == "a" else "a"
        assert ran_by(first) and not ran_by(other), "one replica runs the batch"
        await asyncio.to_thread(servers["ab".index(first)].__exit__, None, None, None)  # stops, gives its lease back
        survivor = clients["ab".index(other)]
        deadline = time.monotonic() + 30
        while (ended := await survivor.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, ended.status
            await asyncio.sleep(0.05)
        content = await survivor.files.content(ended.output_file_id)
        output = [orjson.loads(line) for line in content.content.splitlines()]
    for store in stores:
        store.close()
    assert ended.error_file_id is None and ended.request_counts.completed == LINES
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(LINES))
    served = [e["request_id"] for name in "ab" for e in ran_by(name) if e["status"] == "ok"]
    assert sorted(served) == sorted(o["response"]["request_id"] for o in output), "each line served once"
    assert ran_by(other), "the other replica finished it"
