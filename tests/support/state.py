"""Shared by the state-backend tests: the real Redis's URL, a settable clock at a fixed date, a fresh key prefix on the
real Redis (`redis_prefix`), where a test's RedisStates live (`redis_at`: the real Redis or the session's Redis
Cluster), and the local clusters (tests/support/redis_cluster.py). Fixtures every test folder sees: tests/conftest.py
loads this module."""

import uuid
from datetime import UTC, datetime

import pytest

from tests.support.redis_cluster import redis_cluster, redis_cluster_proxied  # noqa: F401 - fixtures, seen everywhere
from tests.support.services import require_service

URL = "redis://127.0.0.1:6379/0"
NOW = datetime(2026, 5, 10, 12, 0, tzinfo=UTC).timestamp()


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def fresh_redis_prefix() -> str:
    """A key prefix no test has used, once the real Redis answers (fails under CI=true when it does not)."""
    import redis

    client = redis.Redis.from_url(URL)
    try:
        client.ping()
    except redis.RedisError as err:
        require_service("redis", f"{URL}: {err}")
    finally:
        client.close()
    return f"twtest-{uuid.uuid4().hex[:12]}"


def drop_redis_prefix(prefix: str) -> None:
    """Delete the keys under a prefix this test made (never any other)."""
    import redis

    client = redis.Redis.from_url(URL)
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def redis_client():
    """A client of the real Redis (fails under CI=true when it does not answer)."""
    import redis

    client = redis.Redis.from_url(URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError as e:
        require_service("redis", f"{URL}: {e}")
    yield client
    client.close()


@pytest.fixture
def redis_prefix():
    """A fresh key prefix on the real Redis, its keys deleted afterwards."""
    name = fresh_redis_prefix()
    yield name
    drop_redis_prefix(name)


class RedisAt:
    """Makes RedisStates on one fresh prefix of the real Redis or of the session's Redis Cluster: `redis_at(**kw)`
    (RedisState's keywords; the test closes them), `redis_at.unreachable(**kw)` one whose server nothing answers."""

    def __init__(self, url: str, prefix: str, cluster: bool) -> None:
        self.url, self.prefix, self.cluster = url, prefix, cluster

    def __call__(self, **kw):
        from tokenweir.gateway.state.redis import RedisState

        return RedisState(self.url, **{"prefix": self.prefix, "cluster": self.cluster, **kw})

    def unreachable(self, **kw):
        from tokenweir.gateway.state.redis import RedisState

        return RedisState("redis://127.0.0.1:1/0", cluster=self.cluster, **kw)  # nothing listens on port 1


def redis_at_param(request, name: str) -> RedisAt:
    """`name` "redis" (a fresh prefix of the real Redis, dropped afterwards) or "cluster" (of the session's cluster,
    which goes with it)."""
    if name == "cluster":
        return RedisAt(request.getfixturevalue("redis_cluster").url, f"twtest-{uuid.uuid4().hex[:12]}", True)
    return RedisAt(URL, request.getfixturevalue("redis_prefix"), False)


@pytest.fixture(params=["redis", "cluster"])
def redis_at(request) -> RedisAt:
    """Where this test's RedisStates live: the real Redis, then the session's Redis Cluster."""
    return redis_at_param(request, request.param)


@pytest.fixture(params=["memory", "redis", "cluster"])
async def state_replicas(request):
    """(a, b): two handles on one state backend, as two gateway replicas see it: the same InMemoryState twice, or two
    RedisStates on one fresh prefix of the real Redis or of the session's Redis Cluster (closed afterwards)."""
    from tokenweir.gateway.state.memory import InMemoryState

    if request.param == "memory":
        state = InMemoryState()
        yield state, state
        return
    at = redis_at_param(request, request.param)
    states = [at() for _ in range(2)]
    yield states[0], states[1]
    for s in states:
        await s.close()
