"""The in-flight journal: what each running request has taken (a budget hold, a concurrency lease) and which
upstream attempt it is on, so that the restart of a process killed mid-request settles it at once: the usage the
upstream made is billed, the hold and the lease are given back, and the request gets its one event.

One append-only JSONL file per gateway process, beside its event file (`events.jsonl` -> `events.inflight.jsonl`,
a worker's `events.w1.jsonl` -> `events.w1.inflight.jsonl`). Each step is one `write` on an O_APPEND descriptor, no
fsync: a process killed outright (SIGKILL, the OOM killer) has already handed every line to the kernel. (A power
loss may take the tail, as it may the events' between fsyncs: holds and leases then lapse by expiry, as before.)

    {"k": key, "t": "res", ...}    a reservation: the request's fields for its event, the hold's id in a shared state
    {"k": key, "t": "slot", ...}   a concurrency lease, named before it is taken (the release op the outbox replays)
    {"k": key, "t": "hop", ...}    an attempt sent to an instance: its upstream id, base URL, ours or external
    {"k": key, "t": "done"}        `Settler.finish` has settled it and written its event

`Recovery` runs at start-up, before serving (gateway/app.py): every request without "done" is settled from what
its upstream says it made (our engine's POST /abort answers with the usage of a request it ran), or from the
reservation's bound where it cannot say, and the file starts afresh (a line it cannot read is kept in
`<journal>.quarantine`, gateway/accounting/quarantine.py). The file is compacted to the live requests' lines
once it passes `max_bytes`, so it stays small however long the process runs.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from tokenweir.common.logging import get_logger
from tokenweir.gateway.accounting.quarantine import NUMBER, Fields, read_lines, wrong_field
from tokenweir.gateway.request.context import RequestContext, RequestRecord
from tokenweir.gateway.request.outcome import Outcome
from tokenweir.gateway.state.backend import StateBackend, StateUnavailable
from tokenweir.gateway.upstream.client import UpstreamClient, request_json

if TYPE_CHECKING:
    from tokenweir.gateway.request.settle import Settler
    from tokenweir.gateway.state.outbox import StateOutbox
    from tokenweir.gateway.upstream.pools import Hop, Upstreams

log = get_logger()

REASON = "worker_died"  # the event's reason for a request its process did not live to finish


def journal_path(events_path: str | Path) -> Path:
    return Path(events_path).with_suffix(".inflight.jsonl")


class InflightJournal:
    def __init__(self, path: str | Path, max_bytes: int = 4 << 20) -> None:
        self.path, self.max_bytes = Path(path), max_bytes
        self._fd: int | None = None
        self._size = 0
        self._live: dict[RequestContext, tuple[str, list[bytes]]] = {}  # the lines of each unfinished request
        self._live_bytes = 0
        self._keys = itertools.count()
        self._prefix = f"{os.getpid()}-"  # keys never repeat across restarts of the process either
        self.failed = False  # a write failed once (logged once; the request itself goes on)
        self._torn = False  # the file ends in a fragment of a short write

    def open(self) -> None:
        """Start afresh (`Recovery` has read what an earlier run left)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o644)
        self._size, self._torn = 0, False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __len__(self) -> int:
        return len(self._live)

    def reserved(self, ctx: RequestContext) -> None:
        """A reservation was taken: what the request's event needs, and its hold's id in a shared state."""
        res = ctx.reservation
        shared = getattr(res, "backend_id", None) if not ctx.local_state else None
        line: dict[str, Any] = {"t": "res", "rid": ctx.request_id, "team": ctx.team_id, "key": ctx.key_id}
        line |= {"model": ctx.model, "kind": ctx.kind, "stream": ctx.stream, "priority": ctx.priority, "user": ctx.user}
        line |= {"prompt": ctx.prompt_tokens, "max": ctx.max_tokens, "ts": time.time(), "local": ctx.local_state}
        line |= {"res_id": shared, "res_key": getattr(res, "key_id", None)}
        if ctx.batch_id is not None:  # a batch line's recovered event names its batch too (gateway/batches/job.py)
            line["batch"] = ctx.batch_id
        self._append(ctx, line)

    def slot(self, ctx: RequestContext, *, lease_id: str, key_id: str | None) -> None:
        """A concurrency lease about to be taken, as the outbox's release op (releasing one never taken is a no-op)."""
        op = {"op": "release_slot", "team_id": ctx.team_id, "lease_id": lease_id, "key_id": key_id}
        self._append(ctx, {"t": "slot", "release": op})

    def hop(self, ctx: RequestContext, hop: Hop) -> None:
        """An attempt is about to be sent: where, and the id the upstream knows it by."""
        inst = hop.instance.cfg
        line = {"t": "hop", "uid": ctx.upstream_id, "url": inst.base_url, "engine": inst.engine}
        self._append(ctx, line | {"label": hop.label, "served": hop.model})

    def done(self, ctx: RequestContext) -> bool:
        """The request's finish settled it and wrote its event (sync, right after the event: no usage flush can
        come between the two, so a recovery never bills a request whose event is not replayed). False: the line
        could not be written (a full disk), so a restart would take the request for unfinished."""
        entry = self._live.pop(ctx, None)
        if entry is None:
            return True  # it never took anything
        self._live_bytes -= sum(len(line) for line in entry[1])
        written = self._write(orjson.dumps({"k": entry[0], "t": "done"}) + b"\n")
        if self._size > self.max_bytes and self._size > 2 * self._live_bytes:  # amortized: never once per request
            self._compact()
        return written

    def _append(self, ctx: RequestContext, line: dict[str, Any]) -> None:
        entry = self._live.get(ctx)
        if entry is None:
            entry = self._live[ctx] = (self._prefix + str(next(self._keys)), [])
        data = orjson.dumps({"k": entry[0], **line}) + b"\n"
        entry[1].append(data)
        self._live_bytes += len(data)
        self._write(data)

    def _write(self, data: bytes) -> bool:
        if self._fd is None:
            return True  # not opened: journals nothing
        try:
            if self._torn:  # a short write left a fragment: ended first, or this line would be read as part of it
                self._size += os.write(self._fd, b"\n")
                self._torn = False
            n = os.write(self._fd, data)
            self._size += n
            if n < len(data):  # a short write (a full disk): the line is torn, as good as not written
                self._torn = n > 0
                raise OSError(errno.ENOSPC, "short write")
        except OSError:
            if not self.failed:
                log.exception("inflight_journal_write_failed", path=str(self.path))
            self.failed = True
            return False
        return True

    def _compact(self) -> None:
        """Only the live requests' lines, into a new file that replaces the old one."""
        tmp = self.path.with_suffix(".tmp")
        data = b"".join(line for _, lines in self._live.values() for line in lines)
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path)
        except OSError:
            log.exception("inflight_journal_compact_failed", path=str(self.path))
            return
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size, self._torn = len(data), False


