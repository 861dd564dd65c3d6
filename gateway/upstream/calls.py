"""The gateway's HTTP calls to one upstream hop: a non-stream call, a stream opened up to its headers, and our
engine's /abort.

One shared keep-alive pool (`gateway.upstream.client`: aiohttp's client; httpx cost more CPU than the rest of the
gateway on this path). Failures before the first byte raise `UpstreamFailed` (the caller tries the next hop) or
`UpstreamRejected` (a 4xx: the client's fault, passed through). Deadlines are `loop.time()` instants applied with
`asyncio.timeout_at`, so one deadline covers connect, headers and body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import orjson

from tokenweir.common.logging import get_logger
from tokenweir.gateway.upstream.client import HTTPError, UpstreamClient, request_json
from tokenweir.gateway.upstream.pools import Hop
from tokenweir.gateway.upstream.sse import SSEStream

log = get_logger()


class UpstreamFailed(Exception):
    """The hop failed before any byte reached the client (connection error, 5xx): try the next hop.

    Its text is what a tenant may read (the hop's pool and instance name, what went wrong); `detail` adds what only
    the operator may: the instance's address and the connection error (the log, the request's event)."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail or message


def failed(hop: Hop, reason: str, cause: object = None) -> UpstreamFailed:
    """The hop failed: logged in full now (a retried hop leaves no other trace of why), remembered on the hop for
    the request's event, raised to the tenant as `reason` only (`cause` names addresses)."""
    detail = f"{hop.where}: {cause or reason}"
    hop.error = detail
    log.warning("upstream_failed", upstream=hop.label, base_url=hop.instance.cfg.base_url, error=str(cause or reason))
    return UpstreamFailed(f"{hop.public_label}: {reason}", detail)


