"""GET /v1/me: what a key may read about itself (LiteLLM's /key/info, OpenAI-style): its limits and its team's,
their live counters, and what is left to it now, the tighter of the two.

The live counters are the state backend's snapshots (policies.snapshot's shape, the one /admin/teams/{id}/state
shows), read under the limits as they are now (the key's auth lookup), not as the backend last saw them at a
reserve: a limit set a moment ago shows what is left of it at once. A key's spend is counted limits or not.
"""

from __future__ import annotations

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.auth.authenticator import Principal
from tokenweir.gateway.deps.services import Services
from tokenweir.gateway.state.backend import StateUnavailable
from tokenweir.policies.limits import KeyLimits
from tokenweir.policies.snapshot import with_limits

# What `remaining` reports: (its name, where the snapshot keeps it).
_REMAINING = (
    ("requests_per_minute", ("remaining_requests",)),
    ("tokens_per_minute", ("remaining_tokens",)),
    ("tokens_today", ("day", "remaining")),
    ("tokens_this_month", ("month", "remaining")),
    ("usd_today", ("day_usd", "remaining")),
    ("usd_this_month", ("month_usd", "remaining")),
)


def _read(snapshot: dict | None, path: tuple[str, ...]):
    value = snapshot
    for name in path:
        value = value.get(name) if isinstance(value, dict) else None
    return value


def tightest(team: dict | None, key: dict | None) -> dict:
    """Per dimension, the smaller of the team's and the key's remaining (None: neither has a limit there)."""
    out = {}
    for name, path in _REMAINING:
        values = [v for v in (_read(team, path), _read(key, path)) if v is not None]
        out[name] = min(values) if values else None
    return out


async def key_info(services: Services, principal: Principal) -> dict:
    key, team = principal.key, principal.team
    if team is None:
        raise APIError(403, "This key belongs to no team (admin keys manage the gateway); use a team key.", "no_team")
    team_state = key_state = None
    error = None
    try:
        team_state = with_limits(await services.state.snapshot(team.id), team.limits)
        key_state = await services.state.snapshot(team.id, key_id=key.id)
        key_state = with_limits(key_state, key.limits or KeyLimits())
    except StateUnavailable as e:
        error = f"state_unavailable: {e}"
    return {
        "object": "key_info",
        "key": {
            "id": key.id,
            "name": key.name,
            "prefix": key.prefix,
            "team_id": key.team_id,
            "created_at": key.created_at,
            "expires_at": key.expires_at,
            "limits": key.limits.to_dict() if key.limits is not None else None,
            "state": key_state,
        },
        "team": {"id": team.id, "name": team.name, "limits": team.limits.to_dict(), "state": team_state},
        "remaining": tightest(team_state, key_state) if error is None else None,
        "state_error": error,
    }
