"""Where the upstreams live is the operator's business: a tenant's 503 names the pool and the instance's name, never its
address (that goes to the request's event and the log); the anonymous /health says ok/down per pool, and only an
admin key sees the instances, their addresses and loads."""

from __future__ import annotations

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.support.events import the_event
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.config import BreakerConfig, EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

PROMPT = [1, 2, 3]
ADDRESS_MARKS = ("127.0.0.1", "http://", "localhost")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("privacy")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    team = store.create_team("tenant", TeamLimits())
    tenant, _ = store.create_key(team.id, "tenant")
    admin, _ = store.create_key(None, "ops", is_admin=True)
    dead_port = free_port()  # nothing listens there: connection refused
    with ServerThread(FakeUpstream(model="m")) as up, ServerThread(FakeUpstream(model="m", down=True)) as sick:
        config = GatewayConfig(
            port=0,
            pools=[
                # unnamed on purpose: the default name must not be the address
                PoolConfig(model="dead", upstreams=[UpstreamConfig(f"http://127.0.0.1:{dead_port}", engine=False)]),
                PoolConfig(model="sick", upstreams=[UpstreamConfig(sick.url, engine=False)]),
                PoolConfig(model="ok", upstreams=[UpstreamConfig(up.url, engine=False)]),
            ],
            breaker=BreakerConfig(failures=100, cooldown_s=60),
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
        )
        with serve_app(config, store=store) as gw:
            yield {
                "url": gw.url,
                "tenant": {"authorization": f"Bearer {tenant}"},
                "admin": {"authorization": f"Bearer {admin}"},
                "events": tmp / "events.jsonl",
                "dead_port": dead_port,
                "sick_url": sick.url,
            }
    store.close()


def assert_no_address(text: str, *ports: int) -> None:
    for mark in (*ADDRESS_MARKS, *(f":{p}" for p in ports)):
        assert mark not in text, f"{mark!r} leaked: {text}"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tenants_503_names_pool_and_instance_but_no_address(stack, stream):
    body = {"model": "dead", "prompt": PROMPT, "max_tokens": 1, "stream": stream}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers=stack["tenant"], timeout=10)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "upstream_unavailable" and "dead@dead-0" in err["message"], err
    assert "connection failed" in err["message"]
    assert_no_address(r.text, stack["dead_port"])
    event = the_event(stack["events"], r.headers["x-request-id"])
    assert event["route"] == ["dead@dead-0"] and event["reason"] == "upstream_unavailable"
    # the operator's record keeps the whole story: the address and the socket error
    assert f"127.0.0.1:{stack['dead_port']}" in event["upstream_error"], event
    assert "cannot connect" in event["upstream_error"]


def test_an_upstream_5xx_reaches_the_tenant_as_pool_instance_and_status_only(stack):
    body = {"model": "sick", "prompt": PROMPT, "max_tokens": 1}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers=stack["tenant"], timeout=10)
    assert r.status_code == 503 and "sick@sick-0: HTTP 503" in r.json()["error"]["message"], r.text
    assert_no_address(r.text, int(stack["sick_url"].rsplit(":", 1)[1]))
    assert stack["sick_url"] in the_event(stack["events"], r.headers["x-request-id"])["upstream_error"]


def test_anonymous_health_says_up_or_down_per_pool_without_instances(stack):
    for headers in ({}, stack["tenant"]):  # a tenant's key sees what anyone sees
        r = httpx.get(stack["url"] + "/health", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["checks"]["pool:ok"] == "ok" and set(body) == {"status", "checks"}, body
        assert_no_address(r.text, stack["dead_port"])
        assert "dead-0" not in r.text and "in_flight" not in r.text


def test_admin_health_lists_each_instance_with_its_address(stack):
    r = httpx.get(stack["url"] + "/health", headers=stack["admin"], timeout=10)
    assert r.status_code == 200, r.text
    (dead,) = r.json()["pools"]["dead"]
    assert dead["instance"] == "dead-0" and dead["base_url"] == f"http://127.0.0.1:{stack['dead_port']}"
    assert {"circuit", "down", "in_flight"} <= set(dead)
    bad = httpx.get(stack["url"] + "/health", headers={"authorization": "Bearer tw-" + "x" * 43}, timeout=10)
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"


def test_unnamed_pool_members_are_named_by_position_and_names_differ():
    pool = PoolConfig(model="m", upstreams=[UpstreamConfig("http://10.0.0.7:8100"), UpstreamConfig("http://h:1")])
    assert [u.name for u in pool.upstreams] == ["m-0", "m-1"]
    with pytest.raises(ValueError, match="names must differ"):
        PoolConfig(model="m", upstreams=[UpstreamConfig("http://a", name="x"), UpstreamConfig("http://b", name="x")])
    assert "s3cret" not in repr(UpstreamConfig("http://a", api_key="s3cret")), "a key never lands in a log by repr"
