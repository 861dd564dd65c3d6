-- OpenAI batch jobs (gateway/batches/): uploaded and produced files, batches, and one row per batch line that has
-- started or ended. Every row carries its team: another team's id reads as missing. Times are epoch seconds, as the
-- OpenAI API shows them; a batch's lease (which replica runs it, until when) is epoch seconds too. Portable SQL.
CREATE TABLE files (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    content TEXT NOT NULL
);
CREATE INDEX files_team ON files (team_id, created_at);

CREATE TABLE batches (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    key_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    metadata TEXT,
    total INTEGER NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    in_progress_at BIGINT,
    finalizing_at BIGINT,
    ended_at BIGINT,
    cancelling_at BIGINT,
    output_file_id TEXT,
    error_file_id TEXT,
    lease_owner TEXT,
    lease_until DOUBLE PRECISION
);
CREATE INDEX batches_team ON batches (team_id, created_at);
CREATE INDEX batches_status ON batches (status);

-- state: running (sent into admission, no answer recorded yet) or done. A running row a restart finds was in flight
-- when its replica died (gateway/batches/job.py says what happens to it).
CREATE TABLE batch_lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    state TEXT NOT NULL,
    status_code INTEGER,
    body TEXT,
    error_code TEXT,
    error_message TEXT,
    PRIMARY KEY (batch_id, line)
);
