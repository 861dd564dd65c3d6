"""The engine's HTTP routes: OpenAI's /v1 endpoints and vLLM-style extras (/tokenize, /detokenize, /abort, /load,
/health, /metrics).

Routes stay thin: the body arrives validated (engine/api/protocol.py), the prompt becomes token ids, AsyncEngine checks
the request against its limits and streams the outputs, and any error is raised for the app's handlers to render.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Annotated, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenweir.common.http.disconnect import wait_disconnect
from tokenweir.common.http.fairness_id import FAIRNESS_ID_HEADER, MAX_FAIRNESS_ID_CHARS
from tokenweir.common.text import prefix_hash
from tokenweir.common.text.tokenizer import Tokenizer
from tokenweir.common.text.tool_prompt import tool_conversation
from tokenweir.engine.api.choices import ChatRenderer, CompletionRenderer
from tokenweir.engine.api.errors import APIError
from tokenweir.engine.api.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenweir.engine.api.responses import (
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    DeltaMessage,
    ModelCard,
    ModelList,
    Usage,
    dump_response,
)
from tokenweir.engine.api.streaming import stream_response
from tokenweir.engine.api.tracing import trace_request
from tokenweir.engine.core.async_engine import AsyncEngine, RequestStream
from tokenweir.engine.core.errors import RequestError
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.tool_parsers import ToolParser


def _engine(request: Request) -> AsyncEngine:
    return request.app.state.async_engine


Engine = Annotated[AsyncEngine, Depends(_engine)]
router = APIRouter()

# --- OpenAI endpoints -----------------------------------------------------------------------------------------------


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, engine: Engine):
    check_model(engine, body.model)
    parser = chat_tool_parser(request, body)
    tools = body.tool_dicts()
    prompt = encode_chat(engine, body.template_messages(), body.add_generation_prompt, tools, parser)
    stream = start(engine, request, prompt, body, prompt_param="messages", tool_parser=parser)
    response_id = f"chatcmpl-{stream.request_id}"
    render = ChatRenderer(body, engine.tokenizer, parser)
    if body.stream:
        return stream_response(
            stream,
            ChatCompletionChunk,
            render.chunk_choice,
            response_id=response_id,
            model=engine.model_name,
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            show_token_ids=body.return_token_ids,
            first_choices=[
                ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(body.n)
            ],
        )
    outs = await collect(request, stream, body.n)
    return whole_response(ChatCompletion, [render.choice(out) for out in outs], outs, response_id, engine.model_name)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, engine: Engine):
    check_model(engine, body.model)
    # CompletionRequest._one_prompt leaves one prompt: text or token ids (a batch of one is unwrapped).
    prompt = encode_text(engine, body.prompt) if isinstance(body.prompt, str) else cast("list[int]", list(body.prompt))
    stream = start(engine, request, prompt, body, prompt_param="prompt")
    response_id = f"cmpl-{stream.request_id}"
    # A model without a tokenizer has no text to show: its token ids are the output.
    show_token_ids = body.return_token_ids or engine.tokenizer is None
    render = CompletionRenderer(body, engine.tokenizer, prompt, show_token_ids)
    if body.stream:
        return stream_response(
            stream,
            Completion,
            render.choice,
            response_id=response_id,
            model=engine.model_name,
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            show_token_ids=show_token_ids or body.echo,
        )
    outs = await collect(request, stream, body.n)
    return whole_response(Completion, [render.choice(out) for out in outs], outs, response_id, engine.model_name)


@router.get("/v1/models")
async def models(engine: Engine) -> ModelList:
    return ModelList(data=[ModelCard(id=engine.model_name, root=engine.model_path, max_model_len=engine.max_model_len)])


# --- vLLM-style extras ----------------------------------------------------------------------------------------------


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, engine: Engine) -> dict:
    check_model(engine, body.model)
    if body.messages is not None:
        messages = [m.to_template() for m in body.messages]
        tokens = encode_chat(engine, messages, body.add_generation_prompt, None, tool_parser_of(request))
    else:
        assert body.prompt is not None  # the request's validator wants exactly one of prompt and messages
        tokens = encode_text(engine, body.prompt)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, engine: Engine) -> dict:
    check_model(engine, body.model)
    tokenizer = need_tokenizer(engine, "detokenizing", "tokens")
    vocab = engine.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < min(vocab, tokenizer.vocab_size)]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", "invalid_token_id", "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


@router.post("/abort")
async def abort(body: AbortRequest, engine: Engine) -> dict:
    """Stop a request; the answer's usage is exactly what it made. "unknown": it never reached this engine (it made
    nothing, and if it arrives late it is refused)."""
    out = await engine.abort(body.request_id)
    status = "unknown" if out is None else "aborted" if out.finish_reason == "abort" else "finished"
    answer = {"request_id": body.request_id, "status": status, "usage": out.usage if out else None}
    if out is not None and out.kv_transfer_params is not None:  # a decode hop's fetch, as its answer would say
        answer["kv_transfer_params"] = out.kv_transfer_params
    return answer


@router.get("/health")
async def health(engine: Engine) -> Response:
    if engine.errored is not None:
        return APIError(503, f"engine loop died: {engine.errored!r}", "engine_dead").response()
    return JSONResponse({"status": "ok"})


MAX_EVICTED_PER_POLL = 4096  # a poller further behind gets the newest ones and `evicted_complete: false`


@router.get("/load")
async def load(engine: Engine, since: int | None = None, epoch: str | None = None) -> dict:
    """Queues, KV usage and the prefix cache, for routers. `evicted_hashes`: the prefix-cache block hashes
    (common/text/prefix_hash.py) evicted after eviction number `since` of the log `epoch` (both as the poller's last
    answer gave them; a different epoch, an engine restart, counts as seeing nothing), so a router's index can forget
    them. Without `since`, none: a first poll learns `evicted_seq` and starts from there."""
    stats = engine.stats
    bm = engine.engine.block_manager
    log = bm.log
    if epoch is not None and epoch != log.epoch:
        since = None
    seq, evicted, complete = log.since(since, MAX_EVICTED_PER_POLL)
    return {
        "num_running": stats.num_running_reqs,
        "num_waiting": stats.num_waiting_reqs,
        "kv_cache_usage": round(stats.kv_cache_usage, 4),
        "num_free_blocks": stats.num_free_blocks,
        "num_total_blocks": stats.num_total_blocks,
        "num_cached_free_blocks": stats.num_cached_free_blocks,
        "max_num_seqs": engine.max_num_seqs,
        "model_revision": engine.engine.model_revision,
        "block_size": bm.block_size,
        "prefix_caching": bm.enable_prefix_caching,
        "num_cached_blocks": log.num_cached_blocks,
        "prefix_hash": prefix_hash.SCHEME,
        "prefix_hash_probe": prefix_hash.probe(bm.block_size),
        "evicted_epoch": log.epoch,
        "evicted_seq": seq,
        "evicted_hashes": evicted,
        "evicted_complete": complete and (epoch is None or epoch == log.epoch),
    }


@router.get("/metrics")
async def metrics(engine: Engine) -> Response:
    return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# --- helpers --------------------------------------------------------------------------------------------------------


def check_model(engine: AsyncEngine, name: str | None) -> None:
    if name is not None and name != engine.model_name:
        raise APIError(
            404,
            f"The model {name!r} does not exist: this server serves {engine.model_name!r}.",
            "model_not_found",
            "model",
        )


def need_tokenizer(engine: AsyncEngine, what: str, param: str) -> Tokenizer:
    if engine.tokenizer is None:
        raise APIError(
            400,
            f"model {engine.model_name!r} has no tokenizer, so {what} is not possible: send token ids as a "
            "/v1/completions prompt instead",
            "no_tokenizer",
            param,
        )
    return engine.tokenizer


def encode_text(engine: AsyncEngine, text: str) -> list[int]:
    tokenizer = need_tokenizer(engine, "a text prompt", "prompt")
    return tokenizer.with_bos(tokenizer.encode(text))


def tool_parser_of(request: Request) -> ToolParser | None:
    return request.app.state.tool_parser


def chat_tool_parser(request: Request, body: ChatCompletionRequest) -> ToolParser | None:
    """The engine's tool-call parser; a chat whose model is to choose its calls ("auto") needs one."""
    parser = tool_parser_of(request)
    if parser is None and body.tool_mode == "auto":
        raise APIError(
            400,
            "tool_choice 'auto' (the default when tools are sent) needs a tool-call parser, and this engine runs "
            "without one (start it with --tool-call-parser hermes): name a function (tool_choice={'type': "
            "'function', 'function': {'name': ...}}), send 'required', or send 'none'",
            "invalid_request",
            "tool_choice",
        )
    return parser


