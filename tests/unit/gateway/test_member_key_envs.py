"""A member's api_key_env names only a variable marked as a member's key (TOKENWEIR_MEMBER_KEY_*, the engines' key, or
one the config lists in api_key_envs): the gateway sends its value to the member's address, so a name of its own
secrets (its admin key, its store's password) is refused at start, and a stored entry that names one is skipped."""

from __future__ import annotations

import pytest

from tokenweir.gateway.config import GatewayConfig, PoolConfig, UpstreamConfig, load_config
from tokenweir.gateway.runtime.routing_sync import compose, pool_body
from tokenweir.gateway.store.routing import RoutingEntry

MEMBER = "pools:\n  - model: m\n    upstreams:\n      - base_url: http://h:1\n        api_key_env: {name}\n"


def test_a_config_file_member_that_names_the_admin_key_stops_the_start(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(MEMBER.format(name="TOKENWEIR_ADMIN_KEY"))
    allowed = r"TOKENWEIR_MEMBER_KEY_<NAME> or TOKENWEIR_ENGINE_API_KEY .*listed in the gateway config's api_key_envs"
    with pytest.raises(ValueError, match=rf"pool m, upstream m-0: api_key_env TOKENWEIR_ADMIN_KEY .*{allowed}"):
        load_config(path, env={"TOKENWEIR_ADMIN_KEY": "admin-secret"})
    path.write_text(MEMBER.format(name="PGPASSWORD"))
    with pytest.raises(ValueError, match=r"to allow PGPASSWORD, add it there"):
        load_config(path, env={"PGPASSWORD": "db-secret"})


def test_a_member_key_variable_the_engines_key_and_a_listed_name_are_read(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(
        "api_key_envs: [OPENAI_API_KEY]\n"
        "pools:\n  - model: m\n    upstreams:\n"
        "      - {base_url: 'http://h:1', api_key_env: TOKENWEIR_MEMBER_KEY_VLLM}\n"
        "      - {base_url: 'http://h:2', api_key_env: OPENAI_API_KEY}\n"
        "      - {base_url: 'http://h:3', api_key_env: TOKENWEIR_ENGINE_API_KEY}\n"
    )
    env = {"TOKENWEIR_MEMBER_KEY_VLLM": "k-vllm", "OPENAI_API_KEY": "k-openai", "TOKENWEIR_ENGINE_API_KEY": "k-engine"}
    config = load_config(path, env=env)  # a TOKENWEIR_MEMBER_KEY_* variable is no unknown setting either
    assert [u.api_key for u in config.pools[0].upstreams] == ["k-vllm", "k-openai", "k-engine"]
    assert load_config(env={"TOKENWEIR_API_KEY_ENVS": '["OPENAI_API_KEY"]'}).api_key_envs == ["OPENAI_API_KEY"]


def test_the_env_pools_are_held_to_the_same_rule():
    pools = '[{"model": "m", "upstreams": [{"base_url": "http://h:1", "api_key_env": "TOKENWEIR_STORE_URL"}]}]'
    with pytest.raises(ValueError, match="api_key_env TOKENWEIR_STORE_URL is not a member's key"):
        load_config(env={"TOKENWEIR_POOLS": pools})


@pytest.mark.parametrize("name", ["TOKENWEIR_ADMIN_KEY", "TOKENWEIR_KEY_PEPPER", "NOT-A-NAME", ""])
def test_api_key_envs_never_lists_a_gateway_variable_or_a_malformed_name(name):
    with pytest.raises(ValueError, match="api_key_envs: .* is not an env variable a member's key may be read from"):
        GatewayConfig(api_key_envs=[name])


def test_a_stored_member_that_names_another_variable_is_skipped_and_its_value_never_read(monkeypatch):
    monkeypatch.setenv("TOKENWEIR_ADMIN_KEY", "admin-secret")
    monkeypatch.setenv("TOKENWEIR_MEMBER_KEY_REC", "k-rec")
    leaking = PoolConfig("m", [UpstreamConfig("http://recorder:1", name="r", api_key_env="TOKENWEIR_ADMIN_KEY")])
    seed = PoolConfig("m", [UpstreamConfig("http://engine:1", name="e")])
    composed = compose([seed], [], [RoutingEntry("pool", "m", pool_body(leaking), 1, "")])
    assert [(u.base_url, u.api_key) for u in composed.pools[0].upstreams] == [("http://engine:1", None)]  # the seed's
    keyed = PoolConfig("m", [UpstreamConfig("http://recorder:1", name="r", api_key_env="TOKENWEIR_MEMBER_KEY_REC")])
    composed = compose([seed], [], [RoutingEntry("pool", "m", pool_body(keyed), 1, "")])
    assert [(u.base_url, u.api_key) for u in composed.pools[0].upstreams] == [("http://recorder:1", "k-rec")]
    listed = PoolConfig("m", [UpstreamConfig("http://recorder:1", name="r", api_key_env="LISTED_KEY")])
    monkeypatch.setenv("LISTED_KEY", "k-listed")
    composed = compose([seed], [], [RoutingEntry("pool", "m", pool_body(listed), 1, "")], ["LISTED_KEY"])
    assert composed.pools[0].upstreams[0].api_key == "k-listed"
