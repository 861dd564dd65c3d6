"""Authenticator on a real SQLite store: every 401/403 case, cache expiry bounds, single flight, FastAPI deps."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from fastapi import Depends, FastAPI

from tokenweir.common.http.errors import APIError, api_error_handler
from tokenweir.gateway.auth.authenticator import Authenticator, Principal
from tokenweir.gateway.deps.callers import require_admin, require_key
from tokenweir.gateway.deps.services import Services
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits


class CountingStore(Store):
    """A real store that counts key lookups, to see the cache and single flight at work."""

    lookups = 0

    def find_key(self, secret):
        self.lookups += 1
        time.sleep(0.01)  # a real database round trip is not instant; let concurrent misses overlap
        return super().find_key(secret)


@pytest.fixture
def store(tmp_path):
    s = CountingStore.open(f"sqlite:///{tmp_path}/auth.db")
    yield s
    s.close()


async def expect_error(auth: Authenticator, secret, status: int, code: str) -> str:
    with pytest.raises(APIError) as info:
        await auth.authenticate(secret)
    assert (info.value.status, info.value.code) == (status, code)
    return info.value.message


async def wait_for_error(auth: Authenticator, secret: str, code: str, limit_s: float = 2.0) -> float:
    """Seconds until `secret` is refused with `code`; fails past `limit_s`."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            await auth.authenticate(secret)
        except APIError as err:
            assert err.code == code
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    pytest.fail(f"key still accepted after {limit_s} s")


async def test_valid_team_and_admin_keys(store):
    team = store.create_team("alpha", TeamLimits(rpm=7))
    secret, key = store.create_key(team.id, "k")
    admin_secret, admin = store.create_key(None, "root", is_admin=True)
    auth = Authenticator(store)
    assert await auth.authenticate(secret) == Principal(key=key, team=team)
    assert await auth.authenticate(admin_secret) == Principal(key=admin, team=None)


async def test_each_refusal_says_why_without_leaking(store):
    team = store.create_team("alpha")
    secret, key = store.create_key(team.id, "k")
    auth = Authenticator(store)
    assert "didn't provide" in await expect_error(auth, None, 401, "invalid_api_key")
    assert "didn't provide" in await expect_error(auth, "", 401, "invalid_api_key")
    assert "Malformed" in await expect_error(auth, "sk-not-ours", 401, "invalid_api_key")
    # Long and random enough to be an operator's own admin secret (TOKENWEIR_ADMIN_KEY): looked up, then unknown.
    assert "Incorrect API key provided: tw-_****" in await expect_error(auth, "tw-_" + secret, 401, "invalid_api_key")
    unknown = "tw-" + "A" * 43
    message = await expect_error(auth, unknown, 401, "invalid_api_key")
    assert "Incorrect API key provided: tw-AAAA****" in message
    assert "A" * 10 not in message and key.id not in message and "alpha" not in message

    store.revoke_key(key.id)
    auth.invalidate()
    message = await expect_error(auth, secret, 401, "invalid_api_key")
    assert "revoked" in message and secret[7:] not in message


async def test_revoked_key_dies_within_two_seconds_through_cache(store):
    team = store.create_team("alpha")
    secret, key = store.create_key(team.id, "k")
    auth = Authenticator(store, cache_ttl_s=1.0)
    await auth.authenticate(secret)
    for _ in range(20):
        await auth.authenticate(secret)
    assert store.lookups == 1  # the cache served the rest
    # Revoke through another Store, as another replica's admin API would: no invalidation reaches this cache.
    other = Store.open(f"sqlite:///{store_path(store)}")
    other.revoke_key(key.id)
    other.close()
    assert await wait_for_error(auth, secret, "invalid_api_key") <= 1.5


async def test_expiry_is_exact_even_when_cached(store):
    team = store.create_team("alpha")
    expires = datetime.now(UTC) + timedelta(milliseconds=400)
    secret, _ = store.create_key(team.id, "k", expires_at=expires)
    auth = Authenticator(store, cache_ttl_s=1.0)
    await auth.authenticate(secret)
    await asyncio.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.05)
    message = await expect_error(auth, secret, 401, "invalid_api_key")
    assert "expired" in message and store.lookups == 1  # refused from the cached entry, no store read
    _, old = store.create_key(team.id, "old", expires_at="2020-01-01T00:00:00Z")
    assert old.is_expired()


async def test_disabled_team_then_reenabled_and_new_limits(store):
    team = store.create_team("alpha", TeamLimits(rpm=1))
    secret, _ = store.create_key(team.id, "k")
    auth = Authenticator(store)
    assert (await auth.authenticate(secret)).team.limits.rpm == 1
    store.update_team(team.id, enabled=False)
    assert await wait_for_error(auth, secret, "team_disabled") <= 1.5
    message = await expect_error(auth, secret, 403, "team_disabled")
    assert "alpha" in message and "disabled" in message
    store.update_team(team.id, enabled=True)
    store.set_limits(team.id, TeamLimits(rpm=99))
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            if (await auth.authenticate(secret)).team.limits.rpm == 99:
                break
        except APIError:
            pass
        await asyncio.sleep(0.05)
    else:
        pytest.fail("re-enabled team or new limits not seen within 2 s")


