"""Gateway configuration: dataclasses loaded from YAML or TOML, then overridden by `TOKENWEIR_*` env vars.

Env names follow the field path: `TOKENWEIR_PORT=9000`, `TOKENWEIR_STORE_URL=...`,
`TOKENWEIR_TIMEOUTS__TTFT_S=30` (double underscore steps into a nested section). Lists and whole sections are
JSON: `TOKENWEIR_ENGINE__EXTRA_ARGS='["--max-num-seqs","8"]'`, `TOKENWEIR_POOLS='[{"model": "m", "upstreams":
[{"base_url": "http://h:8100", "engine": false}]}]'`. One-upstream shortcut: `TOKENWEIR_UPSTREAM_URL`
(+ `TOKENWEIR_UPSTREAM_MODEL`, and `TOKENWEIR_UPSTREAM_TOKENIZER`: a GGUF path or "default" for exact counts).

Strict both ways: an unknown key in the file, or a `TOKENWEIR_*` env var that names no setting (and is not one of
`OTHER_ENV`, nor a member's key, TOKENWEIR_MEMBER_KEY_*), is an error naming it and the closest valid name; a boolean
is one of true/false/1/0/yes/no/on/off.

One validator reads every source: pydantic over the section dataclasses (validate.py), the same that reads the admin
API's bodies, for the file, the env's overrides (loading.py) and the store's pools and aliases. The sections:
upstreams.py (pools, their members, timeouts, the breaker), routing.py (aliases, variants, rollouts, routes_error),
discovery.py, state.py, observability.py (events, tracing), engine.py (the bundled engine), gateway.py (the whole).
"""

from tokenweir.gateway.config.base import (
    CACHE_SCOPES,
    ENV_PREFIX,
    MEMBER_KEY_PREFIX,
    OTHER_ENV,
    member_key_env_error,
)
from tokenweir.gateway.config.batches import BatchesConfig
from tokenweir.gateway.config.discovery import DiscoveryConfig, nameserver_address
from tokenweir.gateway.config.engine import BundledEngineConfig
from tokenweir.gateway.config.gateway import GatewayConfig, config_digest
from tokenweir.gateway.config.loading import env_names, load_config
from tokenweir.gateway.config.observability import EventsConfig, TracingConfig
from tokenweir.gateway.config.routing import AliasConfig, RolloutConfig, VariantConfig, routes_error
from tokenweir.gateway.config.state import StateConfig
from tokenweir.gateway.config.upstreams import BreakerConfig, PoolConfig, TimeoutConfig, UpstreamConfig
from tokenweir.gateway.config.validate import parse_section

__all__ = [
    "CACHE_SCOPES",
    "ENV_PREFIX",
    "MEMBER_KEY_PREFIX",
    "OTHER_ENV",
    "AliasConfig",
    "BatchesConfig",
    "BreakerConfig",
    "BundledEngineConfig",
    "DiscoveryConfig",
    "EventsConfig",
    "GatewayConfig",
    "PoolConfig",
    "RolloutConfig",
    "StateConfig",
    "TimeoutConfig",
    "TracingConfig",
    "UpstreamConfig",
    "VariantConfig",
    "config_digest",
    "env_names",
    "load_config",
    "member_key_env_error",
    "nameserver_address",
    "parse_section",
    "routes_error",
]
