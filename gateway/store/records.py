"""The store's records (`Team`, `ApiKey`) and how they map to rows: the limits tables' columns in the order of the
policies' dataclasses, the SELECTs that read a team or key with its limits, and the writes of those limits."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from datetime import UTC, datetime

from tokenweir.gateway.store.db import Db, parse_ts
from tokenweir.policies.limits import KeyLimits, TeamLimits

# team_limits columns, in TeamLimits order. A field added to TeamLimits needs a migration: the assert says so.
LIMIT_COLUMNS = (
    "rpm", "tpm", "tokens_per_day", "tokens_per_month", "max_concurrency", "max_prompt_tokens",
    "max_output_tokens", "allowed_models", "priority", "weight", "queue_timeout_s", "ttft_timeout_s",
    "total_timeout_s", "usd_per_day", "usd_per_month",
)  # fmt: skip
assert tuple(f.name for f in fields(TeamLimits)) == LIMIT_COLUMNS, "TeamLimits changed: add a migration"
# key_limits columns (migration 0003), in KeyLimits order.
KEY_LIMIT_COLUMNS = (
    "rpm", "tpm", "tokens_per_day", "tokens_per_month", "usd_per_day", "usd_per_month", "max_concurrency",
    "allowed_models",
)  # fmt: skip
assert tuple(f.name for f in fields(KeyLimits)) == KEY_LIMIT_COLUMNS, "KeyLimits changed: add a migration"

TEAM_SELECT = (
    f"SELECT t.id, t.name, t.enabled, t.created_at, {', '.join('l.' + c for c in LIMIT_COLUMNS)}"
    " FROM teams t LEFT JOIN team_limits l ON l.team_id = t.id"
)
KEY_COLUMNS = (
    "k.id, k.team_id, k.name, k.prefix, k.is_admin, k.created_at, k.expires_at, k.revoked_at, k.may_pick_variant"
)
KEY_SELECT = (
    f"SELECT {KEY_COLUMNS}, l.key_id, {', '.join('l.' + c for c in KEY_LIMIT_COLUMNS)}"
    " FROM api_keys k LEFT JOIN key_limits l ON l.key_id = k.id"
)


@dataclass(frozen=True)
class Team:
    id: str
    name: str
    enabled: bool
    limits: TeamLimits
    created_at: str


@dataclass(frozen=True)
class ApiKey:
    id: str
    team_id: str | None
    name: str
    prefix: str
    is_admin: bool
    created_at: str
    expires_at: str | None
    revoked_at: str | None
    limits: KeyLimits | None = None  # its own limits, enforced together with its team's; None: the team's only
    # It may pick an alias's variant with the x-tokenweir-variant header (migration 0006; the admin grants it)
    may_pick_variant: bool = False

    def is_expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and parse_ts(self.expires_at) <= (now or datetime.now(UTC))


def write_key_limits(db: Db, key_id: str, limits: KeyLimits) -> None:
    values = [getattr(limits, c) for c in KEY_LIMIT_COLUMNS]
    models = KEY_LIMIT_COLUMNS.index("allowed_models")
    values[models] = None if limits.allowed_models is None else json.dumps(list(limits.allowed_models))
    columns = ", ".join(KEY_LIMIT_COLUMNS)
    db.execute(
        f"INSERT INTO key_limits (key_id, {columns}) VALUES (?{', ?' * len(KEY_LIMIT_COLUMNS)})", (key_id, *values)
    )


def write_limits(db: Db, team_id: str, limits: TeamLimits) -> None:
    values = [getattr(limits, c) for c in LIMIT_COLUMNS]
    models = LIMIT_COLUMNS.index("allowed_models")
    values[models] = None if limits.allowed_models is None else json.dumps(list(limits.allowed_models))
    db.execute("DELETE FROM team_limits WHERE team_id = ?", (team_id,))
    db.execute(
        f"INSERT INTO team_limits (team_id, {', '.join(LIMIT_COLUMNS)}) VALUES (?{', ?' * len(LIMIT_COLUMNS)})",
        (team_id, *values),
    )


def team_from_row(row: tuple) -> Team:
    raw = dict(zip(LIMIT_COLUMNS, row[4:], strict=True))
    if raw["allowed_models"] is not None:
        raw["allowed_models"] = json.loads(raw["allowed_models"])
    raw = {k: v for k, v in raw.items() if v is not None}  # a missing limits row reads as TeamLimits()
    return Team(id=row[0], name=row[1], enabled=bool(row[2]), limits=TeamLimits.from_dict(raw), created_at=row[3])


def key_from_row(row: tuple) -> ApiKey:
    return ApiKey(
        id=row[0],
        team_id=row[1],
        name=row[2],
        prefix=row[3],
        is_admin=bool(row[4]),
        created_at=row[5],
        expires_at=row[6],
        revoked_at=row[7],
        may_pick_variant=bool(row[8]),
        limits=key_limits_from_row(row[9:]) if len(row) > 9 and row[9] is not None else None,
    )


def key_limits_from_row(row: tuple) -> KeyLimits:
    """A key_limits row (its key_id, then KEY_LIMIT_COLUMNS) as KeyLimits."""
    raw = dict(zip(KEY_LIMIT_COLUMNS, row[1:], strict=True))
    if raw["allowed_models"] is not None:
        raw["allowed_models"] = json.loads(raw["allowed_models"])
    return KeyLimits.from_dict(raw)
