"""Members found by DNS: the pure expansion into one member per address, the addresses kept between resolutions
(joining, draining, leaving, a failed lookup keeping what was known), a discovered instance that takes no request
until it answers a poll, and a runtime pool's discovered member following its addresses."""

from __future__ import annotations

import asyncio
import time

import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread
from tokenweir.gateway.config import DiscoveryConfig, GatewayConfig, PoolConfig, UpstreamConfig, load_config
from tokenweir.gateway.runtime.routing_sync import RoutingSync, pool_body
from tokenweir.gateway.store.store import Store
from tokenweir.gateway.upstream.client import UpstreamClient
from tokenweir.gateway.upstream.discovery import Addresses, Discovery, at_address, expand
from tokenweir.gateway.upstream.pools import Hop, Upstreams

URL = "http://engines.ns.svc.cluster.local:8100/v1"


def _pools(*members: UpstreamConfig) -> list[PoolConfig]:
    return [PoolConfig("m", list(members)), PoolConfig("other", [UpstreamConfig("http://fixed:1", name="f")])]


def test_a_discovered_member_becomes_one_member_per_address_named_by_it():
    pools = _pools(UpstreamConfig(URL, name="engine", discover=True, api_key="k"), UpstreamConfig("http://x:2"))
    found = {"engines.ns.svc.cluster.local": Addresses(("10.0.0.9", "10.0.0.10"), ("fd00::1",))}
    out = expand(pools, found)
    members = out[0].upstreams
    assert [u.name for u in members] == ["engine-10.0.0.9", "engine-10.0.0.10", "engine-fd00::1", "m-1"]
    assert [u.base_url for u in members[:3]] == [
        "http://10.0.0.9:8100",
        "http://10.0.0.10:8100",
        "http://[fd00::1]:8100",
    ]
    assert [u.draining for u in members] == [False, False, True, False]  # a leaving address drains
    assert all(u.api_key == "k" and u.discover for u in members[:3])
    assert out[1] is pools[1]  # a pool without discovered members is left as it is
    assert expand(pools, found) == out  # pure: the same inputs, equal pools (Upstreams.apply keeps their state)


def test_tenants_errors_name_a_discovered_instance_without_its_address():
    pools = _pools(UpstreamConfig(URL, name="my-engine", discover=True), UpstreamConfig("http://x:2", name="e-1"))
    found = {"engines.ns.svc.cluster.local": Addresses(("10.0.0.9", "fd00::1"))}
    upstreams = Upstreams(GatewayConfig(pools=expand(pools, found)))
    hops = {h.label: h.public_label for h in upstreams.plan("m")} | {
        f"m@{i.name}": Hop("m", i).public_label for i in upstreams.pools["m"].instances
    }
    assert hops == {"m@my-engine-10.0.0.9": "m@my-engine", "m@my-engine-fd00::1": "m@my-engine", "m@e-1": "m@e-1"}


def test_a_name_not_resolved_yet_stays_as_written_and_a_drained_member_drains_every_address():
    member = UpstreamConfig(URL, name="engine", discover=True, draining=True)
    pools = _pools(member)
    assert expand(pools, {}) == pools
    out = expand(pools, {"engines.ns.svc.cluster.local": Addresses(("10.0.0.1",))})
    assert [(u.name, u.draining) for u in out[0].upstreams] == [("engine-10.0.0.1", True)]
    plain = _pools(UpstreamConfig(URL, name="engine"))  # not marked discover: never expanded
    assert expand(plain, {"engines.ns.svc.cluster.local": Addresses(("10.0.0.1",))}) == plain


def test_an_address_whose_name_another_member_has_is_left_out():
    pools = _pools(UpstreamConfig(URL, name="e", discover=True), UpstreamConfig("http://y:1", name="e-10.0.0.1"))
    out = expand(pools, {"engines.ns.svc.cluster.local": Addresses(("10.0.0.1", "10.0.0.2"))})
    assert [u.name for u in out[0].upstreams] == ["e-10.0.0.2", "e-10.0.0.1"]
    assert out[0].upstreams[1].base_url == "http://y:1"


