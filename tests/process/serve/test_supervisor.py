"""The engine supervisor with trivial children: restarts with backoff, hooks, and a clean stop."""

import asyncio
import signal
import socket
import subprocess
import sys
import time

from tokenweir.gateway.process.supervisor import Supervisor, consecutive_free_ports


def _cmd(code: str):
    return lambda index, port: [sys.executable, "-c", code, str(index), str(port)]


async def test_a_child_that_exits_is_restarted_with_growing_backoff():
    exits, starts = [], []
    sup = Supervisor(
        _cmd("import sys; sys.exit(3)"),
        n=1,
        base_port=9000,
        backoff_s=0.05,
        max_backoff_s=0.2,
        on_exit=lambda c: exits.append((c.index, c.last_status, c.backoff_s)),
        on_start=lambda c: starts.append(c.port),
    )
    await sup.start()
    for _ in range(400):
        if sup.restarts >= 4:
            break
        await asyncio.sleep(0.02)
    await sup.stop()
    assert sup.restarts >= 4 and starts[0] == 9000 and len(starts) >= 4
    assert [e[1] for e in exits[:4]] == [3, 3, 3, 3]
    assert [e[2] for e in exits[:4]] == [0.05, 0.1, 0.2, 0.2]  # doubling, capped


async def test_running_children_on_consecutive_ports_are_stopped():
    code = "import sys, time; open(sys.argv[3], 'a').write(sys.argv[2] + ' '); time.sleep(60)"
    sup = Supervisor(lambda i, p: [sys.executable, "-c", code, str(i), str(p), "/dev/null"], n=3, base_port=9100)
    await sup.start()
    assert [c.port for c in sup.children] == [9100, 9101, 9102]
    assert all(c.running for c in sup.children)
    await sup.stop(grace_s=5)
    assert not any(c.running for c in sup.children) and sup.restarts == 0


def test_consecutive_free_ports_skips_a_taken_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
        port = consecutive_free_ports(2, start=taken - 1)
        assert not (port <= taken < port + 2)


SUPERVISE_AND_REPORT = """
import asyncio, sys
from tokenweir.gateway.process.supervisor import Supervisor

async def main():
    sup = Supervisor(lambda i, p: [sys.executable, "-c", "import time; time.sleep(120)"], n=2, base_port=9200)
    await sup.start()
    print(" ".join(str(c.proc.pid) for c in sup.children), flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_children_die_with_a_supervisor_killed_outright():
    parent = subprocess.Popen([sys.executable, "-c", SUPERVISE_AND_REPORT], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "a child outlived its killed supervisor"
    finally:
        parent.kill()
