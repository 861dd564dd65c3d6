"""TOKENWEIR_ADMIN_KEY: the operator's own admin secret, stored hashed once, across restarts and replicas."""

from __future__ import annotations

import secrets

import pytest

from gateway.bootstrap import ensure_bootstrap
from gateway.store import Conflict, Store


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


def test_malformed_env_admin_key_is_refused(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/k.db")
    with pytest.raises(ValueError, match="tw-"):
        ensure_bootstrap(store, admin_key="hunter2")
