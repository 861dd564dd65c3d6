"""Weighted variants of a model name, through real HTTP: client -> gateway -> fake upstreams. An alias `chat` splits
90/10 between two pools; its requests land on one variant per sticky subject (the key, or the `user`), every event
says which (alias, variant, and the variant's pool as `model`), the metrics count them per variant, the override
header picks one outright for a key allowed to (tests/app/gateway/test_variant_permission.py: one that is not), and
/v1/models lists the alias."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.metrics import gateway_metrics
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import team
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import (
    AliasConfig,
    EventsConfig,
    GatewayConfig,
    PoolConfig,
    UpstreamConfig,
    VariantConfig,
)
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store

PROMPT = [101, 102, 103]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("variants")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    with ServerThread(FakeUpstream(model="m")) as upstream:
        pools = [
            PoolConfig(model=name, upstreams=[UpstreamConfig(upstream.url, model="m")], capacity=256)
            for name in ("chat-v1", "chat-v2")
        ]
        variants = [VariantConfig("chat-v1", 90, "stable"), VariantConfig("chat-v2", 10, "canary")]
        aliases = [AliasConfig("chat", variants, sticky="user"), AliasConfig("chat-by-key", variants)]
        config = GatewayConfig(
            port=0,
            pools=pools,
            aliases=aliases,
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
        )
        with serve_app(config, store=store, state_backend=InMemoryState()) as gw:
            yield {"store": store, "url": gw.url, "events": tmp / "events.jsonl"}
    store.close()


async def ask(c: httpx.AsyncClient, model: str, user: str | None = None, **headers: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "fake": {"tokens": 2}}
    return await c.post("/v1/completions", json=body | ({"user": user} if user else {}), headers=headers)


def events_by_id(stack) -> dict[str, dict]:
    return {e["request_id"]: e for e in read_events(stack["events"])}


async def test_a_90_10_split_over_2000_users_sends_10_percent_to_the_canary_each_user_always_to_one(stack):
    _, secret = team(stack)
    sem = asyncio.Semaphore(32)

    async def one(c: httpx.AsyncClient, user: str) -> str:
        async with sem:
            r = await ask(c, "chat", user)
        assert r.status_code == 200, r.text
        return r.headers["x-request-id"]

    headers = {"authorization": f"Bearer {secret}"}
    users = [f"user-{i}" for i in range(2000)]
    async with httpx.AsyncClient(base_url=stack["url"], headers=headers, timeout=30) as c:
        first = await asyncio.gather(*(one(c, u) for u in users))
        again = await asyncio.gather(*(one(c, u) for u in users[:200]))  # the same users: the same variants
    events = await asyncio.to_thread(events_by_id, stack)
    got = [events[rid] for rid in first]
    share = Counter(e["variant"] for e in got)
    assert 0.08 <= share["canary"] / len(got) <= 0.12, share
    assert all(e["alias"] == "chat" and e["model"] == {"stable": "chat-v1", "canary": "chat-v2"}[e["variant"]]
               for e in got)  # fmt: skip
    assert [events[rid]["variant"] for rid in again] == [e["variant"] for e in got[:200]]
    metrics = gateway_metrics(stack["url"])
    for variant, n in share.items():
        labels = (("alias", "chat"), ("status", "ok"), ("variant", variant))
        assert metrics[("tokenweir_gateway_variant_requests_total", labels)] >= n


async def test_sticky_per_key_and_the_override_header(stack):
    keys = [team(stack)[1] for _ in range(30)]
    seen: dict[str, set[str]] = {}
    for secret in keys:
        async with httpx.AsyncClient(base_url=stack["url"], timeout=30) as c:
            for user in ("a", "b", "c"):  # sticky per key: the user does not matter here
                r = await ask(c, "chat-by-key", user, authorization=f"Bearer {secret}")
                assert r.status_code == 200, r.text
                seen.setdefault(secret, set()).add(r.headers["x-request-id"])
    events = await asyncio.to_thread(events_by_id, stack)
    assert all(len({events[rid]["variant"] for rid in rids}) == 1 for rids in seen.values())
    key_id = stack["store"].find_key(keys[0]).id
    stack["store"].update_key(key_id, may_pick_variant=True)  # the admin lets this key pick (tests: who may not)
    async with httpx.AsyncClient(base_url=stack["url"], timeout=30) as c:
        auth = f"Bearer {keys[0]}"
        await asyncio.sleep(1.1)  # past the gateway's key cache (<= 1 s): a change made outside its admin API
        r = await ask(c, "chat-by-key", authorization=auth, **{"x-tokenweir-variant": "canary"})
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        r = await ask(c, "chat-by-key", authorization=auth, **{"x-tokenweir-variant": "nightly"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_variant", r.text
        models = (await c.get("/v1/models", headers={"authorization": auth})).json()["data"]
    assert (await asyncio.to_thread(events_by_id, stack))[rid]["variant"] == "canary"
    assert {"chat", "chat-by-key", "chat-v1", "chat-v2"} <= {m["id"] for m in models}
