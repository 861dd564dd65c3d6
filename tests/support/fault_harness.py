"""Fault-injection harness: real gateway subprocesses, a fake upstream, Redis behind a cuttable proxy, a store.

    with Stack(tmp_dir) as st:                        # fake upstream + Redis proxy + SQLite store
        big = st.team("big")                          # a team and its key, made directly in the store
        gw = st.gateway("a", state="redis").start()   # `python -m gateway.process.cli serve --no-engine --config ...`
        outcomes = run(storm(gw.url, [Req(big.secret, completion(...))]))
        st.redis_proxy.cut(); st.redis_proxy.restore()
        gw.stop()                                     # SIGTERM (SIGKILL past a deadline)
        st.events(), st.store_billed(), st.served(), st.redis_leaks(big.id)

Everything talks to 127.0.0.1 only, ports are picked by binding port 0, every wait is bounded, and only the
processes started here are signalled (by PID). The gateway runs from the tree this file lives in (cwd and
PYTHONPATH = that tree's root), so a copy of the tree under /tmp runs its own `gateway` package, not the
editable install's: `Gateway.imported_from()` prints where `gateway` really comes from.

`before=True` writes HEAD's config format: no `state:` section (HEAD's loader rejects unknown keys).

`Stack(..., cluster=LocalCluster(proxied=True))` (tests/support/redis_cluster.py): the gateways' state is that Redis
Cluster (`state.cluster: true`) instead of the single Redis, reached through one proxy per node, which
`st.redis_proxy` cuts, restores and slows all at once (the cluster itself); the checks read the nodes directly.

Invariants every scenario checks once its traffic has ended (tests/process/faults/scenarios.py: `settle_and_stop`,
`check_contract`), whatever the fault:
  (a) served <= reserved, per request: an event's completion_tokens never exceed its max_tokens (the output its
      reservation held: per choice x choices), unless the event names the excess in `overrun_tokens`, and then
      exactly (`beyond_reservation`). A stream that goes past its bound is cut there (`reason: output_cut`).
  (b) billed once, and what was made: the sum of prompt + completion tokens over the events == the store's usage
      rows (in all, and per team) == what the fake upstream counted making (a scenario that breaks the link to
      the upstream counts what reached the gateway instead: the upstream's counters also count tokens it wrote
      into the dead connection).
  (c) nothing outlives its request: within a few seconds of the traffic's end (`leaks_redis` waits 4 s; the
      leases live 60 s and the holds 15 min, so this is the gateway handing them back, not their expiry), every
      subject's `slots` and `holds` zsets in Redis are empty and its meta `reserved` is 0 (the team's and each
      API key's, gateway/state/redis_keys.py), or the in-memory state's in-flight, open reservations and
      reserved tokens are 0; and each gateway still running reports nothing in flight upstream or queued
      (`in_flight_left`, from its /metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[2]  # the tree whose gateway the subprocesses run
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
PG_URL = os.environ.get("TOKENWEIR_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
MODEL = "fake-model"
PROMPT = [101, 102, 103, 104, 105, 106, 107, 108]  # token ids: the gateway's count == the upstream's count


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_available(timeout: float = 1.0) -> str | None:
    """None when Redis answers at 127.0.0.1:6379, else why not."""
    import redis

    try:
        redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_connect_timeout=timeout, socket_timeout=timeout).ping()
        return None
    except Exception as e:  # noqa: BLE001
        return f"redis://{REDIS_HOST}:{REDIS_PORT}: {e}"


# --- the gateway as a real process ---------------------------------------------------------------------------
class GatewayExited(RuntimeError):
    def __init__(self, name: str, rc: int, log: str) -> None:
        super().__init__(f"gateway {name} exited with status {rc}; log tail:\n{log}")
        self.rc, self.log = rc, log


@dataclass
class Gateway:
    name: str
    workdir: Path
    config: dict
    root: Path = ROOT
    port: int = 0
    proc: subprocess.Popen | None = None
    starts: int = 0
    exit_codes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.config["port"] = self.port
        self.config_path = self.workdir / f"gateway-{self.name}.yaml"
        self.log_path = self.workdir / f"gateway-{self.name}.log"
        self.events_path = Path(self.config["events"]["path"])
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWEIR_")}
        env["PYTHONPATH"] = str(self.root)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def imported_from(self) -> str:
        """Where the subprocess's `gateway` package comes from (same interpreter, cwd and env as `start`)."""
        out = subprocess.run(
            [sys.executable, "-c", "import gateway; print(gateway.__file__)"],
            cwd=self.root,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip() or out.stderr.strip()

    def start(self, wait: bool = True, timeout: float = 30.0) -> Gateway:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it; closed when the child is reaped
        log.write(f"\n===== start {self.starts} =====\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenweir.gateway.process.cli",
                "serve",
                "--no-engine",
                "--config",
                str(self.config_path),
            ],
            cwd=self.root,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        if wait:
            self.wait_ready(timeout)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def probe(self, path: str, timeout: float = 1.0) -> tuple[int, dict | str | None]:
        """(status, JSON body or text) of a GET; status 0 when nothing answers."""
        try:
            r = httpx.get(self.url + path, timeout=timeout)
        except httpx.HTTPError:
            return 0, None
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def liveness(self, timeout: float = 1.0) -> int:
        """/livez; HEAD has none (404): then /health."""
        status, _ = self.probe("/livez", timeout)
        if status == 404:
            status, _ = self.probe("/health", timeout)
        return status

    def wait_listening(self, timeout: float = 30.0) -> bool:
        """True once the process answers liveness (200); False at the timeout. Raises if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise GatewayExited(self.name, self.proc.returncode, self.log_tail())
            if self.liveness(0.5) == 200:
                return True
            time.sleep(0.05)
        return False

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until /health is 200 (readiness on the fixed gateway, liveness on HEAD)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise GatewayExited(self.name, self.proc.returncode, self.log_tail())
            if self.probe("/health", 0.5)[0] == 200:
                return
            time.sleep(0.05)
        raise TimeoutError(f"gateway {self.name} not ready in {timeout:g}s; log tail:\n{self.log_tail()}")

    def wait_exit(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.exit_codes.append(rc)
        return rc

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (graceful: uvicorn drains for shutdown_grace_s, then the lifespan flushes); SIGKILL past timeout."""
        if not self.alive():
            return self.proc.returncode if self.proc is not None else None
        self.signal(signal.SIGTERM)
        rc = self.wait_exit(timeout)
        if rc is None:
            return self.kill()
        return rc

    def kill(self) -> int | None:
        if not self.alive():
            return self.proc.returncode if self.proc is not None else None
        self.signal(signal.SIGKILL)
        return self.wait_exit(10)

    def events(self) -> list[dict]:
        p = self.events_path
        if not p.exists():
            return []
        out = []
        for line in p.read_bytes().splitlines():
            if line.strip():
                with contextlib.suppress(orjson.JSONDecodeError):  # a line cut by SIGKILL mid-write
                    out.append(orjson.loads(line))
        return out


# --- teams, store, upstream, Redis ---------------------------------------------------------------------------
@dataclass
class Team:
    id: str
    name: str
    secret: str
    limits: object
    key_id: str = ""


class Stack:
    """One scenario's world: a FakeUpstream (in a thread), a TCP proxy in front of Redis (and optionally one in
    front of the upstream), a store with teams and keys, and the gateway processes. `close()` stops and cleans
    everything it started, including its teams' keys in Redis."""

    def __init__(
        self,
        workdir: Path,
        *,
        before: bool = False,
        store: str = "sqlite",
        upstream_proxy: bool = False,
        redis_proxy: bool = True,
        cluster=None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.before = before
        self.store_kind = store
        self._want_upstream_proxy, self._want_redis_proxy = upstream_proxy, redis_proxy
        self.cluster = cluster  # a proxied LocalCluster: the state is that cluster
        self.gateways: list[Gateway] = []
        self.teams: list[Team] = []
        self.seeded: dict[str, int] = {}  # team id -> tokens of usage put in the store before the traffic
        self.fake = None
        self.upstream = None
        self.upstream_proxy = None
        self.redis_proxy = None
        self.store = None
        self.store_url = ""
        self._pg_schema: str | None = None
        self._closers: list = []

    # --- set up / tear down ------------------------------------------------------------------------------
    def __enter__(self) -> Stack:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        from loadtests.fake_upstream import FakeUpstream
        from tests.support.serve_thread import ServerThread
        from tests.support.tcp_proxy import TCPProxy
        from tokenweir.gateway.store.store import Store

        self.fake = FakeUpstream(model=MODEL)
        self.upstream = ServerThread(self.fake).__enter__()
        self._closers.append(lambda: self.upstream.__exit__(None, None, None))
        if self._want_upstream_proxy:
            self.upstream_proxy = TCPProxy(self.upstream.port).start()
            self._closers.append(self.upstream_proxy.stop)
        if self.cluster is not None:
            self.cluster.wait_ok()
            self.redis_proxy = self.cluster  # cut / restore / latency_s on every node's proxy
        elif self._want_redis_proxy:
            self.redis_proxy = TCPProxy(REDIS_PORT, REDIS_HOST).start()
            self._closers.append(self.redis_proxy.stop)
        if self.store_kind == "sqlite":
            self.store_url = f"sqlite:///{self.workdir}/store.db"
        else:
            self.store_url = self._pg_schema_url()
        self.store = Store.open(self.store_url)
        self._closers.append(self.store.close)
        self.admin_secret, _ = self.store.create_key(None, "faults-admin", is_admin=True)

    def _pg_schema_url(self) -> str:
        import psycopg

        self._pg_schema = "tw_faults_" + secrets.token_hex(6)
        with psycopg.connect(PG_URL, autocommit=True, connect_timeout=3) as c:
            c.execute(f"CREATE SCHEMA {self._pg_schema}")
        sep = "&" if "?" in PG_URL else "?"
        return f"{PG_URL}{sep}options=-csearch_path%3D{self._pg_schema}"

    def close(self) -> None:
        for gw in self.gateways:
            with contextlib.suppress(Exception):
                gw.kill()
        if self.cluster is not None:  # whole again for the next scenario: no cut, no latency
            with contextlib.suppress(Exception):
                self.cluster.restore()
                self.cluster.latency_s = 0.0
        with contextlib.suppress(Exception):
            self.clean_redis()
        for fn in reversed(self._closers):
            with contextlib.suppress(Exception):
                fn()
        self._closers.clear()
        if self._pg_schema:
            import psycopg

            with contextlib.suppress(Exception), psycopg.connect(PG_URL, autocommit=True, connect_timeout=3) as c:
                c.execute(f"DROP SCHEMA {self._pg_schema} CASCADE")
            self._pg_schema = None

    # --- teams -------------------------------------------------------------------------------------------
    def team(self, label: str, limits=None) -> Team:
        from tokenweir.policies.limits import TeamLimits

        limits = limits or TeamLimits()
        name = f"faults-{label}-{secrets.token_hex(4)}"
        t = self.store.create_team(name, limits)
        secret, key = self.store.create_key(t.id, "faults")
        team = Team(t.id, name, secret, limits, key.id)
        self.teams.append(team)
        return team

    def seed_spend(self, team: Team, tokens: int) -> None:
        """Usage already in the store today (so a start-up has spend to seed into the state backend)."""
        from datetime import UTC, datetime

        from tokenweir.gateway.store.store import UsageRow

        day = datetime.now(UTC).strftime("%Y-%m-%d")
        self.store.record_usage([UsageRow(team.id, day, MODEL, 1, tokens, 0, 0)])
        self.seeded[team.id] = self.seeded.get(team.id, 0) + tokens

    # --- gateways ----------------------------------------------------------------------------------------
    @property
    def upstream_url(self) -> str:
        port = self.upstream_proxy.port if self.upstream_proxy is not None else self.upstream.port
        return f"http://127.0.0.1:{port}"

    @property
    def redis_url(self) -> str:
        if self.cluster is not None:
            return self.cluster.url
        port = self.redis_proxy.port if self.redis_proxy is not None else REDIS_PORT
        return f"redis://127.0.0.1:{port}/0"

    def gateway_config(
        self,
        name: str,
        *,
        state: str = "redis",  # "redis" | "memory"
        engine: bool = True,
        capacity: int = 256,
        max_queued: int = 4096,
        events_flush_s: float = 0.1,
        usage_flush_s: float = 0.25,
        shutdown_grace_s: float = 5.0,
        state_opts: dict | None = None,
        breaker_cooldown_s: float = 0.5,
        breaker_failures: int = 3,
        timeouts: dict | None = None,
        log_level: str = "info",
    ) -> dict:
        cfg: dict = {
            "host": "127.0.0.1",
            "store_url": self.store_url,
            "state_url": self.redis_url if state == "redis" else None,
            "pools": [
                {
                    "model": MODEL,
                    "capacity": capacity,
                    "max_queued": max_queued,
                    "upstreams": [{"base_url": self.upstream_url, "name": "fake-0", "engine": engine}],
                }
            ],
            "timeouts": {"queue_s": 30, "ttft_s": 30, "total_s": 60, "connect_s": 2, **(timeouts or {})},
            "breaker": {"failures": breaker_failures, "cooldown_s": breaker_cooldown_s},
            "events": {"path": str(self.workdir / f"events-{name}.jsonl"), "flush_interval_s": events_flush_s},
            "engine": {"enabled": False},
            "default_max_tokens": 64,
            "load_poll_interval_s": 0.5,
            "auth_cache_ttl_s": 1.0,
            "usage_flush_interval_s": usage_flush_s,
            "shutdown_grace_s": shutdown_grace_s,
            "log_level": log_level,
        }
        if state == "redis" and not self.before:
            # HEAD's loader rejects unknown keys: the `state:` section only exists in the fixed format
            cfg["state"] = {"max_connections": 64, "pool_timeout_s": 5.0, "timeout_s": 1.0, **(state_opts or {})}
            if self.cluster is not None:
                cfg["state"]["cluster"] = True
        return cfg

    def gateway(self, name: str, **kwargs) -> Gateway:
        gw = Gateway(name, self.workdir, self.gateway_config(name, **kwargs))
        self.gateways.append(gw)
        return gw

    # --- what the world says -----------------------------------------------------------------------------
    def team_ids(self) -> set[str]:
        return {t.id for t in self.teams}

    def events(self) -> list[dict]:
        ids = self.team_ids()
        return [e for gw in self.gateways for e in gw.events() if e.get("team") in ids]

    def events_billed(self) -> int:
        return sum((e.get("prompt_tokens") or 0) + (e.get("completion_tokens") or 0) for e in self.events())

    def store_billed(self, seeded: int = 0) -> int:
        total = 0
        for t in self.teams:
            total += sum(r.prompt_tokens + r.completion_tokens for r in self.store.usage(team_id=t.id))
        return total - seeded

    def served(self) -> int:
        p, c = self.fake.totals()
        return p + c

    def served_by(self, upstream_ids) -> int:
        """Tokens the upstream counted for these of its request ids (the `upstream_request_id` of events)."""
        records = self.fake.records
        return sum(records[i].prompt_tokens + records[i].completion_tokens for i in upstream_ids if i in records)

    def redis_client(self):
        """The state's Redis, directly (not through the proxy): the single one, or the cluster's nodes."""
        import redis

        if self.cluster is not None:
            return self.cluster.client()
        return redis.Redis(host=REDIS_HOST, port=REDIS_PORT, decode_responses=True, socket_timeout=5)

    def redis_leaks(self, team_id: str) -> dict:
        """Straight from Redis (not through the proxy): leases, holds and the reserved tokens left, the team's and
        its API keys' (each key is a subject of its own, under `key:<id>:`)."""
        subjects = [f"tw:{{{team_id}}}:"]
        subjects += [f"tw:{{{team_id}}}:key:{t.key_id}:" for t in self.teams if t.id == team_id and t.key_id]
        r = self.redis_client()
        try:
            now = time.time()
            with r.pipeline(transaction=False) as p:
                for k in subjects:
                    p.zcard(k + "slots").zcount(k + "slots", f"({now!r}", "+inf").zcard(k + "holds")
                    p.hget(k + "meta", "reserved")
                got = p.execute()
        finally:
            r.close()
        slots, live_slots, holds, reserved = (got[i::4] for i in range(4))
        return {
            "slots": sum(slots),
            "live_slots": sum(live_slots),
            "holds": sum(holds),
            "reserved": sum(int(x or 0) for x in reserved),
        }

    def memory_leaks(self, gw: Gateway, team_id: str) -> dict:
        """In-memory state: the live snapshot through the admin API (this replica's counters)."""
        r = httpx.get(
            f"{gw.url}/admin/teams/{team_id}/state",
            headers={"authorization": f"Bearer {self.admin_secret}"},
            timeout=5,
        )
        live = (r.json() or {}).get("live") or {}
        return {
            "slots": int(live.get("in_flight") or 0),
            "live_slots": int(live.get("in_flight") or 0),
            "holds": int(live.get("open_reservations") or 0),
            "reserved": int(live.get("reserved_tokens") or 0),
        }

    def in_flight_left(self, gw: Gateway) -> int | None:
        """Requests a gateway still counts as in flight upstream or waiting in a dispatch queue (its /metrics
        gauges); None when it does not answer."""
        try:
            r = httpx.get(gw.url + "/metrics", timeout=5)
        except httpx.HTTPError:
            return None
        gauges = ("tokenweir_gateway_in_flight{", "tokenweir_gateway_queue_depth{")
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines() if line.startswith(gauges)))

    def billed_by_team(self) -> dict[str, tuple[int, int]]:
        """Team id -> (tokens billed per its events, per the store's usage rows less what `seed_spend` put there)."""
        billed = dict.fromkeys(self.team_ids(), 0)
        for e in self.events():
            billed[e["team"]] += (e.get("prompt_tokens") or 0) + (e.get("completion_tokens") or 0)
        out = {}
        for t in self.teams:
            stored = sum(r.prompt_tokens + r.completion_tokens for r in self.store.usage(team_id=t.id))
            out[t.id] = (billed[t.id], stored - self.seeded.get(t.id, 0))
        return out

    def clean_redis(self) -> int:
        """Delete this stack's teams' keys (`tw:{<team_id>}:*`)."""
        if not self.teams:
            return 0
        r = self.redis_client()
        n = 0
        try:
            for t in self.teams:
                keys = list(r.scan_iter(match=f"tw:{{{t.id}}}:*", count=500))
                if keys:
                    n += r.delete(*keys)
        finally:
            r.close()
        return n

    def wait_events(self, n: int, timeout: float = 5.0) -> list[dict]:
        """Until at least `n` events of this stack's teams are on disk (or the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            ev = self.events()
            if len(ev) >= n or time.monotonic() > deadline:
                return ev
            time.sleep(0.05)

    def wait_store(self, timeout: float = 5.0, seeded: int = 0) -> int:
        """Until the store's usage equals the events' sum (usage flushes every usage_flush_interval_s)."""
        deadline = time.monotonic() + timeout
        while True:
            stored, billed = self.store_billed(seeded), self.events_billed()
            if stored == billed or time.monotonic() > deadline:
                return stored
            time.sleep(0.1)


def beyond_reservation(events: list[dict]) -> list[str]:
    """Events that served more than their reservation held without saying by how much (invariant (a))."""
    out = []
    for e in events:
        completion, bound, overrun = e.get("completion_tokens") or 0, e.get("max_tokens") or 0, e.get("overrun_tokens")
        if completion > bound + (overrun or 0) or (overrun or 0) != max(0, completion - bound):
            out.append(f"{e.get('request_id')}: completion {completion}, max_tokens {bound}, overrun {overrun}")
    return out


# --- requests --------------------------------------------------------------------------------------------------
def completion(
    *,
    stream: bool = False,
    tokens: int = 8,
    max_tokens: int | None = None,
    ttft_ms: int = 0,
    itl_ms: int = 0,
    fail_after: int | None = None,
    prompt: list[int] | None = None,
) -> dict:
    fake: dict = {"tokens": tokens, "ttft_ms": ttft_ms, "itl_ms": itl_ms}
    if fail_after is not None:
        fake["fail_after"] = fail_after
    return {
        "model": MODEL,
        "prompt": prompt or PROMPT,
        "max_tokens": max_tokens or tokens,
        "stream": stream,
        "fake": fake,
    }


@dataclass
class Req:
    secret: str
    body: dict
    url: str = ""  # gateway base URL; the storm's default when empty
    delay_s: float = 0.0  # sent this long after the storm starts
    tag: str = ""


@dataclass
class Outcome:
    tag: str = ""
    status: int = 0  # HTTP status; 0: could not connect; -1: timed out; -2: connection broke before a status
    code: str | None = None  # error.code of a JSON error body
    json_error: bool = False  # an OpenAI-shaped JSON error body
    content_type: str = ""
    retry_after: str | None = None
    body_head: str = ""
    stream: bool = False
    tokens: int = 0  # completion chunks received (one token each from the fake)
    sse_error: str | None = None  # error.code of an SSE error event
    done: bool = False  # the stream ended with [DONE]
    broke: bool = False  # the connection broke mid-body
    sent: bool = True  # the request reached the gateway (False: connection refused)
    elapsed_s: float = 0.0


async def one_request(client: httpx.AsyncClient, url: str, req: Req) -> Outcome:
    out = Outcome(tag=req.tag, stream=bool(req.body.get("stream")))
    t0 = time.monotonic()
    headers = {"authorization": f"Bearer {req.secret}", "content-type": "application/json"}
    content = orjson.dumps(req.body)
    try:
        if out.stream:
            async with client.stream("POST", url + "/v1/completions", content=content, headers=headers) as r:
                _head(out, r)
                if r.status_code != 200:
                    _error_body(out, await r.aread())
                else:
                    buf = b""
                    async for chunk in r.aiter_raw():
                        buf += chunk
                        *events, buf = buf.split(b"\n\n")
                        for ev in events:
                            _sse_event(out, ev)
        else:
            r = await client.post(url + "/v1/completions", content=content, headers=headers)
            _head(out, r)
            if r.status_code != 200:
                _error_body(out, r.content)
            else:
                with contextlib.suppress(Exception):
                    out.tokens = int(r.json()["usage"]["completion_tokens"])
    except httpx.ConnectError:
        out.status, out.sent = 0, False
    except httpx.TimeoutException:
        if out.status == 0:
            out.status = -1
        out.broke = True
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        if out.status == 0:
            out.status = -2
        out.broke = True
    out.elapsed_s = time.monotonic() - t0
    return out


def _head(out: Outcome, r: httpx.Response) -> None:
    out.status = r.status_code
    out.content_type = r.headers.get("content-type", "")
    out.retry_after = r.headers.get("retry-after")


def _error_body(out: Outcome, raw: bytes) -> None:
    out.body_head = raw[:200].decode("utf-8", "replace")
    try:
        obj = orjson.loads(raw)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict):
            out.json_error, out.code = True, err.get("code")
    except orjson.JSONDecodeError:
        pass


def _sse_event(out: Outcome, ev: bytes) -> None:
    for line in ev.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            out.done = True
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "error" in obj and not obj.get("choices"):
            out.sse_error = (obj.get("error") or {}).get("code") or "error"
        elif isinstance(obj, dict) and obj.get("choices"):
            c = obj["choices"][0]
            if c.get("text") or (c.get("delta") or {}).get("content"):
                out.tokens += 1


async def storm(url: str, reqs: list[Req], timeout_s: float = 30.0, during=None) -> list[Outcome]:
    """Send every request (each after its delay), all overlapping; `during(t0)` (a coroutine function) runs
    alongside, e.g. to cut Redis at some instant. Returns one Outcome per request, in order."""
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
    timeout = httpx.Timeout(timeout_s, connect=5.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.monotonic()

        async def delayed(req: Req) -> Outcome:
            if req.delay_s:
                await asyncio.sleep(max(0.0, req.delay_s - (time.monotonic() - t0)))
            try:
                return await asyncio.wait_for(one_request(client, req.url or url, req), timeout_s + 5)
            except TimeoutError:
                return Outcome(tag=req.tag, status=-1, stream=bool(req.body.get("stream")), broke=True)

        tasks = [asyncio.ensure_future(delayed(r)) for r in reqs]
        side = asyncio.ensure_future(during(t0)) if during is not None else None
        outcomes = await asyncio.gather(*tasks)
        if side is not None:
            await asyncio.wait_for(side, timeout_s)
        return outcomes


async def raw_request(
    url: str,
    secret: str,
    body: dict,
    *,
    leave_after_s: float | None = None,
    leave_after_events: int | None = None,
    partial_body: bool = False,
    timeout_s: float = 15.0,
) -> Outcome:
    """One request over a bare socket, to leave at an exact point: halfway through the body (`partial_body`), at
    once after the body (`leave_after_s=0`), after a while (queued, or while the upstream works), or after
    `leave_after_events` SSE events."""
    host, port = url.removeprefix("http://").split(":")
    out = Outcome(tag="raw", stream=bool(body.get("stream")))
    data = orjson.dumps(body)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\nauthorization: Bearer {secret}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode()
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
    except (OSError, TimeoutError):
        out.sent = False
        return out
    try:
        if partial_body:
            writer.write(head + data[: len(data) // 2])
            await writer.drain()
            await asyncio.sleep(0.05)  # the gateway is reading the body now: leave
        else:
            writer.write(head + data)
            await writer.drain()
        if partial_body:
            pass
        elif leave_after_s is not None:
            try:
                got = await asyncio.wait_for(reader.read(65536), leave_after_s) if leave_after_s > 0 else b""
            except TimeoutError:
                got = b""
            if got.startswith(b"HTTP/1.1 "):
                out.status = int(got[9:12])
        elif leave_after_events is not None:
            buf, seen = b"", 0
            async with asyncio.timeout(timeout_s):
                while seen < leave_after_events:
                    chunk = await reader.read(65536)
                    if not chunk:
                        break
                    if not buf and chunk.startswith(b"HTTP/1.1 "):
                        out.status = int(chunk[9:12])
                    buf += chunk
                    seen = buf.count(b"data: ")
            out.tokens = seen
    except (OSError, TimeoutError):
        out.broke = True
    finally:
        # leave: a RST-free close, as a client process that goes away
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 2)
    out.elapsed_s = time.monotonic() - t0
    return out


def run(coro):
    """Run a coroutine to completion from sync code (tests, the table)."""
    return asyncio.run(coro)
