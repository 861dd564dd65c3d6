"""The producer's pinned blocks: a finished prefill hop keeps its sequence's blocks (their ref counts held) under a
transfer id until a consumer has fetched them or `timeout_s` has passed, whichever comes first.

Pins are made and freed on the engine thread (the block manager is its alone); the KV server's threads only open a
pin to read it and close it, saying whether the consumer confirmed the fetch. A pin being read is never freed, so
its blocks cannot be handed to another sequence while their bytes are on the way."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenweir.engine.kv_transfer.layout import prompt_digest
from tokenweir.engine.kv_transfer.params import RemotePrefill, producer_answer
from tokenweir.engine.kv_transfer.trust import signed
from tokenweir.engine.sched.sequence import Sequence


@dataclass(eq=False)
class Pin:
    transfer_id: str
    seq: Sequence
    prompt_digest: str
    num_tokens: int  # prompt tokens whose K/V the blocks hold
    block_ids: tuple[int, ...]
    expires: float  # monotonic seconds
    readers: int = 0
    fetched: bool = False


class KVPins:
    def __init__(self, timeout_s: float, on_change: Callable[[], None] = lambda: None, key: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.on_change = on_change  # a pin became free to collect (the engine loop may be idle)
        self.key = key  # the engines' shared key: the answers are signed with it (trust.py); None: unsigned
        self._pins: dict[str, Pin] = {}
        self._lock = threading.Lock()
        self.num_expired = 0
        self.address = ("", 0, "")  # host, port and engine id of the KV server, for the answers

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(p.block_ids) for p in self._pins.values())

    def next_expiry(self) -> float | None:
        with self._lock:
            return min((p.expires for p in self._pins.values()), default=None)

    def pin(self, seq: Sequence) -> Pin:
        """Keep a finished sequence's blocks (engine thread), and give it the answer that says where to fetch them,
        signed with the engines' key if this engine has one."""
        assert not seq.is_prefilling, "a pin holds a computed prompt"
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        pin = Pin(
            secrets.token_hex(16),  # unguessable: whoever can reach the port still cannot name a transfer
            seq,
            prompt_digest(prompt),
            seq.num_prompt_tokens,
            tuple(seq.block_table),
            time.monotonic() + self.timeout_s,
        )
        with self._lock:
            self._pins[pin.transfer_id] = pin
        remote = RemotePrefill(*self.address, pin.transfer_id, pin.num_tokens)
        seq.kv_transfer_params = producer_answer(signed(remote, self.key, self.timeout_s))
        return pin

    def open(self, transfer_id: str) -> Pin | None:
        """A pin to read (KV server thread), or None if it is unknown, fetched already or expired."""
        with self._lock:
            pin = self._pins.get(transfer_id)
            if pin is None or pin.fetched or time.monotonic() > pin.expires:
                return None
            pin.readers += 1
            return pin

    def close(self, pin: Pin, fetched: bool) -> None:
        """Done reading (KV server thread); `fetched`: the consumer confirmed it has the blocks."""
        with self._lock:
            pin.readers -= 1
            pin.fetched = pin.fetched or fetched
        if fetched:
            self.on_change()

    def release(self, group_id: str) -> int:
        """Let go of request `group_id`'s pins (its router sends no consumer for them: the request was aborted);
        they are freed at the next collect, as fetched ones are. Returns how many."""
        with self._lock:
            pins = [p for p in self._pins.values() if p.seq.group_id == group_id]
            for pin in pins:
                pin.fetched = True
        return len(pins)

    def collect(self, free: Callable[[Sequence], None], now: float | None = None) -> int:
        """Free the pins fetched or expired (by `now`, monotonic seconds) and not being read (engine thread); returns
        how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            done = [p for p in self._pins.values() if p.readers == 0 and (p.fetched or now > p.expires)]
            for pin in done:
                del self._pins[pin.transfer_id]
                self.num_expired += not pin.fetched
        for pin in done:
            free(pin.seq)
        return len(done)