def test_at_address_keeps_scheme_port_and_path():
    assert at_address("https://svc.example:8443/api", "10.1.2.3") == "https://10.1.2.3:8443/api"
    assert at_address("http://svc.example", "::1") == "http://[::1]"


class FakeDNS:
    def __init__(self) -> None:
        self.answers: dict[str, list[str] | Exception] = {}
        self.asked: list[str] = []

    async def __call__(self, name: str) -> list[str]:
        self.asked.append(name)
        answer = self.answers.get(name, OSError("NXDOMAIN"))
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


async def test_addresses_join_vanish_drain_and_leave_and_a_failed_lookup_keeps_them():
    dns, now = FakeDNS(), [100.0]
    disc = Discovery(DiscoveryConfig(drain_s=30), resolve=dns, clock=lambda: now[0])
    pools = _pools(UpstreamConfig(URL, name="engine", discover=True))
    host = "engines.ns.svc.cluster.local"
    assert not await disc.refresh(pools) and disc.found == {}  # never resolved: the member stays at its name
    dns.answers[host] = ["10.0.0.2", "10.0.0.1", "10.0.0.1"]
    assert await disc.refresh(pools) and disc.found[host] == Addresses(("10.0.0.1", "10.0.0.2"))
    assert not await disc.refresh(pools)  # the same answer: nothing to apply again
    dns.answers[host] = OSError("SERVFAIL")
    assert not await disc.refresh(pools) and disc.found[host].live == ("10.0.0.1", "10.0.0.2")
    dns.answers[host] = []  # an answer with no address: a hiccup too, never an empty pool
    assert not await disc.refresh(pools) and disc.found[host].live == ("10.0.0.1", "10.0.0.2")
    dns.answers[host] = ["10.0.0.2", "10.0.0.3"]
    now[0] += 1
    assert await disc.refresh(pools)
    assert disc.found[host] == Addresses(("10.0.0.2", "10.0.0.3"), ("10.0.0.1",))
    now[0] += 29
    assert not await disc.refresh(pools)  # still draining
    now[0] += 1
    assert await disc.refresh(pools) and disc.found[host] == Addresses(("10.0.0.2", "10.0.0.3"))  # gone
    dns.answers[host] = ["10.0.0.3"]
    await disc.refresh(pools)
    dns.answers[host] = ["10.0.0.2", "10.0.0.3"]  # back within its drain time: live again, not draining
    assert await disc.refresh(pools) and disc.found[host] == Addresses(("10.0.0.2", "10.0.0.3"))
    assert set(dns.asked) == {host}
    await disc.refresh(_pools())
    assert disc.found == {}  # no discovered member left: nothing kept


async def test_a_slow_resolver_is_a_failed_lookup():
    async def hangs(name: str) -> list[str]:
        await asyncio.sleep(10)
        return ["10.0.0.1"]

    disc = Discovery(DiscoveryConfig(timeout_s=0.05), resolve=hangs)
    started = time.monotonic()
    assert not await disc.refresh(_pools(UpstreamConfig(URL, discover=True)))
    assert time.monotonic() - started < 1


def test_the_discovery_section_is_read_strictly():
    cfg = load_config(env={"TOKENWEIR_DISCOVERY": '{"interval_s": 2, "nameservers": ["127.0.0.1:5353", "[::1]:53"]}'})
    assert cfg.discovery.nameserver_addresses() == [("127.0.0.1", 5353), ("::1", 53)]
    assert DiscoveryConfig(nameservers=["10.0.0.10", "::1"]).nameserver_addresses() == [("10.0.0.10", 53), ("::1", 53)]
    for bad in ("dns.example:53", "10.0.0.1:0", "[::1]x", "10.0.0.1:port"):
        with pytest.raises(ValueError, match="discovery.nameservers"):
            DiscoveryConfig(nameservers=[bad])
    with pytest.raises(ValueError, match="interval_s"):
        DiscoveryConfig(interval_s=0)
    with pytest.raises(ValueError, match="unknown config key"):
        load_config(env={"TOKENWEIR_DISCOVERY": '{"interval": 2}'})


