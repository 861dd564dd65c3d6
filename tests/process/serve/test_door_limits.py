"""The gateway's door (common/http/door_limits.py, common/http/door.py) against a real `tokenweir serve` process
on a free port, with raw sockets: heads bounded in bytes, fields and time, bodies that must keep arriving, idle
connections closed, open connections capped; and the same limits under uvicorn's h11 parser."""

from __future__ import annotations

import time
from dataclasses import asdict

import httpx
import orjson
import pytest

from loadtests.fake_upstream import free_port
from tests.support.door_client import (
    closes_within,
    connect,
    floods,
    open_connections,
    read_answer,
    request_bytes,
    rss_mib,
    still_open,
    trickle,
)
from tests.support.serve_process import serve_process
from tests.support.serve_thread import ServerThread
from tokenweir.common.http.door import protocol_class
from tokenweir.common.http.door_limits import HttpLimits, uvicorn_options
from tokenweir.gateway.config import load_config

# Short timeouts, so that what must be cut is cut within a test's patience.
HTTP = {"header_timeout_s": 1, "body_timeout_s": 1, "keep_alive_s": 1, "max_header_fields": 20}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("door")
    cfg = tmp / "c.yaml"
    http = ", ".join(f"{k}: {v}" for k, v in HTTP.items())
    cfg.write_text(
        "pools:\n  - model: m\n    upstreams:\n      - base_url: http://127.0.0.1:9\n"
        f"events: {{path: {tmp}/ev.jsonl}}\nhttp: {{{http}}}\n"
    )
    args = ["--no-engine", "--config", str(cfg), "--port", str(free_port()), "--store", f"sqlite:///{tmp}/tw.db"]
    with serve_process(args) as served:
        yield served


def port_of(served) -> int:
    return int(served.url.rsplit(":", 1)[1])


def test_three_never_ending_150_mb_headers_are_cut_at_the_limit_and_memory_stays_flat(gateway):
    port = port_of(gateway)
    assert httpx.get(gateway.url + "/livez").status_code == 200
    before = rss_mib(gateway.proc.pid)
    results = floods(port, n=3, total=150 * 2**20, deadline_s=60, path="/livez")
    after = rss_mib(gateway.proc.pid)
    for flood in results:
        # The client's own socket buffers take a few MiB before the server's refusal reaches it.
        assert flood.sent < 32 * 2**20, f"the server took {flood.sent} bytes of one header"
        assert flood.answer is not None and flood.answer.status in (431, None), flood
        if flood.answer.status == 431:
            assert flood.answer.body["error"]["code"] == "header_too_large"
    assert after - before < 30, f"RSS {before:.0f} -> {after:.0f} MiB"
    assert httpx.get(gateway.url + "/livez").status_code == 200


