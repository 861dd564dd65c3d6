-- Requests billed straight to the store because the event log or the in-flight journal could not record them (a full
-- disk, an I/O error): their usage rows and this row are written in one transaction. Start-up bills none of them
-- again: neither the replay of the events file (an event of theirs that did land) nor the in-flight recovery (a
-- journal left without their "done"). `seq`: their event's seq in the file, NULL where the event did not land; a row
-- is dropped once the in-flight recovery has run and the writer's watermark covers that seq. Portable SQL.
CREATE TABLE settled_requests (
    writer TEXT NOT NULL,
    upstream_request_id TEXT NOT NULL,
    seq BIGINT,
    PRIMARY KEY (writer, upstream_request_id)
);
