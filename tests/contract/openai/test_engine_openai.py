"""The real SmolLM2 model behind the engine server, driven by the official `openai` SDK over real HTTP."""

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from tokenweir.common.text.tokenizer import Tokenizer
from tokenweir.engine.api import build_app
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.async_engine import AsyncEngine
from tokenweir.engine.core.llm_engine import LLMEngine
from tokenweir.engine.server import KEEP_ALIVE_S

pytestmark = pytest.mark.slow

SERVED = "smollm2-test"
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def base_url():
    """One uvicorn server for the module, on a free port, in a thread with its own event loop (lifespan starts the
    engine there)."""
    engine = LLMEngine(
        EngineConfig(served_model_name=SERVED, kv_cache_memory=128 * 2**20, max_model_len=2048, quantization="none")
    )
    app = build_app(AsyncEngine(engine))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2, timeout_keep_alive=KEEP_ALIVE_S
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=15)
    sock.close()


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def greedy_chat(client, tokenizer):  # tokenizer first: its load must not idle the client's pooled connection
    return client.chat.completions.create(
        model=SERVED, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_headers={"X-Request-Id": "chat-1"}
    )


def test_chat_completion_usage_is_exact(greedy_chat, tokenizer):
    assert greedy_chat.id == "chatcmpl-chat-1" and greedy_chat.model == SERVED
    (choice,) = greedy_chat.choices
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    usage = greedy_chat.usage
    assert usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if choice.finish_reason == "length":
        assert usage.completion_tokens == MAX_TOKENS
    else:
        assert usage.completion_tokens <= MAX_TOKENS
    # The reported text is what the reported tokens decode to (one token of slack: a stop token has no text).
    assert len(tokenizer.encode(choice.message.content)) <= usage.completion_tokens


def test_streamed_chat_equals_non_stream_greedy(client, greedy_chat):
    stream = client.chat.completions.create(
        model=SERVED,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0] for c in chunks if c.choices]
    text = "".join(choice.delta.content or "" for choice in content)
    assert text == greedy_chat.choices[0].message.content
    assert content[-1].finish_reason == greedy_chat.choices[0].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == greedy_chat.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == greedy_chat.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_and_stop_string(client, tokenizer):
    prompt = "The capital of France is"
    full = client.completions.create(model=SERVED, prompt=prompt, max_tokens=8, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and text.strip()
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt)) and full.usage.completion_tokens >= 1
    # A stop string taken from the greedy text itself: the output must end right before it.
    stop = text.strip()[:3]
    cut = client.completions.create(model=SERVED, prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.usage.completion_tokens <= full.usage.completion_tokens


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    assert models.data[0].max_model_len == 2048


def test_over_long_prompt_is_a_typed_bad_request(client):
    long_text = "word " * 2100
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": long_text}], max_tokens=4)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    assert "2048" in info.value.message


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)
    assert info.value.code == "model_not_found" and SERVED in info.value.message


def test_tokenize_and_detokenize(base_url, tokenizer):
    r = httpx.post(f"{base_url}/tokenize", json={"model": SERVED, "messages": MESSAGES})
    assert r.status_code == 200
    assert r.json()["tokens"] == tokenizer.encode_chat(MESSAGES) and r.json()["max_model_len"] == 2048
    r = httpx.post(f"{base_url}/tokenize", json={"prompt": "Hello there"})
    assert r.json()["count"] == len(tokenizer.encode("Hello there"))
    back = httpx.post(f"{base_url}/detokenize", json={"tokens": r.json()["tokens"]})
    assert back.json() == {"prompt": "Hello there"}
    bad = httpx.post(f"{base_url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_token_id"


def test_raw_chat_stream_shape(base_url, greedy_chat):
    """What non-SDK clients parse: the role only in the first delta, usage on every chunk when asked."""
    body = {
        "model": SERVED,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    payloads = [line[len("data: ") :] for line in r.text.split("\n\n") if line]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1])
    completion = [c["usage"]["completion_tokens"] for c in chunks[1:-1]]
    assert completion == sorted(completion) and completion[-1] == greedy_chat.usage.completion_tokens
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == greedy_chat.usage.total_tokens


def test_streamed_stop_string_matches_non_stream(client):
    """Text held back while a stop string may be forming is released or cut exactly as the non-stream answer."""
    prompt = "List the days of the week:"
    full = client.completions.create(model=SERVED, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = full.strip()[4:7]  # inside the text, so the answer must be cut there
    kwargs = {"model": SERVED, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": stop}
    cut = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.text == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == cut.finish_reason == "stop"


def test_text_parts_content_is_the_same_prompt(client, greedy_chat):
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    r = client.chat.completions.create(model=SERVED, messages=parts, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == greedy_chat.usage.prompt_tokens
