"""Loading the configuration: the file (YAML, or TOML by suffix), then the `TOKENWEIR_*` env overrides merged into
its data, then the one validator (validate.py) over the whole; then members' keys read from the env variables they
name, and the one-upstream shortcut.

The env is text: a list or a whole section is JSON, an empty value of a setting that may be null is null, anything
else is given to the validator as it is (which reads numbers and booleans from text). What the validator finds wrong
in a value from the env names its variable."""

from __future__ import annotations

import difflib
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from tokenweir.gateway.config.base import ENV_PREFIX, MEMBER_KEY_PREFIX, OTHER_ENV
from tokenweir.gateway.config.gateway import GatewayConfig
from tokenweir.gateway.config.upstreams import PoolConfig, UpstreamConfig
from tokenweir.gateway.config.validate import Loc, optional_inner, parse_section


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """File (YAML by default, TOML by suffix) then env overrides; a missing path means defaults + env."""
    data: dict = {}
    if path is not None:
        text = Path(path).read_text()
        data = tomllib.loads(text) if str(path).endswith(".toml") else (yaml.safe_load(text) or {})
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
    env = os.environ if env is None else env
    sources = _merge_env(data, env)
    config = parse_section(GatewayConfig, data, sources=sources)
    _resolve_api_keys(config, env)
    if env.get("TOKENWEIR_UPSTREAM_URL"):
        model = env.get("TOKENWEIR_UPSTREAM_MODEL", "default")
        config.pools = [p for p in config.pools if p.model != model]
        upstream = UpstreamConfig(env["TOKENWEIR_UPSTREAM_URL"])
        config.pools.append(
            PoolConfig(model=model, upstreams=[upstream], tokenizer=env.get("TOKENWEIR_UPSTREAM_TOKENIZER"))
        )
    return config


def _resolve_api_keys(config: GatewayConfig, env: Mapping[str, str]) -> None:
    """Upstreams' `api_key_env`: the key from that variable, now, so a missing one stops the start, not a request."""
    for pool in config.pools:
        for upstream in pool.upstreams:
            if upstream.api_key_env and not upstream.api_key:
                upstream.api_key = env.get(upstream.api_key_env) or None
                if upstream.api_key is None:
                    raise ValueError(
                        f"pool {pool.model}, upstream {upstream.name}: api_key_env names {upstream.api_key_env}, "
                        "which is not set (or empty) in the env"
                    )


def env_names(cls: type = GatewayConfig, prefix: str = ENV_PREFIX) -> dict[str, Any]:
    """Every settable env name -> its field type: each field, and each field of a nested section."""
    names = {}
    for name, tp in typing.get_type_hints(cls).items():
        names[prefix + name.upper()] = tp
        if isinstance(tp, type) and is_dataclass(tp):
            names.update(env_names(tp, f"{prefix}{name.upper()}__"))
    return names


def _merge_env(data: dict, env: Mapping[str, str]) -> dict[Loc, str]:
    """The env's overrides into the file's `data`, each value decoded from text; returns where each one went -> its
    variable, so that the validator's errors name the variable. An unknown TOKENWEIR_* name is an error naming the
    closest one."""
    names = env_names()
    sources: dict[Loc, str] = {}
    for key, raw in sorted(env.items()):
        if not key.startswith(ENV_PREFIX) or key in OTHER_ENV or key.startswith(("TOKENWEIR_TEST_", MEMBER_KEY_PREFIX)):
            continue
        if key not in names:
            close = difflib.get_close_matches(key, [*names, *OTHER_ENV], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ValueError(f"unknown setting in env: {key}{hint}")
        *sections, last = key[len(ENV_PREFIX) :].lower().split("__")
        target = data
        for part in sections:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        target[last] = _env_value(key, names[key], raw)
        sources[(*sections, last)] = key
    return sources


def _env_value(key: str, tp: Any, raw: str) -> Any:
    """An env variable's text as data for the setting of type `tp`."""
    inner = optional_inner(tp)
    if raw == "" and inner is not tp:  # Optional: empty means None
        return None
    if is_dataclass(inner) or typing.get_origin(inner) is list:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"{key}: expected JSON ({e})") from e
    return raw.strip() if inner is bool else raw
