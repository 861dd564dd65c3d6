"""Pieces of the request path that need no server: chunk filtering, SSE framing, breaker, events rotation."""

from __future__ import annotations

import orjson

from tokenweir.gateway.accounting.events import FIELDS, EventWriter, read_events
from tokenweir.gateway.config import BreakerConfig, UpstreamConfig
from tokenweir.gateway.request.relay import sse_error
from tokenweir.gateway.request.stream_chunks import ChunkFilter
from tokenweir.gateway.upstream.instance import Instance


def chunk(content=None, usage=None, choices=True, finish=None) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
    obj = {"id": "x", "choices": [choice] if choices else []}
    if usage is not None:
        obj["usage"] = usage
    return orjson.dumps(obj)


USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_usage_we_asked_for_is_stripped_and_the_final_usage_chunk_dropped():
    f = ChunkFilter(client_usage=False, client_continuous=False, keep_text=False, clock=lambda: 1.0)
    out = f.process(chunk("hi", usage=USAGE))
    assert b"usage" not in out and orjson.loads(out[6:])["choices"][0]["delta"]["content"] == "hi"
    assert f.process(chunk(choices=False, usage=USAGE)) is None
    assert f.usage == USAGE and f.process(b"[DONE]") == b"data: [DONE]\n\n" and f.done


def test_client_asked_for_usage_keeps_the_final_chunk_byte_for_byte():
    f = ChunkFilter(client_usage=True, client_continuous=False, keep_text=False, clock=lambda: 1.0)
    raw = chunk("a")
    assert f.process(raw) == b"data: " + raw + b"\n\n"  # untouched when there is nothing to drop
    final = chunk(choices=False, usage=USAGE)
    assert f.process(final) == b"data: " + final + b"\n\n"
    f2 = ChunkFilter(client_usage=True, client_continuous=True, keep_text=False, clock=lambda: 1.0)
    with_usage = chunk("a", usage=USAGE)
    assert f2.process(with_usage) == b"data: " + with_usage + b"\n\n"


def test_token_clock_ignores_role_only_chunks_and_keeps_text_for_external_upstreams():
    t = iter([1.0, 2.0, 3.0])
    f = ChunkFilter(client_usage=False, client_continuous=False, keep_text=True, clock=lambda: next(t))
    f.process(orjson.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
    assert f.first_token_at is None
    f.process(chunk("a"))
    f.process(chunk("b", finish="stop"))
    assert (f.first_token_at, f.last_token_at, f.text, f.finish_reason) == (1.0, 2.0, ["a", "b"], "stop")


def test_sse_error_ends_the_stream():
    body = sse_error("boom", "timeout", "timeout_error")
    first, done, _ = body.split(b"\n\n")
    assert orjson.loads(first[6:])["error"]["code"] == "timeout" and done == b"data: [DONE]"


def test_breaker_opens_after_n_failures_and_lets_one_probe_through_after_cooldown():
    inst = Instance(UpstreamConfig("http://x"), BreakerConfig(failures=2, cooldown_s=10))
    for now in (0.0, 1.0):
        assert inst.available(now)
        inst.take(now)
        inst.done(False, now)
    assert not inst.available(5.0)
    assert inst.available(11.5)
    inst.take(11.5)  # the half-open probe
    assert not inst.available(11.6), "only one probe at a time"
    inst.done(False, 12.0)
    assert not inst.available(13.0) and inst.available(22.5), "a failed probe restarts the cooldown"
    inst.take(22.5)
    inst.done(True, 23.0)
    assert inst.opened_at is None and inst.failures == 0 and inst.in_flight == 0


async def test_events_rotate_by_size_and_flush_on_close(tmp_path):
    path = tmp_path / "ev.jsonl"
    w = EventWriter(path, max_bytes=2000, backups=2, flush_interval_s=60)
    await w.start()
    for i in range(40):
        w.emit({"request_id": f"r{i}", "status": "ok"})
        if i % 5 == 4:
            await w.flush()
    w.emit({"request_id": "last"})
    await w.close()  # the periodic flush never ran: close must write what is left
    lines = read_events(path)
    assert lines[-1]["request_id"] == "last" and list(lines[-1]) == list(FIELDS)
    assert (tmp_path / "ev.jsonl.1").exists() and (tmp_path / "ev.jsonl.2").exists()
    assert not (tmp_path / "ev.jsonl.3").exists()
    assert all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    assert w.written == 41
