"""Which producers a consumer fetches KV from. A decode hop's kv_transfer_params name an address the consumer connects
to and blocks it keeps in its prefix cache, for every later request to share: whoever could hand an engine such params
would put KV of their own into every team's cache, or probe internal hosts. So the consumer trusts them only when
their producer signed them (`transfer_token`: HMAC-SHA256, under the key the engines share, of the producer's address,
engine id, transfer, token count and the signature's expiry) and the signature has not expired, or when they name an
address it was told to trust (`kv_producers`). Anything else is refused before any connection, and the consumer
computes the prompt itself. A consumer with neither a key nor producers trusts none."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from collections.abc import Iterable
from dataclasses import replace

from tokenweir.engine.kv_transfer.params import RemotePrefill

CLOCK_SKEW_S = 5  # a signature still holds this long past its expiry: the engines' clocks may differ a little


def sign(remote: RemotePrefill, key: str) -> str:
    """The signature of what a consumer acts on: where it connects, which transfer it fetches, until when."""
    fields = [remote.host, remote.port, remote.engine_id, remote.transfer_id, remote.num_tokens, remote.expires]
    message = json.dumps(fields, separators=(",", ":")).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def signed(remote: RemotePrefill, key: str | None, lifetime_s: float, now: float | None = None) -> RemotePrefill:
    """The producer's answer signed for `lifetime_s` (its pin's timeout); unsigned without a key (then only consumers
    that trust the producer's address take it)."""
    if key is None:
        return replace(remote, expires=None, token=None)
    now = time.time() if now is None else now
    remote = replace(remote, expires=math.ceil(now + lifetime_s), token=None)
    return replace(remote, token=sign(remote, key))


class ProducerTrust:
    """A consumer's trust: the engines' shared key (None: no signature holds), and the "host:port" addresses of the
    producers it fetches from signed or not."""

    def __init__(self, key: str | None, producers: Iterable[str] = ()) -> None:
        self._key = key
        self.producers = frozenset(producers)

    @property
    def trusts_any(self) -> bool:
        return self._key is not None or bool(self.producers)

    def describe(self) -> str:
        ways = ["answers signed with the engines' key"] if self._key is not None else []
        ways += [f"producers at {', '.join(sorted(self.producers))}"] if self.producers else []
        return " and ".join(ways) or "no producer (no key, no --kv-producers): it computes every prompt itself"

    def refusal(self, remote: RemotePrefill, now: float | None = None) -> str | None:
        """None if the consumer may connect to `remote`'s producer and fetch its transfer; else why not (for the
        engine's log, never for the client)."""
        address = f"{remote.host}:{remote.port}"
        if address in self.producers:
            return None
        if self._key is None:
            return f"{address} is not among this engine's producers, and it has no key to check a signature with"
        if remote.token is None or remote.expires is None:
            return f"the transfer from {address} is not signed"
        if not hmac.compare_digest(remote.token.encode(), sign(remote, self._key).encode()):
            return f"the transfer from {address} is not signed with this engine's key"
        now = time.time() if now is None else now
        if now > remote.expires + CLOCK_SKEW_S:
            return f"the signature of the transfer from {address} expired {now - remote.expires:.0f} s ago"
        return None
