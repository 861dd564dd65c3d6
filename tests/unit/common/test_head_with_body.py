"""A response's head goes out with its body's first write (one writelines), or alone at the end of the loop
iteration when no body follows at once; nothing is ever reordered, dropped into a closing transport or kept."""

from __future__ import annotations

import asyncio

from tokenweir.common.http.head_with_body import HeadWithBody


class Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, parts) -> None:
        self.calls.append(("writelines", b"".join(parts)))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True
        self.calls.append(("close", b""))

    def get_extra_info(self, name: str):
        return f"info:{name}"


async def test_head_and_body_in_one_write() -> None:
    raw = Recording()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")
    t.write(b"body")
    t.write(b"more")
    await asyncio.sleep(0)  # the end-of-iteration flush finds nothing held
    assert raw.calls == [("writelines", b"HTTP/1.1 200 OK\r\n\r\nbody"), ("write", b"more")]


async def test_a_head_alone_is_written_at_the_end_of_the_iteration() -> None:
    raw = Recording()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"HEAD")
    assert raw.calls == []
    await asyncio.sleep(0)
    assert raw.calls == [("write", b"HEAD")]
    t.write(b"chunk")
    assert raw.calls == [("write", b"HEAD"), ("write", b"chunk")]


async def test_close_writes_what_is_held_first_and_the_rest_passes_through() -> None:
    raw = Recording()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"HEAD")
    t.close()
    assert raw.calls == [("write", b"HEAD"), ("close", b"")]
    assert t.is_closing() and t.get_extra_info("peername") == "info:peername"
    await asyncio.sleep(0)
    assert raw.calls == [("write", b"HEAD"), ("close", b"")]


async def test_nothing_is_written_into_a_closing_transport() -> None:
    raw = Recording()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"HEAD")
    raw.closing = True  # the client went away meanwhile
    t.write(b"body")
    await asyncio.sleep(0)
    assert raw.calls == []
