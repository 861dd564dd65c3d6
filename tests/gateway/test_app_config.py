"""Config: YAML/TOML files, env overrides, and errors that name the bad key."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig, load_config


def test_example_config_loads():
    config = load_config("config.example.yaml", env={})
    assert isinstance(config, GatewayConfig) and config.port == 8000 and config.timeouts.ttft_s == 60


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
    assert (up.base_url, up.engine, up.model, up.name) == ("http://a:1", False, "up", "http://a:1")


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
