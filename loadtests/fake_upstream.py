"""A minimal, fast OpenAI-compatible upstream for tests and benchmarks (raw ASGI, no validation layer).

It speaks /v1/chat/completions and /v1/completions (stream and non-stream, `n` choices), /v1/embeddings
(deterministic vectors, float or base64), /v1/models, /health, /load and /abort like our engine server does, and
keeps exact counters so tests can check the gateway's accounting, and the last bodies it received (`received`).

Knobs (per request, in the body so they pass through the gateway as extra fields):
  "fake": {"ttft_ms": 0, "itl_ms": 0, "tokens": 16, "status": 200, "fail_after": None}
  - ttft_ms: delay before the first chunk (non-stream: before the whole response)
  - itl_ms: delay between stream chunks
  - tokens: completion tokens to make (capped by max_tokens)
  - status: answer with this HTTP status and an OpenAI error body instead
  - error: {"type": ..., "code": ...} of that error body (a stream with status 200: one error event, then [DONE],
    as our engine ends a stream whose request failed)
  - fail_after: a stream that breaks (connection cut) after this many chunks
  - usage: false to send no usage at all (an upstream that ignores stream_options)
  - overrun: true to make `tokens` whatever max_tokens says (an upstream that ignores it)
  - arrive_ms: the request reaches the model this much later (still on the wire); aborted before then, it is refused
    on arrival and makes nothing, as our engine does
Server-wide: `FakeUpstream.fail_next` (answer the next N requests with 503), `.down` (every request 503), `.garbage`
(every chat or completion answered 200 with a JSON object that has usage but no `choices`).
Token rule: a prompt costs one token per whitespace-separated word (+1 per chat message), a token-id prompt its
length; each stream chunk is one token; n choices make n x tokens, for each prompt of a completions batch. An
embedding input costs what a prompt does. A choice that makes max_tokens ends with finish_reason "length", one that
makes fewer (the `tokens` knob) with "stop". A chat with `tools` whose tool_choice is "required" or names a function
calls that function (or the first tool) instead of writing text: arguments `{"tok": "tok"}` in TOOL_ARGUMENTS'
pieces (one token each), finish_reason "tool_calls".
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import socket
import struct
import time
from dataclasses import dataclass, field

import orjson
import uvicorn

from loadtests import fake_responses
from tokenweir.common.text import prefix_hash


@dataclass
class FakeRecord:
    request_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    status: str = "running"  # running | finished | aborted | cancelled
    stream: bool = False


@dataclass
class FakeUpstream:
    model: str = "fake-model"
    records: dict[str, FakeRecord] = field(default_factory=dict)
    aborts: list[str] = field(default_factory=list)
    aborted_unseen: set[str] = field(default_factory=set)  # aborted before they arrived: refused if they do
    fail_next: int = 0
    down: bool = False
    garbage: bool = False
    requests_seen: int = 0
    max_model_len: int | None = 2048  # what /v1/models reports (as our engine does)
    ttft_ms: float = 0.0  # added to every answer's first-token delay (a slower model version)
    itl_ms: float = (
        0.0  # every stream's delay between chunks where its body sets none (a client that cannot send knobs)
    )
    received: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))  # (path, body)
    # the x-gateway-inference-fairness-id each of those came with (None: none), as our engine reads it
    fairness_ids: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    # /load says it caches prompt prefixes in blocks of this many tokens, hashed as our engine hashes them (so a
    # gateway routes to it by prefix); None: /load says nothing of a cache
    block_size: int | None = None
    in_progress: int = 0  # chat and completion requests being answered now
    peak_in_progress: int = 0  # the most at once

    # --- counters for tests ---------------------------------------------------------------------------
    def totals(self) -> tuple[int, int]:
        return (
            sum(r.prompt_tokens for r in self.records.values()),
            sum(r.completion_tokens for r in self.records.values()),
        )

    def running(self) -> int:
        return sum(1 for r in self.records.values() if r.status == "running")

    # --- ASGI -------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path in ("/health", "/load", "/v1/models"):
            if path == "/health":
                return await _json(send, 503 if self.down else 200, {"status": "ok"})
            if path == "/load":
                load = {"num_running": self.running(), "num_waiting": 0, "kv_cache_usage": 0.0, "num_free_blocks": 1000}
                if self.block_size is not None:
                    probe = prefix_hash.probe(self.block_size)
                    load |= {"block_size": self.block_size, "prefix_caching": True, "prefix_hash_probe": probe}
                return await _json(send, 200, load)
            card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
            return await _json(send, 200, {"object": "list", "data": [card]})
        if method != "POST":
            return await _json(send, 404, _err("not found", "not_found_error", "not_found"))
        body = await _read_body(receive)
        try:
            req = orjson.loads(body)
        except orjson.JSONDecodeError:
            return await _json(send, 400, _err("bad json", "invalid_request_error", "invalid_json"))
        if path == "/abort":
            return await self._abort(send, req)
        if path == "/v1/responses":  # an external server that serves the Responses API itself
            return await self._respond(send, req)
        if path not in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            return await _json(send, 404, _err("not found", "not_found_error", "not_found"))
        self.requests_seen += 1
        self.received.append((path, req))
        fairness_id = dict(scope["headers"]).get(b"x-gateway-inference-fairness-id")
        self.fairness_ids.append(fairness_id.decode() if fairness_id is not None else None)
        if self.down or self.fail_next > 0:
            self.fail_next = max(0, self.fail_next - 1)
            return await _json(send, 503, _err("upstream down", "service_unavailable", "unavailable"))
        knobs = req.get("fake") or {}
        if self.ttft_ms:
            knobs = {**knobs, "ttft_ms": (knobs.get("ttft_ms") or 0) + self.ttft_ms}
        if self.itl_ms:
            knobs = {**knobs, "itl_ms": knobs.get("itl_ms") or self.itl_ms}
        error = {"type": "invalid_request_error", "code": "injected", **(knobs.get("error") or {})}
        if knobs.get("status", 200) != 200:
            return await _json(send, knobs["status"], _err("injected", error["type"], error["code"]))
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode() or f"fake-{self.requests_seen}"
        if path == "/v1/embeddings":
            return await self._embed(send, req, rid)
        if self.garbage:
            usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
            return await _json(send, 200, {"id": f"cmpl-{rid}", "object": "text_completion", "usage": usage})
        chat = path == "/v1/chat/completions"
        if knobs.get("arrive_ms"):  # still on its way to the engine this long (a slow network, a busy server)
            await asyncio.sleep(knobs["arrive_ms"] / 1000)
        if rid in self.aborted_unseen:  # as our engine does: it makes nothing for a request aborted on the way
            self.aborted_unseen.discard(rid)
            self.records[rid] = FakeRecord(rid, 0, status="aborted", stream=bool(req.get("stream")))
            return await _json(send, 499, _err("aborted", "invalid_request_error", "aborted"))
        record = FakeRecord(rid, _count_prompt(req, chat), stream=bool(req.get("stream")))
        self.records[rid] = record
        # As OpenAI and vLLM read them: chat prefers max_completion_tokens, completions knows only max_tokens.
        max_tokens = (req.get("max_completion_tokens") if chat else None) or req.get("max_tokens") or 16
        n_tokens = int(knobs.get("tokens", 16))
        if not knobs.get("overrun"):
            n_tokens = min(n_tokens, int(max_tokens))
        finish = "length" if n_tokens and n_tokens >= int(max_tokens) else "stop"
        call = _tool_call(req) if chat else None
        if call is not None:
            n_tokens, finish = len(TOOL_ARGUMENTS), "tool_calls"
        self.in_progress += 1
        self.peak_in_progress = max(self.peak_in_progress, self.in_progress)
        try:
            if req.get("stream"):
                await self._stream(send, receive, req, record, n_tokens, knobs, chat, (finish, call))
            else:
                await self._complete(send, req, record, n_tokens, knobs, chat, (finish, call))
        finally:
            self.in_progress -= 1
            if record.status == "running":
                record.status = "cancelled"

    async def _complete(self, send, req, record: FakeRecord, n_tokens: int, knobs: dict, chat: bool, end) -> None:
        if knobs.get("ttft_ms"):
            await asyncio.sleep(knobs["ttft_ms"] / 1000)
        if record.status == "aborted":
            return await _json(send, 499, _err("aborted", "invalid_request_error", "aborted"))
        n = _choices(req)
        record.completion_tokens = n_tokens * n
        record.status = "finished"
        text = "tok " * n_tokens
        choices = []
        for index in range(n):
            finish, call = end
            choice = {"index": index, "finish_reason": finish}
            if chat and call is not None:
                whole = {**call, "function": {**call["function"], "arguments": "".join(TOOL_ARGUMENTS)}}
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": [whole]}
            elif chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        answer = {
            "id": f"cmpl-{record.request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.get("model", self.model),
            "choices": choices,
        }
        if knobs.get("usage", True):
            answer["usage"] = _usage(record)
        await _json(send, 200, answer)

    async def _stream(
        self, send, receive, req, record: FakeRecord, n_tokens: int, knobs: dict, chat: bool, end
    ) -> None:
        # A client that goes away stops the generation, as in vLLM and our engine (uvicorn drops writes to a closed
        # connection silently): the record then counts what was made until then, and its status is "cancelled".
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await self._stream_events(send, req, record, n_tokens, knobs, chat, gone, end)
        finally:
            gone.cancel()

    async def _stream_events(
        self, send, req, record: FakeRecord, n_tokens: int, knobs: dict, chat: bool, gone: asyncio.Future, end
    ) -> None:
        opts = req.get("stream_options") or {}
        include_usage, continuous = bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats"))
        if not knobs.get("usage", True):
            include_usage = continuous = False
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        base = {
            "id": f"cmpl-{record.request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.get("model", self.model),
        }
        if knobs.get("ttft_ms"):
            await asyncio.sleep(knobs["ttft_ms"] / 1000)
        if knobs.get("error"):
            record.status = "finished"
            await _sse(send, orjson.dumps(_err("injected", knobs["error"]["type"], knobs["error"]["code"])))
            await _sse(send, b"[DONE]")
            return await send({"type": "http.response.body", "body": b"", "more_body": False})
        fail_after, itl = knobs.get("fail_after"), knobs.get("itl_ms", 0)
        n = _choices(req)
        for i in range(n_tokens):
            if i and itl:
                await asyncio.sleep(itl / 1000)
            if gone.done() and record.status == "running":
                record.status = "cancelled"
            if record.status in ("aborted", "cancelled"):
                break
            if fail_after is not None and i >= fail_after:
                record.status = "cancelled"
                raise ConnectionResetError("injected stream failure")  # uvicorn closes the connection
            finish = end[0] if i == n_tokens - 1 else None
            for index in range(n):  # one chunk per choice, as OpenAI streams n > 1
                record.completion_tokens += 1
                if chat and end[1] is not None:  # a tool call: its id and name first, then its arguments' pieces
                    call = {**end[1], "function": {**end[1]["function"], "arguments": TOOL_ARGUMENTS[i]}}
                    call = call if i == 0 else {"index": 0, "function": {"arguments": TOOL_ARGUMENTS[i]}}
                    choice = {"index": index, "delta": {"tool_calls": [call]}, "finish_reason": finish}
                elif chat:
                    choice = {"index": index, "delta": {"content": "tok "}, "finish_reason": finish}
                else:
                    choice = {"index": index, "text": "tok ", "finish_reason": finish}
                chunk = {**base, "choices": [choice]}
                if continuous:
                    chunk["usage"] = _usage(record)
                await _sse(send, orjson.dumps(chunk))
        if record.status == "running":
            record.status = "finished"
            if not n_tokens:  # nothing made: each choice still ends, as OpenAI's and vLLM's streams do
                for index in range(n):
                    end = {"index": index, "finish_reason": "stop"}
                    end |= {"delta": {}} if chat else {"text": ""}
                    await _sse(send, orjson.dumps({**base, "choices": [end]}))
        if include_usage:
            await _sse(send, orjson.dumps({**base, "choices": [], "usage": _usage(record)}))
        await _sse(send, b"[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _respond(self, send, req: dict) -> None:
        """/v1/responses (loadtests/fake_responses.py), recorded and counted as a chat is."""
        self.requests_seen += 1
        self.received.append(("/v1/responses", req))
        if (why := fake_responses.refusal(req)) is not None:
            return await _json(send, 400, _err(why, "invalid_request_error", "invalid_value"))
        rid = f"fake-{self.requests_seen}"
        tokens = min(int((req.get("fake") or {}).get("tokens", 16)), int(req.get("max_output_tokens") or 16))
        record = FakeRecord(rid, fake_responses.prompt_tokens(req), tokens, "finished", bool(req.get("stream")))
        self.records[rid] = record
        whole = fake_responses.answer(req, rid, record.prompt_tokens, tokens)
        if not req.get("stream"):
            return await _json(send, 200, whole)
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for event in fake_responses.events(whole):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _embed(self, send, req: dict, rid: str) -> None:
        """Deterministic vectors (`dimensions` long, 8 by default) from each input's hash; usage as a prompt's."""
        inputs = req.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            return await _json(send, 400, _err("input is required", "invalid_request_error", "invalid_value"))
        dims = req.get("dimensions") or 8
        record = FakeRecord(rid, sum(_count_prompt({"prompt": x}, False) for x in inputs), status="finished")
        self.records[rid] = record
        data = []
        for index, item in enumerate(inputs):
            vector = embedding_vector(item, dims)
            if req.get("encoding_format") == "base64":
                vector = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": vector})
        usage = {"prompt_tokens": record.prompt_tokens, "total_tokens": record.prompt_tokens}
        await _json(send, 200, {"object": "list", "data": data, "model": req.get("model", self.model), "usage": usage})

    async def _abort(self, send, req: dict) -> None:
        rid = req.get("request_id", "")
        self.aborts.append(rid)
        record = self.records.get(rid)
        if record is None:
            self.aborted_unseen.add(rid)
            return await _json(send, 200, {"request_id": rid, "status": "unknown", "usage": None})
        status = "finished" if record.status == "finished" else "aborted"
        if record.status in ("running", "cancelled"):
            record.status = "aborted"
        await _json(send, 200, {"request_id": rid, "status": status, "usage": _usage(record)})


TOOL_ARGUMENTS = ('{"tok":', ' "tok"}')  # a tool call's arguments as the fake streams them: one token a piece


def _tool_call(req: dict) -> dict | None:
    """The call a chat must make (tool_choice "required" or a named function, with tools), as a stream's first
    tool_calls delta has it (arguments still empty); None: it writes text."""
    tools, choice = req.get("tools"), req.get("tool_choice")
    if not tools or not (choice == "required" or isinstance(choice, dict)):
        return None
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    name = named or tools[0].get("function", {}).get("name", "")
    call_id = f"call_{len(req.get('messages') or [])}"
    return {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}


def _choices(req: dict) -> int:
    """n per prompt; a completions batch (a list of strings or of token-id lists) completes each prompt."""
    n = req.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 128 else 1
    prompt = req.get("prompt")
    batch = isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt)
    return n * len(prompt) if batch else n


def embedding_vector(item, dims: int) -> list[float]:
    """The fake's embedding of one input: `dims` floats in [-1, 1) from the input's SHA-256 (float32-exact)."""
    seed = orjson.dumps(item)
    out: list[float] = []
    block = 0
    while len(out) < dims:
        digest = hashlib.sha256(seed + block.to_bytes(4, "little")).digest()
        out += [(b - 128) / 128 for b in digest]
        block += 1
    return out[:dims]


def _count_prompt(req: dict, chat: bool) -> int:
    if chat:
        return sum(len(str(m.get("content", "")).split()) + 1 for m in req.get("messages", []))
    prompt = req.get("prompt", "")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # token ids count as themselves, exactly as the gateway counts them
    return len((" ".join(map(str, prompt)) if isinstance(prompt, list) else str(prompt)).split())


def _usage(r: FakeRecord) -> dict:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }


def _err(message: str, type_: str, code: str) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


async def _disconnected(receive) -> None:
    """Returns when the client has gone (the request's body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _json(send, status: int, payload: dict) -> None:
    body = orjson.dumps(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _sse(send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True})


# --- running it ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="fast fake OpenAI-compatible upstream")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--model", default="fake-model")
    args = parser.parse_args()
    uvicorn.run(FakeUpstream(model=args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
