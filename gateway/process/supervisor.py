"""Child processes supervised as a group (the engine children of `serve --engines N`, the gateway workers of
`serve --workers N`): each restarted with exponential backoff when it exits, until `stop`.

A restart loop shows in the log (one warning per exit, with the exit status, the restart count and the wait) and in
`restarts` / `on_exit` (the gateway can count it in metrics, open the instance's circuit and end its in-flight
requests there). The backoff doubles from `backoff_s` up to `max_backoff_s` while a child keeps dying young, and
starts over once one has run `stable_s`.

The command line (`make_cmd(index, port)`) and the hooks are the caller's (gateway/process/engines.py,
gateway/process/workers.py). Children die with their parent (`die_with_parent`): a supervisor killed outright
(SIGKILL, OOM) leaves no engine or worker behind holding its port and memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("tokenweir.supervisor")
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded here, not in the child


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send the child SIGTERM when this process dies, however it dies (the
    child then shuts down as on any SIGTERM). None off Linux. The parent's pid is taken now: a parent that died
    between fork and prctl would leave the child adopted already, so the child exits at once instead."""
    if _libc is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def consecutive_free_ports(n: int, start: int = 8100, host: str = "127.0.0.1", tries: int = 200) -> int:
    """The first port p >= start with p .. p + n - 1 all free to bind now (racy, as any such probe is)."""
    port = start
    for _ in range(tries):
        ok = True
        for p in range(port, port + n):
            with socket.socket() as s:
                try:
                    s.bind((host, p))
                except OSError:
                    ok, port = False, p + 1
                    break
        if ok:
            return port
    raise RuntimeError(f"no {n} consecutive free ports from {start}")


@dataclass
class Child:
    index: int
    port: int
    proc: asyncio.subprocess.Process | _Exited | None = None  # _Exited: its command could not start
    started_at: float = 0.0
    restarts: int = 0  # exits that were followed by a restart
    backoff_s: float = 0.0  # the wait before the next restart
    last_status: int | None = None
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class Supervisor:
    def __init__(
        self,
        make_cmd: Callable[[int, int], list[str]],
        n: int,
        base_port: int,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        stable_s: float = 30.0,
        on_exit: Callable[[Child], None] | None = None,
        on_start: Callable[[Child], None] | None = None,
        spawn_kwargs: dict | None = None,
    ) -> None:
        assert n >= 1 and backoff_s > 0 and max_backoff_s >= backoff_s
        self.make_cmd = make_cmd
        self.children = [Child(i, base_port + i) for i in range(n)]
        self.backoff_s, self.max_backoff_s, self.stable_s = backoff_s, max_backoff_s, stable_s
        self.on_exit, self.on_start = on_exit, on_start
        self.spawn_kwargs = spawn_kwargs or {}  # for the subprocess, e.g. pass_fds: a listening socket it inherits
        self._stopping = False

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self.children)

    async def start(self) -> None:
        for child in self.children:
            await self._spawn(child)
            child.task = asyncio.create_task(self._watch(child))

    async def _spawn(self, child: Child) -> None:
        cmd = self.make_cmd(child.index, child.port)
        child.proc = await asyncio.create_subprocess_exec(*cmd, preexec_fn=die_with_parent(), **self.spawn_kwargs)
        child.started_at = time.monotonic()
        if self.on_start is not None:
            self.on_start(child)

    async def _watch(self, child: Child) -> None:
        while not self._stopping:
            assert child.proc is not None  # _spawn set it before this watch began
            child.last_status = await child.proc.wait()
            if self._stopping:
                return
            ran = time.monotonic() - child.started_at
            if ran >= self.stable_s or child.backoff_s == 0:
                child.backoff_s = self.backoff_s
            else:
                child.backoff_s = min(child.backoff_s * 2, self.max_backoff_s)
            child.restarts += 1
            log.warning(
                "engine %d (port %d) exited with status %s after %.1fs; restart %d in %.1fs",
                child.index,
                child.port,
                child.last_status,
                ran,
                child.restarts,
                child.backoff_s,
            )
            if self.on_exit is not None:
                self.on_exit(child)
            await asyncio.sleep(child.backoff_s)
            if self._stopping:
                return
            try:
                await self._spawn(child)
            except OSError as e:  # the command itself cannot start: keep backing off
                log.error("engine %d could not be started: %r", child.index, e)
                child.proc, child.started_at = _Exited(), time.monotonic()

    async def stop(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        for child in self.children:
            if child.running:
                assert child.proc is not None and not isinstance(child.proc, _Exited)  # running: it started
                with contextlib.suppress(ProcessLookupError):
                    child.proc.terminate()
        for child in self.children:
            if child.proc is not None and not isinstance(child.proc, _Exited):
                try:
                    await asyncio.wait_for(child.proc.wait(), grace_s)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.kill()
                    await child.proc.wait()
            if child.task is not None:
                child.task.cancel()
                await asyncio.gather(child.task, return_exceptions=True)


class _Exited:
    """A process that never started (its command failed): `wait` answers at once."""

    returncode = 127

    async def wait(self) -> int:
        return self.returncode
