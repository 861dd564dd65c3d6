"""The consumer's side of the TCP connector: fetches a prompt's blocks from a producer into blocks the scheduler set
aside, on worker threads, so the engine goes on stepping the other sequences meanwhile. The engine polls the finished
fetches each step; a fetch that failed (refused, timed out, the producer gone, a layout or prompt that differs) is
reported, and the engine computes that prompt itself."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tokenweir.engine.kv_transfer.layout import KVLayout
from tokenweir.engine.kv_transfer.params import RemotePrefill
from tokenweir.engine.kv_transfer.server import BLOCKS_PER_SEND, MAX_HEADER_BYTES
from tokenweir.engine.sched.sequence import Sequence


class KVTransferError(RuntimeError):
    pass


@dataclass(eq=False)
class KVFetch:
    seq: Sequence
    remote: RemotePrefill
    prompt_digest: str
    first_block: int  # the producer's block index of block_ids[0]
    block_ids: list[int]  # this engine's blocks to fill, in order (none: only tell the producer to free its pin)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    error: str | None = None
    num_bytes: int = 0
    seconds: float = 0.0


class KVFetcher:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        timeout_s: float,
        on_done: Callable[[], None] = lambda: None,
        max_workers: int = 4,
    ) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.timeout_s = timeout_s
        self.on_done = on_done  # a fetch finished (the engine loop may be waiting)
        self.in_flight = 0  # engine thread only
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kv-fetch")
        self._done: queue.SimpleQueue[KVFetch] = queue.SimpleQueue()
        self._any_done = threading.Event()

    def submit(self, fetch: KVFetch) -> None:
        self.in_flight += 1
        self._pool.submit(self._run, fetch)

    def poll(self) -> list[KVFetch]:
        """The fetches finished since the last poll (engine thread)."""
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.in_flight -= len(done)
        return done

    def wait(self, timeout: float) -> None:
        """Until a fetch finishes or `timeout` seconds pass (an engine with nothing else to compute)."""
        self._any_done.wait(timeout)
        self._any_done.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, fetch: KVFetch) -> None:
        torch.set_num_threads(1)  # block copies; an OpenMP pool on this thread would slow the engine's steps
        start = time.monotonic()
        try:
            self._fetch(fetch, start + self.timeout_s)
            fetch.ok = True
        except Exception as exc:  # whatever broke, the engine computes the prompt itself
            fetch.error = str(exc) if isinstance(exc, KVTransferError) else repr(exc)
        finally:
            fetch.seconds = time.monotonic() - start
            self._done.put(fetch)
            self._any_done.set()
            self.on_done()

    def _fetch(self, fetch: KVFetch, deadline: float) -> None:
        remote, layout = fetch.remote, self.layout
        count = len(fetch.block_ids)
        with socket.create_connection((remote.host, remote.port), timeout=_left(deadline)) as conn:
            request = {
                "transfer_id": remote.transfer_id,
                "prompt_digest": fetch.prompt_digest,
                "first_block": fetch.first_block,
                "num_blocks": count,
                "layout": layout.to_dict(),
            }
            conn.sendall(json.dumps(request).encode() + b"\n")
            reader = conn.makefile("rb")
            reply = json.loads(reader.readline(MAX_HEADER_BYTES) or b"{}")
            if not reply.get("ok"):
                raise KVTransferError(f"the producer refused: {reply.get('error', 'it closed the connection')}")
            if reply.get("num_blocks") != count or reply.get("block_bytes") != layout.block_bytes:
                raise KVTransferError(f"the producer offers {reply} for {count} blocks of {layout.block_bytes} bytes")
            buffer = bytearray(BLOCKS_PER_SEND * layout.block_bytes)
            for start in range(0, count, BLOCKS_PER_SEND):
                if fetch.cancelled.is_set():
                    raise KVTransferError("cancelled: the request ended")
                ids = fetch.block_ids[start : start + BLOCKS_PER_SEND]
                size = len(ids) * layout.block_bytes
                conn.settimeout(_left(deadline))
                _read_exactly(reader, memoryview(buffer)[:size])
                blocks = torch.frombuffer(buffer, dtype=torch.uint8, count=size).view(layout.torch_dtype)
                blocks = blocks.view(len(ids), *layout.block_shape).permute(1, 2, 0, 3, 4, 5)
                index = torch.tensor(ids, device=self.kv_cache.device)
                self.kv_cache.index_copy_(2, index, blocks.to(self.kv_cache.device))
                fetch.num_bytes += size
            conn.sendall(b"ok\n")


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise KVTransferError("timed out")
    return left


def _read_exactly(reader, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = reader.readinto(view[got:])
        if not n:
            raise KVTransferError(f"the producer closed the connection after {got} of {len(view)} bytes")
        got += n
