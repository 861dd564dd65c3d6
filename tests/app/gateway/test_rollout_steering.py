"""A canary rollout is judged on the traffic nobody steered: through real HTTP (client -> gateway -> fake upstreams),
one gateway judging alias `chat` = stable (pool v1) + canary (pool v2, falling back to v1) at 50/50, sticky per
`user`. Many users send ordinary requests; one tenant steers, by the `x-tokenweir-variant` header (its key may pick)
or by choosing `user` values that land on the variant it wants, requests the variant's upstream refuses (4xx) or the
gateway refuses (a prompt over its team's cap). A canary failing 30% of requests is still rolled back while the
baseline is flooded with refusals; a healthy one is still promoted while it is flooded with them. Requests picked by
the header are served as that variant and left out of its window."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.canary import Flaky, canary_config
from tests.support.events import the_event
from tests.support.serve_thread import ServerThread, serve_app
from tokenweir.gateway.config import (
    BreakerConfig,
    RolloutConfig,
)
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits
from tokenweir.policies.variants import pick_variant, subject_point

HEADER = "x-tokenweir-variant"
VARIANTS = ("stable", "canary")  # the alias's order: at 50/50 a subject's point below 0.5 gets stable


def gateway(tmp_path, canary_app, rollout: RolloutConfig):
    """The gateway and its upstreams; yields its URL, the admin's headers, an ordinary key and a steering key (its
    team's prompts capped at 2 tokens; the key may pick variants)."""

    class Stack:
        def __enter__(self):
            self.store = Store.open(f"sqlite:///{tmp_path}/store.db")
            self.parts = [ServerThread(FakeUpstream(model="m")).__enter__(), ServerThread(canary_app).__enter__()]
            stable_url, canary_url = (p.url for p in self.parts)
            # the judge, not the breaker, deals with a failing canary
            breaker = BreakerConfig(failures=1000)
            events = str(tmp_path / "events.jsonl")
            config = canary_config(stable_url, canary_url, rollout, events, ["v1"], breaker=breaker)
            app = serve_app(config, store=self.store, state_backend=InMemoryState())
            self.parts.append(app.__enter__())
            admin, _ = self.store.create_key(None, "admin", is_admin=True)
            users = self.store.create_team("users")
            steering = self.store.create_team("steering", TeamLimits(max_prompt_tokens=2))
            steerer, _ = self.store.create_key(steering.id, "steering", may_pick_variant=True)
            return {
                "url": app.url,
                "admin": {"authorization": f"Bearer {admin}"},
                "key": {"authorization": f"Bearer {self.store.create_key(users.id, 'app')[0]}"},
                "steer": {"authorization": f"Bearer {steerer}"},
                "events": tmp_path / "events.jsonl",
            }

        def __exit__(self, *exc):
            for part in reversed(self.parts):
                part.__exit__(None, None, None)
            self.store.close()

    return Stack()


def users_landing_on(variant: str) -> Iterator[str]:
    """`user` values whose sticky point puts them on `variant` at a 50/50 split (as a tenant could compute them)."""
    want = VARIANTS.index(variant)
    return (u for i in itertools.count() if pick_variant([1, 1], subject_point("chat", u := f"steer-{i}")) == want)


async def rollout_of(c: httpx.AsyncClient, info: dict) -> dict:
    data = (await c.get(f"{info['url']}/admin/rollouts", headers=info["admin"])).json()["data"]
    return next(a for a in data if a["model"] == "chat")["rollout"]


