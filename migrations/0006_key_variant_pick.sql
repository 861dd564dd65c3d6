-- Whether an API key may pick an alias's variant with the x-tokenweir-variant header (the admin grants it, for
-- testing a variant, a dark one included); such requests are served but never judged by a rollout. Portable SQL
-- (SQLite and PostgreSQL).
ALTER TABLE api_keys ADD COLUMN may_pick_variant BOOLEAN NOT NULL DEFAULT FALSE;