@dataclass
class Unfinished:
    """A request a dead process left without its "done": what it took and where it went."""

    key: str
    res: dict[str, Any] | None = None
    leases: list[dict[str, Any]] = field(default_factory=list)
    hops: list[dict[str, Any]] = field(default_factory=list)


# Each kind of line, the fields recovery reads of it and their types (gateway/accounting/quarantine.py).
_LINES: dict[str, Fields] = {
    "res": {
        "rid": (str,),
        "team": (str,),
        "key": (str, None),
        "model": (str,),
        "kind": (str,),
        "stream": (bool,),
        "priority": (int,),
        "user": (str, None),
        "prompt": (int,),
        "max": (int, None),
        "ts": NUMBER,
        "local": (bool, None),
        "res_id": (str, None),
        "res_key": (str, None),
    },
    "slot": {"release": (dict,)},
    "hop": {"uid": (str,), "url": (str,), "engine": (bool,), "label": (str,), "served": (str, None)},
    "done": {},
}
_RELEASE: Fields = {"op": (str,), "team_id": (str,), "lease_id": (str,), "key_id": (str, None)}


def _unusable(line: Any) -> str | None:
    """Why recovery cannot use a decoded journal line; None when it can."""
    why = wrong_field(line, {"k": (str,), "t": (str,)})
    if why is not None:
        return why
    if line["t"] not in _LINES:
        return f"an unknown kind of line {line['t']!r}"
    why = wrong_field(line, _LINES[line["t"]])
    if why is None and line["t"] == "slot":
        why = wrong_field(line["release"], _RELEASE)
        if why is None and line["release"]["op"] != "release_slot":
            why = "its release is not a release_slot"
    return why


def read_unfinished(path: str | Path) -> list[Unfinished]:
    """The requests the journal names without their "done". A line torn by the kill mid-write (the step it names
    completed nothing we could undo) or of another shape is set aside in `<journal>.quarantine`: the others, and
    the requests they name, are recovered all the same."""
    p = Path(path)
    if not p.exists():
        return []
    entries: dict[str, Unfinished] = {}
    for line in read_lines(p, _unusable):
        key, kind = line["k"], line["t"]
        if kind == "done":
            entries.pop(key, None)
            continue
        entry = entries.setdefault(key, Unfinished(key))
        if kind == "res":
            entry.res = line
        elif kind == "slot":
            entry.leases.append(line["release"])
        elif kind == "hop":
            entry.hops.append(line)
    return list(entries.values())


