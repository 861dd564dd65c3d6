"""The lab's processes and what each run holds: the Lab record (temp dir, ports, addresses, the database, every
process started, by PID), starting and stopping processes, the per-run PostgreSQL database, the nginx/prometheus/
locust binaries, and waiting on a condition while watching for a process that died. What runs, and how it is wired,
is deploy/lab_topology.py.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("TWLAB_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TWLAB_REDIS", "redis://127.0.0.1:6379/9")
APT_HINT = "apt-get install -y nginx prometheus"


class LabError(RuntimeError):
    pass


def clean_env() -> dict[str, str]:
    """os.environ without TOKENWEIR_* (the gateway refuses unknown ones, and the lab sets its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TOKENWEIR_")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_binaries() -> list[str]:
    return [b for b in ("nginx", "prometheus") if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]


def binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def locust_binary() -> str | None:
    here = Path(sys.executable).with_name("locust")
    return str(here) if here.exists() else shutil.which("locust")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class Lab:
    tmp: Path
    ports: dict[str, int]
    db_name: str
    procs: list[Proc] = field(default_factory=list)
    admin_key: str | None = None
    own_tmp: bool = True
    down_upstream: bool = False

    # ---- addresses
    @property
    def nginx_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['nginx']}"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['prometheus']}"

    def gateway_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.ports[f'gateway-{i}']}" for i in (1, 2)]

    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.ports[f'engine-{i}']}" for i in (1, 2)]

    def events_path(self, replica: int) -> Path:
        return self.tmp / f"gateway-{replica}" / "events.jsonl"

    @property
    def store_url(self) -> str:
        return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + self.db_name

    # ---- processes
    def spawn(self, name: str, cmd: list[str], env: dict | None = None) -> Proc:
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as fh:
            popen = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**clean_env(), "PYTHONPATH": str(ROOT), **(env or {})},
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C reaches the lab, which stops these in order
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        # gateways first (they flush usage and events), then engines, nginx, prometheus: reverse start order
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                proc.popen.terminate()
        deadline = time.monotonic() + 15
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=5)
        drop_database(self.db_name)
        if self.own_tmp and not os.environ.get("TWLAB_KEEP"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    def logs_tail(self, n: int = 25) -> str:
        parts = []
        for proc in self.procs:
            lines = proc.output().splitlines()[-n:]
            parts.append(f"--- {proc.name} (rc={proc.popen.poll()}) ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def summary(self) -> str:
        return "\n".join(
            [
                f"tokenweir lab (files in {self.tmp})",
                f"  public (nginx):  {self.nginx_url}/v1   (OpenAI base URL; /docs for the admin API)",
                f"  gateways:        {'  '.join(self.gateway_urls())}",
                f"  engines:         {'  '.join(self.engine_urls())}",
                f"  prometheus:      {self.prometheus_url}   (alerts: {self.prometheus_url}/alerts)",
                f"  admin key:       {self.admin_key}   (export TOKENWEIR_ADMIN_KEY=...)",
                f"  store:           {self.store_url}   state: {REDIS_URL}",
                f"  events:          {self.events_path(1)}  {self.events_path(2)}",
            ]
        )


def create_database() -> str:
    import psycopg

    name = "tokenweir_lab_" + secrets.token_hex(4)
    with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def drop_database(name: str) -> None:
    import psycopg

    try:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except psycopg.Error as exc:
        print(f"tokenweir lab: could not drop database {name}: {exc}", file=sys.stderr)


def wait_until(what: str, check, lab: Lab, timeout_s: float, procs: list[Proc] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.popen.poll() is not None:
                raise LabError(
                    f"{proc.name} exited ({proc.popen.returncode}) while waiting for {what}:\n"
                    + "\n".join(proc.output().splitlines()[-30:])
                )
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.3)
    raise LabError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{lab.logs_tail()}")
