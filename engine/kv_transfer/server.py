"""The producer's side of the TCP connector: serves pinned blocks to consumers, one thread per connection.

One exchange per connection. The consumer sends a JSON line {"transfer_id", "prompt_digest", "first_block",
"num_blocks", "layout"} (no blocks: it needs none after all); the server answers a JSON line, {"ok": true,
"block_bytes", "num_blocks"} or {"ok": false, "error"}, then the blocks' bytes, a few blocks at a time as they are
gathered from the cache; the consumer answers "ok" once it holds them all, which frees the pin (a consumer that
never answers leaves it to expire)."""

from __future__ import annotations

import json
import logging
import socket
import threading

import torch

from tokenweir.engine.kv_transfer.layout import KVLayout
from tokenweir.engine.kv_transfer.pins import KVPins, Pin

log = logging.getLogger("tokenweir.engine")
MAX_HEADER_BYTES = 1 << 16
BLOCKS_PER_SEND = 8
IO_TIMEOUT_S = 30.0


class KVServer:
    def __init__(self, pins: KVPins, kv_cache: torch.Tensor, layout: KVLayout, host: str, port: int) -> None:
        self.pins = pins
        self.kv_cache = kv_cache
        self.layout = layout
        self.bytes_sent = 0
        self.transfers_served = 0
        self._listener = socket.create_server((host, port))
        self.host, self.port = host, self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="kv-server", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kv-server-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        torch.set_num_threads(1)  # a gather is a few copies; an OpenMP pool on this thread would slow the steps
        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            reader = conn.makefile("rb")
            try:
                request = json.loads(reader.readline(MAX_HEADER_BYTES))
                pin, error = self._check(request)
                if pin is None:
                    conn.sendall(_line({"ok": False, "error": error}))
                    return
                fetched = False
                try:
                    self._send_blocks(conn, pin, request["first_block"], request["num_blocks"])
                    fetched = reader.readline(16).strip() == b"ok"
                finally:
                    self.pins.close(pin, fetched)
                if fetched:
                    self.transfers_served += 1
            except Exception as exc:  # a consumer gone or speaking nonsense: this transfer ends, the server goes on
                log.warning("KV transfer to a consumer failed: %r", exc)

    def _check(self, request: dict) -> tuple[Pin | None, str]:
        mismatch = self.layout.mismatch(request.get("layout") or {})
        if mismatch is not None:
            return None, f"the engines' KV layouts differ: {mismatch}"
        first, count = request.get("first_block"), request.get("num_blocks")
        if not isinstance(first, int) or not isinstance(count, int) or first < 0 or count < 0:
            return None, "first_block and num_blocks: a block range (no blocks: the consumer needs none, free them)"
        pin = self.pins.open(str(request.get("transfer_id")))
        if pin is None:
            return None, f"no pinned KV under transfer {request.get('transfer_id')!r} (unknown, fetched or expired)"
        if request.get("prompt_digest") != pin.prompt_digest:
            self.pins.close(pin, fetched=False)
            return None, "the prompt differs from the one whose KV this transfer holds"
        if first + count > len(pin.block_ids) or (first + count - 1) * self.layout.block_size >= pin.num_tokens:
            self.pins.close(pin, fetched=False)
            return None, f"blocks {first}..{first + count - 1} are past the {pin.num_tokens} tokens pinned"
        return pin, ""

    def _send_blocks(self, conn: socket.socket, pin: Pin, first: int, count: int) -> None:
        conn.sendall(_line({"ok": True, "block_bytes": self.layout.block_bytes, "num_blocks": count}))
        ids = list(pin.block_ids[first : first + count])
        for start in range(0, count, BLOCKS_PER_SEND):
            group = torch.tensor(ids[start : start + BLOCKS_PER_SEND], device=self.kv_cache.device)
            # [2, layers, n, block, heads, dim] -> n contiguous blocks of [2, layers, block, heads, dim]
            blocks = self.kv_cache.index_select(2, group).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
            data = blocks.view(torch.uint8).numpy().reshape(-1)
            conn.sendall(data.data)
            self.bytes_sent += data.nbytes


def _line(message: dict) -> bytes:
    return json.dumps(message).encode() + b"\n"
