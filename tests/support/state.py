"""Shared by the state-backend tests: the real Redis's URL, a settable clock at a fixed date, and a fresh key prefix
on the real Redis (`redis_prefix`, a fixture every test folder sees: tests/conftest.py loads this module)."""

import uuid
from datetime import UTC, datetime

import pytest

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
def redis_prefix():
    """A fresh key prefix on the real Redis, its keys deleted afterwards."""
    name = fresh_redis_prefix()
    yield name
    drop_redis_prefix(name)


@pytest.fixture(params=["memory", "redis"])
async def state_replicas(request):
    """(a, b): two handles on one state backend, as two gateway replicas see it: the same InMemoryState twice, or two
    RedisStates on one fresh prefix of the real Redis (closed afterwards)."""
    from tokenweir.gateway.state.memory import InMemoryState
    from tokenweir.gateway.state.redis import RedisState

    if request.param == "memory":
        state = InMemoryState()
        yield state, state
        return
    prefix = request.getfixturevalue("redis_prefix")
    states = [RedisState(URL, prefix=prefix) for _ in range(2)]
    yield states[0], states[1]
    for s in states:
        await s.close()
