"""A real Redis Cluster on loopback for tests: 3 primaries and 3 replicas (`redis-server --cluster-enabled yes` each,
then `redis-cli --cluster create ... --cluster-replicas 1`), on free ports picked by binding port 0, their files in a
temporary directory, no persistence.

    cluster = LocalCluster(workdir).start()     # ready: cluster_state:ok on every node, every replica in sync
    cluster.url                                  # redis://127.0.0.1:<a node's port>/0 (with `state.cluster: true`)
    node = cluster.primary_of(slot)
    cluster.kill(node)                           # SIGKILL; its replica is promoted (cluster-node-timeout 1 s)
    cluster.wait_failover(slot, node)            # until another node serves the slot and the cluster is ok again
    cluster.restart(node)                        # back, as a replica of the promoted one
    cluster.stop()                               # SIGKILL to the PIDs it started, and only those

`proxied=True`: each node tells clients (CLUSTER SLOTS, MOVED) the port of a TCPProxy in front of it
(tests/support/tcp_proxy.py), so a gateway reaches every node through them, and `cut()`, `restore()` and `latency_s`
act on all of them at once: the fault harness's Redis cut and slow Redis, on a cluster. The cluster bus stays direct
(a cut causes no failover); a replica's link to its primary goes through the proxies too. `admin(node)` and `client()`
reach the nodes directly.

Fixtures (session-scoped, started at first use): `redis_cluster` and `redis_cluster_proxied`. Under CI=true a cluster
that does not start fails the tests that need it, never skips them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from tests.support.services import require_service
from tests.support.tcp_proxy import TCPProxy

HOST = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now (each bound to port 0 at the same time, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def slot_of(key: str) -> int:
    return key_slot(key.encode())


@dataclass
class Node:
    index: int
    port: int  # where redis-server listens
    bus_port: int
    dir: Path
    proxy: TCPProxy | None = None
    proc: subprocess.Popen | None = None

    @property
    def client_port(self) -> int:
        """The port clients are told (its proxy's when proxied)."""
        return self.proxy.port if self.proxy is not None else self.port

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    def __init__(self, workdir: Path, *, proxied: bool = False, primaries: int = 3, node_timeout_ms: int = 1000):
        self.workdir = Path(workdir)
        self.proxied, self.node_timeout_ms = proxied, node_timeout_ms
        ports = free_ports(4 * primaries)
        self.nodes = [Node(i, ports[2 * i], ports[2 * i + 1], self.workdir / f"node-{i}") for i in range(2 * primaries)]
        self._latency_s = 0.0

    # --- life cycle ---------------------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> LocalCluster:
        for node in self.nodes:
            node.dir.mkdir(parents=True, exist_ok=True)
            if self.proxied:
                node.proxy = TCPProxy(node.port, HOST).start()
            self._launch(node)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            self._until(deadline, lambda n=node: self._answers(n), f"node {node.index} answering")
        create = [shutil.which("redis-cli") or "redis-cli", "--cluster", "create"]
        create += [f"{HOST}:{n.port}" for n in self.nodes] + ["--cluster-replicas", "1", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({done.returncode}): {done.stdout[-800:]}")
        self.wait_ok(max(1.0, deadline - time.monotonic()))
        return self

    def _launch(self, node: Node) -> None:
        args = [shutil.which("redis-server") or "redis-server", "--port", str(node.port), "--bind", HOST]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += ["--cluster-port", str(node.bus_port), "--cluster-node-timeout", str(self.node_timeout_ms)]
        args += ["--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0"]
        args += ["--dir", str(node.dir), "--save", "", "--appendonly", "no", "--logfile", str(node.dir / "redis.log")]
        if node.proxy is not None:
            args += ["--cluster-announce-ip", HOST, "--cluster-announce-port", str(node.proxy.port)]
            args += ["--cluster-announce-bus-port", str(node.bus_port)]
        quiet = subprocess.DEVNULL
        node.proc = subprocess.Popen(args, stdin=quiet, stdout=quiet, stderr=quiet)

    def stop(self) -> None:
        for node in self.nodes:  # the proxies first: none is left connecting to a node already gone
            if node.proxy is not None:
                node.proxy.stop()
                node.proxy = None
        for node in self.nodes:
            if node.alive():
                assert node.proc is not None
                node.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(10)

    # --- faults -------------------------------------------------------------------------------------------------
    def kill(self, node: Node) -> None:
        """SIGKILL the node's process (the one this cluster started)."""
        assert node.proc is not None and node.alive(), f"node {node.index} is not running"
        os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait(10)

    def restart(self, node: Node, timeout: float = 20.0) -> None:
        """Start a killed node again (its node table kept): it rejoins as a replica; back once the cluster is whole."""
        assert not node.alive()
        self._launch(node)
        self.wait_ok(timeout)

    def cut(self, mode: str = "refuse", rst: bool = True) -> None:
        for node in self.nodes:
            assert node.proxy is not None, "cut() needs proxied=True"
            node.proxy.cut(mode, rst)

    def restore(self) -> None:
        for node in self.nodes:
            assert node.proxy is not None
            node.proxy.restore()

    @property
    def latency_s(self) -> float:
        return self._latency_s

    @latency_s.setter
    def latency_s(self, value: float) -> None:
        self._latency_s = value
        for node in self.nodes:
            assert node.proxy is not None, "latency_s needs proxied=True"
            node.proxy.latency_s = value

    # --- what it says -------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        node = next(n for n in self.nodes if n.alive())
        return f"redis://{HOST}:{node.client_port}/0"

    def admin(self, node: Node) -> redis.Redis:
        """A direct client of one node (not through its proxy)."""
        return redis.Redis(host=HOST, port=node.port, decode_responses=True, socket_timeout=5, socket_connect_timeout=2)

    def client(self) -> RedisCluster:
        """A cluster client that reaches the nodes directly (not through the proxies)."""
        direct = {n.client_port: n.port for n in self.nodes}
        node = next(n for n in self.nodes if n.alive())
        return RedisCluster(
            host=HOST,
            port=node.port,
            decode_responses=True,
            socket_timeout=5,
            address_remap=lambda address: (address[0], direct.get(address[1], address[1])),
        )

    def node_at(self, client_port: int) -> Node:
        return next(n for n in self.nodes if n.client_port == client_port)

    def primary_of(self, slot: int) -> Node:
        """The node that serves `slot`, as the first live node that answers says."""
        for node in self.nodes:
            if node.alive():
                with contextlib.suppress(redis.RedisError), self.admin(node) as admin:
                    for first, last, primary, *_ in admin.execute_command("CLUSTER SLOTS"):
                        if first <= slot <= last:
                            return self.node_at(int(primary[1]))
        raise RuntimeError(f"no live node names the primary of slot {slot}")

    def primaries(self) -> list[Node]:
        return [n for n in self.nodes if n.alive() and self._info(n, "replication").get("role") == "master"]

    # --- waiting ------------------------------------------------------------------------------------------------
    def wait_ok(self, timeout: float = 20.0) -> None:
        """Until every node is up with cluster_state:ok, half of them primaries with slots, every replica in sync."""
        self._until(time.monotonic() + timeout, self._whole, "the cluster whole (cluster_state:ok, replicas in sync)")

    def wait_failover(self, slot: int, old: Node, timeout: float = 20.0) -> Node:
        """Until another node serves `slot` and every live node says cluster_state:ok; the new primary."""

        def moved() -> bool:
            live = [n for n in self.nodes if n.alive()]
            return all(self._info(n, "cluster").get("cluster_state") == "ok" for n in live) and (
                self.primary_of(slot) is not old
            )

        self._until(time.monotonic() + timeout, moved, f"slot {slot} failed over from node {old.index}")
        return self.primary_of(slot)

    def _whole(self) -> bool:
        if not all(n.alive() for n in self.nodes):
            return False
        infos = [(self._info(n, "cluster"), self._info(n, "replication")) for n in self.nodes]
        if not all(c.get("cluster_state") == "ok" for c, _ in infos):
            return False
        roles = [r.get("role") for _, r in infos]
        if roles.count("master") * 2 != len(self.nodes):
            return False
        return all(r.get("master_link_status") == "up" for _, r in infos if r.get("role") == "slave")

    def _answers(self, node: Node) -> bool:
        if not node.alive():
            raise RuntimeError(f"redis-server of node {node.index} exited: {self._log_tail(node)}")
        with contextlib.suppress(redis.RedisError), self.admin(node) as admin:
            return bool(admin.ping())
        return False

    def _info(self, node: Node, section: str) -> dict:
        """INFO <section>, or CLUSTER INFO for "cluster"; {} when the node does not answer."""
        with contextlib.suppress(redis.RedisError), self.admin(node) as admin:
            return dict(admin.execute_command("CLUSTER INFO") if section == "cluster" else admin.info(section))
        return {}

    def _until(self, deadline: float, ready, what: str) -> None:
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.05)
        raise TimeoutError(f"redis cluster: not {what} in time; node 0's log: {self._log_tail(self.nodes[0])}")

    @staticmethod
    def _log_tail(node: Node) -> str:
        with contextlib.suppress(OSError):
            return (node.dir / "redis.log").read_text(errors="replace")[-600:]
        return ""


def _session_cluster(tmp_path_factory, proxied: bool):
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        require_service("redis cluster", "redis-server or redis-cli not on PATH")
    name = "redis-cluster-proxied" if proxied else "redis-cluster"
    for attempt in (1, 2):  # a second time on other ports: one picked may have been taken before a node bound it
        cluster = LocalCluster(tmp_path_factory.mktemp(name), proxied=proxied)
        try:
            cluster.start()
            break
        except (OSError, RuntimeError, subprocess.SubprocessError, redis.RedisError) as err:
            cluster.stop()
            if attempt == 2:
                require_service("redis cluster", f"{type(err).__name__}: {err}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A 3-primary, 3-replica Redis Cluster for the session (clients connect to the nodes directly)."""
    yield from _session_cluster(tmp_path_factory, proxied=False)


@pytest.fixture(scope="session")
def redis_cluster_proxied(tmp_path_factory):
    """A 3-primary, 3-replica Redis Cluster for the session whose clients go through cuttable proxies."""
    yield from _session_cluster(tmp_path_factory, proxied=True)
