"""One request-id rule for both servers: the id the gateway keeps is the id the engine runs (and aborts) under."""

from __future__ import annotations

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from tokenweir.common.http.request_id import is_sane_request_id, request_id_from


@pytest.mark.parametrize("value", ["req-abc", "job/42#1", "a:b.c_d-e", "x" * 128, "tenant|7@host"])
def test_sane_ids_are_kept(value):
    assert is_sane_request_id(value)
    assert request_id_from(value) == value


@pytest.mark.parametrize("value", [None, "", "has space", "x" * 129, "naïve", "tab\there", "line\nbreak"])
def test_other_ids_are_replaced_by_a_fresh_one(value):
    assert not is_sane_request_id(value)
    minted = request_id_from(value)
    assert minted.startswith("req-") and len(minted) == 36 and minted != request_id_from(value)
    assert request_id_from(value, prefix="").isalnum()


async def _echo_request_id(scope: Scope, receive: Receive, send: Send) -> None:
    body = scope["state"]["request_id"].encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("sent", ["job/42#1", "req-0123abcd", "tenant|7@host"])
async def test_the_engine_runs_a_request_under_the_id_the_gateway_sent(sent):
    """The gateway keeps any sane client id and forwards it; the engine must run under the same id, or the gateway's
    abort (client gone, timeout) names a request the engine does not know and its tokens are made for nobody."""
    from tokenweir.engine.api.app import RequestIdMiddleware

    app = RequestIdMiddleware(_echo_request_id)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
        response = await client.get("/", headers={"x-request-id": sent})
    assert response.text == sent
    assert response.headers["x-request-id"] == sent
    assert request_id_from(sent) == sent  # and the gateway keeps it too
