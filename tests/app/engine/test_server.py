"""The engine's OpenAI-compatible server on a tiny random Llama (no tokenizer: token ids in, token ids out), served by
a real uvicorn on a free port so streams, disconnects and aborts travel over real HTTP."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
import torch
import uvicorn

from tests.support.tiny_llama import make_tiny_llama
from tokenweir.common.engine_flags import parse_size
from tokenweir.common.text.model_files import model_digest
from tokenweir.engine.api import build_app
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.async_engine import AsyncEngine, EngineThread
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.engine.llm import LLM
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.server import main

PROMPT = [5, 17, 42, 99, 3, 250, 8]
LONG = 8000  # max_tokens of requests that are meant to be cut short: they cannot finish during a test
MAX_LEN = 8192


@dataclass
class Served:
    client: httpx.AsyncClient
    engine: AsyncEngine

    @property
    def model(self) -> str:
        return self.engine.model_name

    async def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        return await self.client.post(
            path, json={"model": self.model, **body} if path.startswith("/v1") else body, **kwargs
        )

    async def metrics(self) -> dict[str, float]:
        """GET /metrics as {series name with labels: value}, plus each name summed over its labels."""
        r = await self.client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        values: dict[str, float] = {}
        for line in r.text.splitlines():
            if line.startswith("tokenweir:") and "{" in line:
                series, value = line.rsplit(" ", 1)
                name = series.split("{", 1)[0]
                values[series] = float(value)
                values[name] = values.get(name, 0) + float(value)
        return values

    async def load(self) -> dict:
        return (await self.client.get("/load")).json()

    async def wait_idle(self, timeout: float = 20.0) -> dict:
        """Polls /load until nothing runs or waits (bounded), and returns it."""
        for _ in range(int(timeout / 0.02)):
            load = await self.load()
            if load["num_running"] == 0 and load["num_waiting"] == 0:
                return load
            await asyncio.sleep(0.02)
        raise AssertionError(f"engine still busy after {timeout}s: {load}")

    async def wait_running(self, timeout: float = 20.0) -> None:
        for _ in range(int(timeout / 0.01)):
            if (await self.load())["num_running"] > 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the request never started running")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # A long context, so a request with max_tokens=LONG runs for seconds and can be cut short deterministically.
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-long")), seed=1, max_position_embeddings=MAX_LEN)


def make_engine(model_dir: str, **kwargs) -> LLMEngine:
    # One intra-op thread: on a shared 2-core box, torch's thread pool makes a tiny step ~30x slower. float32, as
    # greedy_reference: `--dtype auto` times a bf16 probe at the model's shape, which a tiny model's can win or lose
    # by noise, and bf16 picks other tokens of a random model.
    kwargs = {"dtype": "float32", **kwargs}
    return LLMEngine(
        EngineConfig(model=model_dir, num_kv_blocks=MAX_LEN // 16, num_threads=1, quantization="none", **kwargs)
    )


@asynccontextmanager
async def serve(engine: LLMEngine, **app_options):
    """uvicorn on a free port in this event loop (its lifespan starts the engine loop), and a client for it;
    `app_options` go to build_app."""
    threads = torch.get_num_threads()
    async_engine = AsyncEngine(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        build_app(async_engine, **app_options),
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=2,
        timeout_keep_alive=60,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started, "uvicorn did not start"
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield Served(client, async_engine)
    finally:
        server.should_exit = True
        await task
        sock.close()
        torch.set_num_threads(threads)


@pytest.fixture
async def served(model_dir):
    async with serve(make_engine(model_dir)) as s:
        yield s


def greedy_reference(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy ids from the offline LLM (no server involved), to compare the HTTP path against."""
    llm = LLM(model_dir, dtype="float32", quantization="none", num_kv_blocks=64, num_threads=1)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return out.new_token_ids


