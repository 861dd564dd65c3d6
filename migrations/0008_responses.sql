-- Responses made through /v1/responses with `store` (OpenAI's default): each its team's (another team's id reads as
-- missing), the response object as it was answered, and its input items (those carried from earlier turns through
-- previous_response_id first, then its own), both as JSON. Portable SQL.
CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    created_at TEXT NOT NULL,
    previous_response_id TEXT,
    body TEXT NOT NULL, -- the response object, JSON
    input_items TEXT NOT NULL -- JSON array of items, each with its id
);
CREATE INDEX responses_by_team ON responses (team_id, created_at);
