"""`tokenweir serve --workers 2` (two gateway processes on one Redis) in front of two engines (fake ones whose /load
says they cache prefixes as ours do, so the pool routes by prefix with the real default tokenizer):

- with `max_parallel_requests: 2` per member, the engines never see more than 2 requests at once each from the two
  processes together (counted at the engines), and every request is served (the others wait for a slot);
- the same team goes to the same engine from both processes (>= 90% of its requests), both engines serve, and each
  process routed by what the other sent (the prefix index shared through Redis).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson

from loadtests.fake_upstream import FakeUpstream, free_port
from tests.process.serve.test_serve_workers import Output, forget_state, wait_for
from tests.support.serve_process import serve_process
from tests.support.serve_thread import ServerThread

REDIS_URL = "redis://127.0.0.1:6379/0"
TOPICS = ["billing systems", "the search index", "mobile apps", "the data lake", "payments risk", "email delivery"]


def post(url: str, key: str, messages: list[dict], ttft_ms: int) -> httpx.Response:
    """On a connection of its own: either worker may take it."""
    body = {"model": "m", "messages": messages, "max_tokens": 4, "fake": {"tokens": 4, "ttft_ms": ttft_ms}}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)


def test_two_gateway_processes_share_member_capacity_and_send_a_team_to_one_engine(tmp_path, redis_client):
    db = f"sqlite:///{tmp_path / 'tw.db'}"
    teams: set[str] = set()  # the conversations' six
    engines = [FakeUpstream(model="m", block_size=16) for _ in range(2)]
    with ServerThread(engines[0]) as e0, ServerThread(engines[1]) as e1:
        members = "".join(
            f"      - {{base_url: {e.url}, name: engine-{i}, max_parallel_requests: 2}}\n"
            for i, e in enumerate((e0, e1))
        )
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"pools:\n  - model: m\n    tokenizer: default\n    route: prefix\n    upstreams:\n{members}"
            f"state_url: {REDIS_URL}\nevents: {{path: {tmp_path}/ev.jsonl}}\n"
            "load_poll_interval_s: 0.1\nprefix_index_sync_s: 0.05\n"
        )
        args = ["--no-engine", "--config", str(cfg), "--port", str(free_port()), "--store", db, "--workers", "2"]
        try:
            with serve_process(args) as served:
                out = Output(served.proc, served.output)
                wait_for("both workers ready", lambda: len(out.workers()) == 2)
                admin = {"authorization": f"Bearer {served.admin_key}"}
                keys = []
                for i in range(len(TOPICS)):
                    team = httpx.post(served.url + "/admin/teams", headers=admin, json={"name": f"fleet-{i}"}).json()
                    teams.add(team["id"])
                    key = httpx.post(f"{served.url}/admin/teams/{team['id']}/keys", headers=admin, json={"name": "k"})
                    keys.append(key.json()["secret"])

                # 1) capacity: 24 at once through both processes, 2 per engine at most, every one served
                hello = [{"role": "user", "content": "hello there"}]
                with ThreadPoolExecutor(24) as pool:
                    answers = list(pool.map(lambda _: post(served.url, served.demo_key, hello, 150), range(24)))
                assert [a.status_code for a in answers] == [200] * 24
                assert [e.peak_in_progress for e in engines] == [2, 2]

                # 2) affinity: conversations of 4 turns, each turn on a new connection (either process)
                def conversation(i: int) -> None:
                    system = f"You are an assistant for a team of our company that works on {TOPICS[i % 6]}. "
                    msgs = [{"role": "system", "content": system + " ".join(["Answer briefly and precisely."] * 12)}]
                    for turn in range(4):
                        msgs.append({"role": "user", "content": f"question {turn} of conversation {i}: what now?"})
                        answer = post(served.url, keys[i % 6], msgs, 20)
                        assert answer.status_code == 200, answer.text
                        msgs.append({"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]})

                # two at a time: a team's engine is then never full (its cap is 2), so where a turn goes is the
                # routing's choice alone (with more at once, a full engine sends the turn to the other one)
                with ThreadPoolExecutor(2) as pool:
                    list(pool.map(conversation, range(24)))
        finally:
            forget_state(db, redis_client)
            stale = [*redis_client.scan_iter("tw:member:*"), b"tw:prefix-log"]
            redis_client.delete(*stale)

    events = [orjson.loads(line) for w in (0, 1) for line in (tmp_path / f"ev.w{w}.jsonl").read_bytes().splitlines()]
    chats = [e for e in events if e["team"] in teams]
    assert len(chats) == 96
    by_team: dict[str, Counter] = {}
    workers_of: dict[str, set] = {}
    for e in chats:
        by_team.setdefault(e["team"], Counter())[e["route"][-1]] += 1
    for w in (0, 1):
        for line in (tmp_path / f"ev.w{w}.jsonl").read_bytes().splitlines():
            workers_of.setdefault(orjson.loads(line)["team"], set()).add(w)
    same = sum(c.most_common(1)[0][1] for c in by_team.values())
    assert same / 96 >= 0.9, by_team
    assert len({c.most_common(1)[0][0] for c in by_team.values()}) == 2, by_team  # both engines serve
    assert all(workers_of[t] == {0, 1} for t in by_team), workers_of  # each team through both processes
    hits = Counter(e["route_reason"]["reason"] for e in chats)
    assert hits["prefix_hit"] >= 48, hits  # later turns found their prefix, whichever process sent the earlier ones
