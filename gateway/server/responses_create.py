"""POST /v1/responses: a Responses request served as a chat through the one admission pipeline, its answer given back
in the Responses API's shape, and kept (with `store`, OpenAI's default) for a later turn, a retrieve or a delete.

The steps: the body checked (gateway/openai/responses_schema.py); the previous response's items loaded, the team's
only (`previous_response_id`); the chat built from them and the new input (gateway/openai/responses_input.py); then
`Admission.handle` with kind "responses", so budgets, priorities, routing, the event and metrics are exactly a chat's,
while the upstream is sent a chat. A whole answer is translated once it is billed (responses_output.py); a stream's
writes are rewritten on their way out (responses_stream.py), the pipeline still relaying, counting and settling it
(and a client that leaves still cancelling it). The response is stored as it was answered, with its input items.

A hop to a pool that serves /v1/responses itself (`serves_responses`) is sent the request as it is instead
(`passthrough_body`: the earlier turns written into its input; gateway/request/context.py hop_kind), and its answer,
already a response, is only made this gateway's (responses_output.passed_through), streamed or whole.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Message, Send

from tokenweir.common.http.errors import APIError
from tokenweir.common.ids import random_hex
from tokenweir.common.logging import get_logger
from tokenweir.gateway.auth.authenticator import Principal
from tokenweir.gateway.deps.services import Services
from tokenweir.gateway.openai import responses_output
from tokenweir.gateway.openai.body import check_body, orjson_body
from tokenweir.gateway.openai.responses_input import chat_body, input_items, passthrough_body
from tokenweir.gateway.openai.responses_schema import RESPONSES, check_supported
from tokenweir.gateway.openai.responses_stream import ResponseEvents
from tokenweir.gateway.request.context import request_scope
from tokenweir.gateway.request.relay import StreamResponse
from tokenweir.gateway.store.db import DB_ERRORS
from tokenweir.gateway.store.responses import StoredResponse
from tokenweir.gateway.store.store import Store

log = get_logger()
T = TypeVar("T")

# What an id of ours looks like; anything else is no stored response (and never reaches a query)
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def new_id(prefix: str) -> str:
    return f"{prefix}_{random_hex()}"


async def store_call(fn: Callable[..., T], *args: Any) -> T:
    """A store call off the event loop; a store that is away is a 503, never a 500."""
    try:
        return await asyncio.to_thread(fn, *args)
    except DB_ERRORS as exc:
        raise APIError(
            503,
            f"The response store is unavailable ({type(exc).__name__}); retry shortly.",
            "store_unavailable",
            headers={"retry-after": "1"},
        ) from exc


async def stored_response(store: Store, team_id: str, response_id: str, param: str) -> StoredResponse:
    """The team's stored response `response_id`; another team's reads as missing (the same 404)."""
    found = await store_call(store.get_response, team_id, response_id) if _ID.fullmatch(response_id) else None
    if found is None:
        shown = response_id[:128]
        if param == "previous_response_id":
            raise APIError(404, f"Previous response with id '{shown}' not found.", "previous_response_not_found", param)
        raise APIError(404, f"No response found with id '{shown}'.", "response_not_found", param)
    return found


async def create_response(request: Request, services: Services, principal: Principal) -> Response:
    raw = await request.body()
    data = orjson_body(raw)
    request_scope(request).model = data.get("model")  # for the event of a request refused before admission
    check_supported(data)
    body = check_body(data, raw, RESPONSES)
    items = input_items(body, new_id)
    previous_id = body.get("previous_response_id")
    if previous_id is not None and principal.team is not None:  # a key without a team: admission refuses it
        previous = await stored_response(services.store, principal.team.id, previous_id, "previous_response_id")
        items = [*previous.input_items, *previous.body.get("output", []), *items]
    envelope = responses_output.envelope(body, new_id("resp"), int(time.time()))
    # a pool that serves /v1/responses is passed the request itself (gateway/request/context.py hop_kind)
    request_scope(request).responses_body = passthrough_body(body, items)
    answer = await services.path.admission.handle(request, principal, chat_body(body, items), "responses")
    keep = _keeper(services.store, principal, body, items)
    if isinstance(answer, StreamResponse):
        answer.pump = _translated(answer.pump, ResponseEvents(envelope, new_id), keep)
        return answer
    if answer.status_code != 200:  # the upstream refused it: its OpenAI error as it came
        return answer
    made = orjson.loads(answer.body)
    if made.get("object") == "response":  # passed through: the upstream's own response, made ours
        response = responses_output.passed_through(made, envelope)
    else:
        response = responses_output.from_chat(made, envelope, new_id)
    await keep(response)
    headers = {k: v for k, v in answer.headers.items() if k.startswith("x-")}  # x-ratelimit-*, as chat's
    return JSONResponse(response, headers=headers)


def _keeper(
    store: Store, principal: Principal, body: dict[str, Any], items: list[dict[str, Any]]
) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """What keeps a finished response (nothing, with `store: false`). The answer is billed already: a store that
    fails now is logged, and the answer still given."""

    async def keep(response: dict[str, Any]) -> None:
        if not response["store"] or principal.team is None:
            return
        stored = StoredResponse(response["id"], principal.team.id, body.get("previous_response_id"), response, items)
        try:
            await asyncio.to_thread(store.save_response, stored)
        except DB_ERRORS:
            log.exception("response_not_stored", response_id=response["id"])

    return keep


def _translated(
    pump: Callable[[Send], Awaitable[bool]],
    events: ResponseEvents,
    keep: Callable[[dict[str, Any]], Awaitable[None]],
) -> Callable[[Send], Awaitable[bool]]:
    """The stream's pump, its writes rewritten as Responses events (the first led by response.created, the last
    ended by the response's final event, once the response is kept)."""

    async def pump_events(send: Send) -> bool:
        async def send_events(message: Message) -> None:
            out = events.feed(message.get("body", b""))
            more = bool(message.get("more_body", False))
            if not more:
                out += events.end()
                assert events.final is not None  # end() made it
                await keep(events.final)
            await send({"type": "http.response.body", "body": out, "more_body": more})

        return await pump(send_events)

    return pump_events
