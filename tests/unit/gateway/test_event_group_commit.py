"""The event file's group commit (gateway/accounting/events.py), on real files: requests finishing together share
one write, a commit returns only once its line is in the file, an idle request waits for no one, and seqs, rotation
and torn tails stay as they were with one write per line."""

from __future__ import annotations

import asyncio
import statistics
import time

from tokenweir.gateway.accounting.events import FIELDS, EventWriter, read_events, replay_after


def in_file(path) -> list[int]:
    return [e["seq"] for e in read_events(path)]


async def test_requests_finishing_together_share_one_write(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path, flush_interval_s=3600)
    await writer.start()
    n = 32
    seqs = await asyncio.gather(*(writer.commit({"request_id": f"r{i}", "status": "ok"}) for i in range(n)))
    # The first is written at once (it cannot know that others follow), the 31 after it in one batch
    assert writer.writes == 2 < n
    assert writer.written == n
    events = read_events(path)
    assert [e["request_id"] for e in events] == [f"r{i}" for i in range(n)]
    assert all(list(e) == list(FIELDS) for e in events), "every line complete"
    assert [e["seq"] for e in events] == sorted(seqs) == list(range(1, n + 1)), "seqs increase in file order"
    await writer.close()


async def test_a_commit_returns_only_once_its_line_is_in_the_file(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path, flush_interval_s=3600)
    await writer.start()
    seen: dict[str, bool] = {}

    async def finish(request_id: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)  # requests end at different times: several batches
        seq = await writer.commit({"request_id": request_id})
        seen[request_id] = seq in in_file(path)  # read at once, before anything else runs on the loop

    await asyncio.gather(*(finish(f"r{i}", (i % 4) * 0.002) for i in range(20)))
    assert seen == {f"r{i}": True for i in range(20)}
    assert 1 < writer.writes < 20
    assert in_file(path) == list(range(1, 21))
    await writer.close()


async def test_an_idle_request_adds_under_2_ms(tmp_path):
    writer = EventWriter(tmp_path / "events.jsonl", flush_interval_s=3600)
    await writer.start()
    waits = []
    for i in range(30):
        await asyncio.sleep(0.001)  # idle between requests: nothing else to batch with
        t0 = time.perf_counter()
        await writer.commit({"request_id": f"r{i}"})
        waits.append(time.perf_counter() - t0)
    assert writer.writes == 30, "alone in its batch: never waits for company"
    assert statistics.median(waits) < 0.002, waits
    await writer.close()


async def test_a_sync_emit_writes_the_open_batch_first(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path, flush_interval_s=3600)
    await writer.start()
    waiting = [asyncio.ensure_future(writer.commit({"request_id": f"c{i}"})) for i in range(3)]
    await asyncio.sleep(0)  # the first commit was written at once, the two after it joined the open batch
    assert in_file(path) == [1]
    assert writer.emit({"request_id": "refused"}) == 4
    assert [e["request_id"] for e in read_events(path)] == ["c0", "c1", "c2", "refused"]
    assert await asyncio.gather(*waiting) == [1, 2, 3]
    assert in_file(path) == [1, 2, 3, 4] and writer.written == 4
    await writer.close()


async def test_a_cancelled_committer_is_written_and_cancels_no_one_else(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path, flush_interval_s=3600)
    await writer.start()
    tasks = [asyncio.ensure_future(writer.commit({"request_id": f"r{i}"})) for i in range(3)]
    await asyncio.sleep(0)
    tasks[1].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[0] == 1 and results[2] == 3 and isinstance(results[1], asyncio.CancelledError)
    assert in_file(path) == [1, 2, 3], "its line was in the batch already"
    await writer.close()


async def test_a_batch_rotates_between_lines(tmp_path):
    path = tmp_path / "ev.jsonl"
    writer = EventWriter(path, max_bytes=2000, backups=8, flush_interval_s=3600)  # ~700-byte lines: 2 a file
    await writer.start()
    seqs = await asyncio.gather(*(writer.commit({"request_id": f"r{i}", "status": "ok"}) for i in range(12)))
    await writer.close()
    assert seqs == list(range(1, 13))
    assert (tmp_path / "ev.jsonl.1").exists() and all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    assert [e["seq"] for e in replay_after(path, 0, 8)] == seqs, "every line whole, in seq order across the files"
    assert 1 < writer.writes < 12


async def test_a_batch_torn_by_a_kill_costs_only_its_own_fragment(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path, flush_interval_s=3600)
    await writer.start()
    await asyncio.gather(*(writer.commit({"request_id": f"r{i}"}) for i in range(3)))
    await writer.close()
    with path.open("ab") as f:
        f.write(b'{"ts":1.0,"request_id":"torn","se')  # a kill in the middle of the next batch's write
    again = EventWriter(path, flush_interval_s=3600)
    again.open()
    assert again.seq == 3
    await again.start()
    assert await again.commit({"request_id": "after"}) == 4
    await again.close()
    assert [(e["request_id"], e["seq"]) for e in replay_after(path, 0)] == [
        ("r0", 1),
        ("r1", 2),
        ("r2", 3),
        ("after", 4),
    ]
