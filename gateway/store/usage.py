"""Daily usage rows in the store: the batched writes of `UsageRecorder` (with its event watermark), the admin
API's reads, and the spend that seeds the day / month budgets at start.

A mixin of `Store` (gateway/store/store.py), which supplies the transaction and read helpers it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenweir.policies.pricing import FEMTOS_PER_MICRO

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from tokenweir.gateway.store.db import Db

_USAGE_COLUMNS = "team_id, day, model, requests, prompt_tokens, completion_tokens, cached_tokens"


@dataclass(frozen=True)
class UsageRow:
    team_id: str
    day: str  # 'YYYY-MM-DD', UTC
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class SettledRequest:
    """A request billed straight to the store (`record_usage`'s `settled`): its writer, the id its upstream knew it by
    (what the in-flight journal names it by) and its event's seq (None: its event could not be written)."""

    writer: str
    upstream_request_id: str
    seq: int | None = None


@dataclass(frozen=True)
class KeyUsageRow:
    """A day's usage of one key by one end user (the request's `user`, '' when none) on one model."""

    team_id: str
    key_id: str
    user: str
    day: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_micros: int = 0  # whole micro-USD of the exact cost
    cost_rem_femtos: int = 0  # and the femto-USD below a micro-dollar (0 to 10^9 - 1): see policies.pricing


_KEY_USAGE_COLUMNS = (
    "team_id, key_id, user_id, day, model, requests, prompt_tokens, completion_tokens, cached_tokens, cost_micros,"
    " cost_rem_femtos"
)
# A row's exact cost in femto-USD, summed over a group (cost_micros * 10^9 + cost_rem_femtos, each summed in SQL).
_SUM_COST = "COALESCE(SUM(cost_micros), 0), COALESCE(SUM(cost_rem_femtos), 0)"
_REM_SUM = "usage_daily_keys.cost_rem_femtos + excluded.cost_rem_femtos"  # in an upsert: the row's and the new one's
# What /admin/usage can group the per-key rows by, and the columns each grouping keeps.
KEY_GROUPINGS = {"key": ("team_id", "key_id"), "user": ("team_id", "user_id")}


class UsageQueries:
    """The usage half of `Store`: needs `_tx()` (one transaction) and `_read(sql, params)` from it."""

    if TYPE_CHECKING:  # what Store supplies, declared for the type checker only

        def _tx(self) -> AbstractContextManager[Db]: ...

        def _read(self, sql: str, params: tuple | list = ()) -> list[tuple]: ...

    def record_usage(
        self,
        rows: list[UsageRow],
        watermark: tuple[str, int] | None = None,
        key_rows: list[KeyUsageRow] | None = None,
        settled: SettledRequest | None = None,
    ) -> None:
        """Adds each row to its (team, day, model) total, and each key row to its (team, key, user, day, model)
        total, all in one transaction: all rows land or none. `watermark` (writer, seq): the rows include every
        event of that writer up to seq, recorded atomically. `settled`: the rows are that one request's, billed
        here directly (its event or its journal line could not be written): start-up bills it no more."""
        if not rows and watermark is None and not key_rows:
            return
        with self._tx() as db:
            if settled is not None:
                db.execute(
                    "INSERT INTO settled_requests (writer, upstream_request_id, seq) VALUES (?, ?, ?)"
                    " ON CONFLICT (writer, upstream_request_id) DO NOTHING",
                    (settled.writer, settled.upstream_request_id, settled.seq),
                )
            if watermark is not None:
                db.execute(
                    "INSERT INTO usage_watermarks (writer, seq) VALUES (?, ?)"
                    " ON CONFLICT (writer) DO UPDATE SET seq = excluded.seq"
                    " WHERE excluded.seq > usage_watermarks.seq",
                    watermark,
                )
            if key_rows:
                db.executemany(
                    f"INSERT INTO usage_daily_keys ({_KEY_USAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (team_id, key_id, user_id, day, model) DO UPDATE SET"
                    " requests = usage_daily_keys.requests + excluded.requests,"
                    " prompt_tokens = usage_daily_keys.prompt_tokens + excluded.prompt_tokens,"
                    " completion_tokens = usage_daily_keys.completion_tokens + excluded.completion_tokens,"
                    " cached_tokens = usage_daily_keys.cached_tokens + excluded.cached_tokens,"
                    # exact cost: femtos below a micro-dollar carry into whole micros (both SETs read the old row;
                    # integer division on SQLite and PostgreSQL alike; x - x / d * d, as '%' is a placeholder to
                    # psycopg), so the sum stays exact and far from int64's end
                    " cost_micros = usage_daily_keys.cost_micros + excluded.cost_micros"
                    f" + ({_REM_SUM}) / {FEMTOS_PER_MICRO},"
                    f" cost_rem_femtos = ({_REM_SUM}) - ({_REM_SUM}) / {FEMTOS_PER_MICRO} * {FEMTOS_PER_MICRO}",
                    [
                        (r.team_id, r.key_id, r.user, r.day, r.model, r.requests, r.prompt_tokens,
                         r.completion_tokens, r.cached_tokens, r.cost_micros, r.cost_rem_femtos)
                        for r in key_rows
                    ],
                )  # fmt: skip
            if not rows:
                return
            db.executemany(
                f"INSERT INTO usage_daily ({_USAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (team_id, day, model) DO UPDATE SET"
                " requests = usage_daily.requests + excluded.requests,"
                " prompt_tokens = usage_daily.prompt_tokens + excluded.prompt_tokens,"
                " completion_tokens = usage_daily.completion_tokens + excluded.completion_tokens,"
                " cached_tokens = usage_daily.cached_tokens + excluded.cached_tokens",
                [
                    (
                        r.team_id,
                        r.day,
                        r.model,
                        r.requests,
                        r.prompt_tokens,
                        r.completion_tokens,
                        r.cached_tokens,
                    )
                    for r in rows
                ],
            )

    def usage(self, team_id: str | None = None, since: str | None = None, until: str | None = None) -> list[UsageRow]:
        """Daily rows, both day bounds inclusive ('YYYY-MM-DD')."""
        where, params = [], []
        for clause, value in (("team_id = ?", team_id), ("day >= ?", since), ("day <= ?", until)):
            if value is not None:
                where.append(clause)
                params.append(value)
        sql = f"SELECT {_USAGE_COLUMNS} FROM usage_daily"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._read(sql + " ORDER BY day, team_id, model", params)
        return [UsageRow(r[0], r[1], r[2], *(int(v) for v in r[3:])) for r in rows]

    def usage_by(
        self, group_by: str, team_id: str | None = None, since: str | None = None, until: str | None = None
    ) -> list[tuple]:
        """Daily totals per key ('key': team_id, key_id) or per end user ('user': team_id, user_id), both day bounds
        inclusive: (team_id, key_or_user, day, model, requests, prompt, completion, cached, cost) tuples, cost the
        exact femto-USD."""
        group = ", ".join(KEY_GROUPINGS[group_by])
        where, params = [], []
        for clause, value in (("team_id = ?", team_id), ("day >= ?", since), ("day <= ?", until)):
            if value is not None:
                where.append(clause)
                params.append(value)
        sql = (
            f"SELECT {group}, day, model, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens),"
            f" SUM(cached_tokens), {_SUM_COST} FROM usage_daily_keys"
        )
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" GROUP BY {group}, day, model ORDER BY day, {group}, model"
        return [(*r[:4], *(int(v) for v in r[4:8]), _femtos(r[8], r[9])) for r in self._read(sql, params)]

    def spent_by_key(self, since_day: str, *, femtos: bool = False) -> list[tuple[str, str, int, int]]:
        """(team_id, key_id, prompt + completion tokens, cost) per key since a day (inclusive): seeds the keys' own
        budgets, and the teams' spend budgets (every request with a usage row has a key). The cost is whole
        micro-USD, the exact sum rounded down (what spend budgets count), or with `femtos` the exact femto-USD."""
        rows = self._read(
            f"SELECT team_id, key_id, COALESCE(SUM(prompt_tokens + completion_tokens), 0), {_SUM_COST}"
            " FROM usage_daily_keys WHERE day >= ? GROUP BY team_id, key_id ORDER BY team_id, key_id",
            (since_day,),
        )
        unit = 1 if femtos else FEMTOS_PER_MICRO
        return [(r[0], r[1], int(r[2]), _femtos(r[3], r[4]) // unit) for r in rows]

    def usage_watermark(self, writer: str) -> int:
        """The last event seq of `writer` whose usage is stored (0 if none)."""
        rows = self._read("SELECT seq FROM usage_watermarks WHERE writer = ?", (writer,))
        return int(rows[0][0]) if rows else 0

    def settled_requests(self, writer: str) -> dict[str, int | None]:
        """The requests of `writer` billed here directly (upstream request id -> its event's seq, None: no event)."""
        rows = self._read("SELECT upstream_request_id, seq FROM settled_requests WHERE writer = ?", (writer,))
        return {r[0]: None if r[1] is None else int(r[1]) for r in rows}

    def prune_settled(self, writer: str) -> None:
        """After start-up's in-flight recovery: drop the rows no start-up needs any more (no event, or one the
        writer's watermark covers: the replay never reads it again)."""
        with self._tx() as db:
            db.execute(
                "DELETE FROM settled_requests WHERE writer = ? AND (seq IS NULL"
                " OR seq <= (SELECT seq FROM usage_watermarks WHERE writer = ?))",
                (writer, writer),
            )

    def spent_tokens(self, team_id: str, since_day: str) -> int:
        """Prompt + completion tokens since a day (inclusive): seeds the day/month budgets at start."""
        rows = self._read(
            "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM usage_daily"
            " WHERE team_id = ? AND day >= ?",
            (team_id, since_day),
        )
        return int(rows[0][0])


def _femtos(micros, rem_femtos) -> int:
    """A summed cost_micros and cost_rem_femtos (PostgreSQL sums BIGINT as NUMERIC) as one exact femto-USD int."""
    return int(micros) * FEMTOS_PER_MICRO + int(rem_femtos)
