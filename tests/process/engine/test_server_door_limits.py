"""The engine server's door (common/http/door_limits.py flags on `python -m engine.server`), on a tiny random Llama
in a real process on a free port, with raw sockets: the same head, body and keep-alive bounds as the gateway's."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
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
from tests.support.tiny_llama import make_tiny_llama
from tokenweir.common.http.door_limits import http_limits_from_args
from tokenweir.engine.flags import parse_args

FLAGS = ["--header-timeout", "1", "--body-timeout", "1", "--timeout-keep-alive", "1", "--max-header-fields", "20"]
FLAGS += ["--max-body-bytes", "64KiB"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_tiny_llama(str(tmp_path_factory.mktemp("tiny")), seed=1)
    port = free_port()
    args = ["--model", model, "--port", str(port), "--served-model-name", "tiny", "--num-kv-blocks", "32"]
    args += ["--max-model-len", "256", "--num-threads", "1", "--log-level", "error", *FLAGS]
    proc = subprocess.Popen([sys.executable, "-m", "tokenweir.engine.server", *args], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 420  # a first start may wait for the CPU kernels' build
        while True:
            assert proc.poll() is None, f"the server exited: {proc.stdout.read()}"
            assert time.monotonic() < deadline, "the engine did not answer /health in time"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield proc, port
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_never_ending_headers_are_cut_at_the_limit_and_memory_stays_flat(engine):
    proc, port = engine
    before = rss_mib(proc.pid)
    for flood in floods(port, n=3, total=150 * 2**20, deadline_s=60):
        assert flood.sent < 32 * 2**20, f"the server took {flood.sent} bytes of one header"
        assert flood.answer is not None and flood.answer.status in (431, None), flood
    after = rss_mib(proc.pid)
    assert after - before < 30, f"RSS {before:.0f} -> {after:.0f} MiB"


def test_too_many_header_fields_get_431(engine):
    sock = connect(engine[1])
    sock.sendall(request_bytes("/health", fields=20))
    answer = read_answer(sock, 5)
    assert answer.status == 431 and answer.body["error"]["code"] == "too_many_headers"


def test_slow_header_senders_are_cut_while_other_clients_are_served(engine):
    port = engine[1]
    head = request_bytes("/health", field_bytes=200)
    socks = open_connections(port, 20)
    start, served, step = time.monotonic(), [], 0
    while time.monotonic() - start < 3:
        trickle(socks, head, step)
        step += 1
        served.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code)
        time.sleep(1)
    assert served and all(status == 200 for status in served)
    assert not any(still_open(s) for s in socks)
    answer = read_answer(socks[0], 2)
    assert answer.status == 408 and answer.body["error"]["code"] == "header_timeout"


def test_a_stalled_body_gets_408(engine):
    sock = connect(engine[1])
    body = b'{"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}'
    extra = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    sock.sendall(request_bytes("/v1/completions", method="POST", extra=extra) + body[:10])
    answer = read_answer(sock, 5)
    assert answer.status == 408 and answer.body["error"]["code"] == "body_timeout"
    assert 0.8 < answer.after_s < 3


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(engine):
    sock = connect(engine[1])
    sock.sendall(request_bytes("/health"))
    assert read_answer(sock, 5).status == 200
    closed_after = closes_within(sock, 4)
    assert closed_after is not None and 0.7 < closed_after < 2.5


def test_a_body_over_the_limit_gets_413_by_its_content_length_or_as_it_arrives(engine):
    port = engine[1]
    sock = connect(port)
    sock.sendall(request_bytes("/v1/completions", method="POST", extra="Content-Length: 70000\r\n"))
    answer = read_answer(sock, 5)
    assert answer.status == 413 and answer.body["error"]["code"] == "body_too_large"
    assert "65536" in answer.body["error"]["message"]
    sock = connect(port)  # chunked: no length to judge by, so the bytes are counted
    sock.sendall(request_bytes("/v1/completions", method="POST", extra="Transfer-Encoding: chunked\r\n"))
    chunk = b"4000\r\n" + b" " * 0x4000 + b"\r\n"
    try:
        for _ in range(8):
            sock.sendall(chunk)
    except OSError:
        pass  # refused while we were still sending
    answer = read_answer(sock, 5)
    assert answer.status in (413, None)
    if answer.status == 413:
        assert answer.body["error"]["code"] == "body_too_large"


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--header-timeout", "0"], "--header-timeout"),
        (["--max-header-bytes", "100"], "--max-header-bytes"),
        (["--max-connections", "none"], "--max-connections"),
    ],
)
def test_a_bad_limit_flag_is_a_usage_error_naming_it_before_anything_loads(flags, named, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(flags)
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_the_limit_flags_make_the_limits_with_the_engines_defaults():
    limits = http_limits_from_args(parse_args(["--max-header-bytes", "32KiB", "--body-timeout", "5"]))
    assert (limits.max_header_bytes, limits.body_timeout_s, limits.keep_alive_s) == (32768, 5.0, 75)
    assert limits.max_body_bytes == 32 * 2**20
