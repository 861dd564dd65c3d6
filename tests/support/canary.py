"""What the rollout tests share: an upstream that fails a fixed share of requests, and the gateway config of alias
`chat` = stable (pool `v1`) + canary (pool `v2`) under a rollout."""

import itertools

import orjson

from loadtests.fake_upstream import FakeUpstream
from tokenweir.gateway.config import (
    AliasConfig,
    EventsConfig,
    GatewayConfig,
    PoolConfig,
    RolloutConfig,
    UpstreamConfig,
    VariantConfig,
)


class Flaky:
    """A fake upstream that answers 503 to 3 of every 10 inference requests while `broken` (never two in a row: its
    circuit stays closed, so every one of its failures is its own), then passes everything to the fake it wraps."""

    def __init__(self, inner: FakeUpstream) -> None:
        self.inner, self.seen, self.broken = inner, itertools.count(1), True

    async def __call__(self, scope, receive, send) -> None:
        fail = scope["type"] == "http" and scope["path"].startswith("/v1/") and self.broken
        if fail and next(self.seen) % 10 in (1, 4, 7):
            while (await receive()).get("more_body"):
                pass
            body = orjson.dumps({"error": {"message": "down", "type": "server_error", "param": None, "code": None}})
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.inner(scope, receive, send)


def canary_config(
    stable_url: str,
    canary_url: str,
    rollout: RolloutConfig,
    events_path: str,
    fallbacks: list[str] | None = None,
    **settings,
) -> GatewayConfig:
    """Alias `chat` (sticky by `user`) = stable (pool v1, one member s0) + canary (pool v2, one member c0, falling
    back to `fallbacks`) under `rollout`; `settings`: the GatewayConfig's other fields."""
    return GatewayConfig(
        port=0,
        pools=[
            PoolConfig("v1", [UpstreamConfig(stable_url, name="s0", model="m")], capacity=256),
            PoolConfig("v2", [UpstreamConfig(canary_url, name="c0", model="m")], fallbacks=fallbacks or []),
        ],
        aliases=[
            AliasConfig(
                "chat",
                [VariantConfig("v1", 1, "stable"), VariantConfig("v2", 1, "canary")],
                sticky="user",
                rollout=rollout,
            )
        ],
        events=EventsConfig(path=events_path, flush_interval_s=0.05),
        routing_poll_interval_s=0.2,
        **settings,
    )
