"""Gateway test fixtures: a fresh key prefix on the real Redis (fails under CI=true when Redis is down)."""

import uuid

import pytest

from tests.conftest import require_service
from tests.gateway.state_support import URL


@pytest.fixture
def redis_prefix():
    """A fresh key prefix on the real Redis, its keys deleted afterwards."""
    import redis

    client = redis.Redis.from_url(URL)
    try:
        client.ping()
    except redis.RedisError as err:
        require_service("redis", f"{URL}: {err}")
    name = f"twtest-{uuid.uuid4().hex[:12]}"
    yield name
    keys = list(client.scan_iter(f"{name}:*"))
    if keys:
        client.delete(*keys)
    client.close()
