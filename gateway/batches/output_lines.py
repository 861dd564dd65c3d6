"""A batch's output and error files, in OpenAI's output line format, from its lines' rows in the store:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"}, "error": null}

A line answered 2xx goes to the output file; one answered otherwise goes to the error file with its response; one
never answered (expired, cancelled, stopped at the budget, interrupted) goes there with `response` null and `error`
{code, message}. Lines are written in the input file's order.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenweir.gateway.store.batches import LineRow

# Why a line was never answered: its error's code and message
UNANSWERED = {
    "budget_exhausted": "Not run: the batch stopped when the team's or key's budget was exhausted.",
    "batch_expired": "Not run: the batch's completion window ended first.",
    "batch_cancelled": "Not run: the batch was cancelled first.",
    "interrupted": (
        "The gateway replica running this line stopped before its answer was recorded; it may have been served and "
        "billed, so it was not run again. Resubmit it if you need its answer."
    ),
}


def answered_ok(row: LineRow) -> bool:
    return row.status_code is not None and 200 <= row.status_code < 300


def output_line(batch_id: str, row: LineRow) -> dict[str, Any]:
    response = None
    if row.status_code is not None:
        body = orjson.loads(row.body) if row.body else None
        response = {"status_code": row.status_code, "request_id": row.request_id, "body": body}
    error = None
    if row.status_code is None:
        error = {"code": row.error_code, "message": row.error_message or UNANSWERED.get(row.error_code or "", "")}
    return {"id": f"batch_req_{batch_id.removeprefix('batch_')}_{row.line}", "custom_id": row.custom_id,
            "response": response, "error": error}  # fmt: skip


def output_files(batch_id: str, rows: list[LineRow]) -> tuple[str, str]:
    """(output file, error file) as JSONL text; either may be empty."""
    ok: list[bytes] = []
    failed: list[bytes] = []
    for row in rows:
        (ok if answered_ok(row) else failed).append(orjson.dumps(output_line(batch_id, row)) + b"\n")
    return b"".join(ok).decode(), b"".join(failed).decode()
