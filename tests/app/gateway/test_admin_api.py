"""Admin API over real HTTP-in-process (httpx ASGITransport), a real SQLite store and the real InMemoryState."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
from fastapi import Depends, FastAPI

from tokenweir.common.http.errors import APIError, api_error_handler
from tokenweir.gateway.admin.teams import router
from tokenweir.gateway.auth.authenticator import Authenticator, Principal
from tokenweir.gateway.deps.callers import require_key
from tokenweir.gateway.deps.services import Services
from tokenweir.gateway.process.bootstrap import ensure_bootstrap
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store import keys
from tokenweir.gateway.store.store import Store, UsageRow
from tokenweir.policies.limits import TeamLimits


def make_app(store: Store) -> FastAPI:
    app = FastAPI()
    app.add_exception_handler(APIError, api_error_handler)
    app.include_router(router)
    app.state.services = Services.partial(store=store, authenticator=Authenticator(store), state=InMemoryState())

    @app.get("/whoami")
    async def whoami(principal: Principal = Depends(require_key)):
        return {"team": principal.team.name, "rpm": principal.team.limits.rpm}

    return app


@pytest.fixture
def store(tmp_path):
    s = Store.open(f"sqlite:///{tmp_path}/admin.db")
    yield s
    s.close()


@pytest.fixture
async def env(store):
    """(client with the admin key, app, demo key secret)."""
    admin_secret, demo_secret = ensure_bootstrap(store)
    app = make_app(store)
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {admin_secret}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as client:
        yield client, app, demo_secret


def assert_error(r: httpx.Response, status: int, code: str, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["type"] and err["message"], err
    return err["message"]


# --- a minimal JSON-schema check, enough for FastAPI's OpenAPI output --------------------------------------

_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "boolean": bool}


def check_schema(value, schema: dict, spec: dict, path: str = "$") -> None:
    if "$ref" in schema:
        target = spec
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return check_schema(value, target, spec, path)
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                return check_schema(value, option, spec, path)
            except AssertionError:
                continue
        raise AssertionError(f"{path}: {value!r} matches no anyOf option")
    kind = schema.get("type")
    if kind == "null":
        assert value is None, f"{path}: expected null"
    elif kind:
        assert isinstance(value, _TYPES[kind]) and not (kind != "boolean" and isinstance(value, bool)), (
            f"{path}: {value!r} is not {kind}"
        )
    if "const" in schema:
        assert value == schema["const"], f"{path}: {value!r} != {schema['const']!r}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if kind == "object":
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            assert name in value, f"{path}: missing {name}"
        for name, item in value.items():
            if name in props:
                check_schema(item, props[name], spec, f"{path}.{name}")
            else:
                assert not props or schema.get("additionalProperties") is True, f"{path}: undeclared {name}"
    if kind == "array":
        for i, item in enumerate(value):
            check_schema(item, schema.get("items", {}), spec, f"{path}[{i}]")


def response_schema(spec: dict, path: str, method: str, status: int) -> dict:
    responses = spec["paths"][path][method]["responses"]
    entry = responses.get(str(status)) or responses["4XX"]
    return entry["content"]["application/json"]["schema"]


# --- bootstrap ----------------------------------------------------------------------------------------------


def test_bootstrap_once_then_only_to_recover_admin(store):
    admin_secret, demo_secret = ensure_bootstrap(store)
    assert keys.is_well_formed(admin_secret) and keys.is_well_formed(demo_secret)
    admin, demo = store.find_key(admin_secret), store.find_key(demo_secret)
    assert admin.is_admin and admin.team_id is None
    assert not demo.is_admin and demo.team_id == store.get_team_by_name("demo").id
    assert ensure_bootstrap(store) == (None, None)  # a restart creates nothing
    store.delete_team(demo.team_id)
    assert ensure_bootstrap(store) == (None, None)  # a deleted demo team stays deleted
    store.revoke_key(admin.id)
    new_admin, again_demo = ensure_bootstrap(store)  # locked out: a restart gives a new admin key
    assert store.find_key(new_admin).is_admin and again_demo is None


# --- access -------------------------------------------------------------------------------------------------


async def test_admin_routes_need_an_admin_key(env):
    client, _, demo_secret = env
    r = await client.get("/admin/teams", headers={"Authorization": ""})
    assert_error(r, 401, "invalid_api_key")
    r = await client.get("/admin/teams", headers={"Authorization": "Bearer tw-" + "x" * 43})
    assert_error(r, 401, "invalid_api_key")
    r = await client.get("/admin/teams", headers={"Authorization": f"Bearer {demo_secret}"})
    assert_error(r, 403, "admin_required")
    r = await client.post("/admin/teams", json={"name": "x"}, headers={"Authorization": f"Bearer {demo_secret}"})
    assert_error(r, 403, "admin_required")
    assert (await client.get("/admin/teams")).status_code == 200


# --- teams --------------------------------------------------------------------------------------------------


async def test_team_lifecycle(env):
    client, _, _ = env
    r = await client.post("/admin/teams", json={"name": "alpha", "limits": {"rpm": 60, "allowed_models": ["m"]}})
    assert r.status_code == 201, r.text
    team = r.json()
    assert team["object"] == "team" and team["name"] == "alpha" and team["enabled"] is True
    assert team["limits"]["rpm"] == 60 and team["limits"]["allowed_models"] == ["m"]
    assert team["limits"]["priority"] == 1 and team["limits"]["tpm"] is None
    tid = team["id"]
    assert (await client.get(f"/admin/teams/{tid}")).json() == team
    assert {t["name"] for t in (await client.get("/admin/teams")).json()["data"]} == {"demo", "alpha"}

    r = await client.patch(f"/admin/teams/{tid}", json={"name": "beta", "enabled": False})
    assert r.status_code == 200 and r.json()["name"] == "beta" and r.json()["enabled"] is False
    assert r.json()["limits"] == team["limits"]  # PATCH leaves limits alone

    r = await client.delete(f"/admin/teams/{tid}")
    assert r.json() == {"id": tid, "object": "team", "deleted": True}
    assert_error(await client.get(f"/admin/teams/{tid}"), 404, "team_not_found", "team_id")
    assert_error(await client.delete(f"/admin/teams/{tid}"), 404, "team_not_found", "team_id")
    assert_error(await client.patch(f"/admin/teams/{tid}", json={"enabled": True}), 404, "team_not_found", "team_id")


async def test_duplicate_team_name_conflicts(env):
    client, _, _ = env
    assert (await client.post("/admin/teams", json={"name": "alpha"})).status_code == 201
    b = (await client.post("/admin/teams", json={"name": "beta"})).json()
    assert "alpha" in assert_error(
        await client.post("/admin/teams", json={"name": "alpha"}), 409, "duplicate_team_name", "name"
    )
    r = await client.patch(f"/admin/teams/{b['id']}", json={"name": "alpha"})
    assert_error(r, 409, "duplicate_team_name", "name")


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({}, "missing_required_parameter", "name"),
        ({"name": ""}, "invalid_value", "name"),
        ({"name": "has space"}, "invalid_value", "name"),
        ({"name": "x" * 65}, "invalid_value", "name"),
        ({"name": "ok", "limits": {"rpm": 0}}, "invalid_value", "limits.rpm"),
        ({"name": "ok", "limits": {"rpm": "lots"}}, "invalid_value", "limits.rpm"),
        ({"name": "ok", "limits": {"priority": 3}}, "invalid_value", "limits.priority"),
        ({"name": "ok", "limits": {"queue_timeout_s": -1}}, "invalid_value", "limits.queue_timeout_s"),
        ({"name": "ok", "limits": {"rmp": 5}}, "unknown_parameter", "limits.rmp"),
        ({"name": "ok", "colour": "red"}, "unknown_parameter", "colour"),
        ({"name": "ok", "enabled": "maybe"}, "invalid_value", "enabled"),
    ],
)
async def test_invalid_team_bodies_name_the_field(env, body, code, param):
    client, _, _ = env
    r = await client.post("/admin/teams", json=body)
    message = assert_error(r, 400, code, param)
    assert param in message and r.json()["error"]["type"] == "invalid_request_error"
    assert [t["name"] for t in (await client.get("/admin/teams")).json()["data"]] == ["demo"]  # nothing created


async def test_malformed_json_and_bad_query(env):
    client, _, _ = env
    r = await client.post("/admin/teams", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")
    assert_error(await client.get("/admin/usage?since=2026-13-01"), 400, "invalid_value", "since")
    assert_error(await client.get("/admin/usage?until=yesterday"), 400, "invalid_value", "until")
    r = await client.get("/admin/usage?since=2026-03-02&until=2026-03-01")
    assert "before" in assert_error(r, 400, "invalid_value", "until")


# --- limits -------------------------------------------------------------------------------------------------


async def test_limits_replace_and_take_effect_at_once(env):
    client, _, _ = env
    team = (await client.post("/admin/teams", json={"name": "alpha", "limits": {"rpm": 5, "tpm": 100}})).json()
    key = (await client.post(f"/admin/teams/{team['id']}/keys", json={"name": "k"})).json()
    whoami = {"Authorization": f"Bearer {key['secret']}"}
    assert (await client.get("/whoami", headers=whoami)).json() == {"team": "alpha", "rpm": 5}

    r = await client.put(f"/admin/teams/{team['id']}/limits", json={"rpm": 7, "priority": 0, "weight": 4})
    assert r.status_code == 200
    limits = r.json()
    assert limits["rpm"] == 7 and limits["tpm"] is None and limits["priority"] == 0 and limits["weight"] == 4
    assert (await client.get(f"/admin/teams/{team['id']}/limits")).json() == limits
    # This replica dropped its auth cache: the very next request sees the new limits.
    assert (await client.get("/whoami", headers=whoami)).json() == {"team": "alpha", "rpm": 7}

    r = await client.put(f"/admin/teams/{team['id']}/limits", json={"weight": 0})
    assert_error(r, 400, "invalid_value", "weight")
    assert_error(await client.put("/admin/teams/team_nope/limits", json={}), 404, "team_not_found", "team_id")
    assert_error(await client.get("/admin/teams/team_nope/limits"), 404, "team_not_found", "team_id")

    await client.patch(f"/admin/teams/{team['id']}", json={"enabled": False})
    assert_error(await client.get("/whoami", headers=whoami), 403, "team_disabled")


# --- keys ---------------------------------------------------------------------------------------------------


async def test_keys_create_list_revoke(env):
    client, _, demo_secret = env
    team = (await client.post("/admin/teams", json={"name": "alpha"})).json()
    r = await client.post(f"/admin/teams/{team['id']}/keys", json={"name": "ci", "expires_in_s": 3600})
    assert r.status_code == 201
    created = r.json()
    assert keys.is_well_formed(created["secret"]) and created["prefix"] == created["secret"][:7]
    assert created["status"] == "active" and created["team_id"] == team["id"] and not created["is_admin"]
    assert datetime.fromisoformat(created["expires_at"]) > datetime.now(UTC)

    listed = (await client.get(f"/admin/teams/{team['id']}/keys")).json()["data"]
    assert [k["id"] for k in listed] == [created["id"]]
    assert "secret" not in listed[0] and created["secret"] not in str(listed)
    everyone = (await client.get("/admin/keys")).json()["data"]
    assert len(everyone) == 3 and sum(k["is_admin"] for k in everyone) == 1  # bootstrap admin, demo, ci
    assert [k["id"] for k in (await client.get(f"/admin/keys?team_id={team['id']}")).json()["data"]] == [created["id"]]

    whoami = {"Authorization": f"Bearer {created['secret']}"}
    assert (await client.get("/whoami", headers=whoami)).status_code == 200
    r = await client.delete(f"/admin/keys/{created['id']}")
    assert r.status_code == 200 and r.json()["status"] == "revoked" and r.json()["revoked_at"]
    assert "revoked" in assert_error(await client.get("/whoami", headers=whoami), 401, "invalid_api_key")
    assert (await client.delete(f"/admin/keys/{created['id']}")).json()["revoked_at"] == r.json()["revoked_at"]

    assert_error(await client.delete("/admin/keys/key_nope"), 404, "key_not_found", "key_id")
    assert_error(await client.post("/admin/teams/team_nope/keys", json={"name": "k"}), 404, "team_not_found", "team_id")
    assert_error(await client.get("/admin/teams/team_nope/keys"), 404, "team_not_found", "team_id")
    r = await client.post(
        f"/admin/teams/{team['id']}/keys", json={"name": "k", "expires_in_s": 5, "expires_at": "2030-01-01T00:00:00Z"}
    )
    assert "not both" in assert_error(r, 400, "invalid_value")
    r = await client.post(f"/admin/teams/{team['id']}/keys", json={"name": "old", "expires_at": "2020-01-01T00:00:00"})
    assert r.json()["status"] == "expired"
    assert "expired" in assert_error(
        await client.get("/whoami", headers={"Authorization": f"Bearer {r.json()['secret']}"}), 401, "invalid_api_key"
    )


async def test_admin_key_can_mint_another_admin_key(env):
    client, _, _ = env
    r = await client.post("/admin/keys", json={"name": "ops"})
    assert r.status_code == 201 and r.json()["is_admin"] and r.json()["team_id"] is None
    other = {"Authorization": f"Bearer {r.json()['secret']}"}
    assert (await client.get("/admin/keys", headers=other)).status_code == 200


# --- usage and state ----------------------------------------------------------------------------------------


async def test_usage_filters_and_totals(env, store):
    client, _, _ = env
    a = (await client.post("/admin/teams", json={"name": "a"})).json()["id"]
    b = (await client.post("/admin/teams", json={"name": "b"})).json()["id"]
    store.record_usage(
        [
            UsageRow(a, "2026-03-01", "m", 2, 100, 10, 5),
            UsageRow(a, "2026-03-02", "m", 1, 50, 5, 0),
            UsageRow(b, "2026-03-02", "m", 4, 1, 1, 1),
        ]
    )
    body = (await client.get("/admin/usage")).json()
    assert len(body["data"]) == 3 and body["total"] == {
        "requests": 7,
        "prompt_tokens": 151,
        "completion_tokens": 16,
        "cached_tokens": 6,
    }
    body = (await client.get("/admin/usage", params={"team_id": a, "since": "2026-03-02"})).json()
    assert body["data"] == [
        {
            "team_id": a,
            "day": "2026-03-02",
            "model": "m",
            "requests": 1,
            "prompt_tokens": 50,
            "completion_tokens": 5,
            "cached_tokens": 0,
        }
    ]
    body = (await client.get("/admin/usage", params={"until": "2026-03-01"})).json()
    assert [r["team_id"] for r in body["data"]] == [a] and body["total"]["requests"] == 2


async def test_team_state_live_and_stored(env, store):
    client, app, _ = env
    limits = {"tokens_per_day": 1000, "tokens_per_month": 5000, "tpm": 10_000}
    team = (await client.post("/admin/teams", json={"name": "alpha", "limits": limits})).json()
    today = datetime.now(UTC).date()
    store.record_usage([UsageRow(team["id"], today.isoformat(), "m", 3, 200, 100, 0)])
    if today.day > 1:  # earlier this month: counts for the month, not for today
        store.record_usage([UsageRow(team["id"], today.replace(day=1).isoformat(), "m", 1, 1000, 0, 0)])
    month_extra = 1000 if today.day > 1 else 0
    await app.state.services.state.reserve(team["id"], TeamLimits(**limits), 40, 60)

    state = (await client.get(f"/admin/teams/{team['id']}/state")).json()
    assert state["stored"]["spent_today"] == 300 and state["stored"]["remaining_day"] == 700
    assert state["stored"]["spent_month"] == 300 + month_extra
    assert state["stored"]["remaining_month"] == 5000 - 300 - month_extra
    assert state["live"]["reserved_tokens"] == 100 and state["live"]["team_id"] == team["id"]
    assert state["limits"]["tokens_per_day"] == 1000

    app.state.services.state = None  # an app without a state backend still answers, with live = null
    state = (await client.get(f"/admin/teams/{team['id']}/state")).json()
    assert state["live"] is None and state["stored"]["remaining_day"] == 700
    assert_error(await client.get("/admin/teams/team_nope/state"), 404, "team_not_found", "team_id")


# --- the app's own OpenAPI schema ---------------------------------------------------------------------------


async def test_responses_match_the_openapi_schema(env):
    client, app, _ = env
    spec = (await client.get("/openapi.json")).json()
    admin_paths = {p: ops for p, ops in spec["paths"].items() if p.startswith("/admin")}
    assert len(admin_paths) == 18  # teams, keys, usage; pools, members, aliases, rollouts
    for ops in admin_paths.values():
        for op in ops.values():
            assert op["summary"] and "422" not in op["responses"]  # errors are documented as OpenAI errors

    r = await client.post("/admin/teams", json={"name": "alpha", "limits": {"rpm": 5, "allowed_models": ["m"]}})
    check_schema(r.json(), response_schema(spec, "/admin/teams", "post", 201), spec)
    tid = r.json()["id"]
    r = await client.post(f"/admin/teams/{tid}/keys", json={"name": "k", "limits": {"rpm": 2, "usd_per_day": 1.5}})
    check_schema(r.json(), response_schema(spec, "/admin/teams/{team_id}/keys", "post", 201), spec)
    r = await client.get(f"/admin/keys/{r.json()['id']}/limits")
    check_schema(r.json(), response_schema(spec, "/admin/keys/{key_id}/limits", "get", 200), spec)
    r = await client.get("/admin/keys")
    check_schema(r.json(), response_schema(spec, "/admin/keys", "get", 200), spec)
    r = await client.get(f"/admin/teams/{tid}/state")
    check_schema(r.json(), response_schema(spec, "/admin/teams/{team_id}/state", "get", 200), spec)
    r = await client.get("/admin/usage")
    check_schema(r.json(), response_schema(spec, "/admin/usage", "get", 200), spec)
    r = await client.get("/admin/teams/team_nope")
    check_schema(r.json(), response_schema(spec, "/admin/teams/{team_id}", "get", 404), spec)
    r = await client.post("/admin/teams", json={"name": "alpha"})
    check_schema(r.json(), response_schema(spec, "/admin/teams", "post", 409), spec)
    with pytest.raises(AssertionError):  # the checker itself can fail
        check_schema({"object": "team"}, response_schema(spec, "/admin/teams", "post", 201), spec)


async def test_store_outage_is_a_503_not_a_500(env, store):
    client, app, _ = env
    await client.get("/admin/teams")  # warm the admin key in the auth cache
    import sqlite3

    path = store._conn.execute("PRAGMA database_list").fetchone()[2]
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE teams RENAME TO teams_away")
    conn.commit()
    r = await client.get("/admin/teams")
    assert_error(r, 503, "store_unavailable")
    assert r.headers["retry-after"] == "1"
    conn.execute("ALTER TABLE teams_away RENAME TO teams")
    conn.commit()
    conn.close()
    assert (await client.get("/admin/teams")).status_code == 200
