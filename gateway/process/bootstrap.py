"""First start: make the gateway usable at once (an admin key, and a demo team with its own key)."""

from __future__ import annotations

import os

from tokenweir.gateway.store import keys
from tokenweir.gateway.store.store import Conflict, Store, Team

DEMO_TEAM = "demo"
ADMIN_KEY_ENV = "TOKENWEIR_ADMIN_KEY"


def admin_key_error(secret: str | None) -> str | None:
    """The one line saying why `secret` cannot be the operator's admin secret (None: it can, or it is unset).
    Checked before anything starts, so a bad one costs the operator no engine load."""
    if not secret:
        return None
    weakness = keys.secret_weakness(secret)
    return None if weakness is None else f"{ADMIN_KEY_ENV}: expected {keys.SECRET_RULE}; {weakness}"


def ensure_env_admin_key(store: Store, secret: str | None) -> bool:
    """TOKENWEIR_ADMIN_KEY: the operator's own strong secret (any format: a vault's own is fine) becomes an admin
    key, stored hashed like any other and found by the hash of the whole string.

    Idempotent across restarts and replicas: an already stored secret is left as it is (revoked included: a revoked
    key stays revoked). Returns True when the key was created now. A weak secret: ValueError (admin_key_error)."""
    if not secret:
        return False
    if (error := admin_key_error(secret)) is not None:
        raise ValueError(error)
    if store.find_key(secret) is not None:
        return False
    try:
        store.create_key(None, "env-admin", is_admin=True, secret=secret)
    except Conflict:  # another replica inserted it between our look-up and insert
        return False
    return True


def ensure_bootstrap(store: Store, admin_key: str | None = None) -> tuple[str | None, str | None]:
    """Returns (admin_secret, demo_secret), each only when created now, for the caller to print once.

    An admin key is created whenever no usable one exists (so a locked-out operator gets back in by restarting);
    the demo team only on a fresh store (no teams, no keys), so deleting it is respected on later starts.
    `admin_key` (default $TOKENWEIR_ADMIN_KEY): the operator's own admin secret, stored first; then no admin key
    is generated (the operator has theirs) unless that one is revoked.
    """
    admin_key = os.environ.get(ADMIN_KEY_ENV) if admin_key is None else admin_key
    fresh = not store.list_keys() and not store.list_teams()
    ensure_env_admin_key(store, admin_key)
    all_keys = store.list_keys()
    admin_secret = demo_secret = None
    if not any(k.is_admin and k.revoked_at is None and not k.is_expired() for k in all_keys):
        admin_secret, _ = store.create_key(None, "bootstrap-admin", is_admin=True)
    if fresh:
        team: Team | None
        try:
            team = store.create_team(DEMO_TEAM)
        except Conflict:  # another replica bootstrapping the same database got there first
            team = store.get_team_by_name(DEMO_TEAM)
        assert team is not None  # created here, or by that replica
        demo_secret, _ = store.create_key(team.id, "demo")
    return admin_secret, demo_secret
