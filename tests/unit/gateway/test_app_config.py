"""Config: YAML/TOML files, env overrides, and errors that name the bad key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from tokenweir.gateway.config import GatewayConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[3] / "config.example.yaml"


def _leaves(data: dict, path: tuple = ()):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


def test_example_config_loads(tmp_path):
    """Every value the example file sets is the loaded config's, and it documents every setting."""
    config = load_config(EXAMPLE, env={})
    assert isinstance(config, GatewayConfig)
    raw = yaml.safe_load(EXAMPLE.read_text())
    leaves = dict(_leaves(raw))
    for path, value in leaves.items():
        target = config
        for part in path:
            target = getattr(target, part)
        assert target == value, (path, target, value)
    documented = {path[0] for path in leaves} | {p[0] + "." + p[1] for p in leaves if len(p) == 2}
    for f in dataclasses.fields(GatewayConfig):
        assert f.name in documented, f"config.example.yaml does not show {f.name}"
    # The file is read, not just defaults: the same file with two values changed loads those values.
    text = EXAMPLE.read_text()
    assert "ttft_s: 60 " in text and "  port: 8100" in text
    (tmp_path / "c.yaml").write_text(text.replace("ttft_s: 60 ", "ttft_s: 61 ").replace("  port: 8100", "  port: 8101"))
    changed = load_config(tmp_path / "c.yaml", env={})
    assert (changed.timeouts.ttft_s, changed.engine.port) == (61, 8101)


def test_yaml_pools_and_env_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "port: 9000\npools:\n  - model: m\n    fallbacks: []\n    upstreams:\n"
        "      - {base_url: 'http://a:1/', engine: false, model: up}\n"
    )
    env = {"TOKENWEIR_PORT": "9001", "TOKENWEIR_TIMEOUTS__TTFT_S": "2.5", "TOKENWEIR_ENGINE__ENABLED": "false"}
    config = load_config(path, env=env)
    assert config.port == 9001 and config.timeouts.ttft_s == 2.5 and config.engine.enabled is False
    (up,) = config.pool("m").upstreams
    assert (up.base_url, up.engine, up.model, up.name) == ("http://a:1", False, "up", "m-0")  # never its address


def test_toml_and_upstream_shortcut(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('store_url = "sqlite://:memory:"\n[events]\nbackups = 2\n')
    env = {
        "TOKENWEIR_UPSTREAM_URL": "http://x:2",
        "TOKENWEIR_UPSTREAM_MODEL": "mm",
        "TOKENWEIR_UPSTREAM_TOKENIZER": "default",
    }
    config = load_config(path, env=env)
    assert config.events.backups == 2 and config.store_url == "sqlite://:memory:"
    assert config.pool("mm").upstreams[0].base_url == "http://x:2" and config.pool("mm").tokenizer == "default"


@pytest.mark.parametrize(
    ("text", "needle"),
    [("prot: 1\n", "prot"), ("timeouts: {ttft: 3}\n", "ttft"), ("port: abc\n", "port"), ("pools: 3\n", "pools")],
)
def test_bad_config_names_the_key(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        load_config(path, env={})


def test_a_pools_route_knobs_reach_its_router_and_a_bad_one_names_the_pool(tmp_path):
    path = tmp_path / "c.yaml"
    knobs = "route: round_robin, route_min_bound: 2, route_load_cost_tokens: 10, route_kv_cost_tokens: 5"
    path.write_text(f"pools:\n  - {{model: m, {knobs}, upstreams: [{{base_url: 'http://a:1'}}]}}\n")
    params = load_config(path, env={}).pool("m").route_params(block_size=32)
    assert (params.strategy, params.block_size, params.min_bound) == ("round_robin", 32, 2)
    assert (params.load_cost_tokens, params.kv_cost_tokens, params.load_epsilon) == (10, 5, 0.25)
    path.write_text("pools:\n  - {model: m, route_kv_cost_tokens: -1, upstreams: [{base_url: 'http://a:1'}]}\n")
    with pytest.raises(ValueError, match="pool m: route: .*kv_cost_tokens >= 0"):
        load_config(path, env={})
