"""The team a request belongs to reaches our engine as its fairness id (the engine shares its tokens between teams),
set by the gateway alone: a client's own header is not passed on, and an upstream that is not our engine is not told
who our tenants are."""

from __future__ import annotations

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fairness_id")
    store = Store.open(f"sqlite:///{tmp}/store.db")
    team = store.create_team("tenant", TeamLimits())
    key, _ = store.create_key(team.id, "tenant")
    ours, theirs = FakeUpstream(model="m"), FakeUpstream(model="m")
    with ServerThread(ours) as engine, ServerThread(theirs) as external:
        config = GatewayConfig(
            port=0,
            pools=[
                PoolConfig(model="ours", upstreams=[UpstreamConfig(engine.url, engine=True)]),
                PoolConfig(model="theirs", upstreams=[UpstreamConfig(external.url, engine=False)]),
                PoolConfig(model="fifo", upstreams=[UpstreamConfig(engine.url, engine=True)], fairness="fcfs"),
            ],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
        )
        with serve_app(config, store=store) as gw:
            yield {"url": gw.url, "team": team.id, "key": key, "engine": ours, "external": theirs}
    store.close()


@pytest.mark.parametrize("stream", [False, True])
def test_our_engine_hears_the_team_and_never_the_clients_claim(stack, stream):
    headers = {"authorization": f"Bearer {stack['key']}", "x-gateway-inference-fairness-id": "someone-else"}
    body = {"model": "ours", "prompt": [1, 2, 3], "max_tokens": 2, "stream": stream}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert stack["engine"].fairness_ids[-1] == stack["team"]


def test_an_external_upstream_is_not_told_the_team(stack):
    headers = {"authorization": f"Bearer {stack['key']}", "x-gateway-inference-fairness-id": "someone-else"}
    body = {"model": "theirs", "prompt": [1, 2, 3], "max_tokens": 2}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert stack["external"].fairness_ids[-1] is None


def test_a_pool_not_fair_by_tokens_leaves_its_engines_as_they_were(stack):
    body = {"model": "fifo", "prompt": [1, 2, 3], "max_tokens": 2}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, headers={"authorization": f"Bearer {stack['key']}"})
    assert r.status_code == 200, r.text
    assert stack["engine"].fairness_ids[-1] is None
