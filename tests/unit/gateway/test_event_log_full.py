"""The event writer on a disk that fills up for real (a tmpfs of the test's own, tests/support/small_disk.py): the
lines that landed whole are committed and the others raise, the writer says it is failing and why, a fragment a short
write left never swallows the next line, and the writer finds room again by itself once the disk has it."""

from __future__ import annotations

import asyncio
import errno
import time

from tests.support.small_disk import fill, small_disk
from tokenweir.gateway.accounting.events import EventWriter, replay_after


async def test_a_full_disk_commits_the_lines_that_landed_and_fails_the_others_with_enospc(tmp_path):
    with small_disk(tmp_path) as disk:
        path = disk / "events.jsonl"
        writer = EventWriter(path, flush_interval_s=3600)
        await writer.start()
        assert await writer.commit({"request_id": "before"}) == 1
        filler = fill(disk)
        # One written at once, 59 in one batch: the file's last page takes a few whole lines and a fragment, no more
        results = await asyncio.gather(
            *(writer.commit({"request_id": f"r{i}"}) for i in range(60)), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in failed), failed
        committed = {f"r{i}": seq for i, seq in enumerate(results) if isinstance(seq, int)}
        fault = writer.faults.fault
        assert fault is not None and fault.error.startswith("ENOSPC"), fault
        assert writer.faults.failed_writes.get("ENOSPC", 0) >= 1
        in_file = {e["request_id"]: e["seq"] for e in replay_after(path, 0)}
        assert in_file == {"before": 1, **committed}, "every line a commit returned is whole in the file, no other"
        assert path.read_bytes()[-1:] != b"\n", "the short write left a fragment of the next line"

        filler.unlink()
        after = await writer.commit({"request_id": "after"})
        assert writer.faults.fault is None, "a write that succeeds ends the fault"
        events = list(replay_after(path, 0))
        assert [(e["request_id"], e["seq"]) for e in events][-1] == ("after", after), "not glued onto the fragment"
        assert len(events) == len(committed) + 2
        await writer.close()


async def test_a_failing_writer_finds_room_again_without_a_request(tmp_path):
    with small_disk(tmp_path) as disk:
        path = disk / "events.jsonl"
        writer = EventWriter(path, flush_interval_s=0.05)
        await writer.start()
        filler = fill(disk)
        for i in range(20):  # until the file's last page is full too
            try:
                await writer.commit({"request_id": f"r{i}"})
            except OSError:
                break
        assert writer.faults.fault is not None
        await asyncio.sleep(0.3)
        assert writer.faults.fault is not None, "still no room: the probe must not clear it"
        filler.unlink()
        deadline = time.monotonic() + 5
        while writer.faults.fault is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert writer.faults.fault is None, "the sync task's probe found the room"
        assert not list(disk.glob("*.probe")), "the probe leaves nothing behind"
        await writer.commit({"request_id": "after"})
        assert [e["request_id"] for e in replay_after(path, 0)][-1] == "after"
        await writer.close()


async def test_a_disk_full_at_start_is_known_before_the_first_request(tmp_path):
    with small_disk(tmp_path) as disk:
        writer = EventWriter(disk / "events.jsonl", flush_interval_s=3600)
        filler = fill(disk)
        await writer.start()
        assert writer.faults.fault is not None and writer.faults.fault.error.startswith("ENOSPC")
        filler.unlink()
        await writer.close()


async def test_a_sync_emit_on_a_full_disk_does_not_raise(tmp_path):
    with small_disk(tmp_path) as disk:
        writer = EventWriter(disk / "events.jsonl", flush_interval_s=3600)
        await writer.start()
        fill(disk)
        for i in range(20):  # a refusal's event: its caller (an error handler) has nothing to bill and must answer
            writer.emit({"request_id": f"refused{i}"})
        assert writer.faults.fault is not None
        await writer.close()
