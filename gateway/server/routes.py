"""Thin routes: the /v1 endpoints (parse and validate the body like OpenAI does, then hand it to the admission
pipeline: chat, completions, embeddings; the team's models to list or retrieve) and their OpenAPI documentation.

Parsing and validation live in gateway.openai.body, the request schemas in gateway.openai.schema. The request schemas
are published in the OpenAPI document through `openapi_extra` (built from the same models), so FastAPI documents the
body without parsing it a second time.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, TypeAdapter

from tokenweir.common.http.errors import APIError
from tokenweir.gateway.auth.authenticator import Principal
from tokenweir.gateway.deps.callers import require_key
from tokenweir.gateway.deps.services import Services, ServicesDep
from tokenweir.gateway.openai.body import check_body, orjson_body
from tokenweir.gateway.openai.endpoints import KIND_PATHS, InferenceKind
from tokenweir.gateway.openai.error_body import ErrorBody
from tokenweir.gateway.openai.schema import CHAT, COMPLETION, EMBEDDING
from tokenweir.gateway.request.context import request_scope
from tokenweir.gateway.server.me import key_info
from tokenweir.gateway.upstream.pools import Upstreams

router = APIRouter()

# --- OpenAPI ----------------------------------------------------------------------------------------------------


def _inline(schema: dict) -> dict:
    """The model's JSON schema with its `$defs` references inlined: self-contained, as `openapi_extra` needs."""
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**resolve(defs[ref.removeprefix("#/$defs/")]), **resolve(rest)}
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Choice(BaseModel):
    model_config = ConfigDict(extra="allow")
    index: int
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    """Non-stream answer (`stream: true` gets `text/event-stream` chunks ending with `data: [DONE]`)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class TextCompletion(ChatCompletion):
    object: str = "text_completion"


class EmbeddingUsage(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    model_config = ConfigDict(extra="allow")
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format "base64"


class EmbeddingList(BaseModel):
    model_config = ConfigDict(extra="allow")
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int | None = None  # the context length, where known (tokenweir, as vLLM reports it)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _err(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


_ERRORS = {
    400: _err("Invalid request: `param` names the field (a dotted path such as 'messages.0.content')."),
    401: _err("Missing, malformed, unknown, revoked or expired API key."),
    403: _err("The key has no team, the team is disabled, or it may not use this model."),
    404: _err("No such model."),
    413: _err("The body is larger than the gateway's limit."),
    429: _err("Rate limit, budget, concurrency or queue full; see `Retry-After`."),
    503: _err("No upstream could serve the request, or the gateway is not ready; retry."),
    504: _err("The upstream timed out."),
}
_SSE = {"text/event-stream": {"schema": {"type": "string", "description": "Server-sent events (stream: true)."}}}


def _inference_doc(schema: TypeAdapter, answer: type[BaseModel], stream: bool = True) -> dict:
    ok = {"model": answer, "description": "The completion.", "content": _SSE} if stream else {"model": answer}
    return {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _inline(schema.json_schema())}},
            }
        },
        "responses": {200: ok, **_ERRORS},
    }


# --- routes -----------------------------------------------------------------------------------------------------


_SCHEMAS: dict[InferenceKind, TypeAdapter] = {"chat": CHAT, "completions": COMPLETION, "embeddings": EMBEDDING}


async def inference_response(
    request: Request, services: Services, principal: Principal, kind: InferenceKind
) -> Response:
    """The body read, parsed once and validated, then the admission pipeline's answer. Called by the routes below
    and by the inference lane (gateway/server/lane.py), which serves these paths ahead of FastAPI's router."""
    raw = await request.body()
    data = orjson_body(raw)
    request_scope(request).model = data.get("model")  # for the event of a request refused before admission
    body = check_body(data, raw, _SCHEMAS[kind])
    return await services.path.admission.handle(request, principal, body, kind)


@router.post(KIND_PATHS["chat"], summary="Create a chat completion", **_inference_doc(CHAT, ChatCompletion))
async def chat_completions(
    request: Request, services: ServicesDep, principal: Principal = Depends(require_key)
) -> Response:
    return await inference_response(request, services, principal, "chat")


@router.post(
    KIND_PATHS["completions"], summary="Create a text completion", **_inference_doc(COMPLETION, TextCompletion)
)
async def completions(request: Request, services: ServicesDep, principal: Principal = Depends(require_key)) -> Response:
    return await inference_response(request, services, principal, "completions")


@router.post(
    KIND_PATHS["embeddings"], summary="Create embeddings", **_inference_doc(EMBEDDING, EmbeddingList, stream=False)
)
async def embeddings(request: Request, services: ServicesDep, principal: Principal = Depends(require_key)) -> Response:
    return await inference_response(request, services, principal, "embeddings")


@router.get(
    "/v1/models",
    summary="List the models this key may use",
    responses={200: {"model": ModelList, "description": "The models."}, 401: _ERRORS[401], 403: _ERRORS[403]},
)
async def list_models(services: ServicesDep, principal: Principal = Depends(require_key)) -> JSONResponse:
    upstreams = services.upstreams
    names = [*upstreams.pools, *upstreams.aliases]
    return JSONResponse({"object": "list", "data": [_card(n, upstreams) for n in names if principal.may_use(n)]})


@router.get(
    "/v1/models/{model_id:path}",
    summary="Retrieve a model this key may use",
    responses={200: {"model": ModelCard, "description": "The model."}, **{k: _ERRORS[k] for k in (401, 403, 404)}},
)
async def retrieve_model(
    model_id: str, services: ServicesDep, principal: Principal = Depends(require_key)
) -> JSONResponse:
    upstreams = services.upstreams
    known = model_id in upstreams.pools or model_id in upstreams.aliases
    if not known or not principal.may_use(model_id):  # not allowed reads as not there
        raise APIError(
            404,
            f"The model '{_clip(model_id)}' does not exist or you do not have access to it.",
            "model_not_found",
            param="model",
        )
    return JSONResponse(_card(model_id, upstreams))


def _card(name: str, upstreams: Upstreams) -> dict:
    """A pool's card, or an alias's: the shortest context of its variants' pools (any of them may serve a key)."""
    if name in upstreams.pools:
        length = upstreams.pools[name].max_model_len
    else:
        lengths = [upstreams.pools[v.pool].max_model_len for v in upstreams.aliases[name].variants]
        length = min((n for n in lengths if n is not None), default=None)
    return {"id": name, "object": "model", "created": 0, "owned_by": "tokenweir", "max_model_len": length}


def _clip(text: str) -> str:
    return text if len(text) <= 256 else text[:256] + "..."


@router.get(
    "/v1/me",
    summary="This key's limits, its team's, and what is left to it now",
    responses={401: _ERRORS[401], 403: _ERRORS[403]},
)
async def me(services: ServicesDep, principal: Principal = Depends(require_key)) -> JSONResponse:
    return JSONResponse(await key_info(services, principal))
