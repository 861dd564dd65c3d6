"""Two gateway replicas on one Redis in front of two engines (fake ones whose /load says they cache prefixes as ours
do): a member's max_parallel_requests holds for the replicas together (counted at the engines), a full member's
requests wait instead of failing (429 queue_timeout past the queue timeout), and both replicas send a team to the same
engine (the prefix index shared through Redis). One replica without Redis counts alone.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from loadtests.fake_upstream import FakeUpstream
from tests.support.serve_thread import ServerThread, serve_app
from tests.support.state import URL, drop_redis_prefix, fresh_redis_prefix
from tokenweir.gateway.accounting.events import read_events
from tokenweir.gateway.config import EventsConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.state.memory import InMemoryState
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.store.store import Store
from tokenweir.policies.limits import TeamLimits

MODEL = "m"


@contextlib.contextmanager
def fleet(tmp_path, replicas: int, cap: int | None, *, sync_s: float = 0.05, route: str = "prefix"):
    """`replicas` gateways (on one fresh Redis prefix when more than one) over two fake engines of `cap` each."""
    prefix = fresh_redis_prefix() if replicas > 1 else None
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    engines = [FakeUpstream(model=MODEL, block_size=16) for _ in range(2)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(ServerThread(e)).url for e in engines]
        members = [UpstreamConfig(u, name=f"engine-{i}", max_parallel_requests=cap) for i, u in enumerate(urls)]
        gateways = []
        for i in range(replicas):
            pool = PoolConfig(model=MODEL, upstreams=members, tokenizer="default", route=route, capacity=64)
            config = GatewayConfig(
                port=0,
                pools=[pool],
                events=EventsConfig(path=str(tmp_path / f"events.{i}.jsonl"), flush_interval_s=0.05),
                usage_flush_interval_s=0.1,
                load_poll_interval_s=0.1,
                prefix_index_sync_s=sync_s,
            )
            state = InMemoryState() if prefix is None else RedisState(URL, prefix=prefix)
            gateways.append(stack.enter_context(serve_app(config, store=store, state_backend=state)))
        for g in gateways:  # as a load balancer would: traffic once each replica is ready (its state seeded)
            until_ready(g.url)
        yield {"gateways": gateways, "engines": engines, "store": store, "events": tmp_path}
    store.close()
    if prefix is not None:
        drop_redis_prefix(prefix)


def until_ready(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, f"{url} not ready in {timeout_s} s"
        time.sleep(0.02)


def new_team(store, **limits) -> tuple[str, str]:
    team = store.create_team(f"team-{uuid.uuid4().hex[:8]}", TeamLimits(tokens_per_day=10**7, **limits))
    secret, _ = store.create_key(team.id, "k")
    return team.id, secret


def chat(url: str, secret: str, messages: list[dict], **fake) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "fake": {"tokens": 4, **fake}}
    headers = {"authorization": f"Bearer {secret}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def all_events(fl, n: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        events = [e for i in range(len(fl["gateways"])) for e in read_events(fl["events"] / f"events.{i}.jsonl")]
        if len(events) >= n or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


@pytest.mark.parametrize("replicas", [1, 2], ids=["one-replica-memory", "two-replicas-redis"])
def test_members_never_serve_more_than_their_cap_and_full_ones_make_requests_wait(tmp_path, replicas):
    with fleet(tmp_path, replicas, cap=2, route="least_loaded") as fl:
        _, secret = new_team(fl["store"])
        urls = [g.url for g in fl["gateways"]]
        msgs = [{"role": "user", "content": "hello there"}]
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda i: chat(urls[i % len(urls)], secret, msgs, ttft_ms=150), range(12)))
        assert [a.status_code for a in answers] == [200] * 12
        assert [e.peak_in_progress for e in fl["engines"]] == [2, 2]  # the fleet's cap, never passed
        assert sum(e.requests_seen for e in fl["engines"]) == 12
        events = all_events(fl, 12)
        assert len(events) == 12 and {e["status"] for e in events} == {"ok"}
        gw = fl["gateways"][0]
        members = gw.app.state.services.path.members
        deadline = time.monotonic() + 5
        while any(g.app.state.services.path.members.held for g in fl["gateways"]):
            assert time.monotonic() < deadline, "a member lease was never given back"
            time.sleep(0.02)
        member_urls = [u.base_url for u in gw.app.state.services.upstreams.pools[MODEL].cfg.upstreams]
        assert [gw.call(members.in_use(u)) for u in member_urls] == [0, 0]  # none left in Redis either


def test_a_request_waiting_past_the_queue_timeout_for_a_member_is_429(tmp_path):
    with fleet(tmp_path, 1, cap=1, route="least_loaded") as fl:
        _, secret = new_team(fl["store"], queue_timeout_s=0.3)
        url = fl["gateways"][0].url
        msgs = [{"role": "user", "content": "hi"}]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: chat(url, secret, msgs, ttft_ms=1500), range(3)))
        codes = sorted(a.status_code for a in answers)
        assert codes == [200, 200, 429], [a.text for a in answers]
        refused = next(a for a in answers if a.status_code == 429).json()["error"]
        assert refused["code"] == "queue_timeout" and "serves as many requests" in refused["message"]
        events = all_events(fl, 3)
        assert sorted(e["status"] for e in events) == ["ok", "ok", "rejected"]


def test_two_replicas_send_each_team_to_one_engine(tmp_path):
    """6 teams (a distinct system prompt each, sharing a preamble), conversations of 4 turns sent through both
    replicas alternately, 4 at a time: each team's requests land on one engine (>= 90%), and both engines serve."""
    preamble = "You are an assistant for a team of our company that works on "
    topics = ["billing systems", "the search index", "mobile apps", "the data lake", "payments risk", "email delivery"]
    with fleet(tmp_path, 2, cap=None, sync_s=0.05) as fl:
        teams = [new_team(fl["store"]) for _ in topics]
        urls = [g.url for g in fl["gateways"]]

        def conversation(i: int) -> None:
            team_id, secret = teams[i % len(teams)]
            system = preamble + topics[i % len(topics)] + ". " + " ".join(["Answer briefly and precisely."] * 12)
            msgs = [{"role": "system", "content": system}]
            for turn in range(4):
                msgs.append({"role": "user", "content": f"question {turn} of conversation {i}: what now?"})
                answer = chat(urls[(i + turn) % 2], secret, msgs, ttft_ms=20)
                assert answer.status_code == 200, answer.text
                msgs.append({"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]})

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(conversation, range(24)))
        events = all_events(fl, 96)
        assert len(events) == 96
        by_team: dict[str, Counter] = {}
        for e in events:
            by_team.setdefault(e["team"], Counter())[e["route"][-1]] += 1
        same = sum(c.most_common(1)[0][1] for c in by_team.values())
        homes = {c.most_common(1)[0][0] for c in by_team.values()}
        assert same / 96 >= 0.9, by_team
        assert len(homes) == 2, by_team
        learned = [g.app.state.services.upstreams.on_record.__self__.learned for g in fl["gateways"]]
        assert min(learned) > 0  # each replica routed by what the other sent too
