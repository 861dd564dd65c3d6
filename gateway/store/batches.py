"""The batches half of `Store`: OpenAI batch jobs, each its team's, the lease of the replica that runs one, and one
row per line that has started (`running`) or ended (`done`), unique on (batch, line): a line's answer is recorded
once, and a resumed batch skips every line that has a row.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenweir.gateway.store.db import Db
from tokenweir.gateway.store.files import FileRecord, insert_file

# A batch still to be run (or finished) by some replica: what the runners poll for.
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
_BATCH_COLUMNS = (
    "id, team_id, key_id, endpoint, input_file_id, completion_window, status, metadata, total, created_at, expires_at,"
    " in_progress_at, finalizing_at, ended_at, cancelling_at, output_file_id, error_file_id"
)
_UPDATABLE = frozenset({"status", "in_progress_at", "finalizing_at", "ended_at", "output_file_id", "error_file_id"})


StoredFile = tuple[FileRecord, str]  # a file's description and its content


@dataclass(frozen=True, slots=True)
class BatchRecord:
    id: str
    team_id: str
    key_id: str  # the key that created it: its lines run as that key
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    metadata: str | None  # JSON text, as sent
    total: int
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    ended_at: int | None = None  # completed_at, failed_at, expired_at or cancelled_at, as `status` says
    cancelling_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None


@dataclass(frozen=True, slots=True)
class LineRow:
    line: int  # 1-based, as the input file numbers them
    custom_id: str
    request_id: str
    state: str  # running | done
    status_code: int | None = None  # the answer's HTTP status; None: no answer (error_code says why)
    body: str | None = None  # the answer's body, JSON text
    error_code: str | None = None
    error_message: str | None = None


@dataclass(frozen=True, slots=True)
class LineCounts:
    completed: int  # answered 2xx
    failed: int  # answered otherwise, or never answered (expired, cancelled, budget, interrupted)


class BatchQueries:
    """Needs `_tx()` (one transaction) and `_read(sql, params)` from `Store`."""

    if TYPE_CHECKING:

        def _tx(self) -> AbstractContextManager[Db]: ...

        def _read(self, sql: str, params: tuple | list = ()) -> list[tuple]: ...

    def create_batch(self, record: BatchRecord) -> BatchRecord:
        columns = _BATCH_COLUMNS.split(", ")
        with self._tx() as db:
            db.execute(
                f"INSERT INTO batches ({_BATCH_COLUMNS}) VALUES ({', '.join('?' * len(columns))})",
                tuple(getattr(record, c.strip()) for c in columns),
            )
        return record

    def get_batch(self, team_id: str | None, batch_id: str) -> BatchRecord | None:
        """The batch, if it is `team_id`'s (None: whoever's, for the runner)."""
        sql, params = f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?", [batch_id]
        if team_id is not None:
            sql, params = sql + " AND team_id = ?", [*params, team_id]
        rows = self._read(sql, params)
        return BatchRecord(*rows[0]) if rows else None

    def list_batches(self, team_id: str, after: str | None, limit: int) -> list[BatchRecord]:
        """The team's batches, newest first, after the batch `after` of that order."""
        sql, params = f"SELECT {_BATCH_COLUMNS} FROM batches WHERE team_id = ?", [team_id]
        if after is not None:
            sql += " AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ? AND team_id = ?)"
            params += [after, team_id]
        rows = self._read(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", [*params, limit])
        return [BatchRecord(*r) for r in rows]

    def update_batch(self, batch_id: str, **changes: object) -> None:
        assert changes and set(changes) <= _UPDATABLE, f"not updatable: {set(changes) - _UPDATABLE}"
        sets = ", ".join(f"{name} = ?" for name in changes)
        with self._tx() as db:
            db.execute(f"UPDATE batches SET {sets} WHERE id = ?", (*changes.values(), batch_id))

    def cancel_batch(self, team_id: str, batch_id: str, now: int) -> BatchRecord | None:
        """Ask a batch to stop (`cancelling`) if it has not ended; the batch as it is after. None: not the team's."""
        with self._tx() as db:
            db.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ?"
                " WHERE id = ? AND team_id = ? AND status IN ('validating', 'in_progress')",
                (now, batch_id, team_id),
            )
        return self.get_batch(team_id, batch_id)

    # --- leases: one replica runs a batch ---

    def claimable_batches(self, owner: str, now: float) -> list[str]:
        """Active batches no live replica holds (or `owner` holds already), oldest first."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        rows = self._read(
            f"SELECT id FROM batches WHERE status IN ({marks})"
            " AND (lease_owner IS NULL OR lease_owner = ? OR lease_until < ?) ORDER BY created_at, id",
            (*ACTIVE_STATUSES, owner, now),
        )
        return [r[0] for r in rows]

    def claim_batch(self, batch_id: str, owner: str, now: float, until: float) -> bool:
        """Take (or renew) the batch's lease for `owner` until `until`: False if a live replica holds it."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE batches SET lease_owner = ?, lease_until = ?"
                " WHERE id = ? AND (lease_owner IS NULL OR lease_owner = ? OR lease_until < ?)",
                (owner, until, batch_id, owner, now),
            )
            return bool(cur.rowcount)

    def release_batch(self, batch_id: str, owner: str) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE batches SET lease_owner = NULL, lease_until = NULL WHERE id = ? AND lease_owner = ?",
                (batch_id, owner),
            )

    # --- lines ---

    def batch_lines(self, batch_id: str) -> list[LineRow]:
        rows = self._read(
            "SELECT line, custom_id, request_id, state, status_code, body, error_code, error_message"
            " FROM batch_lines WHERE batch_id = ? ORDER BY line",
            (batch_id,),
        )
        return [LineRow(*r) for r in rows]

    def line_counts(self, batch_id: str) -> LineCounts:
        rows = self._read(
            "SELECT SUM(CASE WHEN status_code >= 200 AND status_code < 300 THEN 1 ELSE 0 END), COUNT(*)"
            " FROM batch_lines WHERE batch_id = ? AND state = 'done'",
            (batch_id,),
        )
        completed, done = int(rows[0][0] or 0), int(rows[0][1] or 0)
        return LineCounts(completed, done - completed)

    def start_line(self, batch_id: str, line: int, custom_id: str, request_id: str) -> None:
        """The line is about to enter admission: recorded first, so a restart knows it may have run."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO batch_lines (batch_id, line, custom_id, request_id, state) VALUES (?, ?, ?, ?, 'running')",
                (batch_id, line, custom_id, request_id),
            )

    def end_lines(self, batch_id: str, rows: list[LineRow]) -> None:
        """Record lines' ends: a running row becomes done; a line that never started gets its done row."""
        with self._tx() as db:
            for row in rows:
                values = (row.status_code, row.body, row.error_code, row.error_message)
                cur = db.execute(
                    "UPDATE batch_lines SET state = 'done', status_code = ?, body = ?, error_code = ?,"
                    " error_message = ? WHERE batch_id = ? AND line = ? AND state = 'running'",
                    (*values, batch_id, row.line),
                )
                if not cur.rowcount:
                    db.execute(
                        "INSERT INTO batch_lines (batch_id, line, custom_id, request_id, state, status_code, body,"
                        " error_code, error_message) VALUES (?, ?, ?, ?, 'done', ?, ?, ?, ?)",
                        (batch_id, row.line, row.custom_id, row.request_id, *values),
                    )

    def finish_batch(
        self, batch_id: str, status: str, ended_at: int, output: StoredFile | None, errors: StoredFile | None
    ) -> None:
        """The batch's end: its output and error files and its final status in one transaction, so a crash leaves
        both or neither."""
        with self._tx() as db:
            for stored in (output, errors):
                if stored is not None:
                    insert_file(db, *stored)
            db.execute(
                "UPDATE batches SET status = ?, ended_at = ?, output_file_id = ?, error_file_id = ?,"
                " lease_owner = NULL, lease_until = NULL WHERE id = ?",
                (status, ended_at, output and output[0].id, errors and errors[0].id, batch_id),
            )