def test_a_head_over_the_byte_limit_in_one_read_gets_431(gateway):
    sock = connect(port_of(gateway))
    sock.sendall(request_bytes("/livez", field_bytes=70 * 1024))
    answer = read_answer(sock, 5)
    assert answer.status == 431
    err = answer.body["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "header_too_large") and "65536" in err["message"]


def test_more_header_fields_than_the_limit_get_431_and_the_limit_itself_is_served(gateway):
    port = port_of(gateway)
    sock = connect(port)
    sock.sendall(request_bytes("/livez", fields=HTTP["max_header_fields"] - 1))  # + Host: exactly the limit
    assert read_answer(sock, 5).status == 200
    sock = connect(port)
    sock.sendall(request_bytes("/livez", fields=HTTP["max_header_fields"]))
    answer = read_answer(sock, 5)
    assert answer.status == 431 and answer.body["error"]["code"] == "too_many_headers"
    assert closes_within(sock, 2) is not None


def test_slow_header_senders_are_cut_at_the_header_timeout_while_other_clients_are_served(gateway):
    port = port_of(gateway)
    head = request_bytes("/livez", field_bytes=200)
    socks = open_connections(port, 40)
    start, served, step = time.monotonic(), [], 0
    while time.monotonic() - start < 3:  # one byte per second, per connection: three times the header timeout
        trickle(socks, head, step)
        step += 1
        served.append(httpx.get(gateway.url + "/livez", timeout=5).status_code)
        time.sleep(1)
    assert served and all(status == 200 for status in served)
    assert not any(still_open(s) for s in socks), "slow senders still hold connections past the header timeout"
    answer = read_answer(socks[0], 2)
    assert answer.status == 408 and answer.body["error"]["code"] == "header_timeout"


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(gateway):
    closed_after = closes_within(connect(port_of(gateway)), 4)
    assert closed_after is not None and closed_after < 2.5


def test_a_stalled_body_gets_408_at_the_body_timeout(gateway):
    sock = connect(port_of(gateway))
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    auth = f"Authorization: Bearer {gateway.demo_key}\r\nContent-Type: application/json\r\n"
    head = request_bytes("/v1/chat/completions", method="POST", extra=f"{auth}Content-Length: {len(body)}\r\n")
    sock.sendall(head + body[:10])
    answer = read_answer(sock, 5)
    assert answer.status == 408 and answer.body["error"]["code"] == "body_timeout", answer
    assert 0.8 < answer.after_s < 3
    assert closes_within(sock, 2) is not None


def test_a_slow_body_that_keeps_arriving_is_read_to_the_end(gateway):
    """The body timeout bounds a pause, not the whole body: a byte every 0.4 s for 2.4 s is read, then answered."""
    sock = connect(port_of(gateway))
    body = b'{"a":1}'
    auth = f"Authorization: Bearer {gateway.demo_key}\r\nContent-Type: application/json\r\n"
    sock.sendall(request_bytes("/v1/chat/completions", method="POST", extra=f"{auth}Content-Length: {len(body)}\r\n"))
    for i in range(len(body) - 1):
        sock.sendall(body[i : i + 1])
        time.sleep(0.4)
    sock.sendall(body[-1:])
    answer = read_answer(sock, 5)
    assert answer.status == 400 and answer.body["error"]["param"] == "model", answer  # the schema's answer


def test_an_idle_kept_alive_connection_is_closed_after_keep_alive_s(gateway):
    sock = connect(port_of(gateway))
    sock.sendall(request_bytes("/livez"))
    assert read_answer(sock, 5).status == 200
    closed_after = closes_within(sock, 4)
    assert closed_after is not None and 0.7 < closed_after < 2.5


def test_one_connection_over_max_connections_gets_503_and_the_env_sets_it(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "pools:\n  - model: m\n    upstreams:\n      - base_url: http://127.0.0.1:9\n"
        f"events: {{path: {tmp_path}/ev.jsonl}}\n"
    )
    args = ["--no-engine", "--config", str(cfg), "--port", str(free_port()), "--store", f"sqlite:///{tmp_path}/tw.db"]
    with serve_process(args, env={"TOKENWEIR_HTTP__MAX_CONNECTIONS": "4"}) as served:
        time.sleep(0.5)  # the start-up's health checks have closed their connections
        held = [connect(port_of(served)) for _ in range(4)]
        extra = connect(port_of(served))
        answer = read_answer(extra, 5)
        assert answer.status == 503 and answer.body["error"]["code"] == "too_many_connections"
        assert answer.body["error"]["type"] == "service_unavailable"
        held[0].sendall(request_bytes("/livez"))  # those within the cap are served
        assert read_answer(held[0], 5).status == 200


def test_the_http_section_reaches_the_workers_and_bad_values_are_refused(tmp_path):
    config = load_config(env={"TOKENWEIR_HTTP__HEADER_TIMEOUT_S": "2.5", "TOKENWEIR_HTTP__MAX_HEADER_FIELDS": "7"})
    assert (config.http.header_timeout_s, config.http.max_header_fields) == (2.5, 7)
    path = tmp_path / "w.json"
    path.write_bytes(orjson.dumps(asdict(config)))  # what `serve --workers N` hands each worker
    assert load_config(path, env={}).http == config.http
    with pytest.raises(ValueError, match="header_timeout_s"):
        load_config(env={"TOKENWEIR_HTTP__HEADER_TIMEOUT_S": "0"})


# --- uvicorn's h11 parser (where httptools is missing) gets the same door -----------------------------------------


async def echo_length(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_both_parsers_cut_big_and_slow_heads_and_stalled_bodies(parser):
    limits = HttpLimits(
        header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=0.5, max_header_bytes=8192, max_body_bytes=4096
    )
    options = {**uvicorn_options(limits), "http": protocol_class(limits, parser)}
    server = ServerThread(echo_length, lifespan="off", **options)
    with server:
        sock = connect(server.port)
        sock.sendall(request_bytes("/", field_bytes=4000))
        assert read_answer(sock, 5).status == 200
        assert closes_within(sock, 3) is not None  # keep-alive
        for flood in floods(server.port, n=2, total=32 * 2**20, deadline_s=20):
            assert flood.sent < 16 * 2**20 and flood.answer is not None and flood.answer.status in (431, None)
        sock = connect(server.port)
        sock.sendall(request_bytes("/")[:10])
        assert read_answer(sock, 3).status == 408
        sock = connect(server.port)
        sock.sendall(request_bytes("/", method="POST", extra="Content-Length: 10\r\n") + b"abc")
        answer = read_answer(sock, 3)
        assert answer.status == 408 and answer.body["error"]["code"] == "body_timeout"
        sock = connect(server.port)
        sock.sendall(request_bytes("/", fields=limits.max_header_fields))  # + Host: one over
        assert read_answer(sock, 3).status == 431
        sock = connect(server.port)
        sock.sendall(request_bytes("/", method="POST", extra="Content-Length: 5000\r\n") + b"x" * 5000)
        answer = read_answer(sock, 3)
        assert answer.status == 413 and answer.body["error"]["code"] == "body_too_large"
