"""The files half of `Store`: files uploaded through /v1/files and those a batch produces, each its team's.

A file's bytes are kept in its row (UTF-8 text: batch input and output files are JSONL), bounded by the config's
`batches.max_file_bytes`. Every read takes the caller's team: another team's file reads as missing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenweir.gateway.store.db import Db

_FILE_COLUMNS = "id, team_id, purpose, filename, bytes, created_at"


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A stored file's description (OpenAI's FileObject), without its content."""

    id: str
    team_id: str
    purpose: str  # batch (uploaded input), batch_output (a batch's output or error file)
    filename: str
    bytes: int
    created_at: int  # epoch seconds


class FileQueries:
    """Needs `_tx()` (one transaction) and `_read(sql, params)` from `Store`."""

    if TYPE_CHECKING:

        def _tx(self) -> AbstractContextManager[Db]: ...

        def _read(self, sql: str, params: tuple | list = ()) -> list[tuple]: ...

    def create_file(self, record: FileRecord, content: str) -> FileRecord:
        with self._tx() as db:
            insert_file(db, record, content)
        return record

    def get_file(self, team_id: str, file_id: str) -> FileRecord | None:
        rows = self._read(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ? AND team_id = ?", (file_id, team_id))
        return FileRecord(*rows[0]) if rows else None

    def file_content(self, team_id: str, file_id: str) -> str | None:
        rows = self._read("SELECT content FROM files WHERE id = ? AND team_id = ?", (file_id, team_id))
        return str(rows[0][0]) if rows else None

    def list_files(self, team_id: str, purpose: str | None, after: str | None, limit: int) -> list[FileRecord]:
        """The team's files, newest first (as OpenAI lists them), after the file `after` of that order."""
        sql, params = f"SELECT {_FILE_COLUMNS} FROM files WHERE team_id = ?", [team_id]
        if purpose is not None:
            sql, params = sql + " AND purpose = ?", [*params, purpose]
        if after is not None:
            sql += " AND (created_at, id) < (SELECT created_at, id FROM files WHERE id = ? AND team_id = ?)"
            params += [after, team_id]
        rows = self._read(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", [*params, limit])
        return [FileRecord(*r) for r in rows]

    def delete_file(self, team_id: str, file_id: str) -> bool:
        with self._tx() as db:
            return bool(db.execute("DELETE FROM files WHERE id = ? AND team_id = ?", (file_id, team_id)).rowcount)


def insert_file(db: Db, record: FileRecord, content: str) -> None:
    db.execute(
        f"INSERT INTO files ({_FILE_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (record.id, record.team_id, record.purpose, record.filename, record.bytes, record.created_at, content),
    )
