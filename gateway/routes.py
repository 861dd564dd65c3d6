"""Thin routes: parse and validate the body like OpenAI does, then hand it to the admission pipeline.

Bodies are parsed once with orjson and validated with pydantic (extra="allow"); the dict that goes upstream is
the client's own, so unknown fields pass through untouched.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.auth import Principal, require_key
from gateway.errors import APIError
from gateway.state import InMemoryState

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = None
    stream_options: dict | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list | None = None


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]


async def parse_body(request: Request, schema: type[BaseModel]) -> dict:
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise APIError(400, "We could not parse the JSON body of your request.", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", "invalid_json")
    request.state.model = data.get("model")  # for the event of a request refused before admission
    try:
        schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    if data.get("n") not in (None, 1):
        raise APIError(400, "n > 1 is not supported yet; send n=1 (or leave it out).", "unsupported_value", param="n")
    return data


def validation_error(errors) -> APIError:
    """First pydantic error -> OpenAI's 400 with `param` as the dotted field path."""
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", "missing_required_parameter", param=param)
    return APIError(400, f"Invalid value for '{param}': {msg}.", "invalid_value", param=param)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, principal: Principal = Depends(require_key)) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    return await request.app.state.admission.handle(request, principal, body, "chat")


@router.post("/v1/completions")
async def completions(request: Request, principal: Principal = Depends(require_key)) -> Response:
    body = await parse_body(request, CompletionRequest)
    return await request.app.state.admission.handle(request, principal, body, "completions")


@router.get("/v1/models")
async def list_models(request: Request, principal: Principal = Depends(require_key)) -> JSONResponse:
    limits = principal.team.limits if principal.team is not None else None
    models = [
        {"id": name, "object": "model", "created": 0, "owned_by": "tokenweir"}
        for name in request.app.state.upstreams.pools
        if limits is not None and limits.allows_model(name)
    ]
    return JSONResponse({"object": "list", "data": models})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    pools = {}
    for name, pool in request.app.state.upstreams.pools.items():
        pools[name] = [
            {"instance": i.name, "circuit": "open" if i.opened_at is not None else "closed", "in_flight": i.in_flight}
            for i in pool.instances
        ]
    return JSONResponse({"status": "ok", "pools": pools})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state, m = request.app.state, request.app.state.metrics
    backend = state.state_backend
    admission = getattr(state, "admission", None)  # absent until the lifespan has started
    for team_id in list(admission.seen_teams) if admission is not None else []:
        if isinstance(backend, InMemoryState):
            snap = backend.snapshot(team_id)
        else:  # a shared backend's sync snapshot is a network read: keep it off the event loop
            snap = await asyncio.to_thread(backend.snapshot, team_id)
        m.refresh_team(team_id, snap)
    for model, queue in state.queues.items():
        m.queue_depth.labels(model).set(queue.stats()["queued"])
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
