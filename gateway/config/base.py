"""What the config's sections share: the env names' prefix and the TOKENWEIR_* names that are not settings, pydantic's
config for every section, and the small rules several sections apply."""

from __future__ import annotations

import re

from tokenweir.common.engine_flags import API_KEY_ENV, KV_TRANSFER_KEY_ENV

ENV_PREFIX = "TOKENWEIR_"
CACHE_SCOPES = ("team", "key", "shared")  # PoolConfig.cache_scope
FAIRNESS = ("tokens", "requests", "fcfs")  # PoolConfig.fairness: what the dispatch queue shares between teams
# TOKENWEIR_* variables read elsewhere, not settings (TOKENWEIR_TEST_* belong to the test suite).
OTHER_ENV = frozenset(
    {
        "TOKENWEIR_UPSTREAM_URL",  # the one-upstream shortcut (loading.py)
        "TOKENWEIR_UPSTREAM_MODEL",
        "TOKENWEIR_UPSTREAM_TOKENIZER",
        "TOKENWEIR_KEY_PEPPER",  # gateway/store/store.py
        "TOKENWEIR_ADMIN_KEY",  # gateway/process/bootstrap.py
        "TOKENWEIR_ATTENTION_BACKEND",  # the engine
        "TOKENWEIR_ENGINE_API_KEY",  # the engine's --api-key (engine/flags.py)
        KV_TRANSFER_KEY_ENV,  # the key serve's engines sign KV transfers with (one given to serve is used)
    }
)
# The env variables a member's `api_key_env` may name: the gateway sends that variable's value to the member's
# address, so never one of its own secrets (its admin key, its store's password). Those named with this prefix, the
# engines' key (TOKENWEIR_ENGINE_API_KEY), and those the config lists in `api_key_envs` (member_key_env_error).
MEMBER_KEY_PREFIX = "TOKENWEIR_MEMBER_KEY_"
# pydantic's config for every section: the one validator (validate.py) reads the file, the env, the store's entries
# and the admin API's bodies with it. An unknown key is an error; a number where text is expected is that text (a
# YAML `extra_args: [--max-num-seqs, 8]`).
STRICT = {"extra": "forbid", "coerce_numbers_to_str": True}
FOREVER_S = 10 * 86400.0  # a timeout or backoff longer than this is a mistake
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def plain(text: str) -> bool:
    """No control characters (names end up in logs, metric labels and a database that refuses NUL)."""
    return not any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def member_key_env_error(name: str, listed: list[str]) -> str | None:
    """Why a member's api_key_env may not name `name` (the gateway would send that variable's value to the member's
    address: its own admin key, its store's password), or None: names with MEMBER_KEY_PREFIX, the engines' key, and
    those `listed` (the config's api_key_envs) are members' keys."""
    if (name.startswith(MEMBER_KEY_PREFIX) and len(name) > len(MEMBER_KEY_PREFIX)) or name in (API_KEY_ENV, *listed):
        return None
    return (
        f"api_key_env {name} is not a member's key: it must be named {MEMBER_KEY_PREFIX}<NAME> or {API_KEY_ENV} (the "
        f"engines' key), or be listed in the gateway config's api_key_envs (to allow {name}, add it there)"
    )
