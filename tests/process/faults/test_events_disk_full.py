"""The issue's run, on a real gateway process: the disk of its event log fills up mid-load (a tmpfs of the test's own,
tests/support/small_disk.py), then SIGKILL before the usage flush, then a restart once the disk has room. Before the
fix, most answered requests had no event and their usage died with the process. Now: no answer goes out without its
bill in a durable place (its event, or its row in the store), the rest are refused 503 events_unavailable with
Retry-After, /health names the event log, and after the restart the store holds exactly what the answered requests
made (the upstream's own counters agree), and the gateway serves again."""

from __future__ import annotations

import time
from collections import Counter

from tests.support.fault_harness import Gateway, Req, Stack, completion, run, storm
from tests.support.small_disk import fill, small_disk

PROMPT_TOKENS = 8  # fault_harness.PROMPT


def test_a_full_events_disk_then_sigkill_loses_no_answered_bill(tmp_path):
    with small_disk(tmp_path, size_kib=512) as disk, Stack(tmp_path / "stack", redis_proxy=False) as st:
        team = st.team("disk")
        cfg = st.gateway_config("a", state="memory", usage_flush_s=30.0, events_flush_s=0.1)
        cfg["events"] |= {"path": str(disk / "events-a.jsonl"), "writer_id": "disk-a"}
        gw = Gateway("a", st.workdir, cfg)
        st.gateways.append(gw)
        gw.start()

        filler = []

        async def fill_disk(t0: float) -> None:
            import asyncio

            await asyncio.sleep(0.6)
            filler.append(fill(disk))

        # 300 requests over ~1.5 s, each ~0.2 s upstream, streams and not: the disk fills at 0.6 s
        reqs = [
            Req(team.secret, completion(stream=i % 3 == 0, tokens=8, ttft_ms=200), delay_s=1.5 * i / 300)
            for i in range(300)
        ]
        outcomes = run(storm(gw.url, reqs, during=fill_disk))
        statuses = Counter(o.status for o in outcomes)
        answered = [o for o in outcomes if o.status == 200]
        refused = [o for o in outcomes if o.status != 200]
        assert set(statuses) == {200, 503}, statuses
        assert all(o.code == "events_unavailable" and o.retry_after for o in refused), refused[:3]
        assert all(o.tokens == 8 and (o.done or not o.stream) for o in answered), "answers whole"
        status, health = gw.probe("/health")
        assert status == 503 and isinstance(health, dict) and health["checks"]["events"] == "down", health

        # During the fault, each answer's bill is in its event or in the store's row for it; nothing else was made
        served = set(st.fake.records)
        in_file = {e["upstream_request_id"] for e in gw.events() if e.get("status") == "ok"}
        direct = st.store.settled_requests("disk-a")
        assert len(served) == len(answered), "the refused never reached the upstream"
        assert served <= in_file | set(direct), len(served - in_file - set(direct))
        assert direct, "some bills went to the store directly"

        gw.kill()  # before the usage flush (every 30 s): what is not in the store is only in the event file
        filler[0].unlink()
        gw.start()  # waits for /health 200: the disk has room again
        made = sum(PROMPT_TOKENS + o.tokens for o in answered)
        assert st.served() == made
        assert st.wait_store(timeout=5.0) == made, (st.store_billed(), made)
        time.sleep(0.5)
        assert st.store_billed() == made, "nothing billed twice by the replay or the in-flight recovery"

        again = run(storm(gw.url, [Req(team.secret, completion(tokens=8)) for _ in range(3)]))
        assert [o.status for o in again] == [200, 200, 200]
        gw.stop()
        assert st.store_billed() == made + 3 * (PROMPT_TOKENS + 8)
