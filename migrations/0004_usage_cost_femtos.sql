-- Exact costs (policies.pricing): a per-key usage row keeps its cost as whole micro-USD (cost_micros) plus the
-- femto-USD (1e-15 USD) below a micro-dollar, 0 to 10^9 - 1, carried into cost_micros by the upsert. Sums of many
-- tiny costs stay exact, and neither column nears int64's end. Portable SQL (SQLite and PostgreSQL).
ALTER TABLE usage_daily_keys ADD COLUMN cost_rem_femtos BIGINT NOT NULL DEFAULT 0;
