"""Thin routes of the Files API (/v1/files): upload a batch input file, list, retrieve, read and delete the team's
files. The operations are gateway/batches/service.py's; an upload's size is bounded by the middleware
(`batches.max_file_bytes`, 413 file_too_large) before its body is read.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.datastructures import UploadFile

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.auth.authenticator import Principal
from tokenweir.gateway.batches.service import file_object
from tokenweir.gateway.deps.callers import require_key
from tokenweir.gateway.deps.services import ServicesDep
from tokenweir.gateway.openai.error_body import ErrorBody

router = APIRouter()


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


ERRORS: dict[int | str, dict[str, Any]] = {
    400: _err("Invalid request: `param` names the field."),
    401: _err("Missing, malformed, unknown, revoked or expired API key."),
    403: _err("The key has no team (admin keys manage the gateway), or the team is disabled."),
    404: _err("No such file (another team's reads the same)."),
}
_UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "JSONL, one request a line."},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}


def team_id_of(principal: Principal) -> str:
    if principal.team is None:
        raise APIError(403, "This key belongs to no team (admin keys manage the gateway); use a team key.", "no_team")
    return principal.team.id


@router.post(
    "/v1/files",
    summary="Upload a file (purpose 'batch': a batch's input, JSONL)",
    openapi_extra=_UPLOAD_DOC,
    responses={200: {"model": FileObject}, **ERRORS, 413: _err("The file is larger than the gateway's limit.")},
)
async def upload_file(request: Request, services: ServicesDep, principal: Principal = Depends(require_key)):
    team_id = team_id_of(principal)
    form = await request.form(max_files=1, max_fields=4)
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "Missing the 'file' part: send the file as multipart/form-data.", "missing_file", "file")
    if not isinstance(purpose, str):
        raise APIError(400, "Missing the 'purpose' field: 'batch'.", "missing_purpose", "purpose")
    try:
        data = await upload.read()
    finally:
        await form.close()
    record = await services.batches.upload(team_id, upload.filename or "", purpose, data)
    return JSONResponse(file_object(record))


@router.get("/v1/files", summary="List the team's files", responses={200: {"model": FileList}, **ERRORS})
async def list_files(
    services: ServicesDep,
    principal: Principal = Depends(require_key),
    purpose: str | None = Query(None, max_length=64),
    after: str | None = Query(None, max_length=256),
    limit: int = Query(10_000, ge=1, le=10_000),
    order: Literal["desc"] = Query("desc"),
) -> JSONResponse:
    records = await services.batches.list_files(team_id_of(principal), purpose, after, limit + 1)
    data = [file_object(r) for r in records[:limit]]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    body = {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": len(records) > limit}
    return JSONResponse(body)


@router.get("/v1/files/{file_id}", summary="Retrieve a file", responses={200: {"model": FileObject}, **ERRORS})
async def retrieve_file(
    file_id: str, services: ServicesDep, principal: Principal = Depends(require_key)
) -> JSONResponse:
    return JSONResponse(file_object(await services.batches.file(team_id_of(principal), file_id)))


@router.get(
    "/v1/files/{file_id}/content",
    summary="A file's content",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string"}}}}, **ERRORS},
)
async def file_content(file_id: str, services: ServicesDep, principal: Principal = Depends(require_key)) -> Response:
    content = await services.batches.content(team_id_of(principal), file_id)
    return Response(content.encode(), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", summary="Delete a file", responses={200: {"model": FileDeleted}, **ERRORS})
async def delete_file(file_id: str, services: ServicesDep, principal: Principal = Depends(require_key)) -> JSONResponse:
    await services.batches.delete_file(team_id_of(principal), file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
