-- The last event (by its per-writer seq) whose usage is in usage_daily: written in the same transaction as the
-- usage rows, so start-up can replay exactly the events a crash kept out of the store.
CREATE TABLE usage_watermarks (
    writer TEXT PRIMARY KEY,
    seq BIGINT NOT NULL
);
