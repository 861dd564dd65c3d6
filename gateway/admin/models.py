"""Admin API request/response models: what gateway.admin.teams's routes accept and return, with their bounds.

Also the patterns and bounds those models share with the routes' path parameters (ids, names, plain text).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from tokenweir.gateway.store.store import ApiKey, Team
from tokenweir.policies.limits import KeyLimits, TeamLimits

# Upper bounds on what the admin API accepts: far above any real limit, far below what the store's columns hold
# (BIGINT for rates and budgets; INTEGER, 2**31 - 1, for concurrency and per-request token caps).
MAX_TOKEN_BUDGET = 10**15
MAX_COUNT = 10**9
MAX_TIMEOUT_S = 10 * 86400.0  # 10 days
MAX_USD_BUDGET = 1e9
MAX_KEY_LIFETIME_S = 100 * 365 * 86400.0  # 100 years

# Plain text for names: no control characters (they end up in logs; PostgreSQL refuses NUL). A pattern also makes
# pydantic refuse lone surrogates (not encodable as UTF-8, so no database could store them).
PLAIN_TEXT_PATTERN = r"^[^\x00-\x1f\x7f]*$"
ModelName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=PLAIN_TEXT_PATTERN)]
# Ids are the store's own ('team_' / 'key_' + hex): anything longer or stranger cannot exist.
ID_PATTERN = r"^[A-Za-z0-9._-]+$"
ID_DOC = "1-64 letters, digits, '.', '_' or '-'."


# The limits a team and an API key both have: one definition of each field's bounds and meaning for both models.
Rpm = Annotated[int | None, Field(ge=1, le=MAX_COUNT, description="Requests per minute.")]
Tpm = Annotated[
    int | None, Field(ge=1, le=MAX_TOKEN_BUDGET, description="Tokens (prompt + max_tokens reserved) per minute.")
]
TokensPerDay = Annotated[int | None, Field(ge=0, le=MAX_TOKEN_BUDGET, description="Token budget per UTC day.")]
TokensPerMonth = Annotated[
    int | None, Field(ge=0, le=MAX_TOKEN_BUDGET, description="Token budget per UTC calendar month.")
]
MaxConcurrency = Annotated[int | None, Field(ge=1, le=MAX_COUNT, description="Requests in flight at once.")]
# allow_inf_nan=False: NaN and Infinity (which the JSON parser accepts) are refused as "not a finite number".
UsdPerDay = Annotated[
    float | None,
    Field(
        ge=0,
        le=MAX_USD_BUDGET,
        allow_inf_nan=False,
        description="Spend budget per UTC day, in USD at the pools' prices.",
    ),
]
UsdPerMonth = Annotated[
    float | None,
    Field(ge=0, le=MAX_USD_BUDGET, allow_inf_nan=False, description="Spend budget per UTC calendar month, in USD."),
]


class Limits(BaseModel):
    """A team's limits. Omitted or null means unlimited (timeouts: the gateway default)."""

    model_config = ConfigDict(extra="forbid")

    rpm: Rpm = None
    tpm: Tpm = None
    tokens_per_day: TokensPerDay = None
    tokens_per_month: TokensPerMonth = None
    max_concurrency: MaxConcurrency = None
    # Defaults by keyword: type checkers read only `default=` as a field's default (so `Limits()` checks)
    max_prompt_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT, description="Longest prompt accepted.")
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT, description="Cap on max_tokens.")
    allowed_models: list[ModelName] | None = Field(
        default=None, max_length=1000, description="Models the team may use; null means all."
    )
    priority: int = Field(default=1, ge=0, le=2, description="0 critical, 1 standard, 2 batch; lower runs first.")
    weight: int = Field(default=1, ge=1, le=1000, description="Fair share against other teams in the same band.")
    queue_timeout_s: float | None = Field(
        default=None, gt=0, le=MAX_TIMEOUT_S, description="Longest wait in the dispatch queue."
    )
    ttft_timeout_s: float | None = Field(
        default=None, gt=0, le=MAX_TIMEOUT_S, description="Longest wait for the first token."
    )
    total_timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S, description="Longest whole request.")
    usd_per_day: UsdPerDay = None
    usd_per_month: UsdPerMonth = None

    def to_limits(self) -> TeamLimits:
        return TeamLimits.from_dict(self.model_dump())

    @classmethod
    def of(cls, limits: TeamLimits) -> Limits:
        # Not validated: the bounds are for what comes in; a stored value is shown as it is, whatever it is.
        return cls.model_construct(**limits.to_dict())


class KeyLimitsBody(BaseModel):
    """An API key's own limits, enforced together with its team's (the tighter wins). Omitted or null: the key has
    no limit of its own there (its team's still applies)."""

    model_config = ConfigDict(extra="forbid")

    rpm: Rpm = None
    tpm: Tpm = None
    tokens_per_day: TokensPerDay = None
    tokens_per_month: TokensPerMonth = None
    usd_per_day: UsdPerDay = None
    usd_per_month: UsdPerMonth = None
    max_concurrency: MaxConcurrency = None
    allowed_models: list[ModelName] | None = Field(
        None, max_length=1000, description="Models the key may use (within its team's); null means its team's."
    )

    def to_limits(self) -> KeyLimits | None:
        """None when nothing is set: the key then has no limits of its own (its spend is still counted)."""
        limits = KeyLimits.from_dict(self.model_dump())
        return None if limits == KeyLimits() else limits

    @classmethod
    def of(cls, limits: KeyLimits | None) -> KeyLimitsBody:
        return cls.model_construct(**(limits or KeyLimits()).to_dict())


