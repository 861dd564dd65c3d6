"""Runtime routing tables: the seed overlaid by stored entries, applied keeping what did not change, draining."""

from __future__ import annotations

import time
from dataclasses import replace

from tokenweir.gateway.config import (
    AliasConfig,
    GatewayConfig,
    PoolConfig,
    RolloutConfig,
    UpstreamConfig,
    VariantConfig,
)
from tokenweir.gateway.runtime.routing_sync import alias_body, compose, effective_alias, pool_body, pool_from_body
from tokenweir.gateway.store.routing import RoutingEntry
from tokenweir.gateway.upstream.pools import Upstreams
from tokenweir.policies.canary import ROLLED_BACK, RolloutState


def _pool(model: str, *names: str, **kw) -> PoolConfig:
    return PoolConfig(model, [UpstreamConfig(f"http://{n}:1", name=n, engine=False) for n in names], **kw)


def test_apply_keeps_unchanged_pools_and_members_and_a_request_keeps_its_table():
    up = Upstreams(GatewayConfig(pools=[_pool("a", "a0", "a1"), _pool("b", "b0")]))
    before = up.routes
    a0 = up.pools["a"].member("a0")
    assert a0 is not None
    a0.take(time.monotonic())  # a request in flight on it
    drained = _pool("a", "a0", "a1")
    drained.upstreams[0].draining = True
    up.apply([drained, _pool("b", "b0"), _pool("c", "c0")], [], version=3)
    assert up.routes.version == 3 and set(up.pools) == {"a", "b", "c"}
    assert up.pools["b"] is before.pools["b"]  # unchanged: the same pool, state and all
    assert up.pools["a"].member("a0") is a0 and a0.in_flight == 1  # draining kept its state ...
    assert not a0.available(time.monotonic())  # ... and takes no new request
    assert [h.instance.name for h in up.plan("a")] == ["a1"]
    up.apply([_pool("a", "a1"), _pool("c", "c0")], [], version=4)  # a0 removed, pool b removed
    assert "b" not in up.pools and [i.name for i in up.pools["a"].instances] == ["a1"]
    assert "b" in before.pools and before.pools["b"].member("b0") is not None  # the old table still serves its own
    a0.done(True, time.monotonic())  # the request on the removed member ends normally
    assert a0.in_flight == 0


def test_a_changed_member_is_a_new_instance_and_an_added_pool_routes():
    up = Upstreams(GatewayConfig(pools=[_pool("a", "a0")]))
    old = up.pools["a"].member("a0")
    moved = PoolConfig("a", [UpstreamConfig("http://elsewhere:2", name="a0", engine=False)])
    up.apply([moved, _pool("n", "n0")], [], 1)
    assert up.pools["a"].member("a0") is not old and up.plan("n")[0].instance.name == "n0"


def test_compose_overlays_removes_and_skips_a_bad_entry():
    seed = [_pool("a", "a0"), _pool("b", "b0")]
    entries = [
        RoutingEntry("pool", "a", pool_body(_pool("a", "x0", "x1")), 5, ""),
        RoutingEntry("pool", "b", None, 6, ""),
        RoutingEntry("pool", "c", {"model": "c", "capacity": -1}, 7, ""),  # invalid: skipped, logged
    ]
    composed = compose(seed, [], entries)
    assert [(p.model, [u.name for u in p.upstreams]) for p in composed.pools] == [("a", ["x0", "x1"])]
    assert composed.entry_versions == {("pool", "a"): 5, ("pool", "b"): 6, ("pool", "c"): 7}


def test_a_stored_pool_round_trips_and_a_member_keeps_the_seeds_key():
    seed = PoolConfig("a", [UpstreamConfig("http://e:1", name="e", api_key="secret")], capacity=3)
    body = pool_body(seed)
    assert "api_key" not in body["upstreams"][0]  # never stored
    assert pool_from_body(body) == replace(seed, upstreams=[replace(seed.upstreams[0], api_key=None)])
    composed = compose([seed], [], [RoutingEntry("pool", "a", body, 1, "")])
    assert composed.pools[0].upstreams[0].api_key == "secret"


def test_a_rollout_sets_the_variants_weights_from_its_state():
    alias = AliasConfig(
        "m",
        [VariantConfig("a", 1, "stable"), VariantConfig("b", 1, "canary")],
        rollout=RolloutConfig(canary="canary", baseline="stable", steps=[10, 60, 100]),
    )
    assert [v.weight for v in effective_alias(alias, None).variants] == [90.0, 10.0]
    assert [v.weight for v in effective_alias(alias, RolloutState(step=1)).variants] == [40.0, 60.0]
    back = RolloutState(step=1, status=ROLLED_BACK, reason="x")
    assert [v.weight for v in effective_alias(alias, back).variants] == [100.0, 0.0]
    composed = compose(
        [_pool("a", "a0"), _pool("b", "b0")], [], [RoutingEntry("alias", "m", alias_body(alias, back), 2, "")]
    )
    assert composed.rollouts["m"] == back and [v.weight for v in composed.aliases[0].variants] == [100.0, 0.0]
    assert composed.declared[0].variants[1].weight == 1  # as declared