def sse_events(text: str) -> list:
    """Parsed `data:` payloads of an SSE body, with '[DONE]' kept as the string."""
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), f"not an SSE data line: {block!r}"
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


class LiveStream:
    """Reads SSE events of a live response one at a time (httpx streams can be iterated only once)."""

    def __init__(self, response: httpx.Response) -> None:
        self.chunks = response.aiter_text()
        self.buffer = ""

    async def take(self, count: int) -> list:
        events = []
        while len(events) < count:
            if "\n\n" in self.buffer:
                block, self.buffer = self.buffer.split("\n\n", 1)
                events += sse_events(block + "\n\n")
                continue
            try:
                self.buffer += await anext(self.chunks)
            except StopAsyncIteration:
                raise AssertionError(f"stream ended after {len(events)} more events") from None
        return events

    async def rest(self) -> list:
        async for text in self.chunks:
            self.buffer += text
        return sse_events(self.buffer)


# --- completions --------------------------------------------------------------------------------------------------


async def test_completion_non_stream_matches_offline_greedy(served, model_dir):
    want = greedy_reference(model_dir, PROMPT, 6)
    r = await served.post(
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        headers={"X-Request-Id": "req-1.a:b"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "req-1.a:b"
    body = r.json()
    assert body["id"] == "cmpl-req-1.a:b" and body["object"] == "text_completion" and body["model"] == served.model
    (choice,) = body["choices"]
    assert choice["token_ids"] == want and choice["text"] == "" and choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 6,
        "total_tokens": len(PROMPT) + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_insane_request_id_is_replaced_and_echoed(served):
    r = await served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, headers={"X-Request-Id": "a b/c"})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert rid != "a b/c" and len(rid) == 32 and r.json()["id"] == f"cmpl-{rid}"
    r = await served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, headers={"X-Request-Id": "x" * 129})
    assert r.headers["x-request-id"] != "x" * 129