async def test_deleted_team_key_is_refused(store):
    team = store.create_team("alpha")
    secret, _ = store.create_key(team.id, "k")
    store.delete_team(team.id)
    await expect_error(Authenticator(store), secret, 401, "invalid_api_key")


async def test_concurrent_misses_share_one_lookup(store):
    team = store.create_team("alpha")
    secret, key = store.create_key(team.id, "k")
    auth = Authenticator(store)
    results = await asyncio.gather(*(auth.authenticate(secret) for _ in range(50)))
    assert all(p.key == key for p in results)
    assert store.lookups == 1


async def test_cancelled_caller_does_not_fail_the_others(store):
    team = store.create_team("alpha")
    secret, key = store.create_key(team.id, "k")
    auth = Authenticator(store)
    first = asyncio.create_task(auth.authenticate(secret))
    second = asyncio.create_task(auth.authenticate(secret))
    await asyncio.sleep(0)
    first.cancel()
    assert (await second).key == key
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_ttl_above_one_second_is_refused(store):
    with pytest.raises(AssertionError):
        Authenticator(store, cache_ttl_s=5.0)


async def test_fastapi_dependencies(store):
    team = store.create_team("alpha")
    secret, _ = store.create_key(team.id, "k")
    admin_secret, _ = store.create_key(None, "root", is_admin=True)
    app = FastAPI()
    app.add_exception_handler(APIError, api_error_handler)
    app.state.services = Services.partial(authenticator=Authenticator(store))

    @app.get("/me")
    async def me(principal: Principal = Depends(require_key)):
        return {"key": principal.key.id, "team": principal.team.name if principal.team else None}

    @app.get("/root")
    async def root(principal: Principal = Depends(require_admin)):
        return {"admin": principal.key.is_admin}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.get("/me", headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 200 and r.json()["team"] == "alpha"
        r = await client.get("/me", headers={"x-api-key": secret})
        assert r.status_code == 200
        r = await client.get("/me")
        assert r.status_code == 401
        assert r.json()["error"] | {"message": None} == {
            "message": None,
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
        r = await client.get("/me", headers={"Authorization": f"Basic {secret}"})
        assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]
        r = await client.get("/root", headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
        r = await client.get("/root", headers={"Authorization": f"Bearer {admin_secret}"})
        assert r.status_code == 200 and r.json() == {"admin": True}


def store_path(store: Store) -> str:
    return store._conn.execute("PRAGMA database_list").fetchone()[2]


def rename_table(store: Store, old: str, new: str) -> None:
    """A real store failure: the table vanishes under the authenticator (renamed through another connection)."""
    import sqlite3

    conn = sqlite3.connect(store_path(store))
    conn.execute(f"ALTER TABLE {old} RENAME TO {new}")
    conn.commit()
    conn.close()


async def test_store_outage_serves_recent_keys_and_503s_the_rest(store):
    team = store.create_team("alpha")
    secret, key = store.create_key(team.id, "k")
    auth = Authenticator(store, cache_ttl_s=0.05, max_stale_s=30.0)
    await auth.authenticate(secret)
    rename_table(store, "api_keys", "api_keys_away")
    await asyncio.sleep(0.1)  # past the TTL: the next call goes to the (broken) store
    assert (await auth.authenticate(secret)).key == key  # a key seen moments ago keeps working
    with pytest.raises(APIError) as info:
        await auth.authenticate("tw-" + "B" * 43)  # never seen: no way to know, so 503, not 500 or 401
    assert (info.value.status, info.value.code) == (503, "store_unavailable")
    assert info.value.headers["Retry-After"] == "1"
    strict = Authenticator(store, cache_ttl_s=0.05, max_stale_s=0.0)
    await expect_error(strict, secret, 503, "store_unavailable")
    rename_table(store, "api_keys_away", "api_keys")
    assert (await strict.authenticate(secret)).key == key


async def test_read_started_before_invalidate_does_not_refill_the_cache(store):
    team = store.create_team("alpha")
    secret, _ = store.create_key(team.id, "k")
    auth = Authenticator(store)
    inflight = asyncio.create_task(auth.authenticate(secret))
    await asyncio.sleep(0.002)  # the lookup is now in its thread (it takes ~10 ms)
    auth.invalidate()  # e.g. the admin API just revoked something
    await inflight
    await auth.authenticate(secret)
    assert store.lookups == 2  # the pre-invalidate answer was not cached
