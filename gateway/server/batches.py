"""Thin routes of the Batches API (/v1/batches): create a batch from an uploaded input file, retrieve, list and
cancel the team's batches. The operations are gateway/batches/service.py's; the runner (gateway/batches/runner.py)
runs each batch's lines through the request path.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from tokenweir.gateway.auth.authenticator import Principal
from tokenweir.gateway.batches.schema import CREATE_BATCH
from tokenweir.gateway.batches.service import batch_object
from tokenweir.gateway.deps.callers import require_key
from tokenweir.gateway.deps.services import ServicesDep
from tokenweir.gateway.openai.body import check_body, orjson_body
from tokenweir.gateway.server.files import ERRORS, team_id_of
from tokenweir.gateway.store.batches import LineCounts

router = APIRouter()
_NO_LINES = LineCounts(0, 0)  # a batch just created has no line ended


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    expires_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


_BATCH_ERRORS = {**ERRORS, 404: {**ERRORS[404], "description": "No such batch or input file (another team's reads "
                                                               "the same)."}}  # fmt: skip
_CREATE_DOC = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": CREATE_BATCH.json_schema()}},
    }
}


@router.post(
    "/v1/batches",
    summary="Create a batch from an uploaded input file",
    openapi_extra=_CREATE_DOC,
    responses={200: {"model": BatchObject}, **_BATCH_ERRORS},
)
async def create_batch(request: Request, services: ServicesDep, principal: Principal = Depends(require_key)):
    team_id = team_id_of(principal)
    raw = await request.body()
    body: dict[str, Any] = check_body(orjson_body(raw), raw, CREATE_BATCH)
    batch = await services.batches.create(team_id, principal.key.id, body)
    return JSONResponse(batch_object(batch, _NO_LINES))


@router.get("/v1/batches", summary="List the team's batches", responses={200: {"model": BatchList}, **_BATCH_ERRORS})
async def list_batches(
    services: ServicesDep,
    principal: Principal = Depends(require_key),
    after: str | None = Query(None, max_length=256),
    limit: int = Query(20, ge=1, le=100),
) -> JSONResponse:
    found = await services.batches.batches(team_id_of(principal), after, limit + 1)
    data = [batch_object(record, counts) for record, counts in found[:limit]]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return JSONResponse({"object": "list", "data": data, "first_id": first, "last_id": last,
                         "has_more": len(found) > limit})  # fmt: skip


@router.get(
    "/v1/batches/{batch_id}", summary="Retrieve a batch", responses={200: {"model": BatchObject}, **_BATCH_ERRORS}
)
async def retrieve_batch(batch_id: str, services: ServicesDep, principal: Principal = Depends(require_key)):
    return JSONResponse(batch_object(*await services.batches.batch(team_id_of(principal), batch_id)))


@router.post(
    "/v1/batches/{batch_id}/cancel",
    summary="Cancel a batch: no further line starts; the running ones end",
    responses={200: {"model": BatchObject}, 409: {**ERRORS[400], "description": "The batch has ended."},
               **_BATCH_ERRORS},
)  # fmt: skip
async def cancel_batch(batch_id: str, services: ServicesDep, principal: Principal = Depends(require_key)):
    return JSONResponse(batch_object(*await services.batches.cancel(team_id_of(principal), batch_id)))
