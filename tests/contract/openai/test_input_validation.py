"""Bad input gets an OpenAI-style 4xx that names the field, never a 500, and never reaches the upstream.

Everything goes over real HTTP to the gateway served by uvicorn, in front of the fake upstream (wrapped to record
what it receives). The first list is the issue's 14 cases, each a 500 before input was validated strictly.
"""

from __future__ import annotations

import json

import httpx
import orjson
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.admin.teams import router as admin_router
from tokenweir.gateway.auth.authenticator import Authenticator
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.deps.services import Services
from tokenweir.gateway.openai import body as body_parsing
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

MODEL = "fake-model"
HELLO = [{"role": "user", "content": "Say hello"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class Recording:
    """ASGI wrapper: the JSON bodies the upstream received on /v1, then the fake upstream answers as usual."""

    def __init__(self, app) -> None:
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        self.bodies.append(orjson.loads(body))
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation")
    upstream = Recording(FakeUpstream(model=MODEL))
    store = Store.open(f"sqlite:///{tmp}/store.db")
    team = store.create_team("validation")
    team_secret, _ = store.create_key(team.id, "test")
    admin_secret, _ = store.create_key(None, "admin", is_admin=True)
    with ServerThread(upstream) as up:
        config = GatewayConfig(
            port=0,
            pools=[PoolConfig(model=MODEL, upstreams=[UpstreamConfig(up.url)], max_context=4096)],
            events=EventsConfig(path=str(tmp / "events.jsonl"), flush_interval_s=0.05),
            max_body_bytes=64 * 1024,
        )
        with serve_app(config, store=store) as gw, httpx.Client(base_url=gw.url, timeout=10) as http:
            admin = {"authorization": f"Bearer {admin_secret}"}
            team_id = http.post("/admin/teams", json={"name": "target"}, headers=admin).json()["id"]
            yield {
                "http": http,
                "upstream": upstream,
                "team": {"authorization": f"Bearer {team_secret}"},
                "admin": admin,
                "team_id": team_id,
            }
    store.close()


def send(stack, method: str, path: str, body=None, *, raw: bytes | None = None, admin: bool = False):
    headers = stack["admin"] if admin else stack["team"]
    content = raw if raw is not None else None if body is None else json.dumps(body).encode()
    if content is not None:
        headers = {**headers, "content-type": "application/json"}
    return stack["http"].request(method, path.format(team=stack["team_id"]), content=content, headers=headers)


def assert_refused(stack, response: httpx.Response, status: int, code: str, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    assert (error["code"], error["param"]) == (code, param), error
    assert error["message"] and (param is None or f"'{param}'" in error["message"]), error
    return error["message"]


def deep(levels: int, leaf=1):
    """`levels` objects and arrays nested in one another (alternating), around `leaf`."""
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 4, **fields}


def user(content) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **fields}


# (method, path, body, status, code, param, message excerpt): the issue's 14 inputs, each a 500 before.
ISSUE_CASES = {
    "chat max_tokens as a string": (
        "POST", CHAT, chat(max_tokens="100"), 400, "invalid_type", "max_tokens", "expected an integer, but got a string"
    ),
    "chat max_completion_tokens as a string": (
        "POST", CHAT, chat(max_completion_tokens="100"), 400, "invalid_type", "max_completion_tokens", "a string"
    ),
    "completions max_tokens as a string": (
        "POST", COMPLETIONS, completion(max_tokens="100"), 400, "invalid_type", "max_tokens", "a string"
    ),
    "stream as the string 'false'": (
        "POST", CHAT, chat(stream="false"), 400, "invalid_type", "stream", "expected a boolean, but got a string"
    ),
    "text part with an integer text": (
        "POST", CHAT, user([{"type": "text", "text": 123}]), 400, "invalid_type", "messages.0.content.0.text",
        "expected a string, but got an integer",
    ),
    "text part with a null text": (
        "POST", CHAT, user([{"type": "text", "text": None}]), 400, "invalid_type", "messages.0.content.0.text", "null"
    ),
    "text part with a list text": (
        "POST", CHAT, user([{"type": "text", "text": ["a"]}]), 400, "invalid_type", "messages.0.content.0.text",
        "an array",
    ),
    "a field nested 300 levels deep": (
        "POST", CHAT, chat(metadata_x=deep(300)), 400, "invalid_json", "metadata_x", "at most 64 levels"
    ),
    "prompt as a list of objects": (
        "POST", COMPLETIONS, completion(prompt=[{"a": 1}]), 400, "invalid_type", "prompt", "an array of objects"
    ),
    "prompt mixing strings and integers": (
        "POST", COMPLETIONS, completion(prompt=["a", 1]), 400, "invalid_type", "prompt.1", "expected a string"
    ),
    "prompt with a negative token id": (
        "POST", COMPLETIONS, completion(prompt=[1, -5]), 400, "invalid_value", "prompt.1", "expected a value >= 0"
    ),
    "prompt as an empty list": (
        "POST", COMPLETIONS, completion(prompt=[]), 400, "invalid_value", "prompt", "non-empty array"
    ),
    "team rpm of 2**63": (
        "PUT", "/admin/teams/{team}/limits", {"rpm": 2**63}, 400, "invalid_value", "rpm", "less than or equal to"
    ),
    "key expires_in_s of 1e12": (
        "POST", "/admin/teams/{team}/keys", {"name": "k", "expires_in_s": 1e12}, 400, "invalid_value",
        "expires_in_s", "less than or equal to",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ISSUE_CASES.values(), ids=ISSUE_CASES.keys())
def test_the_issues_fourteen_inputs_get_a_400_naming_the_field(stack, case):
    method, path, body, status, code, param, excerpt = case
    seen = len(stack["upstream"].bodies)
    r = send(stack, method, path, body, admin=path.startswith("/admin"))
    assert excerpt in assert_refused(stack, r, status, code, param)
    assert len(stack["upstream"].bodies) == seen, "a refused request reached the upstream"


# More of the same: strict types as OpenAI's spec has them, content parts, messages, prompts, nesting.
V1_CASES = {
    # numbers and booleans: no coercion from strings, no floats for integers, no integers for booleans
    "temperature as a string": (CHAT, chat(temperature="0.5"), "invalid_type", "temperature"),
    "temperature as a boolean": (CHAT, chat(temperature=True), "invalid_type", "temperature"),
    "temperature above 2": (CHAT, chat(temperature=2.5), "invalid_value", "temperature"),
    "top_p as a string": (CHAT, chat(top_p="1"), "invalid_type", "top_p"),
    "n as a float": (CHAT, chat(n=1.5), "invalid_type", "n"),
    "n as a string": (CHAT, chat(n="1"), "invalid_type", "n"),
    "n as true": (CHAT, chat(n=True), "invalid_type", "n"),
    "n of 0": (CHAT, chat(n=0), "invalid_value", "n"),
    "n of 129": (COMPLETIONS, completion(n=129), "invalid_value", "n"),
    "best_of below n": (COMPLETIONS, completion(n=3, best_of=2), "invalid_value", "best_of"),
    "max_tokens as a float": (CHAT, chat(max_tokens=1.5), "invalid_type", "max_tokens"),
    "max_tokens as true": (CHAT, chat(max_tokens=True), "invalid_type", "max_tokens"),
    "max_tokens of 0": (CHAT, chat(max_tokens=0), "invalid_value", "max_tokens"),
    "max_tokens of 2**40": (CHAT, chat(max_tokens=2**40), "invalid_value", "max_tokens"),
    "max_tokens past 64 bits": (CHAT, chat(max_tokens=2**64), "invalid_type", "max_tokens"),
    "stream as 0": (CHAT, chat(stream=0), "invalid_type", "stream"),
    "stream as the string 'true'": (COMPLETIONS, completion(stream="true"), "invalid_type", "stream"),
    "stream_options not an object": (CHAT, chat(stream=True, stream_options="yes"), "invalid_type", "stream_options"),
    "stream_options.include_usage as a string": (
        CHAT, chat(stream=True, stream_options={"include_usage": "true"}), "invalid_type",
        "stream_options.include_usage",
    ),
    "priority as a string": (CHAT, chat(priority="0"), "invalid_type", "priority"),
    "priority as a float": (CHAT, chat(priority=1.5), "invalid_type", "priority"),
    "priority out of the bands": (CHAT, chat(priority=-1), "invalid_value", "priority"),
    "priority null": (CHAT, chat(priority=None), "invalid_type", "priority"),
    "stop as an integer": (CHAT, chat(stop=5), "invalid_type", "stop"),
    "stop with an integer": (COMPLETIONS, completion(stop=["a", 5]), "invalid_type", "stop.1"),
    "user as an integer": (CHAT, chat(user=5), "invalid_type", "user"),
    "seed as a string": (CHAT, chat(seed="1"), "invalid_type", "seed"),
    "logit_bias out of range": (CHAT, chat(logit_bias={"50256": -101}), "invalid_value", "logit_bias.50256"),
    "logit_bias keyed by a word": (CHAT, chat(logit_bias={"the": 1}), "invalid_value", "logit_bias.the"),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=1), "invalid_value", "top_logprobs"),
    "a function tool without its function": (CHAT, chat(tools=[{"type": "function"}]), "missing_required_parameter",
                                             "tools.0.function"),
    "a function named with a space": (CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
                                      "invalid_value", "tools.0.function.name"),
    "response_format of an unknown type": (CHAT, chat(response_format={"type": "yaml"}), "invalid_value",
                                           "response_format.type"),
    "tools not an array": (CHAT, chat(tools={"type": "function"}), "invalid_type", "tools"),
    "tool without a type": (CHAT, chat(tools=[{"function": {"name": "f"}}]), "missing_required_parameter",
                            "tools.0.type"),
    "tool_choice as a number": (CHAT, chat(tool_choice=1), "invalid_type", "tool_choice"),
    "response_format as a string": (CHAT, chat(response_format="json"), "invalid_type", "response_format"),
    "model missing": (CHAT, {"messages": HELLO}, "missing_required_parameter", "model"),
    "model as an integer": (CHAT, chat(model=5), "invalid_type", "model"),
    "model empty": (COMPLETIONS, completion(model=""), "invalid_value", "model"),
    # messages
    "messages missing": (CHAT, {"model": MODEL}, "missing_required_parameter", "messages"),
    "messages empty": (CHAT, chat(messages=[]), "invalid_value", "messages"),
    "messages as a string": (CHAT, chat(messages="hi"), "invalid_type", "messages"),
    "message as a string": (CHAT, chat(messages=["hi"]), "invalid_type", "messages.0"),
    "message without a role": (CHAT, chat(messages=[{"content": "hi"}]), "missing_required_parameter",
                               "messages.0.role"),
    "message with an unknown role": (CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), "invalid_value",
                                     "messages.0.role"),
    "message with a numeric role": (CHAT, chat(messages=[{"role": 1, "content": "hi"}]), "invalid_type",
                                    "messages.0.role"),
    "user message without content": (CHAT, chat(messages=[{"role": "user"}]), "missing_required_parameter",
                                     "messages.0.content"),
    "user message with null content": (CHAT, user(None), "invalid_type", "messages.0.content"),
    "system message with null content": (
        CHAT, chat(messages=[{"role": "system", "content": None}, *HELLO]), "invalid_type", "messages.0.content"
    ),
    "content as a number": (CHAT, user(5), "invalid_type", "messages.0.content"),
    "content as an object": (CHAT, user({"type": "text", "text": "hi"}), "invalid_type", "messages.0.content"),
    "content as an empty array": (CHAT, user([]), "invalid_value", "messages.0.content"),
    "message name as a number": (CHAT, chat(messages=[{"role": "user", "content": "hi", "name": 5}]),
                                 "invalid_type", "messages.0.name"),
    "assistant tool_calls not an array": (
        CHAT, chat(messages=[*HELLO, {"role": "assistant", "tool_calls": {"id": "x"}}]), "invalid_type",
        "messages.1.tool_calls",
    ),
    "tool call arguments as an object": (
        CHAT,
        chat(messages=[*HELLO, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]),
        "invalid_type", "messages.1.tool_calls.0.function.arguments",
    ),
    # content parts
    "part as a string": (CHAT, user(["hi"]), "invalid_type", "messages.0.content.0"),
    "part without a type": (CHAT, user([{"text": "hi"}]), "missing_required_parameter", "messages.0.content.0.type"),
    "part with a numeric type": (CHAT, user([{"type": 1, "text": "hi"}]), "invalid_type",
                                 "messages.0.content.0.type"),
    "text part without text": (CHAT, user([{"type": "text"}]), "missing_required_parameter",
                               "messages.0.content.0.text"),
    "image part without image_url": (CHAT, user([{"type": "image_url"}]), "missing_required_parameter",
                                     "messages.0.content.0.image_url"),
    "image part with a numeric url": (CHAT, user([{"type": "image_url", "image_url": {"url": 1}}]), "invalid_type",
                                      "messages.0.content.0.image_url.url"),
    "image part with an array image_url": (CHAT, user([{"type": "image_url", "image_url": ["u"]}]), "invalid_type",
                                           "messages.0.content.0.image_url"),
    "audio part with a string input_audio": (CHAT, user([{"type": "input_audio", "input_audio": "x"}]),
                                             "invalid_type", "messages.0.content.0.input_audio"),
    "audio part without format": (CHAT, user([{"type": "input_audio", "input_audio": {"data": "AAA="}}]),
                                  "missing_required_parameter", "messages.0.content.0.input_audio.format"),
    "file part with an array file": (CHAT, user([{"type": "file", "file": []}]), "invalid_type",
                                     "messages.0.content.0.file"),
    "file part with a numeric file_id": (CHAT, user([{"type": "file", "file": {"file_id": 1}}]), "invalid_type",
                                         "messages.0.content.0.file.file_id"),
    # prompts
    "prompt missing": (COMPLETIONS, {"model": MODEL}, "missing_required_parameter", "prompt"),
    "prompt null": (COMPLETIONS, completion(prompt=None), "invalid_type", "prompt"),
    "prompt as a number": (COMPLETIONS, completion(prompt=5), "invalid_type", "prompt"),
    "prompt as booleans": (COMPLETIONS, completion(prompt=[True]), "invalid_type", "prompt"),
    "prompt token ids with a float": (COMPLETIONS, completion(prompt=[1, 2.5]), "invalid_type", "prompt.1"),
    "prompt token id past 2**31": (COMPLETIONS, completion(prompt=[2**31]), "invalid_value", "prompt.0"),
    "prompt token lists with an empty one": (COMPLETIONS, completion(prompt=[[1], []]), "invalid_value", "prompt.1"),
    "prompt token lists with a string": (COMPLETIONS, completion(prompt=[[1, "a"]]), "invalid_type", "prompt.0.1"),
    "prompt token lists nested too far": (COMPLETIONS, completion(prompt=[[[1]]]), "invalid_type", "prompt.0.0"),
    # nesting: 64 levels is the limit, wherever the depth is
    "65 levels in an unknown field": (CHAT, chat(x=deep(64)), "invalid_json", "x"),
    "65 levels inside a message": (CHAT, chat(messages=[{"role": "user", "content": "hi", "x": deep(62)}]),
                                   "invalid_json", "messages"),
    "65 levels in a tool's parameters": (
        CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep(61)}}]), "invalid_json",
        "tools",
    ),
    # fields only the gateway sets on its way to an engine
    "a client's kv_transfer_params on chat": (
        CHAT, chat(kv_transfer_params={"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9}),
        "unsupported_parameter", "kv_transfer_params",
    ),
    "a client's kv_transfer_params on completions": (
        COMPLETIONS, completion(kv_transfer_params={"do_remote_decode": True}), "unsupported_parameter",
        "kv_transfer_params",
    ),
    "a client's null kv_transfer_params": (CHAT, chat(kv_transfer_params=None), "unsupported_parameter",
                                           "kv_transfer_params"),
}  # fmt: skip


@pytest.mark.parametrize("case", V1_CASES.values(), ids=V1_CASES.keys())
def test_bad_v1_bodies_get_a_400_naming_the_field(stack, case):
    path, body, code, param = case
    seen = len(stack["upstream"].bodies)
    message = assert_refused(stack, send(stack, "POST", path, body), 400, code, param)
    assert any(word in message for word in ("expected", "must", "needs", "at most", "Missing")), message
    assert len(stack["upstream"].bodies) == seen, "a refused request reached the upstream"


def test_bodies_that_are_not_json_objects(stack):
    for raw in (b"{nope", b"[]", b'"text"', b"null", b"[" * 2000 + b"]" * 2000, b'{"model": "\\ud800"}'):
        assert_refused(stack, send(stack, "POST", CHAT, raw=raw), 400, "invalid_json", None)
    big = user("a" * 70_000)
    assert_refused(stack, send(stack, "POST", CHAT, big), 413, "body_too_large", None)


ADMIN_CASES = {
    "team rpm past 10**9": ("POST", "/admin/teams", {"name": "a", "limits": {"rpm": 10**9 + 1}}, "limits.rpm"),
    "team tpm past 10**15": ("PUT", "/admin/teams/{team}/limits", {"tpm": 10**15 + 1}, "tpm"),
    "tokens_per_day of 2**63": ("PUT", "/admin/teams/{team}/limits", {"tokens_per_day": 2**63}, "tokens_per_day"),
    "tokens_per_month of 1e300": ("PUT", "/admin/teams/{team}/limits", {"tokens_per_month": 1e300},
                                  "tokens_per_month"),
    "max_concurrency of 2**31": ("PUT", "/admin/teams/{team}/limits", {"max_concurrency": 2**31}, "max_concurrency"),
    "max_prompt_tokens of 2**31": ("PUT", "/admin/teams/{team}/limits", {"max_prompt_tokens": 2**31},
                                   "max_prompt_tokens"),
    "max_output_tokens of 2**63": ("PUT", "/admin/teams/{team}/limits", {"max_output_tokens": 2**63},
                                   "max_output_tokens"),
    "queue_timeout_s past 10 days": ("PUT", "/admin/teams/{team}/limits", {"queue_timeout_s": 864_001},
                                     "queue_timeout_s"),
    "total_timeout_s of 1e300": ("PUT", "/admin/teams/{team}/limits", {"total_timeout_s": 1e300}, "total_timeout_s"),
    "an empty model name": ("PUT", "/admin/teams/{team}/limits", {"allowed_models": [""]}, "allowed_models.0"),
    "a model name with a NUL": ("PUT", "/admin/teams/{team}/limits", {"allowed_models": ["a\x00b"]},
                                "allowed_models.0"),
    "1001 allowed models": ("PUT", "/admin/teams/{team}/limits", {"allowed_models": ["m"] * 1001}, "allowed_models"),
    "a key name with a NUL": ("POST", "/admin/keys", {"name": "ci\x00"}, "name"),
    "a key name with a lone surrogate": ("POST", "/admin/keys", {"name": "ci\ud800"}, "name"),
    "expires_at in year 9999, west of UTC": (
        "POST", "/admin/teams/{team}/keys", {"name": "k", "expires_at": "9999-12-31T23:59:59-05:00"}, "expires_at"
    ),
    "expires_at in year 1, east of UTC": (
        "POST", "/admin/keys", {"name": "k", "expires_at": "0001-01-01T00:00:00+05:00"}, "expires_at"
    ),
    "expires_at 200 years on": ("POST", "/admin/keys", {"name": "k", "expires_at": "2300-01-01T00:00:00Z"},
                                "expires_at"),
    "expires_at as a huge timestamp": ("POST", "/admin/keys", {"name": "k", "expires_at": 1e20}, "expires_at"),
    "a team id of 10,000 characters": ("GET", "/admin/teams/" + "t" * 10_000, None, "team_id"),
    "a team id with a NUL": ("GET", "/admin/teams/team%00x/limits", None, "team_id"),
    "a key id of 1,000 characters": ("DELETE", "/admin/keys/" + "k" * 1000, None, "key_id"),
    "a team_id query of 1,000 characters": ("GET", "/admin/keys?team_id=" + "t" * 1000, None, "team_id"),
    "usage since year 99999": ("GET", "/admin/usage?since=99999-01-01", None, "since"),
    "usage until a timestamp": ("GET", "/admin/usage?until=1e300", None, "until"),
}  # fmt: skip


@pytest.mark.parametrize("case", ADMIN_CASES.values(), ids=ADMIN_CASES.keys())
def test_bad_admin_input_gets_a_400_naming_the_field(stack, case):
    method, path, body, param = case
    r = send(stack, method, path, body, admin=True)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value" and param in error["message"], error


def test_admin_json_nested_too_deep_is_a_400(stack):
    raw = b'{"name": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"  # deeper than Python's json can recurse
    r = stack["http"].post("/admin/teams", content=raw, headers={**stack["admin"], "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_limits_stored_past_the_bounds_still_read_back(stack, tmp_path):
    """The bounds are on input: a team whose stored limits exceed them (written before) still shows them."""
    store = Store.open(f"sqlite:///{tmp_path}/old.db")
    try:
        team = store.create_team("old", TeamLimits(rpm=10**12, max_concurrency=2**31 - 1, queue_timeout_s=1e7))
        app = FastAPI()
        app.include_router(admin_router)
        app.state.services = Services.partial(store=store, authenticator=Authenticator(store))
        secret, _ = store.create_key(None, "admin", is_admin=True)
        with TestClient(app, headers={"authorization": f"Bearer {secret}"}) as client:
            assert client.get(f"/admin/teams/{team.id}/limits").json()["rpm"] == 10**12
            assert client.get(f"/admin/teams/{team.id}").json()["limits"]["queue_timeout_s"] == 1e7
            assert client.get("/admin/teams").status_code == 200
    finally:
        store.close()


def test_admin_bounds_still_accept_large_sane_values(stack):
    limits = {
        "rpm": 10**9,
        "tpm": 10**15,
        "tokens_per_day": 10**15,
        "tokens_per_month": 10**15,
        "max_concurrency": 10**9,
        "max_prompt_tokens": 10**9,
        "max_output_tokens": 10**9,
        "queue_timeout_s": 864_000,
        "allowed_models": [MODEL],
    }
    r = send(stack, "PUT", "/admin/teams/{team}/limits", limits, admin=True)
    assert r.status_code == 200 and r.json()["rpm"] == 10**9, r.text
    r = send(
        stack, "POST", "/admin/teams/{team}/keys", {"name": "long-lived", "expires_in_s": 99 * 365 * 86400}, admin=True
    )
    assert r.status_code == 201, r.text
    r = send(stack, "POST", "/admin/keys", {"name": "k", "expires_at": "2020-01-01T00:00:00+14:00"}, admin=True)
    assert r.status_code == 201 and r.json()["status"] == "expired", r.text


# --- what must still pass ----------------------------------------------------------------------------------------


def test_valid_edge_cases_pass_and_reach_the_upstream_untouched(stack):
    body = chat(
        temperature=1,  # an integer where a number is expected: fine, as OpenAI takes it
        top_p=1,
        presence_penalty=0,
        frequency_penalty=-2,
        seed=-(2**63),
        stop=["\n"],
        user="alice",
        n=1,
        stream=False,
        priority=2,
        logit_bias={"50256": -100},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice="auto",
        vendor_extension={"nested": [1, {"deep": deep(50)}], "flag": None},  # unknown: passed through as it is
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": None, "tool_call_id": "c1"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "Thanks", "name": "bob", "x-extra": True},
        ],
    )  # fmt: skip
    seen = len(stack["upstream"].bodies)
    r = send(stack, "POST", CHAT, body)
    assert r.status_code == 200, r.text
    (received,) = stack["upstream"].bodies[seen:]
    for key in ("temperature", "top_p", "presence_penalty", "seed", "vendor_extension", "messages", "tools"):
        assert received[key] == body[key] and type(received[key]) is type(body[key]), key
    assert isinstance(received["temperature"], int), "validation must not coerce what goes upstream"


@pytest.mark.parametrize(
    "prompt", ["plain", "", ["a", "b"], [1, 2, 3], [0], [[1, 2], [3]]], ids=lambda p: json.dumps(p)[:20]
)
def test_every_prompt_shape_passes(stack, prompt):
    r = send(stack, "POST", COMPLETIONS, completion(prompt=prompt))
    assert r.status_code == 200, r.text


def test_n_choices_pass_and_reach_the_upstream_with_max_tokens_per_choice(stack):
    seen = len(stack["upstream"].bodies)
    r = send(stack, "POST", CHAT, chat(n=3, max_tokens=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    (received,) = stack["upstream"].bodies[seen:]
    assert (received["n"], received["max_tokens"]) == (3, 2)


def test_stream_booleans_and_options_pass(stack):
    r = send(stack, "POST", CHAT, chat(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert r.text.rstrip().endswith("data: [DONE]")
    r = send(stack, "POST", COMPLETIONS, completion(stream=False, stream_options=None, stop=None, max_tokens=None))
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text


@pytest.mark.parametrize(
    "parts",
    [
        [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png", "detail": "low"}}],
        [{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}],
        [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
        [{"type": "file", "file": {"file_id": "file-1"}}],
        [{"type": "some_future_part", "payload": {"x": 1}}],
    ],
    ids=["image_url object", "image_url string", "input_audio", "file", "unknown type"],
)
def test_non_text_parts_pass_validation(stack, parts):
    """What the gateway does with them (count, refuse for a text-only pool) is admission's call: never a 5xx."""
    r = send(stack, "POST", CHAT, user([{"type": "text", "text": "Look:"}, *parts]))
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["code"] not in ("invalid_type", "invalid_json", "missing_required_parameter")


# --- the depth check and the OpenAPI document, directly -------------------------------------------------------


@pytest.mark.parametrize("levels", [63, 64, 65, 66, 200])
def test_depth_limit_is_exact(levels):
    body = {"model": MODEL, "x": deep(levels - 1)}  # the body itself is level 1
    assert body_parsing.nests_too_deep(body) is (levels > body_parsing.MAX_DEPTH)
    assert body_parsing._deeper_than(body, body_parsing.MAX_DEPTH) is (levels > body_parsing.MAX_DEPTH)
    assert body_parsing.too_deep(body, body_parsing.MAX_DEPTH) == ("x" if levels > body_parsing.MAX_DEPTH else None)


def test_openapi_documents_the_request_bodies_and_errors(stack):
    spec = stack["http"].get("/openapi.json").json()
    text = json.dumps(spec)
    assert "#/$defs/" not in text, "request schemas must be self-contained"
    for path, required in ((CHAT, {"model", "messages"}), (COMPLETIONS, {"model", "prompt"})):
        operation = spec["paths"][path]["post"]
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        assert operation["requestBody"]["required"] is True
        assert set(schema["required"]) == required and schema["additionalProperties"] is True
        assert schema["properties"]["max_tokens"]["anyOf"][0]["type"] == "integer"
        assert {"200", "400", "401", "429"} <= set(operation["responses"])
        assert operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
        assert "text/event-stream" in operation["responses"]["200"]["content"]
    message = spec["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert len(message["messages"]["items"]["oneOf"]) == 6  # one per role
