"""A request's `kv_transfer_params`, with vLLM's keys. The prefill hop asks `{"do_remote_decode": true}` (with
max_tokens 1); the producer's output answers `{"do_remote_prefill": true, "remote_host", "remote_port",
"remote_engine_id", "transfer_id", "num_tokens"}`, signed by a producer that has the engines' key
(`"transfer_expires"`, `"transfer_token"`: trust.py); the router passes that answer, as it is, to the decode hop, whose
own answer says what it fetched (`consumer_answer`: for the router's accounting; vLLM's decode hop answers none)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# a decode hop's `fetch_error`, coarse on purpose: it goes back to whoever sent the request
FETCH_ERRORS = ("untrusted_producer", "producer_refused", "timed_out", "cancelled", "fetch_failed")


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """The prefill hop: compute the prompt, keep its KV for a decode engine."""
    return bool(params) and params.get("do_remote_decode") is True  # type: ignore[union-attr]


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """The decode hop: fetch the prompt's KV from the producer named in the params."""
    return bool(params) and params.get("do_remote_prefill") is True  # type: ignore[union-attr]


@dataclass(frozen=True)
class RemotePrefill:
    """Where a consumer fetches a prompt's KV blocks: the producer's address, the transfer, and how many prompt tokens
    its blocks hold."""

    host: str
    port: int
    engine_id: str
    transfer_id: str
    num_tokens: int
    expires: int | None = None  # unix seconds after which the signature no longer holds
    token: str | None = None  # the producer's signature (trust.py); None: unsigned

    @classmethod
    def parse(cls, params: dict[str, Any]) -> RemotePrefill:
        """From a decode hop's kv_transfer_params; a ValueError names the missing or bad key."""
        wanted: dict[str, type] = {"remote_host": str, "remote_port": int, "remote_engine_id": str}
        wanted |= {"transfer_id": str, "num_tokens": int}
        optional: dict[str, type] = {"transfer_expires": int, "transfer_token": str}
        for key, kind in [*wanted.items(), *optional.items()]:
            value = params.get(key)
            if value is None and key in optional:
                continue
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{key}: a {kind.__name__} from the prefill hop's answer")
        if not 0 < params["remote_port"] < 65536 or params["num_tokens"] < 1:
            raise ValueError("kv_transfer_params: remote_port must be 1-65535 and num_tokens at least 1")
        return cls(
            params["remote_host"],
            params["remote_port"],
            params["remote_engine_id"],
            params["transfer_id"],
            params["num_tokens"],
            params.get("transfer_expires"),
            params.get("transfer_token"),
        )


def producer_answer(remote: RemotePrefill) -> dict[str, Any]:
    """What a finished prefill hop returns, for the decode hop: where its KV waits, signed if `remote` is."""
    answer: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": remote.host,
        "remote_port": remote.port,
        "remote_engine_id": remote.engine_id,
        "transfer_id": remote.transfer_id,
        "num_tokens": remote.num_tokens,
    }
    if remote.token is not None:
        answer |= {"transfer_expires": remote.expires, "transfer_token": remote.token}
    return answer


def consumer_answer(engine_id: str, tokens: int, num_bytes: int, seconds: float, error: str | None) -> dict[str, Any]:
    """What a decode hop returns: the prompt tokens whose KV it fetched from `engine_id` (0: its own prefix cache held
    them, or the fetch failed and it computed them: `fetch_error` says why, in one of FETCH_ERRORS; the details,
    which may name hosts and ports, go to the engine's log only), the bytes and the fetch's milliseconds."""
    answer = {"remote_engine_id": engine_id, "fetched_tokens": tokens, "fetched_bytes": num_bytes}
    return answer | {"fetch_ms": round(seconds * 1000, 3), "fetch_error": error}
