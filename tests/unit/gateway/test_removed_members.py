"""A member that leaves its pool's routing table takes nothing new, whatever table a request routes by: the route plan
of a request admitted under an older table holds the members its pools have now (a removed one gone, a changed one as
the new instance), while a pool removed whole still serves the requests admitted under it."""

from __future__ import annotations

import time

from tokenweir.gateway.config import GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.upstream.pools import Upstreams


def _pool(model: str, *names: str, **kw) -> PoolConfig:
    return PoolConfig(model, [UpstreamConfig(f"http://{n}:1", name=n, engine=False) for n in names], **kw)


def _names(up: Upstreams, model: str, routes) -> list[str]:
    return [h.label for h in up.route(model, routes=routes)[0]]


def test_a_removed_member_is_in_no_plan_made_by_an_older_table():
    up = Upstreams(GatewayConfig(pools=[_pool("a", "a0", "a1", fallbacks=["b"]), _pool("b", "b0", "b1")]))
    admitted = up.routes
    a0, b1 = up.pools["a"].member("a0"), up.pools["b"].member("b1")
    assert a0 is not None and b1 is not None
    up.apply([_pool("a", "a1", fallbacks=["b"]), _pool("b", "b0")], [], version=1)
    assert a0.removed and b1.removed and not a0.available(time.monotonic())
    assert _names(up, "a", admitted) == ["a@a1", "b@b0"]  # the fallback pool's members are its current ones too


def test_a_member_whose_settings_changed_is_routed_as_its_new_instance():
    up = Upstreams(GatewayConfig(pools=[_pool("a", "a0")]))
    admitted, old = up.routes, up.pools["a"].member("a0")
    moved = PoolConfig("a", [UpstreamConfig("http://elsewhere:2", name="a0", engine=False)])
    up.apply([moved], [], version=1)
    assert old is not None and old.removed
    (hop,) = up.route("a", routes=admitted)[0]
    assert hop.instance is up.pools["a"].member("a0") and hop.instance.cfg.base_url == "http://elsewhere:2"


def test_a_pool_removed_whole_still_serves_what_was_admitted_under_it():
    up = Upstreams(GatewayConfig(pools=[_pool("a", "a0"), _pool("b", "b0")]))
    admitted = up.routes
    up.apply([_pool("a", "a0")], [], version=1)
    b0 = admitted.pools["b"].member("b0")
    assert b0 is not None and not b0.removed
    assert _names(up, "b", admitted) == ["b@b0"]