# Team names end up in metrics labels and log lines: keep them plain.
TEAM_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
TeamName = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=TEAM_NAME_PATTERN)]
TEAM_NAME_DOC = "Unique; 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit."


class TeamCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: TeamName = Field(description=TEAM_NAME_DOC)
    enabled: bool = True
    limits: Limits = Field(default_factory=Limits)


class TeamUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: TeamName | None = Field(None, description=TEAM_NAME_DOC)
    enabled: bool | None = None


class TeamOut(BaseModel):
    object: Literal["team"] = "team"
    id: str
    name: str
    enabled: bool
    created_at: str
    limits: Limits

    @classmethod
    def of(cls, team: Team) -> TeamOut:
        return cls(
            id=team.id, name=team.name, enabled=team.enabled, created_at=team.created_at, limits=Limits.of(team.limits)
        )


class TeamList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TeamOut]


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool = True


def _sane_expiry(value: datetime | None) -> datetime | None:
    # Checked on the year first: converting an extreme time between time zones overflows.
    last = datetime.now(UTC).year + 100
    if value is not None and not 1970 <= value.year <= last:
        raise ValueError(f"expected a time between 1970 and {last} (at most 100 years from now)")
    return value


MAY_PICK_VARIANT_DOC = (
    "The key may pick an alias's variant with the x-tokenweir-variant header, a variant of weight 0 included (to "
    "test one); such requests are not judged by a rollout. Without it the header is refused (403)."
)


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=PLAIN_TEXT_PATTERN,
        description="What the key is for, e.g. 'ci' or 'alice-laptop'. No control characters.",
    )
    expires_at: Annotated[datetime | None, AfterValidator(_sane_expiry)] = Field(
        None, description="ISO 8601, from 1970 to 100 years from now; naive times are UTC."
    )
    expires_in_s: float | None = Field(
        None, gt=0, le=MAX_KEY_LIFETIME_S, description="Alternative to expires_at: lifetime in seconds (<= 100 years)."
    )
    limits: KeyLimitsBody | None = Field(None, description="The key's own limits (team keys only).")
    may_pick_variant: bool = Field(False, description=MAY_PICK_VARIANT_DOC + " Team keys only.")

    @model_validator(mode="after")
    def _one_expiry(self) -> KeyCreate:
        if self.expires_at is not None and self.expires_in_s is not None:
            raise ValueError("give expires_at or expires_in_s, not both")
        return self

    def expiry(self) -> datetime | None:
        if self.expires_in_s is not None:
            return datetime.now(UTC) + timedelta(seconds=self.expires_in_s)
        return self.expires_at


class KeyUpdate(BaseModel):
    """A team key's permissions; an omitted field stays as it is."""

    model_config = ConfigDict(extra="forbid")
    may_pick_variant: bool | None = Field(None, description=MAY_PICK_VARIANT_DOC)


class KeyOut(BaseModel):
    object: Literal["api_key"] = "api_key"
    id: str
    team_id: str | None
    name: str
    prefix: str = Field(description="The first characters of the secret, to recognise it.")
    is_admin: bool
    status: Literal["active", "revoked", "expired"]
    created_at: str
    expires_at: str | None
    revoked_at: str | None
    limits: KeyLimitsBody | None = Field(None, description="Its own limits; null: only its team's apply.")
    may_pick_variant: bool = Field(description=MAY_PICK_VARIANT_DOC)

    @classmethod
    def of(cls, key: ApiKey) -> KeyOut:
        status: Literal["active", "revoked", "expired"] = (
            "revoked" if key.revoked_at else "expired" if key.is_expired() else "active"
        )
        fields = {k: getattr(key, k) for k in ApiKey.__dataclass_fields__ if k != "limits"}
        limits = None if key.limits is None else KeyLimitsBody.of(key.limits)
        return cls(status=status, limits=limits, **fields)


class KeyCreated(KeyOut):
    secret: str = Field(description="The API key. Shown only in this response: store it now.")


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyOut]


class UsageOut(BaseModel):
    team_id: str
    key_id: str | None = Field(None, description="With group_by=key.")
    user: str | None = Field(None, description="With group_by=user: the requests' `user` field ('' when none).")
    day: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_usd: float | None = Field(None, description="With group_by=key or user: at the pools' prices.")


class UsageTotals(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float | None = None


class UsageList(BaseModel):
    object: Literal["list"] = "list"
    data: list[UsageOut]
    total: UsageTotals


class StoredSpend(BaseModel):
    """From the store, which lags live traffic by the usage flush interval (~2 s)."""

    day: str
    month_start: str
    spent_today: int
    spent_month: int
    remaining_day: int | None = Field(description="null when the team has no daily budget.")
    remaining_month: int | None = Field(description="null when the team has no monthly budget.")


class TeamState(BaseModel):
    object: Literal["team_state"] = "team_state"
    team_id: str
    name: str
    enabled: bool
    limits: Limits
    stored: StoredSpend
    live: dict[str, Any] | None = Field(
        description="Live counters (shared by every replica with a Redis state); null without a state backend or "
        "while it is unreachable (see live_error)."
    )
    live_error: str | None = Field(None, description="Why `live` is null while a state backend is configured.")
