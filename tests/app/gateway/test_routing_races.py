"""Racing admin writes to the routing table, from two gateway replicas on one PostgreSQL store: 200 random
interleavings of deleting pool x, pointing an alias at it, adding a member to it and replacing it. Every write
succeeds or is refused for what it would break (409; 404 for a member added to a pool deleted first), the stored
table stays whole after every round, an unrelated change never gets a 409, and both replicas, and a third started
afterwards, serve the stored table."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import httpx
import orjson
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.store import pg_schema_url
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig, routes_error
from tokenweir.gateway.runtime.routing_sync import compose, pool_body
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store

ROUNDS = 200
POLL_S = 0.05


def _json(value) -> object:
    return orjson.loads(orjson.dumps(value))


async def _served(client: httpx.AsyncClient) -> tuple[set[int], dict, dict]:
    """The routing versions a replica served these two reads from (one, unless it applied a table between them),
    its pools and its aliases, as written."""
    pools = (await client.get("/admin/pools")).json()["data"]
    aliases = (await client.get("/admin/aliases")).json()["data"]
    versions = {p["routing_version"] for p in pools} | {a["routing_version"] for a in aliases}
    return versions, {p["model"]: p["config"] for p in pools}, {a["model"]: a["config"] for a in aliases}


def _stored(store: Store, config: GatewayConfig) -> tuple[int, dict, dict, str | None]:
    version, entries = store.routing_entries()
    table = compose(config.pools, config.aliases, entries)
    pools = {p.model: _json(pool_body(p)) for p in table.pools}
    aliases = {a.model: _json(dataclasses.asdict(a)) for a in table.declared}
    return version, pools, aliases, routes_error(table.pools, table.aliases)


async def _serves_the_store(clients: list[httpx.AsyncClient], store: Store, config: GatewayConfig) -> None:
    """Every replica serves the stored table, version included, within a few poll intervals."""
    version, pools, aliases, error = _stored(store, config)
    assert error is None, error
    deadline = time.monotonic() + 20 * POLL_S + 2
    for client in clients:
        while (served := await _served(client)) != ({version}, pools, aliases):
            assert time.monotonic() < deadline, f"{client.base_url} serves {served}, the store {version}"
            await asyncio.sleep(POLL_S)


@pytest.fixture
def upstream():
    with ServerThread(FakeUpstream(model="m")) as u:
        yield u.url


def _config(tmp_path, name: str, url: str, upstream: str) -> GatewayConfig:
    return GatewayConfig(
        port=0,
        store_url=url,
        pools=[
            PoolConfig("base", [UpstreamConfig(upstream, name="b0", model="m")]),
            PoolConfig("other", [UpstreamConfig(upstream, name="o0", model="m")]),
        ],
        events=EventsConfig(path=str(tmp_path / f"events-{name}.jsonl"), flush_interval_s=0.05),
        routing_poll_interval_s=POLL_S,
    )


async def test_racing_admin_writes_from_two_replicas_keep_one_whole_table(tmp_path, upstream):
    rng = random.Random(1234)
    with pg_schema_url() as url:
        stores = [Store.open(url) for _ in range(3)]
        configs = [_config(tmp_path, n, url, upstream) for n in "abc"]
        admin, _ = stores[0].create_key(None, "admin", is_admin=True)
        headers = {"authorization": f"Bearer {admin}"}
        x_pool = {"model": "x", "upstreams": [{"base_url": upstream, "name": "x0", "model": "m"}]}
        alias = {"model": "al", "variants": [{"pool": "x", "weight": 1, "name": "one"}]}
        with (
            serve_app(configs[0], store=stores[0], state_backend=InMemoryState()) as a,
            serve_app(configs[1], store=stores[1], state_backend=InMemoryState()) as b,
        ):
            replicas = [httpx.AsyncClient(base_url=s.url, headers=headers, timeout=30) for s in (a, b)]
            assert (await replicas[0].put("/admin/pools/x", json=x_pool)).status_code == 200

            async def write(i: int, op: str) -> tuple[str, int, str]:
                client = rng.choice(replicas)
                await asyncio.sleep(rng.random() * 0.004)
                if op == "delete_pool":
                    r = await client.delete("/admin/pools/x")
                elif op == "add_alias":
                    r = await client.put("/admin/aliases/al", json=alias)
                elif op == "add_member":
                    r = await client.post("/admin/pools/x/members", json={"base_url": upstream, "name": f"r{i}"})
                else:  # change the pool: replace it whole
                    r = await client.put("/admin/pools/x", json={**x_pool, "capacity": rng.randint(1, 64)})
                code = r.json()["error"]["code"] if r.status_code >= 400 else ""
                return op, r.status_code, code

            allowed = {
                ("delete_pool", 200, ""), ("delete_pool", 409, "routing_conflict"),
                ("add_alias", 200, ""), ("add_alias", 409, "routing_conflict"),
                ("add_member", 201, ""), ("add_member", 404, "pool_not_found"),
                ("change_pool", 200, ""),
            }  # fmt: skip
            seen = set()
            try:
                for i in range(ROUNDS):
                    ops = rng.sample(["delete_pool", "add_alias", "add_member", "change_pool"], k=rng.randint(2, 4))
                    results = await asyncio.gather(*(write(i, op) for op in ops))
                    *_, error = await asyncio.to_thread(_stored, stores[2], configs[0])
                    assert error is None, f"round {i}: {results} left the stored table broken: {error}"
                    assert set(results) <= allowed, results
                    seen |= set(results)
                    # an unrelated change, and putting the round's names back: never a 409
                    r = await rng.choice(replicas).put(
                        "/admin/pools/other", json={"model": "other", "capacity": i + 1, "upstreams": []}
                    )
                    assert r.status_code == 200, f"round {i}: {r.text}"
                    r = await rng.choice(replicas).delete("/admin/aliases/al")
                    assert r.status_code in (200, 404), f"round {i}: {r.text}"
                    assert (await rng.choice(replicas).put("/admin/pools/x", json=x_pool)).status_code == 200
                    if i % 50 == 49:
                        await _serves_the_store(replicas, stores[2], configs[0])
                conflicts = {("delete_pool", 409, "routing_conflict"), ("add_alias", 409, "routing_conflict")}
                assert conflicts <= seen  # the races happened: each side lost some
                r = await replicas[1].put("/admin/aliases/al", json=alias)  # the last state: the alias in place
                assert r.status_code == 200, r.text
                await _serves_the_store(replicas, stores[2], configs[0])
                with serve_app(configs[2], store=stores[2], state_backend=InMemoryState()) as c:
                    async with httpx.AsyncClient(base_url=c.url, headers=headers, timeout=30) as third:
                        await _serves_the_store([third], stores[2], configs[0])
                        assert "al" in (await _served(third))[2]  # the stored alias, not the config's table
            finally:
                for client in replicas:
                    await client.aclose()
        for s in stores:
            s.close()
