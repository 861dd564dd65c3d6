"""Prices and USD budgets are finite, >= 0 and bounded wherever they are set: a pool's price_*_per_1m in the config
(refused at start, naming the pool and the field), a team's or key's usd_per_day / usd_per_month in the admin API (a
400 naming the field). Within the bounds the cost maths cannot overflow."""

from __future__ import annotations

import httpx
import pytest

from tests.app.gateway.test_admin_api import make_app
from tokenweir.gateway.config import load_config
from tokenweir.gateway.process.bootstrap import ensure_bootstrap
from tokenweir.gateway.store.store import Store
from tokenweir.policies.pricing import MAX_PRICE_PER_1M, Prices

PRICE_FIELDS = ("price_input_per_1m", "price_output_per_1m", "price_cached_per_1m")


@pytest.mark.parametrize("field", PRICE_FIELDS)
@pytest.mark.parametrize("bad", [".inf", "1.0e+308", "-1", ".nan", "2000000"])
def test_a_price_that_is_not_a_finite_bounded_number_is_refused_naming_pool_and_field(tmp_path, field, bad):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"pools:\n  - model: m\n    {field}: {bad}\n    upstreams: [{{base_url: 'http://h:1'}}]\n")
    with pytest.raises(ValueError, match=f"pool m: {field}: expected a number from 0 to 1000000 .USD per 1M tok"):
        load_config(cfg, env={})


def test_the_dearest_price_on_a_huge_request_is_still_an_exact_integer_cost():
    top = Prices(MAX_PRICE_PER_1M, MAX_PRICE_PER_1M, MAX_PRICE_PER_1M)
    assert top.cost_femtos(10**7, 10**7, 10**6) == 2 * 10**13 * 10**9  # $2e7 exactly, in femto-USD
    assert top.max_cost_micros(10**7, 10**9) == (10**7 + 10**9) * 10**6
    with pytest.raises(ValueError, match="output_per_1m"):
        Prices(1.0, float("inf"))


@pytest.fixture
async def admin(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/admin.db")
    admin_secret, _ = ensure_bootstrap(store)
    transport = httpx.ASGITransport(app=make_app(store))
    headers = {"Authorization": f"Bearer {admin_secret}", "content-type": "application/json"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as client:
        yield client
    store.close()


async def test_usd_budgets_that_are_not_finite_and_bounded_are_a_400_naming_the_field(admin):
    team_id = (await admin.post("/admin/teams", json={"name": "t"})).json()["id"]
    key_id = (await admin.post(f"/admin/teams/{team_id}/keys", json={"name": "k"})).json()["id"]
    # NaN and Infinity are not JSON, but the body parser reads them: they must be refused as such, by name.
    cases = {
        "NaN": "finite number",
        "Infinity": "finite number",
        "-Infinity": "finite number",
        "1e308": "less than or equal to 1000000000",
        "-1": "greater than or equal to 0",
    }
    for raw, words in cases.items():
        for method, path, body, param in (
            ("PUT", f"/admin/teams/{team_id}/limits", '{"usd_per_day": %s}', "usd_per_day"),
            ("POST", "/admin/teams", '{"name": "x", "limits": {"usd_per_month": %s}}', "limits.usd_per_month"),
            (
                "POST",
                f"/admin/teams/{team_id}/keys",
                '{"name": "k2", "limits": {"usd_per_day": %s}}',
                "limits.usd_per_day",
            ),
            ("PUT", f"/admin/keys/{key_id}/limits", '{"usd_per_month": %s}', "usd_per_month"),
        ):
            r = await admin.request(method, path, content=(body % raw).encode())
            assert r.status_code == 400, (raw, path, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["code"] == "invalid_value", (raw, error)
            assert param in error["message"] and words in error["message"], (raw, error)
    assert (await admin.get(f"/admin/teams/{team_id}/limits")).json()["usd_per_day"] is None
    teams = (await admin.get("/admin/teams")).json()["data"]
    assert [t["name"] for t in teams] == ["demo", "t"], "no team was created with a bad budget"
