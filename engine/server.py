"""The engine's OpenAI-compatible HTTP server (`python -m engine.server`, `tokenweir engine`).

Each request runs as a `_Run`: a pump task moves the AsyncEngine's outputs into a local queue that the handler reads.
POST /abort ends a run by pushing the engine's final output into that queue, and a client that goes away (stream
closed, or a non-stream request whose connection drops) cancels the pump, which aborts the request in the engine, so
the engine's counters and the usage a caller sees both hold the exact tokens made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncEngine
from engine.llm_engine import RequestError
from engine.output import RequestOutput
from engine.protocol import (
    AbortRequest,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    DeltaMessage,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    Usage,
)

log = logging.getLogger("tokenweir.engine.server")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
KEEP_ALIVE_S = 75
ENGINE_CHECK_S = 1.0
GRACEFUL_SHUTDOWN_S = 10
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


# --- request ids ----------------------------------------------------------------------------------------------------


class RequestIdMiddleware:
    """Takes a sane `X-Request-Id` (else makes a uuid), stores it in scope state and echoes it on the response.
    Pure ASGI on purpose: BaseHTTPMiddleware would sit between a stream and its disconnect."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if REQUEST_ID_RE.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


# --- one request in flight ------------------------------------------------------------------------------------------


class _Run:
    """Outputs of one engine request, endable from outside (POST /abort) and aborted when closed early."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompt: list[int], params, priority: int) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.final: RequestOutput | None = None
        self._stopped = False
        self._pump = asyncio.create_task(self._pump_outputs(engine.generate(request_id, prompt, params, priority)))

    async def _pump_outputs(self, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in outputs:
                self.queue.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the reader, who turns it into an HTTP error
            self.queue.put_nowait(exc)

    def end(self, final: RequestOutput) -> None:
        """Aborted from outside: the engine already freed the request; stop reading it and report `final`."""
        self._stop_pump()
        self.queue.put_nowait(final)

    def close(self) -> None:
        """Synchronous on purpose: it runs in `finally` of a cancelled stream, where an await would be cut short.
        Cancelling the pump makes AsyncEngine.generate abort the request (shielded)."""
        self._stop_pump()

    def _stop_pump(self) -> None:
        # Cancel once only: a second cancel would land in generate()'s shielded abort and skip its cleanup, leaving
        # the request id registered as running.
        if not self._stopped:
            self._stopped = True
            self._pump.cancel()

    def fail(self, exc: BaseException) -> None:
        """The engine died under this run: hand the reader the error (the pump may never return, see watch_engine)."""
        self.queue.put_nowait(exc)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = await self.queue.get()
            if isinstance(out, RequestError):
                raise out
            if isinstance(out, BaseException):  # the engine loop died: a server fault, not the client's
                raise APIError(500, f"engine error: {out}", "engine_error") from out
            if out.finished:
                self.final = out
            yield out
            if out.finished:
                return


class _RunStream(StreamingResponse):
    """An SSE response that ends its run however the response ends: a client gone before the first byte never
    starts the body generator, so the generator's own `finally` cannot be relied on alone."""

    def __init__(self, run: _Run, on_close, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run, self.on_close = run, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close(self.run)


# --- the app --------------------------------------------------------------------------------------------------------


def build_app(async_engine: AsyncEngine) -> FastAPI:
    """The FastAPI app over a running AsyncEngine. Under uvicorn, the lifespan starts and stops the engine loop; a test
    driving the app through httpx.ASGITransport (no lifespan) calls `async_engine.start()` itself."""
    llm = async_engine.engine
    model_name = async_engine.model_name
    runs: dict[str, _Run] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        started_here = not async_engine.started
        if started_here:
            async_engine.start()
        yield
        if started_here:
            async_engine.stop()

    app = FastAPI(title="tokenweir engine", lifespan=lifespan)
    app.add_middleware(RequestIdMiddleware)
    app.state.async_engine = async_engine
    app.state.runs = runs

    # --- errors: always OpenAI's shape, never a 500 for bad input ---------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message, code, param = describe_validation_error(exc.errors())
        return error_response(400, message, code, param)

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.code, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, str(exc.detail), code)

    @app.exception_handler(Exception)
    async def _engine_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("engine error")
        return error_response(500, f"engine error: {exc}", "engine_error")

    # --- helpers ------------------------------------------------------------------------------------------------------

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"The model {name!r} does not exist: this server serves {model_name!r}.",
                "model_not_found",
                "model",
            )

    def need_tokenizer(what: str, param: str = "prompt"):
        if async_engine.tokenizer is None:
            raise APIError(
                400,
                f"model {model_name!r} has no tokenizer, so {what} is not possible: send token ids as a "
                "/v1/completions prompt instead",
                "no_tokenizer",
                param,
            )
        return async_engine.tokenizer

    def encode_text(text: str) -> list[int]:
        tok = need_tokenizer("a text prompt")
        ids = tok.encode(text)
        if tok.add_bos_token and tok.bos_token_id is not None:
            ids = [tok.bos_token_id, *ids]
        return ids

    def encode_chat(messages: list[dict], add_generation_prompt: bool) -> list[int]:
        tok = need_tokenizer("chat", "messages")
        try:
            return tok.encode_chat(messages, add_generation_prompt)
        except ValueError as exc:  # no chat template, or the template's raise_exception()
            raise APIError(400, str(exc), "chat_template_error", "messages") from exc

    def start_run(request: Request, prompt: list[int], body) -> _Run:
        if async_engine.errored is not None:
            raise APIError(500, f"engine error: the engine loop died ({async_engine.errored!r})", "engine_error")
        try:
            params = body.sampling_params()
        except ValueError as exc:  # SamplingParams' own checks, e.g. "top_k must be -1 (off) or >= 1, got -5"
            message = str(exc)
            field = message.split(" ", 1)[0]
            raise APIError(400, message, "invalid_request", field if field.isidentifier() else None) from exc
        try:
            llm.validate(prompt, params)  # here, so a stream's bad request is a 400 before any byte is sent
        except RequestError as exc:
            if isinstance(body, CompletionRequest) and exc.param == "messages":
                exc.param = "prompt"  # the engine words it for chat; a text completion has a prompt
            raise
        request_id = request.state.request_id
        if request_id in runs:
            raise APIError(400, f"request id {request_id!r} is already running", "duplicate_request_id")
        run = _Run(async_engine, request_id, prompt, params, body.priority)
        runs[request_id] = run
        if not watchdog or watchdog[0].done():
            watchdog[:] = [asyncio.create_task(watch_engine())]
        return run

    watchdog: list[asyncio.Task] = []

    async def watch_engine() -> None:
        # When the engine loop dies, AsyncEngine.generate's cleanup awaits an abort nobody will answer, so a run's pump
        # never hands its error over. One task per app (alive while runs are) notices the death and fails them all.
        while runs:
            if async_engine.errored is not None:
                for run in list(runs.values()):
                    run.fail(RuntimeError(f"engine loop died: {async_engine.errored!r}"))
                return
            await asyncio.sleep(ENGINE_CHECK_S)

    def finish_run(run: _Run) -> None:
        run.close()
        if runs.get(run.request_id) is run:
            del runs[run.request_id]

    async def collect(request: Request, run: _Run) -> tuple[list[int], str, RequestOutput]:
        """All outputs of a non-stream request; if the client disconnects first, the request is aborted."""

        async def gather():
            ids, text, last = [], [], None
            async for out in run.outputs():
                ids += out.new_token_ids
                text.append(out.new_text)
                last = out
            return ids, "".join(text), last

        work = asyncio.create_task(gather())
        watch = asyncio.create_task(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise APIError(400, "client disconnected", "client_disconnected")
            return work.result()
        finally:
            watch.cancel()
            work.cancel()
            finish_run(run)

    def usage_of(out: RequestOutput) -> Usage:
        return Usage.model_validate(out.usage)

    def dump(model: BaseModel, drop: tuple[str, ...] = ()) -> str:
        data = model.model_dump(mode="json")
        for key in drop:
            data.pop(key, None)
        _dropped_none_token_ids(data)
        for choice in data["choices"]:
            if "delta" in choice:  # OpenAI sends the role once, in the first delta only
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return "data: " + _json(data) + "\n\n"

    def stream_response(run: _Run, chunks: AsyncIterator[str]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield chunk
            except APIError as exc:  # headers are gone: say it in the stream, as vLLM does
                yield "data: " + _json(error_body(exc.status, exc.message, exc.code, exc.param)) + "\n\n"
            except RequestError as exc:
                yield "data: " + _json(error_body(400, str(exc), exc.code, exc.param)) + "\n\n"
            except Exception as exc:
                log.exception("engine error in stream")
                yield "data: " + _json(error_body(500, f"engine error: {exc}", "engine_error")) + "\n\n"
            finally:
                finish_run(run)
            yield "data: [DONE]\n\n"

        return _RunStream(run, finish_run, body())

    # --- OpenAI endpoints ---------------------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        prompt = encode_chat(body.template_messages(), body.add_generation_prompt)
        run = start_run(request, prompt, body)
        response_id = f"chatcmpl-{run.request_id}"
        if not body.stream:
            ids, text, last = await collect(request, run)
            choice = ChatChoice(
                message=AssistantMessage(content=text),
                finish_reason=last.finish_reason,
                stop_reason=last.stop_reason,
                token_ids=ids if body.return_token_ids else None,
            )
            resp = ChatCompletion(id=response_id, model=model_name, choices=[choice], usage=usage_of(last))
            return JSONResponse(_dropped_none_token_ids(resp.model_dump(mode="json")))

        created = int(time.time())
        drop = () if body.include_usage or body.continuous_usage else ("usage",)

        async def chunks() -> AsyncIterator[str]:
            def chunk(choices: list[ChatChunkChoice], usage: Usage | None) -> str:
                return dump(
                    ChatCompletionChunk(
                        id=response_id, created=created, model=model_name, choices=choices, usage=usage
                    ),
                    drop,
                )

            first = DeltaMessage(role="assistant", content="")
            zero = Usage(prompt_tokens=len(prompt), completion_tokens=0, total_tokens=len(prompt))
            yield chunk([ChatChunkChoice(delta=first)], zero if body.continuous_usage else None)
            async for out in run.outputs():
                if not out.new_text and not out.finished and not body.return_token_ids:
                    continue  # a token whose text is held back (partial UTF-8 or a possible stop string)
                choice = ChatChunkChoice(
                    delta=DeltaMessage(content=out.new_text) if out.new_text else DeltaMessage(),
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    token_ids=out.new_token_ids if body.return_token_ids else None,
                )
                yield chunk([choice], usage_of(out) if body.continuous_usage else None)
            if body.include_usage:
                yield chunk([], usage_of(run.final))

        return stream_response(run, chunks())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt = encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        run = start_run(request, prompt, body)
        response_id = f"cmpl-{run.request_id}"
        # A model without a tokenizer has no text to show: its token ids are the output.
        token_ids = body.return_token_ids or async_engine.tokenizer is None
        if not body.stream:
            ids, text, last = await collect(request, run)
            choice = CompletionChoice(
                text=text,
                finish_reason=last.finish_reason,
                stop_reason=last.stop_reason,
                token_ids=ids if token_ids else None,
            )
            resp = Completion(id=response_id, model=model_name, choices=[choice], usage=usage_of(last))
            return JSONResponse(_dropped_none_token_ids(resp.model_dump(mode="json")))

        created = int(time.time())
        drop = () if body.include_usage or body.continuous_usage else ("usage",)

        async def chunks() -> AsyncIterator[str]:
            async for out in run.outputs():
                if not out.new_text and not out.finished and not token_ids:
                    continue
                choice = CompletionChoice(
                    text=out.new_text,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    token_ids=out.new_token_ids if token_ids else None,
                )
                usage = usage_of(out) if body.continuous_usage else None
                yield dump(
                    Completion(id=response_id, created=created, model=model_name, choices=[choice], usage=usage),
                    drop,
                )
            if body.include_usage:
                final = Completion(
                    id=response_id, created=created, model=model_name, choices=[], usage=usage_of(run.final)
                )
                yield dump(final)

        return stream_response(run, chunks())

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, root=llm.model_path, max_model_len=llm.max_model_len)])

    # --- vLLM-style extras ------------------------------------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if body.messages is not None:
            tokens = encode_chat([m.to_template() for m in body.messages], body.add_generation_prompt)
        else:
            tokens = encode_text(body.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        tok = need_tokenizer("detokenizing", "tokens")
        vocab = llm.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < min(vocab, tok.vocab_size)]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", "invalid_token_id", "tokens")
        return {"prompt": tok.decode(body.tokens)}

    @app.post("/abort")
    async def abort(body: AbortRequest) -> dict:
        out = await async_engine.abort(body.request_id)
        run = runs.get(body.request_id)
        if run is not None and out is not None:
            run.end(out)
        status = "unknown" if out is None else "aborted" if out.finish_reason == "abort" else "finished"
        return {"request_id": body.request_id, "status": status, "usage": out.usage if out else None}

    @app.get("/health")
    async def health() -> Response:
        if async_engine.errored is not None:
            return error_response(503, f"engine loop died: {async_engine.errored!r}", "engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/load")
    async def load() -> dict:
        return async_engine.load()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(async_engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# --- helpers without app state --------------------------------------------------------------------------------------


def _json(data) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _dropped_none_token_ids(data: dict) -> dict:
    for choice in data.get("choices", []):
        if choice.get("token_ids") is None:
            choice.pop("token_ids", None)
    return data


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client is gone. The body is already read, so the next ASGI message is the disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


_UNION_TAG = re.compile(r"[\[\]()]|^(str|int|float|bool|list|dict|none|function-.*)$")


def describe_validation_error(errors) -> tuple[str, str, str | None]:
    """(message, code, param) for pydantic's errors: the most specific error first, its field path as param."""
    errors = list(errors)
    if not errors:
        return "invalid request", "invalid_request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", "invalid_json", None
    # A union reports one error per branch; a value_error (our own check) is what the client needs to read.
    err = next((e for e in errors if e.get("type") == "value_error"), first)
    loc = [part for part in err.get("loc", ()) if part != "body"]
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _UNION_TAG.search(str(part)):
            break
        else:
            path += ("." if path else "") + str(part)
    message = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "missing":
        message = f"{path} is required" if path else "a JSON request body is required"
    elif path:
        message = f"{path}: {message}"
    return message, "invalid_request", path or None


# --- CLI ------------------------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512MiB', '2GiB', '1.5G' (binary units; 'MB' and 'MiB' both mean 2**20 here)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenweir engine", description="tokenweir's OpenAI-compatible engine server")
    p.add_argument("--model", default="", help="a .gguf file or a HF model directory (default: SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--served-model-name", default=None, help="the name clients put in `model`")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, help="bytes for the KV cache, e.g. 512MiB")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="explicit KV pool size (overrides memory)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace):
    from engine.config import EngineConfig

    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=None if args.attention_backend == "auto" else args.attention_backend,
        num_threads=args.num_threads,
    )
    if args.kv_cache_memory is not None:
        config.kv_cache_memory = args.kv_cache_memory
    return config


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from engine.llm_engine import LLMEngine

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
        print(f"tokenweir engine: loading {config.model or 'the default model'} ...", flush=True)
        engine = LLMEngine(config, progress=True)
    except (AssertionError, ValueError, FileNotFoundError, OSError) as exc:  # config and model problems
        raise SystemExit(f"tokenweir engine: cannot start: {exc}") from exc
    app = build_app(AsyncEngine(engine))
    print(f"tokenweir engine: serving {engine.model_name!r} on http://{args.host}:{args.port}/v1", flush=True)
    # Keep idle connections longer than clients' pools do (httpx expires them after 5 s), so a pooled client never
    # sends on a connection the server is closing at that very moment.
    # On SIGTERM, streams get GRACEFUL_SHUTDOWN_S to finish; then they are cancelled, which aborts them in the engine.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


if __name__ == "__main__":
    main()
