-- Identity, limits and usage. Portable SQL: runs unchanged on SQLite (>= 3.24) and PostgreSQL (>= 12).
-- Timestamps are ISO 8601 UTC text ('2026-01-31T12:00:00.000000Z'), days are 'YYYY-MM-DD': both sort as text.

CREATE TABLE schema_version (
    version INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    applied_at TEXT NOT NULL
);

CREATE TABLE teams (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    enabled BOOLEAN NOT NULL DEFAULT TRUE,
    created_at TEXT NOT NULL
);

-- One row per team; NULL means unlimited (or, for timeouts, the gateway default). Mirrors policies.limits.TeamLimits.
CREATE TABLE team_limits (
    team_id TEXT PRIMARY KEY REFERENCES teams (id) ON DELETE CASCADE,
    rpm BIGINT,
    tpm BIGINT,
    tokens_per_day BIGINT,
    tokens_per_month BIGINT,
    max_concurrency INTEGER,
    max_prompt_tokens INTEGER,
    max_output_tokens INTEGER,
    allowed_models TEXT,
    priority INTEGER NOT NULL DEFAULT 1,
    weight INTEGER NOT NULL DEFAULT 1,
    queue_timeout_s DOUBLE PRECISION,
    ttft_timeout_s DOUBLE PRECISION,
    total_timeout_s DOUBLE PRECISION
);

-- Secrets are never stored: only their (peppered) sha256 and a short visible prefix.
-- team_id is NULL for admin keys that belong to no team.
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    team_id TEXT REFERENCES teams (id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    prefix TEXT NOT NULL,
    key_hash TEXT NOT NULL UNIQUE,
    is_admin BOOLEAN NOT NULL DEFAULT FALSE,
    created_at TEXT NOT NULL,
    expires_at TEXT,
    revoked_at TEXT
);

CREATE INDEX api_keys_team_id ON api_keys (team_id);

-- Deliberately no foreign key to teams: billing history outlives a deleted team.
CREATE TABLE usage_daily (
    team_id TEXT NOT NULL,
    day TEXT NOT NULL,
    model TEXT NOT NULL,
    requests BIGINT NOT NULL DEFAULT 0,
    prompt_tokens BIGINT NOT NULL DEFAULT 0,
    completion_tokens BIGINT NOT NULL DEFAULT 0,
    cached_tokens BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (team_id, day, model)
);

CREATE INDEX usage_daily_day ON usage_daily (day);
