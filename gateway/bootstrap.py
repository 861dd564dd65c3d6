"""First start: make the gateway usable at once (an admin key, and a demo team with its own key)."""

from __future__ import annotations

from gateway.store import Conflict, Store

DEMO_TEAM = "demo"


def ensure_bootstrap(store: Store) -> tuple[str | None, str | None]:
    """Returns (admin_secret, demo_secret), each only when created now, for the caller to print once.

    An admin key is created whenever no usable one exists (so a locked-out operator gets back in by restarting);
    the demo team only on a fresh store (no teams, no keys), so deleting it is respected on later starts.
    """
    all_keys = store.list_keys()
    fresh = not all_keys and not store.list_teams()
    admin_secret = demo_secret = None
    if not any(k.is_admin and k.revoked_at is None and not k.is_expired() for k in all_keys):
        admin_secret, _ = store.create_key(None, "bootstrap-admin", is_admin=True)
    if fresh:
        try:
            team = store.create_team(DEMO_TEAM)
        except Conflict:  # another replica bootstrapping the same database got there first
            team = store.get_team_by_name(DEMO_TEAM)
        demo_secret, _ = store.create_key(team.id, "demo")
    return admin_secret, demo_secret