async def test_completion_stream_with_usage_chunk(served, model_dir):
    want = greedy_reference(model_dir, PROMPT, 5)
    body = {
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await served.post("/v1/completions", body, headers={"X-Request-Id": "s1"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
    assert all(c["id"] == "cmpl-s1" and c["usage"] is None for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    assert usage_chunk["usage"]["prompt_tokens"] == len(PROMPT)


async def test_stream_without_usage_has_no_usage_field(served):
    r = await served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and len(events) == 4
    assert all("usage" not in e for e in events[:-1])


async def test_continuous_usage_counts_every_token(served):
    body = {
        "prompt": PROMPT,
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse_events((await served.post("/v1/completions", body)).text)
    chunks = events[:-2]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert all(c["usage"]["prompt_tokens"] == len(PROMPT) for c in chunks)
    assert events[-2]["usage"]["total_tokens"] == len(PROMPT) + 4


async def test_stop_token_id_ends_with_stop_reason(served, model_dir):
    want = greedy_reference(model_dir, PROMPT, 6)
    stop = want[2]
    cut = want.index(stop) + 1  # the first time the stop token appears
    r = await served.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stop_token_ids": [stop]}
    )
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want[:cut]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert r.json()["usage"]["completion_tokens"] == cut


async def test_prompt_as_single_item_batch_of_ids(served):
    r = await served.post("/v1/completions", {"prompt": [PROMPT], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(PROMPT)


async def test_cached_prefix_is_reported(served):
    prompt = list(range(3, 3 + 40))  # two full 16-token blocks, then 8 more
    first = await served.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    second = await served.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


# --- models, load, metrics, health --------------------------------------------------------------------------------


async def test_models_load_health(served):
    models = (await served.client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(served.model, MAX_LEN)]
    load = await served.load()
    assert load["num_total_blocks"] == MAX_LEN // 16 and load["num_free_blocks"] == load["num_total_blocks"]
    assert {"num_running", "num_waiting", "kv_cache_usage", "max_num_seqs"} <= load.keys()
    assert load["model_revision"] == model_digest(served.engine.engine.model_path)  # the model file's digest
    assert (await served.client.get("/health")).json() == {"status": "ok"}


async def test_metrics_count_the_tokens_served(served):
    await served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    await served.post("/v1/completions", {"prompt": PROMPT[:4], "max_tokens": 2, "ignore_eos": True})
    values = await served.metrics()
    assert values["tokenweir:generation_tokens_total"] == 5
    assert values["tokenweir:prompt_tokens_total"] == len(PROMPT) + 4
    assert values["tokenweir:request_success_total"] == 2
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds"):
        assert values[f"tokenweir:{name}_count"] >= 1, name
    assert "tokenweir:num_requests_running" in values and "tokenweir:kv_cache_usage_perc" in values


async def test_prefix_cache_queries_count_a_waiting_request_once(model_dir, monkeypatch):
    """A request waiting for KV blocks is looked up every step it does not fit; it still counts as one query."""
    engine = LLMEngine(
        EngineConfig(model=model_dir, num_kv_blocks=8, num_threads=1, quantization="none")
    )  # 128 tokens of KV
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(0.02) or step())  # the blocker runs for ~0.5 s
    async with serve(engine) as served:
        blocker = {"model": served.model, "prompt": list(range(100, 200)), "max_tokens": 28, "stream": True}
        async with served.client.stream("POST", "/v1/completions", json=blocker) as response:
            live = LiveStream(response)
            await live.take(1)
            # 40 tokens need 3 blocks; the blocker leaves 1 free until it ends.
            waiting = asyncio.create_task(
                served.post("/v1/completions", {"prompt": list(range(3, 43)), "max_tokens": 1})
            )
            for _ in range(1000):
                if (await served.load())["num_waiting"] == 1:
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError("the 40-token request never waited")
            assert (await live.rest())[-1] == "[DONE]"
        assert (await waiting).status_code == 200
        assert (await served.metrics())["tokenweir:prefix_cache_queries_total"] == 100 + 40


# --- abort and disconnect: exact usage, no leaked KV blocks -----------------------------------------------------


async def test_abort_running_stream_returns_exact_usage_and_frees_blocks(served):
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    async with served.client.stream("POST", "/v1/completions", json={"model": served.model, **body},
                                    headers={"X-Request-Id": "to-abort"}) as response:  # fmt: skip
        assert response.status_code == 200
        live = LiveStream(response)
        received = [t for e in await live.take(3) for t in e["choices"][0]["token_ids"]]
        abort = (await served.post("/abort", {"request_id": "to-abort"})).json()
        assert abort["request_id"] == "to-abort" and abort["status"] == "aborted"
        usage = abort["usage"]
        assert usage["prompt_tokens"] == len(PROMPT) and 3 <= usage["completion_tokens"] < LONG
        rest = await live.rest()
    assert rest[-1] == "[DONE]"
    received += [t for e in rest[:-1] for t in e["choices"][0]["token_ids"]]
    assert rest[-2]["choices"][0]["finish_reason"] == "abort"
    assert len(received) == usage["completion_tokens"]  # the client saw exactly the tokens it is billed for
    load = await served.wait_idle()
    assert load["num_free_blocks"] == load["num_total_blocks"]
    again = (await served.post("/abort", {"request_id": "to-abort"})).json()
    assert again["status"] == "aborted" and again["usage"] == usage
    # The engine's own counters agree with what the client is billed for.
    metrics = await served.metrics()
    assert metrics["tokenweir:generation_tokens_total"] == usage["completion_tokens"]
    assert metrics["tokenweir:prompt_tokens_total"] == usage["prompt_tokens"]
    assert metrics[f'tokenweir:request_success_total{{finished_reason="abort",model_name="{served.model}"}}'] == 1


async def test_abort_of_finished_and_unknown_requests(served):
    await served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers={"X-Request-Id": "done-1"})
    done = (await served.post("/abort", {"request_id": "done-1"})).json()
    assert done["status"] == "finished" and done["usage"]["prompt_tokens"] == len(PROMPT)
    unknown = (await served.post("/abort", {"request_id": "never-seen"})).json()
    assert unknown == {"request_id": "never-seen", "status": "unknown", "usage": None}
    # "unknown" holds: the request, arriving after its abort (its bytes were on the wire), is ended unserved
    prompts_before = (await served.metrics())["tokenweir:prompt_tokens_total"]
    late = await served.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers={"X-Request-Id": "never-seen"}
    )
    assert late.status_code == 200 and late.json()["choices"][0]["finish_reason"] == "abort", late.text
    assert late.json()["usage"]["total_tokens"] == 0
    assert (await served.metrics())["tokenweir:prompt_tokens_total"] == prompts_before
    # the bar is spent: the id serves a new request
    again = await served.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers={"X-Request-Id": "never-seen"}
    )
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2, again.text


async def test_stream_closed_by_client_is_aborted(served):
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    async with served.client.stream("POST", "/v1/completions", json={"model": served.model, **body},
                                    headers={"X-Request-Id": "walks-away"}) as response:  # fmt: skip
        await LiveStream(response).take(2)
    load = await served.wait_idle()  # without the abort, this request would run for LONG tokens
    assert load["num_free_blocks"] == load["num_total_blocks"]
    gone = (await served.post("/abort", {"request_id": "walks-away"})).json()
    assert gone["status"] == "aborted" and 2 <= gone["usage"]["completion_tokens"] < LONG


async def test_non_stream_client_disconnect_is_aborted(served):
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    request = asyncio.create_task(
        served.client.post("/v1/completions", json=body, headers={"X-Request-Id": "hangs-up"})
    )
    await served.wait_running()
    request.cancel()  # httpx closes the connection: the server sees the ASGI disconnect
    with pytest.raises(asyncio.CancelledError):
        await request
    load = await served.wait_idle()
    assert load["num_free_blocks"] == load["num_total_blocks"]
    gone = (await served.post("/abort", {"request_id": "hangs-up"})).json()
    assert gone["status"] == "aborted" and 1 <= gone["usage"]["completion_tokens"] < LONG


async def test_duplicate_running_request_id_is_refused(served):
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    async with served.client.stream("POST", "/v1/completions", json={"model": served.model, **body},
                                    headers={"X-Request-Id": "twice"}) as response:  # fmt: skip
        live = LiveStream(response)  # kept: a collected reader would close the response
        await live.take(1)
        r = await served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, headers={"X-Request-Id": "twice"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_request_id"
        await served.post("/abort", {"request_id": "twice"})
    await served.wait_idle()


async def test_priority_from_the_body_orders_the_queue(model_dir):
    """With one sequence slot, requests queued behind a blocker start by priority (lower first), not arrival."""
    async with serve(make_engine(model_dir, max_num_seqs=1)) as served:
        body = {"model": served.model, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
        async with served.client.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "blocker"}) as r:
            live = LiveStream(r)
            await live.take(1)
            done = []

            async def short(name: str, priority: int) -> None:
                body = {"prompt": PROMPT, "max_tokens": 2, "priority": priority}
                r = await served.post("/v1/completions", body, headers={"X-Request-Id": name})
                assert r.status_code == 200, r.text
                done.append(name)

            late = asyncio.create_task(short("low", 5))
            for _ in range(1000):  # "low" is queued before "high" arrives
                if (await served.load())["num_waiting"] == 1:
                    break
                await asyncio.sleep(0.01)
            urgent = asyncio.create_task(short("high", -1))
            for _ in range(1000):
                if (await served.load())["num_waiting"] == 2:
                    break
                await asyncio.sleep(0.01)
            assert (await served.load())["num_waiting"] == 2
            await served.post("/abort", {"request_id": "blocker"})
            await asyncio.gather(late, urgent)
        assert done == ["high", "low"]


# --- bad input: OpenAI's error shape with the right status and code, never a 500 ---------------------------------

BAD_COMPLETIONS = [
    # (body without model unless given, status, code, param)
    ({"prompt": PROMPT, "model": None}, 400, "invalid_request", "model"),
    ({}, 400, "invalid_request", "prompt"),
    ({"prompt": PROMPT, "n": 0}, 400, "invalid_request", "n"),
    ({"prompt": PROMPT, "n": 129}, 400, "invalid_request", "n"),
    ({"prompt": PROMPT, "temperature": -1}, 400, "invalid_request", "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, 400, "invalid_request", "top_p"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "invalid_request", "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": "many"}, 400, "invalid_request", "max_tokens"),
    ({"prompt": PROMPT, "top_k": -2}, 400, "invalid_request", "top_k"),
    ({"prompt": PROMPT, "presence_penalty": 3}, 400, "invalid_request", "presence_penalty"),
    ({"prompt": PROMPT, "logprobs": 21}, 400, "invalid_request", "logprobs"),
    ({"prompt": PROMPT, "logprobs": -1}, 400, "invalid_request", "logprobs"),
    ({"prompt": PROMPT, "logit_bias": {"x": 1}}, 400, "invalid_request", "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, 400, "invalid_request", "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"256": 5}}, 400, "invalid_token_id", "logit_bias"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, 400, "invalid_request", None),
    ({"prompt": PROMPT, "priority": "high"}, 400, "invalid_request", "priority"),
    ({"prompt": []}, 400, "invalid_request", "prompt"),
    ({"prompt": [PROMPT, PROMPT]}, 400, "invalid_request", "prompt"),
    ({"prompt": [1, 256]}, 400, "invalid_token_id", "prompt"),
    ({"prompt": [1, -1]}, 400, "invalid_token_id", "prompt"),
    ({"prompt": "text needs a tokenizer"}, 400, "no_tokenizer", "prompt"),
    ({"prompt": PROMPT, "model": "gpt-4o"}, 404, "model_not_found", "model"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "status", "code", "param"), BAD_COMPLETIONS)
async def test_bad_completion_requests(served, body, status, code, param, stream):
    body = {"model": served.model, **body, "stream": stream}
    if body["model"] is None:
        del body["model"]
    if "stream_options" in body:
        body["stream"] = False
    r = await served.client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert len(error["message"]) > 10
    if code == "model_not_found":
        assert served.model in error["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_over_long_prompt_names_the_numbers(served, stream):
    prompt = [7] * (MAX_LEN - 10)
    r = await served.post("/v1/completions", {"prompt": prompt, "max_tokens": 20, "stream": stream})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert error["param"] == "prompt"
    assert str(MAX_LEN) in error["message"] and str(MAX_LEN + 10) in error["message"]
    assert str(MAX_LEN - 10) in error["message"]


async def test_malformed_json_and_missing_body(served):
    r = await served.client.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = await served.client.post("/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = await served.client.post("/v1/completions", json=["not", "an", "object"])
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = await served.client.post("/abort", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


async def test_chat_bad_requests(served):
    good = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": good}, "no_tokenizer", "messages"),  # the tiny model has no tokenizer or template
        ({"messages": []}, "invalid_request", "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_request", "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "invalid_request", None),
        ({"messages": good, "top_logprobs": 2}, "invalid_request", "top_logprobs"),  # needs logprobs: true
        ({"messages": good, "logprobs": True, "top_logprobs": 21}, "invalid_request", "top_logprobs"),
        ({"messages": good, "n": 0}, "invalid_request", "n"),
        ({"messages": good, "response_format": {"type": "xml"}}, "invalid_request", "response_format.type"),
        ({"messages": good, "response_format": {"type": "json_schema"}}, "invalid_request", "response_format"),
        (
            {"messages": good, "tools": [{"function": {"name": "f"}}], "response_format": {"type": "json_object"}},
            "invalid_request",
            "tool_choice",
        ),
        (
            {"messages": good, "tools": [{"function": {"name": "f"}}], "tool_choice": {"function": {"name": "g"}}},
            "invalid_request",
            "tool_choice",
        ),
        ({"messages": good, "max_completion_tokens": 0}, "invalid_request", "max_completion_tokens"),
        ({"messages": good, "modalities": ["text", "audio"]}, "invalid_request", "modalities"),
        ({"messages": good, "audio": {"voice": "alloy"}}, "invalid_request", "audio"),
        ({"messages": good, "functions": [{"name": "f"}]}, "invalid_request", "functions"),
        ({"messages": good, "reasoning_effort": "low"}, "invalid_request", "reasoning_effort"),
    ]
    for body, code, param in cases:
        r = await served.post("/v1/chat/completions", body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["code"] == code, (body, error)
        if param is not None:
            assert error["param"] == param, (body, error)
    r = await served.post("/v1/chat/completions", cases[3][0])
    assert "text" in r.json()["error"]["message"] and r.json()["error"]["param"].startswith("messages[0].content")


async def test_tools_the_model_would_choose_need_a_tool_call_parser(model_dir):
    tools = [{"type": "function", "function": {"name": "f"}}]
    async with serve(make_engine(model_dir), tool_call_parser=None) as plain:
        for choice in ({}, {"tool_choice": "auto"}):
            r = await plain.post(
                "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": tools, **choice}
            )
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "tool_choice", error
            assert "--tool-call-parser" in error["message"] and error["type"] == "invalid_request_error"


async def test_unknown_route_and_method(served):
    r = await served.client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = await served.client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


async def test_tokenize_without_tokenizer_is_a_clear_400(served):
    r = await served.client.post("/tokenize", json={"prompt": "hello"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer"
    r = await served.client.post("/tokenize", json={})
    assert r.status_code == 400 and "exactly one of prompt or messages" in r.json()["error"]["message"]


# --- the app without uvicorn (ASGITransport runs no lifespan: the engine is started by hand) ---------------------


async def test_app_over_asgi_transport(model_dir):
    threads = torch.get_num_threads()
    async_engine = AsyncEngine(make_engine(model_dir))
    async_engine.start()
    try:
        transport = httpx.ASGITransport(build_app(async_engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            body = {"model": async_engine.model_name, "prompt": PROMPT, "max_tokens": 2, "priority": -5}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        async_engine.stop()
        torch.set_num_threads(threads)


def test_parse_size():
    assert parse_size("536870912") == 512 * 2**20
    assert parse_size("512MiB") == parse_size("512M") == 512 * 2**20
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5k") == 1536
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


async def test_request_id_is_reusable_after_abort_and_disconnect(served):
    """Nothing of an ended request lingers: its id can run again at once (an abort path that forgot its stream would
    refuse it as a duplicate)."""
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    for rid in ("reuse-abort", "reuse-gone"):
        async with served.client.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
            live = LiveStream(r)
            await live.take(1)
            if rid == "reuse-abort":
                await served.post("/abort", {"request_id": rid})
                assert (await live.rest())[-1] == "[DONE]"
        await served.wait_idle()
        again = await served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers={"X-Request-Id": rid})
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["completion_tokens"] == 2


async def test_engine_fault_fails_requests_in_flight_and_refuses_new_ones_as_dead(served, monkeypatch):
    """The engine itself failing (injected into its step). A stream in flight ends with a 500 engine_loop_died error
    event (it may have caused it: a router must not retry it elsewhere), a new request gets 503 engine_dead (it never
    ran: another engine may serve it), and /health turns 503 so a gateway stops routing here."""

    def broken_step():
        raise RuntimeError("injected fault")

    died: list[BaseException] = []
    served.engine.on_dead = died.append  # the server's: SIGTERM itself, then exit non-zero to be restarted
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    async with served.client.stream("POST", "/v1/completions", json=body) as response:
        live = LiveStream(response)
        await live.take(1)
        monkeypatch.setattr(served.engine.engine, "step", broken_step)
        events = await live.rest()
    assert events[-1] == "[DONE]"
    assert len(died) == 1 and "injected fault" in repr(died[0])
    error = events[-2]["error"]
    assert error["code"] == "engine_loop_died" and error["type"] == "server_error"
    assert "injected fault" in error["message"]
    r = await served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers={"X-Request-Id": "f1"})
    assert r.status_code == 503 and r.headers["x-request-id"] == "f1"
    assert r.json()["error"]["code"] == "engine_dead" and "injected fault" in r.json()["error"]["message"]
    health = await served.client.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"


# --- the CLI ----------------------------------------------------------------------------------------------------------


def test_cli_refuses_a_bad_model_or_config_cleanly(tmp_path):
    with pytest.raises(SystemExit, match="cannot start: unsupported model path"):
        main(["--model", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="block_size"):
        main(["--model", str(tmp_path), "--block-size", "3"])


def test_python_m_engine_server_serves(model_dir):
    """`python -m engine.server` (what `tokenweir engine` and `tokenweir serve` run) loads, serves and stops."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--model", model_dir, "--port", str(port), "--served-model-name", "tiny", "--num-kv-blocks", "32"]
    args += ["--max-model-len", "256", "--num-threads", "1", "--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, "-m", "tokenweir.engine.server", *args], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            assert proc.poll() is None, f"the server exited: {proc.stdout.read()}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 256)]
        load = httpx.get(f"{url}/load").json()
        assert load["num_total_blocks"] == 32 and load["max_num_seqs"] == 64
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it so the exit status still says SIGTERM.
    assert proc.returncode in (0, -signal.SIGTERM) and "serving 'tiny'" in out


async def test_concurrent_streams_each_get_their_own_tokens(served, model_dir):
    """Eight streams at once, batched together in the engine: each gets exactly its own greedy continuation."""
    prompts = [[(t * (i + 3) + i) % 256 for t in PROMPT] for i in range(8)]
    llm = LLM(model_dir, dtype="float32", quantization="none", num_kv_blocks=64, num_threads=1)
    want = [
        o.new_token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    ]

    async def one(i: int) -> list[int]:
        body = {"prompt": prompts[i], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
        r = await served.post("/v1/completions", body, headers={"X-Request-Id": f"many-{i}"})
        events = sse_events(r.text)
        assert all(e["id"] == f"cmpl-many-{i}" for e in events[:-1])
        return [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]

    assert await asyncio.gather(*(one(i) for i in range(8))) == want
    load = await served.wait_idle()
    assert load["num_free_blocks"] == load["num_total_blocks"]


async def test_step_loop_runs_on_the_thread_that_built_the_engine(model_dir):
    """Built on an EngineThread, the engine is stepped on that same thread: the OpenMP pools of two compute threads
    would outnumber the cores, and libgomp then sleeps between parallel regions (half the batch-1 speed)."""
    thread = EngineThread()
    engine = thread.call(make_engine, model_dir)
    built_on = thread.call(threading.get_ident)
    stepped_on: set[int] = set()
    step = engine.step

    def traced_step():
        stepped_on.add(threading.get_ident())
        return step()

    engine.step = traced_step
    async_engine = AsyncEngine(engine, thread=thread)
    async_engine.start()
    try:
        stream = async_engine.add_request("on-thread", PROMPT, SamplingParams(max_tokens=3))
        outs = [out async for out in stream]
        stream.close()
        assert outs[-1].finished and outs[-1].num_output_tokens == 3
    finally:
        async_engine.stop()
    assert stepped_on == {built_on} and built_on != threading.get_ident()
