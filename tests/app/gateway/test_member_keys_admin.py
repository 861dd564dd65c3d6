"""The admin API cannot make the gateway send its own secrets anywhere, through real HTTP: a member whose api_key_env
names the gateway's admin key is refused (400, nothing is ever sent to its address), while a TOKENWEIR_MEMBER_KEY_*
variable and one the config lists in api_key_envs are members' keys, sent to the member on every call."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.stack import team
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store

ADMIN_SECRET = "tw-admin-secret-never-sent"
LISTED = "TW_TEST_LISTED_MEMBER_KEY"  # an ordinary variable the config lists in api_key_envs


class Recorder:
    """An upstream (the fake engine) that keeps the Authorization header of every call it gets."""

    def __init__(self) -> None:
        self.fake = FakeUpstream(model="m")
        self.authorizations: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.authorizations.append(dict(scope["headers"]).get(b"authorization", b"").decode())
        await self.fake(scope, receive, send)


@pytest.fixture
def stack(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENWEIR_ADMIN_KEY", ADMIN_SECRET)
    monkeypatch.setenv("TOKENWEIR_MEMBER_KEY_REC", "k-member")
    monkeypatch.setenv(LISTED, "k-listed")
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    primary, recorder = FakeUpstream(model="m"), Recorder()
    with ServerThread(primary) as p, ServerThread(recorder) as rec:
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig("m", [UpstreamConfig(p.url, name="u0", model="m")])],
            events=EventsConfig(path=str(tmp_path / "events.jsonl"), flush_interval_s=0.05),
            routing_poll_interval_s=0.1,
            load_poll_interval_s=0.1,
            api_key_envs=[LISTED],
        )
        with serve_app(config, store=store, state_backend=InMemoryState()) as gw:
            admin, _ = store.create_key(None, "admin", is_admin=True)
            yield {"store": store, "url": gw.url, "recorder": rec.url, "seen": recorder.authorizations,
                   "admin": {"authorization": f"Bearer {admin}"}}  # fmt: skip
    store.close()


def refused(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "api_key_env"), error
    assert "TOKENWEIR_MEMBER_KEY_<NAME>" in error["message"] and "api_key_envs" in error["message"], error


async def test_a_member_named_after_the_admin_key_is_refused_and_nothing_is_sent(stack):
    member = {"base_url": stack["recorder"], "name": "rec", "model": "m", "api_key_env": "TOKENWEIR_ADMIN_KEY"}
    async with httpx.AsyncClient(base_url=stack["url"], headers=stack["admin"], timeout=30) as admin:
        refused(await admin.post("/admin/pools/m/members", json=member))
        refused(await admin.put("/admin/pools/leak", json={"model": "leak", "upstreams": [member]}))
        refused(await admin.patch("/admin/pools/m/members/u0", json={"api_key_env": "TOKENWEIR_ADMIN_KEY"}))
        pools = (await admin.get("/admin/pools")).json()["data"]
    assert [(p["model"], [m["name"] for m in p["members"]]) for p in pools] == [("m", ["u0"])]
    _, secret = team(stack)
    async with httpx.AsyncClient(base_url=stack["url"], headers={"authorization": f"Bearer {secret}"}) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200, r.text
    await asyncio.sleep(0.5)  # past several routing and /load polls
    assert stack["seen"] == []  # the recorder's address was never called, with any key


async def test_a_member_key_variable_and_a_listed_one_are_sent_to_the_member(stack):
    member = {"base_url": stack["recorder"], "name": "rec", "model": "m", "api_key_env": "TOKENWEIR_MEMBER_KEY_REC"}
    _, secret = team(stack)
    async with (
        httpx.AsyncClient(base_url=stack["url"], headers=stack["admin"], timeout=30) as admin,
        httpx.AsyncClient(base_url=stack["url"], headers={"authorization": f"Bearer {secret}"}, timeout=30) as c,
    ):
        r = await admin.put("/admin/pools/keyed", json={"model": "keyed", "upstreams": [member]})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json={"model": "keyed", "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert "Bearer k-member" in stack["seen"]
        r = await admin.patch("/admin/pools/keyed/members/rec", json={"api_key_env": LISTED})
        assert r.status_code == 200, r.text
        stack["seen"].clear()
        r = await c.post("/v1/completions", json={"model": "keyed", "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200, r.text
        refused(await admin.patch("/admin/pools/keyed/members/rec", json={"api_key_env": "TOKENWEIR_ADMIN_KEY"}))
        await asyncio.sleep(0.3)  # /load polls with the member's key meanwhile
    assert stack["seen"] and set(stack["seen"]) == {"Bearer k-listed"}
    assert not any(ADMIN_SECRET in a for a in stack["seen"])
