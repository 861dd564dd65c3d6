"""The consumer's side of the TCP connector: fetches a prompt's blocks from a producer into blocks the scheduler set
aside, on worker threads, so the engine goes on stepping the other sequences meanwhile. It connects only to a producer
it trusts (trust.py), checked before the connection. The engine polls the finished fetches each step; a fetch that
failed (an untrusted producer, refused, timed out, the producer gone, a layout or prompt that differs) is reported,
with a coarse reason for the request's answer and the details for the log, and the engine computes that prompt
itself."""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tokenweir.engine.config import KVTransferConfig
from tokenweir.engine.kv_transfer.layout import KVLayout
from tokenweir.engine.kv_transfer.params import FETCH_ERRORS, RemotePrefill
from tokenweir.engine.kv_transfer.server import BLOCKS_PER_SEND, MAX_HEADER_BYTES
from tokenweir.engine.kv_transfer.trust import ProducerTrust
from tokenweir.engine.sched.sequence import Sequence

log = logging.getLogger("tokenweir.engine")


class KVTransferError(RuntimeError):
    """A fetch that failed for a known `reason` (one of params.FETCH_ERRORS); the message holds the details."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in FETCH_ERRORS, reason
        super().__init__(detail)
        self.reason = reason


@dataclass(eq=False)
class KVFetch:
    seq: Sequence
    remote: RemotePrefill
    prompt_digest: str
    first_block: int  # the producer's block index of block_ids[0]
    block_ids: list[int]  # this engine's blocks to fill, in order (none: only tell the producer to free its pin)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    error: str | None = None  # why it failed, coarse (params.FETCH_ERRORS): for the request's answer
    detail: str | None = None  # what failed, for the log only (it may name hosts and ports)
    num_bytes: int = 0
    seconds: float = 0.0


class KVFetcher:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        config: KVTransferConfig,
        on_done: Callable[[], None] = lambda: None,
        max_workers: int = 4,
    ) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.timeout_s = config.fetch_timeout_s
        self.trust = ProducerTrust(config.transfer_key, config.kv_producers)
        (log.info if self.trust.trusts_any else log.warning)("kv transfer: fetching from %s", self.trust.describe())
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
            fetch.error, fetch.detail = _reason(exc), str(exc) if isinstance(exc, KVTransferError) else repr(exc)
        finally:
            fetch.seconds = time.monotonic() - start
            self._done.put(fetch)
            self._any_done.set()
            self.on_done()

    def _fetch(self, fetch: KVFetch, deadline: float) -> None:
        remote, layout = fetch.remote, self.layout
        refusal = self.trust.refusal(remote)
        if refusal is not None:  # before any connection: an untrusted address is never reached
            raise KVTransferError("untrusted_producer", refusal)
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
                why = reply.get("error", "it closed the connection")
                raise KVTransferError("producer_refused", f"the producer refused: {why}")
            if reply.get("num_blocks") != count or reply.get("block_bytes") != layout.block_bytes:
                offer = f"the producer offers {reply} for {count} blocks of {layout.block_bytes} bytes"
                raise KVTransferError("producer_refused", offer)
            buffer = bytearray(BLOCKS_PER_SEND * layout.block_bytes)
            for start in range(0, count, BLOCKS_PER_SEND):
                if fetch.cancelled.is_set():
                    raise KVTransferError("cancelled", "the request ended")
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


def _reason(exc: Exception) -> str:
    """A failed fetch's reason for the request's answer: nothing of the network (a refused connection and an unknown
    host are both "fetch_failed")."""
    if isinstance(exc, KVTransferError):
        return exc.reason
    return "timed_out" if isinstance(exc, TimeoutError) else "fetch_failed"


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise KVTransferError("timed_out", "timed out")
    return left


def _read_exactly(reader, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = reader.readinto(view[got:])
        if not n:
            raise KVTransferError(
                "fetch_failed", f"the producer closed the connection after {got} of {len(view)} bytes"
            )
        got += n
