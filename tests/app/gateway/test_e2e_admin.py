"""The admin API and the request path together: changes take effect without a restart."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.process.bootstrap import ensure_bootstrap
from tokenweir.gateway.store.store import Store

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    admin_secret, _ = ensure_bootstrap(store)
    with ServerThread(FakeUpstream(model="m")) as upstream:
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig(model="m", upstreams=[UpstreamConfig(upstream.url)])],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            usage_flush_interval_s=0.1,
        )
        with serve_app(config, store=store) as gw:
            yield {"url": gw.url, "admin": {"authorization": f"Bearer {admin_secret}"}}
    store.close()


async def test_team_key_limits_usage_state_and_revocation_live(stack):
    async with httpx.AsyncClient(base_url=stack["url"], headers=stack["admin"]) as admin:
        r = await admin.post("/admin/teams", json={"name": "live", "limits": {"rpm": 100}})
        assert r.status_code == 201, r.text
        team_id = r.json()["id"]
        r = await admin.post(f"/admin/teams/{team_id}/keys", json={"name": "k"})
        key_id, secret = r.json()["id"], r.json()["secret"]
        client = openai.AsyncOpenAI(base_url=stack["url"] + "/v1", api_key=secret, max_retries=0)
        for _ in range(2):
            await client.chat.completions.create(model="m", messages=HELLO, max_tokens=2)

        # limits change without a restart (the auth cache lives ~1 s)
        assert (await admin.put(f"/admin/teams/{team_id}/limits", json={"rpm": 2})).status_code == 200
        deadline = time.monotonic() + 3
        while True:
            try:
                await client.chat.completions.create(model="m", messages=HELLO, max_tokens=2)
            except openai.RateLimitError as e:
                assert e.code == "rate_limited"
                break
            assert time.monotonic() < deadline, "the new rpm limit never took effect"
            await asyncio.sleep(0.2)

        state = (await admin.get(f"/admin/teams/{team_id}/state")).json()
        assert state["live"]["in_flight"] == 0 and state["live"]["reserved_tokens"] == 0
        # usage is flushed in batches, so a first flush may hold only some of the requests: wait for all of them
        deadline = time.monotonic() + 3
        while True:
            rows = (await admin.get("/admin/usage", params={"team_id": team_id})).json()["data"]
            if rows and rows[0]["completion_tokens"] >= 4:
                break
            assert time.monotonic() < deadline, f"usage never reached 4 completion tokens: {rows}"
            await asyncio.sleep(0.1)
        assert rows[0]["model"] == "m"

        # a revoked key is refused within 2 s
        assert (await admin.delete(f"/admin/keys/{key_id}")).status_code == 200
        revoked_at = time.monotonic()
        await admin.put(f"/admin/teams/{team_id}/limits", json={})
        while True:
            try:
                await client.models.list()
            except openai.AuthenticationError:
                break
            assert time.monotonic() - revoked_at < 2.0, "a revoked key still works after 2 s"
            await asyncio.sleep(0.1)

        # a team key is not an admin key
        r = await admin.get("/admin/teams", headers={"authorization": f"Bearer {secret}"})
        assert r.status_code == 401
