"""The responses half of `Store`: responses made through /v1/responses with `store`, each its team's.

A row keeps the response object as it was answered and its input items (those carried from earlier turns first), as
JSON: a later turn (previous_response_id) reads both, GET /v1/responses/{id} the first, its input_items the second.
Every read and delete takes the caller's team: another team's response reads as missing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from tokenweir.gateway.store.db import Db, now_ts


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    team_id: str
    previous_response_id: str | None
    body: dict[str, Any]  # the response object
    input_items: list[dict[str, Any]]


class ResponseQueries:
    """Needs `_tx()` (one transaction) and `_read(sql, params)` from `Store`."""

    if TYPE_CHECKING:

        def _tx(self) -> AbstractContextManager[Db]: ...

        def _read(self, sql: str, params: tuple | list = ()) -> list[tuple]: ...

    def save_response(self, response: StoredResponse) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO responses (id, team_id, created_at, previous_response_id, body, input_items)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    response.id,
                    response.team_id,
                    now_ts(),
                    response.previous_response_id,
                    orjson.dumps(response.body).decode(),
                    orjson.dumps(response.input_items).decode(),
                ),
            )

    def get_response(self, team_id: str, response_id: str) -> StoredResponse | None:
        rows = self._read(
            "SELECT id, team_id, previous_response_id, body, input_items FROM responses WHERE id = ? AND team_id = ?",
            (response_id, team_id),
        )
        if not rows:
            return None
        rid, team, previous, body, items = rows[0]
        return StoredResponse(rid, team, previous, orjson.loads(body), orjson.loads(items))

    def delete_response(self, team_id: str, response_id: str) -> bool:
        """Whether the team had it (and now has not)."""
        with self._tx() as db:
            cursor = db.execute("DELETE FROM responses WHERE id = ? AND team_id = ?", (response_id, team_id))
            return bool(cursor.rowcount)
