"""Picking an alias's variant with the `x-tokenweir-variant` header is a permission of the API key, granted by the
admin: through real HTTP (client -> gateway -> a fake upstream), on a SQLite and on a PostgreSQL store. A key without
it is refused (403, whatever variant it names), one with it reaches any variant, a weight-0 one included, and no
request reaches a weight-0 variant by its weight."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.events import the_event
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.store import open_store
from tokenweir.gateway.config import AliasConfig, EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig, VariantConfig
from tokenweir.gateway.state.memory import InMemoryState

HEADER = "x-tokenweir-variant"


@pytest.fixture(params=["sqlite", "postgresql"])
def gateway(request, tmp_path):
    """Alias `chat`: stable (pool chat-v1) + canary (chat-v2); alias `chat-dark`: stable + dark (chat-v3, weight 0)."""
    with open_store(request.param, tmp_path) as store, ServerThread(FakeUpstream(model="m")) as upstream:
        pools = [
            PoolConfig(model=name, upstreams=[UpstreamConfig(upstream.url, model="m")], capacity=256)
            for name in ("chat-v1", "chat-v2", "chat-v3")
        ]
        stable = VariantConfig("chat-v1", 1, "stable")
        aliases = [
            AliasConfig("chat", [stable, VariantConfig("chat-v2", 1, "canary")]),
            AliasConfig("chat-dark", [stable, VariantConfig("chat-v3", 0, "dark")], sticky="user"),
        ]
        events = tmp_path / "events.jsonl"
        config = GatewayConfig(
            port=0, pools=pools, aliases=aliases, events=EventsConfig(path=str(events), flush_interval_s=0.05)
        )
        with serve_app(config, store=store, state_backend=InMemoryState()) as gw:
            admin, _ = store.create_key(None, "admin", is_admin=True)
            team = store.create_team(f"team-{uuid.uuid4().hex[:8]}")
            yield {"url": gw.url, "admin": {"authorization": f"Bearer {admin}"}, "team": team.id, "events": events}


async def ask(c: httpx.AsyncClient, secret: str, model: str, variant: str | None = None, user: str | None = None):
    body = {"model": model, "prompt": [101, 102], "max_tokens": 2, "fake": {"tokens": 2}}
    body |= {"user": user} if user else {}
    headers = {"authorization": f"Bearer {secret}"} | ({HEADER: variant} if variant is not None else {})
    return await c.post("/v1/completions", json=body, headers=headers)


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["type"] == "permission_error" and err["code"] == "variant_not_allowed" and err["param"] == HEADER, err
    assert "may_pick_variant" in err["message"] and "without it" in err["message"], err


async def test_a_key_picks_a_variant_by_header_only_while_the_admin_allows_it(gateway):
    async with httpx.AsyncClient(base_url=gateway["url"], headers=gateway["admin"], timeout=30) as c:
        r = await c.post(f"/admin/teams/{gateway['team']}/keys", json={"name": "app"})
        assert r.status_code == 201 and r.json()["may_pick_variant"] is False, r.text
        key_id, secret = r.json()["id"], r.json()["secret"]
        assert_refused(await ask(c, secret, "chat", "canary"))
        assert_refused(await ask(c, secret, "chat", "nightly"))  # no variant's name is told to a key that may not
        assert (await ask(c, secret, "chat")).status_code == 200  # without the header: its sticky variant

        r = await c.patch(f"/admin/keys/{key_id}", json={"may_pick_variant": True})
        assert r.status_code == 200 and r.json()["may_pick_variant"] is True, r.text
        listed = (await c.get("/admin/keys", params={"team_id": gateway["team"]})).json()["data"]
        assert [k["may_pick_variant"] for k in listed] == [True]
        for variant in ("canary", "stable"):
            r = await ask(c, secret, "chat", variant)
            assert r.status_code == 200, r.text
            event = await asyncio.to_thread(the_event, gateway["events"], r.headers["x-request-id"])
            assert event["variant"] == variant and event["variant_steered"] is True, event
        r = await ask(c, secret, "chat", "nightly")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_variant", r.text

        r = await c.patch(f"/admin/keys/{key_id}", json={"may_pick_variant": False})
        assert r.status_code == 200 and r.json()["may_pick_variant"] is False
        assert_refused(await ask(c, secret, "chat", "canary"))  # withdrawn: at once on the replica that took it

        r = await c.post(f"/admin/teams/{gateway['team']}/keys", json={"name": "tester", "may_pick_variant": True})
        assert r.status_code == 201 and r.json()["may_pick_variant"] is True
        assert (await ask(c, r.json()["secret"], "chat", "canary")).status_code == 200

        admin_id = (await c.post("/admin/keys", json={"name": "ops"})).json()["id"]
        for r in (
            await c.patch(f"/admin/keys/{admin_id}", json={"may_pick_variant": True}),
            await c.post("/admin/keys", json={"name": "ops2", "may_pick_variant": True}),
        ):
            assert r.status_code == 400 and r.json()["error"]["param"] == "may_pick_variant", r.text
        r = await c.patch("/admin/keys/key_nope", json={"may_pick_variant": True})
        assert r.status_code == 404 and r.json()["error"]["code"] == "key_not_found"


async def test_a_weight_0_variant_is_reached_by_header_only_with_the_permission_never_by_weight(gateway):
    async with httpx.AsyncClient(base_url=gateway["url"], headers=gateway["admin"], timeout=30) as c:
        keys = [
            (await c.post(f"/admin/teams/{gateway['team']}/keys", json={"name": n, "may_pick_variant": n == "ops"}))
            .json()["secret"]
            for n in ("app", "ops")
        ]  # fmt: skip
        plain, tester = keys
        assert_refused(await ask(c, plain, "chat-dark", "dark"))
        answers = [await ask(c, plain, "chat-dark", user=f"user-{i}") for i in range(60)]
        assert all(r.status_code == 200 for r in answers)
        r = await ask(c, tester, "chat-dark", "dark")
        assert r.status_code == 200, r.text
        dark = r.headers["x-request-id"]
    events = [
        await asyncio.to_thread(the_event, gateway["events"], rid)
        for rid in [r.headers["x-request-id"] for r in answers] + [dark]
    ]
    assert {e["variant"] for e in events[:-1]} == {"stable"}  # 60 subjects by weight: none on the dark variant
    assert events[-1]["variant"] == "dark" and events[-1]["model"] == "chat-v3"