def encode_chat(
    engine: AsyncEngine,
    messages: list[dict],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    parser: ToolParser | None,
) -> list[int]:
    """A chat's prompt ids: the tools and earlier calls rendered as the template does, or else in the parser's format
    (common/text/tool_prompt.py)."""
    tokenizer = need_tokenizer(engine, "chat", "messages")
    fmt = parser.name if parser is not None else None
    messages, template_tools = tool_conversation(messages, tools, fmt, tokenizer.template_takes_tools)
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt, template_tools)
    except ValueError as exc:  # no chat template, or the template's raise_exception()
        raise APIError(400, str(exc), "chat_template_error", "messages") from exc


def start(
    engine: AsyncEngine,
    request: Request,
    prompt: list[int],
    body: ChatCompletionRequest | CompletionRequest,
    prompt_param: str,
    tool_parser: ToolParser | None = None,
) -> RequestStream:
    """Hand the request to the engine under the id the middleware chose; a refusal names the prompt as the client
    sent it (`messages` for chat, `prompt` for a text completion). Calls the model chooses follow `tool_parser`'s
    grammar."""
    fairness_id = fairness_header(request)
    params = body.sampling_params()
    if tool_parser is not None and isinstance(body, ChatCompletionRequest) and body.tool_mode == "auto":
        tools, parallel = body.tool_dicts() or [], body.parallel_tool_calls is not False
        params = replace(params, structured={"type": "grammar", "grammar": tool_parser.grammar(tools, parallel)})
    try:
        stream = engine.add_request(request.state.request_id, prompt, params, body.priority, fairness_id=fairness_id)
    except RequestError as exc:
        if exc.param in ("prompt", "messages"):
            exc.param = prompt_param
        if exc.param == "response_format" and getattr(body, "tool_mode", None):  # the schema came from a tool
            exc.param = "tools"
        raise
    trace_request(request.scope, stream)
    return stream


