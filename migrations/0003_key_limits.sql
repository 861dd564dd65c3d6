-- Per-key limits, spend budgets in USD, and usage per key and end user. Portable SQL (SQLite and PostgreSQL).

-- Spend budgets of a team, in USD at the pools' prices (policies.limits.TeamLimits.usd_per_day / usd_per_month).
ALTER TABLE team_limits ADD COLUMN usd_per_day DOUBLE PRECISION;
ALTER TABLE team_limits ADD COLUMN usd_per_month DOUBLE PRECISION;

-- An API key's own limits, enforced together with its team's (the tighter wins); no row: none of its own.
-- Mirrors policies.limits.KeyLimits.
CREATE TABLE key_limits (
    key_id TEXT PRIMARY KEY REFERENCES api_keys (id) ON DELETE CASCADE,
    rpm BIGINT,
    tpm BIGINT,
    tokens_per_day BIGINT,
    tokens_per_month BIGINT,
    usd_per_day DOUBLE PRECISION,
    usd_per_month DOUBLE PRECISION,
    max_concurrency INTEGER,
    allowed_models TEXT
);

-- Daily usage per key and per end user (the request's `user` field, '' when none), with its cost in micro-USD.
-- Like usage_daily, no foreign keys: billing history outlives a revoked key or a deleted team.
CREATE TABLE usage_daily_keys (
    team_id TEXT NOT NULL,
    key_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    day TEXT NOT NULL,
    model TEXT NOT NULL,
    requests BIGINT NOT NULL DEFAULT 0,
    prompt_tokens BIGINT NOT NULL DEFAULT 0,
    completion_tokens BIGINT NOT NULL DEFAULT 0,
    cached_tokens BIGINT NOT NULL DEFAULT 0,
    cost_micros BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (team_id, key_id, user_id, day, model)
);

CREATE INDEX usage_daily_keys_day ON usage_daily_keys (day);