async def run(info: dict, steer_to: str, how: str, seconds: float) -> tuple[dict, int]:
    """The steering tenant (4 clients: by header or by its chosen users, alternately a request the upstream refuses
    with 400 and one over its team's prompt cap), then, once 20 of its requests reached the upstream, ordinary users
    too (4 clients), until the rollout is decided or `seconds` pass; the rollout then, and how many steered requests
    reached an upstream."""
    stop, steered = asyncio.Event(), [0]
    chosen = users_landing_on(steer_to)

    async def ordinary(c: httpx.AsyncClient) -> None:
        while not stop.is_set():
            body = {"model": "chat", "prompt": [101, 102], "max_tokens": 2, "user": uuid.uuid4().hex}
            r = await c.post("/v1/completions", json=body | {"fake": {"tokens": 2}}, headers=info["key"])
            assert r.status_code == 200, r.text  # the canary's failures fell back to the stable pool

    async def steering(c: httpx.AsyncClient) -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            refused_upstream = i % 2 == 0
            prompt = [101] if refused_upstream else [101, 102, 103]  # 3 tokens: over the team's cap of 2
            body = {"model": "chat", "prompt": prompt, "max_tokens": 2, "fake": {"status": 400}}
            headers = info["steer"] | ({HEADER: steer_to} if how == "header" else {})
            if how == "user":
                body["user"] = next(chosen)
            r = await c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 400, r.text
            steered[0] += refused_upstream and r.json()["error"]["code"] == "injected"

    async with httpx.AsyncClient(base_url=info["url"], timeout=30) as c:
        tasks = [asyncio.create_task(steering(c)) for _ in range(4)]
        deadline = time.monotonic() + seconds
        try:
            while steered[0] < 20 and time.monotonic() < deadline:  # the flood is on before anyone else comes
                await asyncio.sleep(0.05)
            tasks += [asyncio.create_task(ordinary(c)) for _ in range(4)]
            while time.monotonic() < deadline and (await rollout_of(c, info))["status"] == "progressing":
                await asyncio.sleep(0.2)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        return await rollout_of(c, info), steered[0]


def thresholds(rollout: RolloutConfig) -> RolloutConfig:
    # Every server here is a thread of this one process: p95s of ~ms differ by scheduling alone. Latency is not what
    # these tests judge; errors only.
    rollout.min_requests, rollout.max_ttft_p95_ratio, rollout.max_tpot_p95_ratio = 15, 100.0, 100.0
    return rollout


@pytest.mark.parametrize("how", ["header", "user"])
async def test_a_canary_failing_30_percent_is_rolled_back_though_a_tenant_floods_the_baseline_with_refusals(
    tmp_path, how
):
    rollout = thresholds(RolloutConfig(canary="canary", baseline="stable", steps=[50, 100], step_s=2.0, window_s=30))
    with gateway(tmp_path, Flaky(FakeUpstream(model="m")), rollout) as info:
        state, steered = await run(info, "stable", how, seconds=30)
    assert state["status"] == "rolled_back" and state["reason"].startswith("error rate"), state
    assert steered >= 15  # the flood reached the baseline's upstream: it could have swayed the verdict
    windows = state["windows"]
    assert windows["stable"]["error_rate"] == 0.0 and windows["canary"]["error_rate"] > 0.2, windows


@pytest.mark.parametrize("how", ["header", "user"])
async def test_a_healthy_canary_is_promoted_though_a_tenant_forces_requests_it_refuses_onto_it(tmp_path, how):
    rollout = thresholds(RolloutConfig(canary="canary", baseline="stable", steps=[50, 100], step_s=1.0, window_s=30))
    with gateway(tmp_path, FakeUpstream(model="m"), rollout) as info:
        state, steered = await run(info, "canary", how, seconds=40)
    assert state["status"] == "promoted", state
    assert steered >= 15
    assert state["windows"]["canary"]["error_rate"] == 0.0, state


async def test_requests_picked_by_header_are_served_by_that_variant_and_left_out_of_its_window(tmp_path):
    rollout = RolloutConfig(canary="canary", baseline="stable", steps=[50, 100], step_s=3600, window_s=60)
    with gateway(tmp_path, FakeUpstream(model="m"), rollout) as info:
        async with httpx.AsyncClient(base_url=info["url"], timeout=30) as c:
            body = {"model": "chat", "prompt": [101], "max_tokens": 2, "fake": {"tokens": 2}}
            steer = info["steer"] | {HEADER: "canary"}
            picked = [await c.post("/v1/completions", json=body, headers=steer) for _ in range(20)]
            assert all(r.status_code == 200 for r in picked)
            event = await asyncio.to_thread(the_event, info["events"], picked[-1].headers["x-request-id"])
            assert event["variant"] == "canary" and event["model"] == "v2" and event["variant_steered"] is True
            plain = await c.post("/v1/completions", json=body | {"user": "u"}, headers=info["key"])
            event = await asyncio.to_thread(the_event, info["events"], plain.headers["x-request-id"])
            assert event["variant_steered"] is False
            windows = (await rollout_of(c, info))["windows"]
    assert windows["canary"]["requests"] + windows["stable"]["requests"] == 1, windows  # the un-steered one only