async def test_a_discovered_instance_takes_requests_once_it_answers_a_poll():
    fake = FakeUpstream(model="m")
    with ServerThread(fake) as engine, ServerThread(FakeUpstream(model="x")) as external:
        members = [
            UpstreamConfig(engine.url, name="engine", discover=True),
            UpstreamConfig(external.url, name="api", engine=False, discover=True),
            UpstreamConfig("http://127.0.0.1:9", name="nobody", discover=True),
        ]
        up = Upstreams(GatewayConfig(pools=[PoolConfig("m", members)]))
        assert up.plan("m") == []  # none answered yet: no request goes to a pod that is not ready
        assert {i.name: i.circuit for i in up.pools["m"].instances} == {"engine": 1, "api": 1, "nobody": 1}
        client = UpstreamClient()
        up.start(client)
        try:
            await up.poll_pending()  # /load for the engine, /health for the other
        finally:
            await up.close()
            await client.aclose()
        assert sorted(h.instance.name for h in up.plan("m")) == ["api", "engine"]
        plain = Upstreams(GatewayConfig(pools=[PoolConfig("m", [UpstreamConfig(engine.url, name="e")])]))
        assert [h.instance.name for h in plain.plan("m")] == ["e"]  # a member as written routes at once, as before


async def test_discovered_members_of_a_runtime_pool_expand_and_follow_their_addresses(tmp_path):
    dns = FakeDNS()
    seed = [PoolConfig("m", [UpstreamConfig("http://seed:1", name="s", engine=False)])]
    up = Upstreams(GatewayConfig(pools=seed))
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    try:
        sync = RoutingSync(up, store, seed, [], Discovery(DiscoveryConfig(drain_s=0), resolve=dns))
        stored = PoolConfig("k8s", [UpstreamConfig("http://svc.test:8100", name="e", engine=False, discover=True)])
        store.put_routing("pool", "k8s", pool_body(stored))  # as the admin API writes it
        assert await sync.refresh()
        assert [i.name for i in up.pools["k8s"].instances] == ["e"]  # not resolved yet: at its name
        dns.answers["svc.test"] = ["10.0.0.1", "10.0.0.2"]
        await sync.rediscover()
        assert [i.name for i in up.pools["k8s"].instances] == ["e-10.0.0.1", "e-10.0.0.2"]
        kept = up.pools["k8s"].member("e-10.0.0.2")
        store.put_routing("pool", "other", pool_body(PoolConfig("other")))  # another change: the expansion stays
        assert await sync.refresh()
        assert up.pools["k8s"].member("e-10.0.0.2") is kept and set(up.pools) == {"m", "k8s", "other"}
        up.pools["k8s"].index.record("e-10.0.0.1", [7, 8])  # what a prompt sent there left in its cache
        dns.answers["svc.test"] = ["10.0.0.2", "10.0.0.3"]
        await sync.rediscover()  # re-applies the last composed table with the new addresses
        assert [i.name for i in up.pools["k8s"].instances] == ["e-10.0.0.2", "e-10.0.0.3"]
        assert up.pools["k8s"].index.match([7, 8]) == {}  # a pod that gets the address later starts with nothing
        assert up.pools["k8s"].member("e-10.0.0.2") is kept and set(up.pools) == {"m", "k8s", "other"}
        assert up.routes.version == store.routing_version()
        assert [u.name for u in sync.declared_pool("k8s").upstreams] == ["e"]  # what the admin API shows as config
    finally:
        store.close()
