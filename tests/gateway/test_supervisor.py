"""The engine supervisor with trivial children: restarts with backoff, hooks, and a clean stop."""

import asyncio
import socket
import sys

from gateway.supervisor import Supervisor, consecutive_free_ports


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