class UpstreamRejected(Exception):
    """The upstream refused the request (4xx): the client's input, not the instance, is at fault."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upstream answered {status}")
        self.status, self.body = status, body


# Engine error codes that end a request it was running: the request may be the cause (a poison input), so it goes to
# no other instance, where it could do the same.
REQUEST_FAULT_CODES = frozenset({"request_failed", "engine_loop_died"})


def request_fault(hop: Hop, error: object) -> UpstreamRejected | None:
    """An engine's error (a JSON body's or a stream's error event) that the request caused or may have caused, as
    what the client gets instead of a retry on the next hop: the engine's own 4xx, or a 502 for a failure inside it.
    None for any other error (the instance's: the next hop may serve the request)."""
    if not hop.instance.cfg.engine or not isinstance(error, dict):
        return None
    if error.get("code") in REQUEST_FAULT_CODES:
        message = (
            f"{hop.public_label} failed while serving this request ({error.get('message')}); it is not retried on "
            "another instance, since the request itself may be the cause."
        )
        error = {"message": message, "type": "upstream_error", "param": None, "code": "upstream_request_failed"}
        return UpstreamRejected(502, orjson.dumps({"error": error}))
    if error.get("type") == "invalid_request_error":
        return UpstreamRejected(400, orjson.dumps({"error": error}))
    return None


def _error_of(raw: bytes) -> object:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return obj.get("error") if isinstance(obj, dict) else None


def failure_reason(status: int) -> str:
    """A status that is the instance's failure, not the client's: a 5xx, a 429, or a 401 (the tenant's key never
    goes upstream: a refused key is the gateway's, a configuration fault)."""
    if status == 401:
        return "HTTP 401: the instance refused the gateway's API key"
    return f"HTTP {status}"


def refusal(hop: Hop, status: int, body: bytes) -> UpstreamFailed | UpstreamRejected:
    """What a non-200 answer raises: the instance's failure (a 5xx, 429 or 401: the next hop may serve the request),
    unless our engine says the request itself caused it; any other status, the client's (passed through)."""
    if status >= 500 or status == 429 or status == 401:
        return request_fault(hop, _error_of(body)) or failed(hop, failure_reason(status))
    return UpstreamRejected(status, body)


def answer_fault(path: str, answer: object) -> str | None:
    """Why a 200 JSON answer to `path` is no answer (a failure of the hop: the next one may serve the request, and
    nothing of it is relayed or billed), or None: an object with a non-empty list of `choices` (chat, completions)
    or of `data` (embeddings), each an object; or a response object (/v1/responses, passed through)."""
    if not isinstance(answer, dict):
        return "an answer that is not a JSON object"
    if path.endswith("/responses"):
        return None if answer.get("object") == "response" else "an answer that is not a response object"
    key = "data" if path.endswith("/embeddings") else "choices"
    items = answer.get(key)
    if not isinstance(items, list) or not items or not all(isinstance(item, dict) for item in items):
        return f"an answer without {key}"
    return None


def make_client(connect_s: float = 5.0) -> UpstreamClient:
    # No read timeout of its own: our deadlines bound reads (a long stream may pause between tokens).
    return UpstreamClient(connect_timeout_s=connect_s)


def upstream_request(
    hop: Hop, body: dict[str, Any], request_id: str, stream: bool, extra: Mapping[str, str] | None = None
) -> tuple[str, bytes, dict[str, Any]]:
    """URL, JSON bytes and headers for this hop: model name mapped; engines asked for usage on every chunk; `extra`
    headers the gateway adds for this hop (gateway/request/attempt.py: a trace's `traceparent`, the team an engine
    schedules fairly by)."""
    inst = hop.instance
    out = dict(body)
    out["model"] = inst.upstream_model(hop.model)
    if stream:
        opts = {"include_usage": True}
        if inst.cfg.engine:
            opts["continuous_usage_stats"] = True
        out["stream_options"] = opts
    headers = {"content-type": "application/json", "x-request-id": request_id, **inst.auth_headers()}
    if extra:
        headers.update(extra)
    return inst.cfg.base_url, orjson.dumps(out), headers


async def call_json(
    client: UpstreamClient,
    hop: Hop,
    path: str,
    body: dict[str, Any],
    request_id: str,
    deadline: float,
    extra: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], bytes]:
    """Non-stream request -> (parsed JSON, raw body): a 200 whose body is an answer (`answer_fault`); anything else
    is the hop's failure (UpstreamFailed) or the client's (UpstreamRejected). TimeoutError past the deadline."""
    base, content, headers = upstream_request(hop, body, request_id, False, extra)
    async with asyncio.timeout_at(deadline):
        try:
            r = await client.request("POST", base + path, content, headers)
            try:
                raw = await r.read()
            finally:
                await r.aclose()
        except HTTPError as e:
            raise failed(hop, "connection failed", e) from e
    if r.status_code != 200:
        raise refusal(hop, r.status_code, raw)
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise failed(hop, "invalid JSON body") from e
    if (fault := answer_fault(path, answer)) is not None:
        raise failed(hop, fault)
    return answer, raw


async def open_stream(
    client: UpstreamClient,
    hop: Hop,
    path: str,
    body: dict[str, Any],
    request_id: str,
    deadline: float,
    extra: Mapping[str, str] | None = None,
) -> SSEStream:
    """Send a stream request and wait for a 200 and its headers."""
    # A Responses stream reports its usage in its last event; its stream_options take no include_usage
    base, content, headers = upstream_request(hop, body, request_id, not path.endswith("/responses"), extra)
    async with asyncio.timeout_at(deadline):
        try:
            response = await client.request("POST", base + path, content, headers)
        except HTTPError as e:
            raise failed(hop, "connection failed", e) from e
        if response.status_code != 200:
            try:
                data = await response.read()
            except HTTPError:
                data = b""
            finally:
                await response.aclose()
            raise refusal(hop, response.status_code, data)
    return SSEStream(response)


async def abort(client: UpstreamClient, hop: Hop, request_id: str) -> dict[str, Any] | None:
    """Tell our engine to stop `request_id`; its answer carries the exact usage made. None if it cannot say."""
    headers = {"content-type": "application/json", **hop.instance.auth_headers()}
    body = orjson.dumps({"request_id": request_id})
    answer = await request_json(client, "POST", hop.instance.cfg.base_url + "/abort", body, headers, timeout_s=5.0)
    return answer if isinstance(answer, dict) else None
