"""Strict env overrides: unknown TOKENWEIR_* names, booleans, JSON lists and sections, /v1 base URLs."""

from __future__ import annotations

import pytest

from tokenweir.gateway.config import BundledEngineConfig, UpstreamConfig, load_config


def test_env_typo_names_the_variable_and_the_closest_setting():
    with pytest.raises(ValueError, match=r"TOKENWEIR_PROT.*did you mean TOKENWEIR_PORT\?"):
        load_config(env={"TOKENWEIR_PROT": "9000"})
    with pytest.raises(ValueError, match=r"TOKENWEIR_TIMEOUTS__TTFT.*TOKENWEIR_TIMEOUTS__TTFT_S"):
        load_config(env={"TOKENWEIR_TIMEOUTS__TTFT": "3"})


def test_env_names_read_elsewhere_are_not_settings_errors():
    env = {"TOKENWEIR_KEY_PEPPER": "p", "TOKENWEIR_ADMIN_KEY": "", "TOKENWEIR_TEST_PG": "x", "OTHER": "1"}
    env["TOKENWEIR_KV_TRANSFER_KEY"] = "k" * 32  # serve hands one it is given to its engines
    assert load_config(env=env).port == 8000


@pytest.mark.parametrize("word", ["ture", "2", "enabled", ""])
def test_bad_boolean_is_an_error(word):
    with pytest.raises(ValueError, match="TOKENWEIR_ACCESS_LOG.*boolean"):
        load_config(env={"TOKENWEIR_ACCESS_LOG": word})


@pytest.mark.parametrize(("word", "value"), [("TRUE", True), ("on", True), ("1", True), ("No", False), ("off", False)])
def test_boolean_words(word, value):
    assert load_config(env={"TOKENWEIR_ENGINE__ENABLED": word}).engine.enabled is value


def test_bad_boolean_in_the_file_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("access_log: 'ture'\n")
    with pytest.raises(ValueError, match="access_log"):
        load_config(path, env={})


def test_lists_and_pools_from_env_as_json(tmp_path):
    env = {
        "TOKENWEIR_ENGINE__EXTRA_ARGS": '["--max-num-seqs", "8"]',
        "TOKENWEIR_POOLS": '[{"model": "m", "fallbacks": [], "upstreams": [{"base_url": "http://h:1/v1/",'
        ' "engine": false}]}]',
        "TOKENWEIR_STATE__ON_UNAVAILABLE": "fail_open",
        "TOKENWEIR_METRICS_TOKEN": "",
    }
    config = load_config(env=env)
    assert isinstance(config.engine, BundledEngineConfig) and config.engine.extra_args == ["--max-num-seqs", "8"]
    (up,) = config.pool("m").upstreams
    assert (up.base_url, up.engine) == ("http://h:1", False)
    assert config.state.on_unavailable == "fail_open" and config.metrics_token is None


def test_env_values_are_validated_like_the_file():
    with pytest.raises(ValueError, match="TOKENWEIR_ENGINE__EXTRA_ARGS.*JSON"):
        load_config(env={"TOKENWEIR_ENGINE__EXTRA_ARGS": "--max-num-seqs 8"})
    with pytest.raises(ValueError, match="TOKENWEIR_POOLS.*list"):
        load_config(env={"TOKENWEIR_POOLS": '{"model": "m"}'})
    with pytest.raises(ValueError, match="on_unavailable"):
        load_config(env={"TOKENWEIR_STATE__ON_UNAVAILABLE": "maybe"})
    with pytest.raises(ValueError, match="TOKENWEIR_PORT.*int"):
        load_config(env={"TOKENWEIR_PORT": "eighty"})


def test_env_overrides_one_key_of_a_file_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("state:\n  retry_after_s: 7\n  timeout_s: 3\n")
    config = load_config(path, env={"TOKENWEIR_STATE__TIMEOUT_S": "4.5"})
    assert (config.state.retry_after_s, config.state.timeout_s) == (7, 4.5)


@pytest.mark.parametrize(
    "url",
    [
        "https://api.example.com",
        "https://api.example.com/",
        "https://api.example.com/v1",
        "https://api.example.com/v1/",
    ],
)
def test_base_url_with_or_without_v1(url):
    assert UpstreamConfig(url).base_url == "https://api.example.com"


def test_upstream_shortcut_strips_v1_too():
    config = load_config(env={"TOKENWEIR_UPSTREAM_URL": "http://x:2/v1", "TOKENWEIR_UPSTREAM_MODEL": "mm"})
    assert config.pool("mm").upstreams[0].base_url == "http://x:2"
