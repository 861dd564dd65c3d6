-- Pools and aliases changed at run time through the admin API (the config file's are the seed): one row per pool
-- or alias, its whole definition as JSON, or NULL where it was removed (a seed's name included). Portable SQL.

-- The routing table's version: bumped by every change, in the changing transaction (its row lock orders writers),
-- so a replica that sees a new version reloads the whole table.
CREATE TABLE routing_version (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    version BIGINT NOT NULL
);
INSERT INTO routing_version (id, version) VALUES (1, 0);

CREATE TABLE routing_entries (
    kind TEXT NOT NULL, -- 'pool' or 'alias'
    name TEXT NOT NULL, -- the public model name
    body TEXT, -- JSON; NULL: removed
    version BIGINT NOT NULL, -- the routing version that wrote it (compare-and-set for the rollout controller)
    updated_at TEXT NOT NULL,
    PRIMARY KEY (kind, name)
);