@dataclass(eq=False)
class Recovery:
    """At start-up, before serving (gateway/app.py): every request the previous run of this process left unfinished,
    settled from the journal and what its upstreams say they made."""

    journal: InflightJournal
    settler: Settler
    state: StateBackend
    outbox: StateOutbox | None
    client: UpstreamClient
    upstreams: Upstreams

    async def run(self, billed: set[str]) -> int:
        """Settle every unfinished request, then start the journal afresh; returns how many events it wrote.
        `billed`: upstream ids whose event was written (replayed from the event file) before the process died."""
        unfinished = read_unfinished(self.journal.path)
        results = await asyncio.gather(*(self.settle(u, billed) for u in unfinished))
        self.journal.open()
        if unfinished:
            path = str(self.journal.path)
            log.warning("inflight_recovered", requests=len(unfinished), events=sum(results), path=path)
        return sum(results)

    async def settle(self, u: Unfinished, billed: set[str]) -> int:
        """One unfinished request: its leases back, its hold settled at what was made, its event. 1 if it wrote one."""
        for op in u.leases:
            await _apply(self.state, self.outbox, op)
        if u.res is None:
            return 0
        res, last = u.res, u.hops[-1] if u.hops else None
        if last is not None and last["uid"] in billed:
            prompt, completion, source = None, None, None  # its finish wrote the event: only the state is left to undo
        else:
            prompt, completion, source = await _made(u, self.client, self.upstreams)
        ts = time.time()
        ctx = RequestRecord(  # its event and bill: it is no longer running, so nothing else of its context is needed
            request_id=res["rid"],
            kind=res["kind"],
            t0=time.perf_counter(),
            team_id=res["team"],
            key_id=res["key"],
            model=res["model"],
            stream=res["stream"],
            priority=res["priority"],
            max_tokens=res["max"],
            outcome=Outcome("error", REASON, 502),
            user=res["user"],
            route=[h["label"] for h in u.hops],
            served_model=last["served"] if last else None,
            upstream_id=last["uid"] if last else "",
            usage_source=source,
            batch_id=res["batch"] if isinstance(res.get("batch"), str) else None,
        )
        tokens = (prompt or 0) + (completion or 0)
        cost = self.settler.cost(ctx, prompt or 0, completion or 0, 0) if prompt is not None else None
        if res.get("res_id"):
            op = {"op": "settle", "team_id": res["team"], "res_id": res["res_id"], "key_id": res["res_key"]}
            await _apply(self.state, self.outbox, op | {"tokens": tokens, "now": ts, "cost": cost or 0})
        elif res.get("local") and self.outbox is not None and tokens:
            # Admitted under this process's own limits while the shared state was away: as finish does, its spend
            # reaches the shared budgets through the outbox.
            op = {"op": "settle", "team_id": res["team"], "res_id": f"local-{u.key}", "key_id": res["res_key"]}
            self.outbox.put(op | {"tokens": tokens, "now": ts, "cost": cost or 0})
        if prompt is None:
            return 0
        assert completion is not None  # None only together with prompt
        await self.settler.record(ctx, ts, prompt, completion, 0, cost)
        return 1


async def _made(u: Unfinished, client: UpstreamClient, upstreams: Upstreams) -> tuple[int, int, str | None]:
    """What the request's attempts made: our engine says exactly (it remembers the usage of requests it finished);
    an attempt it cannot answer for, or an external last one, is billed at the reservation's bound."""
    assert u.res is not None  # Recovery.settle asks only for a request that took a reservation
    prompt = completion = 0
    source = None
    for i, hop in enumerate(u.hops):
        last = i == len(u.hops) - 1
        usage = None
        if hop["engine"]:
            answer = await _abort(client, upstreams, hop)
            if isinstance(answer, dict):
                # "unknown": it never reached the engine (or the engine restarted and forgot it): nothing to bill
                usage, source = answer.get("usage") or {}, "engine_abort"
        if usage is not None:
            prompt += int(usage.get("prompt_tokens") or 0)
            completion += int(usage.get("completion_tokens") or 0)
        elif last:
            # An external upstream, or an engine that cannot be asked: it may have made, and billed, up to the
            # bound the reservation held (the same rule as a stream cut before its usage, gateway/request/settle.py).
            prompt, completion, source = prompt + u.res["prompt"], completion + (u.res["max"] or 0), "reservation_bound"
    return prompt, completion, source


async def _abort(client: UpstreamClient, upstreams: Upstreams, hop: dict[str, Any]) -> dict[str, Any] | None:
    """POST /abort to the instance the attempt went to, with that instance's credentials from the config (never
    from the journal: no secret is written there)."""
    headers = {"content-type": "application/json"}
    for pool in upstreams.pools.values():
        for inst in pool.instances:
            if inst.cfg.base_url == hop["url"]:
                headers |= inst.auth_headers()
                break
    body = orjson.dumps({"request_id": hop["uid"]})
    answer = await request_json(client, "POST", hop["url"] + "/abort", body, headers, timeout_s=5.0)
    return answer if isinstance(answer, dict) else None


async def _apply(state: StateBackend, outbox: StateOutbox | None, op: dict[str, Any]) -> None:
    """A settle or a release on the shared state (both idempotent); the outbox keeps it while the state is away.
    The in-process state died with the process that held these: nothing of it is left to give back."""
    if not hasattr(state, "replay"):
        return
    try:
        await state.replay(op)
    except StateUnavailable as e:
        if outbox is not None:
            outbox.put(e.pending or op)
        log.warning("inflight_state_change_deferred", op=op["op"], error=str(e))
