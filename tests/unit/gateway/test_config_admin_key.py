"""TOKENWEIR_ADMIN_KEY: the operator's own admin secret, stored hashed once, across restarts and replicas."""

from __future__ import annotations

import secrets

import pytest

from tokenweir.gateway.process.bootstrap import ensure_bootstrap
from tokenweir.gateway.store.store import Conflict, Store


def test_env_admin_key_is_the_admin_key_once(tmp_path):
    secret = "tw-" + secrets.token_urlsafe(32)
    url = f"sqlite:///{tmp_path}/k.db"
    store = Store.open(url)
    admin, demo = ensure_bootstrap(store, admin_key=secret)
    assert admin is None and demo  # no generated admin key: the operator has theirs; the demo team as usual
    key = store.find_key(secret)
    assert key.is_admin and key.name == "env-admin" and key.prefix == secret[:7]
    # a restart, and a second replica on the same database: nothing new
    other = Store.open(url)
    assert ensure_bootstrap(other, admin_key=secret) == (None, None)
    assert ensure_bootstrap(store, admin_key=secret) == (None, None)
    assert [k.name for k in store.list_keys() if k.is_admin] == ["env-admin"]
    # the same secret inserted twice is a Conflict (a replica's race), never a second key
    with pytest.raises(Conflict):
        store.create_key(None, "again", is_admin=True, secret=secret)
    # revoked by the operator: it stays revoked, and a bootstrap admin key is generated instead
    store.revoke_key(key.id)
    admin, _ = ensure_bootstrap(store, admin_key=secret)
    assert admin and admin != secret and store.find_key(secret).revoked_at is not None


def test_a_strong_secret_in_any_format_is_the_admin_key_found_by_its_whole_hash(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/k.db")
    vault = "sk-" + secrets.token_hex(32)  # LiteLLM-style master key: not our tw- format
    assert ensure_bootstrap(store, admin_key=vault)[0] is None
    key = store.find_key(vault)
    assert key.is_admin and key.prefix == vault[:4], "only 4 characters of an operator's secret are ever shown"
    assert store.find_key(vault[:-1]) is None and store.find_key(vault[:4]) is None


@pytest.mark.parametrize(
    "weak",
    [
        "hunter2",
        "changeme",
        "a" * 64,  # one character
        "abcd" * 16,  # a short alphabet
        "abcdefghijklmnopqrstuvwxyz0123456789",  # a run: every step the same
        "tw-" + "A" * 43,  # our format, but no secret in it
        "tw-" + secrets.token_urlsafe(32)[:-1] + " ",  # a space cannot travel in an Authorization header
        secrets.token_hex(16),  # 128 random bits as hex: the estimate (~116 bits) is below the bar
        "x" * 513,
    ],
    ids=["hunter2", "changeme", "one_char", "short_alphabet", "run", "tw_zeros", "space", "hex16", "too_long"],
)
def test_a_weak_env_admin_key_is_refused_naming_the_setting_and_the_rule(tmp_path, weak):
    store = Store.open(f"sqlite:///{tmp_path}/k.db")
    with pytest.raises(ValueError, match="TOKENWEIR_ADMIN_KEY: expected 32 to 512 printable ASCII") as info:
        ensure_bootstrap(store, admin_key=weak)
    assert weak not in str(info.value) and "at least 128 bits of estimated entropy" in str(info.value)
    assert not store.list_keys(), "nothing created, not even the demo team's key"
