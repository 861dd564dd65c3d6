"""The SSE reader on its own (gateway/upstream/sse.py): events however the body is cut into chunks, each byte
searched once, and a bound on what an unfinished event may buffer."""

from __future__ import annotations

import pytest

from tokenweir.gateway.upstream.client import HTTPError
from tokenweir.gateway.upstream.sse import MAX_EVENT_BYTES, EventTooLarge, SSEReader

BODY = b'data: {"a": 1}\r\n\r\n: a comment\nevent: x\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
EVENTS = [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]


def read(chunks: list[bytes], reader: SSEReader | None = None) -> list[bytes]:
    reader = reader or SSEReader()
    return [payload for chunk in chunks for payload in reader.feed(chunk)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(BODY)])
def test_events_are_the_same_however_the_body_is_cut_into_chunks(size):
    chunks = [BODY[i : i + size] for i in range(0, len(BODY), size)]
    assert read(chunks) == EVENTS


def test_a_crlf_split_between_two_chunks_still_ends_the_event():
    assert read([b"data: 1\r\n\r", b"\ndata: 2\r", b"\n\r\n"]) == [b"1", b"2"]


def test_a_body_without_a_delimiter_is_searched_once_however_many_chunks_it_comes_in():
    reader = SSEReader()
    chunk = b"x" * 50
    for _ in range(10_000):  # 500 KB in all, under the bound
        assert reader.feed(chunk) == []
    fed = 10_000 * len(chunk)
    # each byte once, plus the one byte before each chunk (a blank line may straddle two): linear, not quadratic
    assert fed <= reader.scanned <= fed + 10_000, reader.scanned


def test_an_unfinished_event_over_the_bound_ends_the_stream_as_a_broken_body():
    reader = SSEReader(max_event_bytes=1000)
    reader.feed(b"data: " + b"x" * 900)
    with pytest.raises(EventTooLarge, match="unfinished") as caught:
        reader.feed(b"x" * 200)
    assert isinstance(caught.value, HTTPError), "the relay ends it as a body cut short"


def test_a_complete_event_over_the_bound_in_one_chunk_is_refused_too():
    with pytest.raises(EventTooLarge, match="an SSE event of"):
        SSEReader(max_event_bytes=1000).feed(b"data: " + b"x" * 2000 + b"\n\ndata: 1\n\n")


def test_events_up_to_the_bound_pass_and_the_default_bound_is_one_mebibyte():
    assert MAX_EVENT_BYTES == 1 << 20
    big = b"data: " + b"x" * (1000 - 6)
    assert read([big[:500], big[500:] + b"\n\n"], SSEReader(max_event_bytes=1000)) == [b"x" * 994]
