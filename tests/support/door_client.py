"""Raw-socket clients for the door limits (tests/process/serve/test_door_limits.py,
tests/process/engine/test_server_door_limits.py): what a hostile or broken client does byte by byte, which an HTTP
library will not do."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@dataclass
class Answer:
    status: int | None  # None: closed (or reset) with no response
    body: dict | None
    after_s: float  # since the call began


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_answer(sock: socket.socket, timeout_s: float) -> Answer:
    """The server's next response (status and JSON body), or None once it closes the connection; a TimeoutError
    if neither comes within `timeout_s`."""
    start, data = time.monotonic(), b""
    sock.settimeout(timeout_s)
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return Answer(None, None, time.monotonic() - start)
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
        length = int(headers.get(b"content-length", b"0"))
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    except ConnectionResetError:
        return Answer(None, None, time.monotonic() - start)
    body = json.loads(rest) if rest and headers.get(b"content-type", b"").startswith(b"application/json") else None
    return Answer(status, body, time.monotonic() - start)


def closes_within(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the server closes the connection without a response, None if it stays open that long."""
    try:
        answer = read_answer(sock, timeout_s)
    except TimeoutError:
        return None
    assert answer.status is None, f"expected a close, got {answer.status}"
    return answer.after_s


@dataclass
class Flood:
    sent: int  # bytes the client got out before the server stopped it (or before it gave up)
    answer: Answer | None  # what came back after that (None: nothing within the deadline)


def never_ending_header(port: int, total: int, deadline_s: float, path: str = "/health") -> Flood:
    """One request whose single header value goes on for `total` bytes, streamed 64 KiB at a time, until the server
    refuses it (a 431, or the connection reset), or `deadline_s` passes."""
    sock = connect(port)
    sock.settimeout(deadline_s)
    sent, chunk, end = 0, b"a" * 65536, time.monotonic() + deadline_s
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Flood: ".encode())
        while sent < total and time.monotonic() < end:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:  # refused: the server closed the connection while we still had bytes for it
        pass
    try:
        answer = read_answer(sock, 5)
    except TimeoutError:
        answer = None
    sock.close()
    return Flood(sent, answer)


def floods(port: int, n: int, total: int, deadline_s: float, path: str = "/health") -> list[Flood]:
    """`n` never-ending headers at once."""
    results: list[Flood | None] = [None] * n

    def one(i: int) -> None:
        results[i] = never_ending_header(port, total, deadline_s, path)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results  # type: ignore[return-value]


def request_bytes(path: str, fields: int = 0, field_bytes: int = 0, method: str = "GET", extra: str = "") -> bytes:
    """A request head with `fields` extra header fields, or one field of `field_bytes` bytes."""
    lines = [f"{method} {path} HTTP/1.1", "Host: x", *(f"X-F{i}: v" for i in range(fields))]
    if field_bytes:
        lines.append("X-Big: " + "b" * field_bytes)
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def open_connections(port: int, n: int) -> list[socket.socket]:
    """`n` non-blocking connections, for `trickle` to feed."""
    socks = []
    for _ in range(n):
        s = connect(port)
        s.setblocking(False)
        socks.append(s)
    return socks


def trickle(socks: list[socket.socket], head: bytes, step: int) -> None:
    """Byte `step` of `head` on every connection still open."""
    for s in socks:
        with contextlib.suppress(OSError):  # the server closed it
            s.send(head[step : step + 1])


def still_open(sock: socket.socket) -> bool:
    """Whether the server has neither answered nor closed this (non-blocking) connection."""
    try:
        sock.recv(1, socket.MSG_PEEK)  # a response, or the end of the stream
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False