def fairness_header(request: Request) -> str | None:
    """The request's tenant for token fairness (engine/sched/fairness.py), from the gateway's header; None without
    one (or an empty one). Trusted as sent: only the gateway holds the engine's API key. Too long a one is a 400, as
    any bad input: it would be a /metrics label and a key the engine keeps."""
    value = request.headers.get(FAIRNESS_ID_HEADER)
    if value and len(value) > MAX_FAIRNESS_ID_CHARS:
        raise APIError(
            400,
            f"the {FAIRNESS_ID_HEADER} header has {len(value)} characters; at most {MAX_FAIRNESS_ID_CHARS} are allowed",
            "invalid_fairness_id",
            FAIRNESS_ID_HEADER,
        )
    return value or None


def whole_response(
    response_type: type[ChatCompletion | Completion],
    choices: list,
    outs: list[RequestOutput],
    response_id: str,
    model: str,
) -> JSONResponse:
    """A non-stream response: its rendered choices, and the usage the last output counted for the whole request."""
    usage = Usage.model_validate(outs[-1].usage)
    body = dump_response(response_type(id=response_id, model=model, choices=choices, usage=usage))
    if outs[-1].kv_transfer_params is not None:  # a prefill hop's: where its KV waits (vLLM's); a decode hop's fetch
        body["kv_transfer_params"] = outs[-1].kv_transfer_params
    return JSONResponse(body)


async def collect(request: Request, stream: RequestStream, n: int = 1) -> list[RequestOutput]:
    """A non-stream request's outputs folded into one per choice, in choice order; the last carries the request's
    final counts. If the client disconnects first, the request is aborted."""

    async def fold() -> list[RequestOutput]:
        totals = [RequestOutput.empty(stream.request_id, i) for i in range(n)]
        last = totals[0]
        async for out in stream:
            totals[out.index].add(out)
            last = out
        for total in totals:  # every choice reports the request's final counts
            total.take_counts(last)
        return totals

    work = asyncio.create_task(fold())
    gone = asyncio.create_task(wait_disconnect(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise APIError(400, "client disconnected", "client_disconnected")
        return work.result()
    finally:
        gone.cancel()
        work.cancel()
        stream.close()
