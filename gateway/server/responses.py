"""Thin routes: OpenAI's Responses API (create, retrieve, delete, list input items) and their OpenAPI documentation.

Creating one is gateway/server/responses_create.py (the inference lane, gateway/server/lane.py, calls it ahead of
FastAPI's router, as it does the chat route); the stored ones are the team's own (gateway/store/responses.py): another
team's id answers the same 404 as a missing one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.auth.authenticator import Principal
from tokenweir.gateway.deps.callers import require_key
from tokenweir.gateway.deps.services import ServicesDep
from tokenweir.gateway.openai.endpoints import KIND_PATHS
from tokenweir.gateway.openai.responses_schema import RESPONSES
from tokenweir.gateway.server.responses_create import create_response, store_call, stored_response
from tokenweir.gateway.server.routes import _ERRORS, _SSE, _inline

router = APIRouter()


class ResponseUsage(BaseModel):
    model_config = ConfigDict(extra="allow")
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(BaseModel):
    """A response (`stream: true` gets `text/event-stream` events, response.created ... response.completed)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


_STORED: dict[int | str, dict[str, Any]] = {
    401: _ERRORS[401],
    403: _ERRORS[403],
    404: {**_ERRORS[404], "description": "No such response for this team (or it was made with store: false)."},
    503: _ERRORS[503],
}
_CREATE_DOC: dict[str, Any] = {
    "openapi_extra": {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _inline(RESPONSES.json_schema())}}}
    },
    "responses": {200: {"model": ResponseObject, "description": "The response.", "content": _SSE}, **_ERRORS},
}


@router.post(KIND_PATHS["responses"], summary="Create a response", **_CREATE_DOC)
async def create(request: Request, services: ServicesDep, principal: Principal = Depends(require_key)) -> Response:
    return await create_response(request, services, principal)


def _team_id(principal: Principal) -> str:
    if principal.team is None:
        raise APIError(403, "This key belongs to no team (admin keys manage the gateway); use a team key.", "no_team")
    return principal.team.id


@router.get(
    "/v1/responses/{response_id}",
    summary="Retrieve a stored response",
    responses={200: {"model": ResponseObject, "description": "The response."}, **_STORED},
)
async def retrieve(
    response_id: str, services: ServicesDep, principal: Principal = Depends(require_key)
) -> JSONResponse:
    found = await stored_response(services.store, _team_id(principal), response_id, "response_id")
    return JSONResponse(found.body)


@router.delete(
    "/v1/responses/{response_id}",
    summary="Delete a stored response",
    responses={200: {"model": DeletedResponse, "description": "Deleted."}, **_STORED},
)
async def delete(response_id: str, services: ServicesDep, principal: Principal = Depends(require_key)) -> JSONResponse:
    team_id = _team_id(principal)
    await stored_response(services.store, team_id, response_id, "response_id")
    if not await store_call(services.store.delete_response, team_id, response_id):  # gone meanwhile
        await stored_response(services.store, team_id, response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get(
    "/v1/responses/{response_id}/input_items",
    summary="List a stored response's input items",
    responses={200: {"model": InputItemList, "description": "The items."}, **_STORED},
)
async def list_input_items(
    response_id: str,
    services: ServicesDep,
    principal: Principal = Depends(require_key),
    after: Annotated[str | None, Query(max_length=128, description="List the items after this item id.")] = None,
    limit: Annotated[int, Query(ge=1, le=100, description="How many items, 1 to 100.")] = 20,
    order: Annotated[Literal["asc", "desc"], Query(description="Oldest first (asc) or newest first (desc).")] = "desc",
) -> JSONResponse:
    found = await stored_response(services.store, _team_id(principal), response_id, "response_id")
    items = found.input_items if order == "asc" else found.input_items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise APIError(400, f"No input item with id '{after}' in this response.", "invalid_value", param="after")
        items = items[at + 1 :]
    page = items[:limit]
    first, last = (page[0].get("id"), page[-1].get("id")) if page else (None, None)  # an upstream's item may have none
    return JSONResponse(
        {"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": len(items) > limit}
    )
