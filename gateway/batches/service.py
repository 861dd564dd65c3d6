"""The Files and Batches APIs' operations, behind the thin routes (gateway/server/files.py, batches.py): each takes
the caller's team, and another team's id reads as missing (404, the same message as an id that never existed).
The objects returned are OpenAI's shapes (the `openai` SDK's FileObject and Batch).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson

from tokenweir.common.http.errors import APIError
from tokenweir.common.ids import random_hex
from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.batches.input_lines import parse_input
from tokenweir.gateway.batches.job import JobDeps, new_file_id
from tokenweir.gateway.batches.line_call import BATCH_ENDPOINTS, LineCaller
from tokenweir.gateway.batches.runner import BatchRunner
from tokenweir.gateway.config import GatewayConfig
from tokenweir.gateway.config.batches import BatchesConfig
from tokenweir.gateway.request.admission import Admission
from tokenweir.gateway.request.queue import DispatchQueue
from tokenweir.gateway.request.settle import Settler
from tokenweir.gateway.store.batches import BatchRecord, LineCounts
from tokenweir.gateway.store.files import FileRecord
from tokenweir.gateway.store.store import Store

UPLOAD_PURPOSES = ("batch",)  # what /v1/files takes; a batch's own files are "batch_output"
COMPLETION_WINDOWS = ("24h",)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class BatchService:
    def __init__(
        self, store: Store, config: BatchesConfig, runner: BatchRunner | None, clock: Callable[[], float] = time.time
    ) -> None:
        self.store, self.config, self.runner, self.clock = store, config, runner, clock

    @classmethod
    def for_replica(
        cls,
        store: Store,
        config: GatewayConfig,
        admission: Admission,
        settler: Settler,
        queues: dict[str, DispatchQueue],
        metrics: Metrics,
        owner: str,
    ) -> BatchService:
        """The service of one gateway replica, with its runner (started by `async with`): each batch's lines go
        through this replica's request path, the runner's lease is held as `owner`."""
        deps = JobDeps(store, LineCaller(admission, settler), queues, config.batches, metrics)
        return cls(store, config.batches, BatchRunner(deps, owner, grace_s=config.shutdown_grace_s))

    async def __aenter__(self) -> BatchService:
        if self.runner is not None:
            self.runner.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.runner is not None:
            await self.runner.close()

    # --- files ---

    async def upload(self, team_id: str, filename: str, purpose: str, data: bytes) -> FileRecord:
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(
                400, f"Invalid purpose '{_clip(purpose)}': this gateway takes files for 'batch' only.",
                "invalid_purpose", param="purpose",
            )  # fmt: skip
        content = _text(data)
        if content is None:  # kept as text in the store (PostgreSQL's TEXT takes no NUL either)
            raise APIError(400, "The file must be UTF-8 text (JSONL, one request per line).", "invalid_file", "file")
        record = FileRecord(new_file_id(), team_id, purpose, _clip(filename or "upload.jsonl"), len(data), self.now())
        return await asyncio.to_thread(self.store.create_file, record, content)

    async def file(self, team_id: str, file_id: str) -> FileRecord:
        record = await asyncio.to_thread(self.store.get_file, team_id, file_id)
        if record is None:
            raise _missing("file", file_id)
        return record

    async def content(self, team_id: str, file_id: str) -> str:
        content = await asyncio.to_thread(self.store.file_content, team_id, file_id)
        if content is None:
            raise _missing("file", file_id)
        return content

    async def list_files(self, team_id: str, purpose: str | None, after: str | None, limit: int) -> list[FileRecord]:
        return await asyncio.to_thread(self.store.list_files, team_id, purpose, after, limit)

    async def delete_file(self, team_id: str, file_id: str) -> None:
        if not await asyncio.to_thread(self.store.delete_file, team_id, file_id):
            raise _missing("file", file_id)

    # --- batches ---

    async def create(self, team_id: str, key_id: str, body: dict[str, Any]) -> BatchRecord:
        endpoint, window = body["endpoint"], body["completion_window"]
        if endpoint not in BATCH_ENDPOINTS:
            allowed = ", ".join(BATCH_ENDPOINTS)
            raise APIError(400, f"Invalid endpoint '{_clip(endpoint)}': one of {allowed}.", "invalid_value", "endpoint")
        if window not in COMPLETION_WINDOWS:
            raise APIError(
                400, "Invalid completion_window: only '24h' is supported.", "invalid_value", "completion_window"
            )
        metadata = check_metadata(body.get("metadata"))
        file_id = body["input_file_id"]
        record = await asyncio.to_thread(self.store.get_file, team_id, file_id)
        content = await asyncio.to_thread(self.store.file_content, team_id, file_id)
        if record is None or content is None:
            raise _missing("file", file_id, param="input_file_id")
        if record.purpose != "batch":
            raise APIError(400, f"The file '{file_id}' was not uploaded with purpose 'batch'.", "invalid_input_file",
                           "input_file_id")  # fmt: skip
        lines = await asyncio.to_thread(parse_input, content, endpoint, self.config.max_lines)
        now = self.now()
        batch = BatchRecord(
            id="batch_" + random_hex()[:24], team_id=team_id, key_id=key_id, endpoint=endpoint,
            input_file_id=file_id, completion_window=window, status="validating",
            metadata=orjson.dumps(metadata).decode() if metadata is not None else None, total=len(lines),
            created_at=now, expires_at=now + int(self.config.completion_window_s),
        )  # fmt: skip
        await asyncio.to_thread(self.store.create_batch, batch)
        if self.runner is not None:
            self.runner.wake()
        return batch

    async def batch(self, team_id: str, batch_id: str) -> tuple[BatchRecord, LineCounts]:
        record = await asyncio.to_thread(self.store.get_batch, team_id, batch_id)
        if record is None:
            raise _missing("batch", batch_id)
        return record, await asyncio.to_thread(self.store.line_counts, batch_id)

    async def batches(self, team_id: str, after: str | None, limit: int) -> list[tuple[BatchRecord, LineCounts]]:
        records = await asyncio.to_thread(self.store.list_batches, team_id, after, limit)
        counts = await asyncio.to_thread(lambda: [self.store.line_counts(r.id) for r in records])
        return list(zip(records, counts, strict=True))

    async def cancel(self, team_id: str, batch_id: str) -> tuple[BatchRecord, LineCounts]:
        record = await asyncio.to_thread(self.store.cancel_batch, team_id, batch_id, self.now())
        if record is None:
            raise _missing("batch", batch_id)
        if record.status not in ("cancelling", "cancelled"):
            raise APIError(409, f"The batch '{batch_id}' has already ended ({record.status}); it cannot be cancelled.",
                           "batch_not_cancellable")  # fmt: skip
        if self.runner is not None:
            self.runner.wake()
        return record, await asyncio.to_thread(self.store.line_counts, batch_id)

    def now(self) -> int:
        return int(self.clock())


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's metadata rule: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    if metadata is None:
        return None
    ok = isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_PAIRS
    ok = ok and all(
        isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE for k, v in metadata.items()
    )
    if not ok:
        raise APIError(
            400,
            f"Invalid metadata: at most {MAX_METADATA_PAIRS} string pairs, keys up to {MAX_METADATA_KEY} characters "
            f"and values up to {MAX_METADATA_VALUE}.",
            "invalid_value",
            "metadata",
        )
    return metadata


def file_object(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id, "object": "file", "bytes": record.bytes, "created_at": record.created_at,
        "filename": record.filename, "purpose": record.purpose, "status": "processed", "status_details": None,
    }  # fmt: skip


def batch_object(record: BatchRecord, counts: LineCounts) -> dict[str, Any]:
    ended = {"completed": "completed_at", "failed": "failed_at", "expired": "expired_at", "cancelled": "cancelled_at"}
    times = dict.fromkeys(ended.values())
    if record.status in ended:
        times[ended[record.status]] = record.ended_at
    return {
        "id": record.id, "object": "batch", "endpoint": record.endpoint, "errors": None,
        "input_file_id": record.input_file_id, "completion_window": record.completion_window,
        "status": record.status, "output_file_id": record.output_file_id, "error_file_id": record.error_file_id,
        "created_at": record.created_at, "in_progress_at": record.in_progress_at, "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at, "cancelling_at": record.cancelling_at, **times,
        "request_counts": {"total": record.total, "completed": counts.completed, "failed": counts.failed},
        "metadata": orjson.loads(record.metadata) if record.metadata else None,
    }  # fmt: skip


def _text(data: bytes) -> str | None:
    try:
        content = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\x00" in content else content


def _missing(what: str, ident: str, param: str | None = None) -> APIError:
    # Another team's id reads exactly as one that never existed.
    return APIError(404, f"No such {what}: '{_clip(ident)}'.", "not_found", param=param)


def _clip(text: str) -> str:
    return text if len(text) <= 256 else text[:256] + "..."
