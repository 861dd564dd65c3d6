"""The lab topology as local processes: 2 engines, 2 gateway replicas (shared Redis + PostgreSQL) behind nginx,
Prometheus scraping all four, and a headless locust run through nginx. scripts/lab.sh and tests/lab use this.

    python -m deploy.lab                       # start, run locust for 20 s, print URLs, wait for Ctrl-C
    python -m deploy.lab --locust-seconds 0    # start only
    python -m deploy.lab --exit                # start, run locust, write the dashboard picture, stop

Redis and PostgreSQL are the machine's (127.0.0.1:6379, :5432): the lab gets a database of its own
(tokenweir_lab_<random>, dropped at the end; TWLAB_PG names the server) and Redis db 9 (TWLAB_REDIS); TWLAB_KEEP=1
keeps the temp dir (configs, logs, events files). nginx and prometheus are Debian's binaries, run as
plain user processes with configs rendered by deploy/render.py into a temp dir. Only 127.0.0.1 is used; every
process started here is stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from deploy import render

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("TWLAB_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TWLAB_REDIS", "redis://127.0.0.1:6379/9")
SCRAPE_INTERVAL = "2s"
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


def engine_cmd(port: int) -> list[str]:
    """One engine on the bundled model, kept light (one thread each: the two share the machine)."""
    cmd = [sys.executable, "-m", "engine.server", "--host", "127.0.0.1", "--port", str(port)]
    return cmd + [*render.ENGINE_ARGS, "--num-threads", "1", "--log-level", "warning"]


def gateway_cmd(config_path: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--no-engine",
        "--config",
        str(config_path),
        "--port",
        str(port),
    ]


def locust_cmd(locust: str, host: str, seconds: int, users: int, csv: Path) -> list[str]:
    cmd = [locust, "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless", "-u", str(users), "-r", str(users)]
    return cmd + ["-t", f"{seconds}s", "--host", host, "--csv", str(csv), "--only-summary", "--stop-timeout", "10"]


def _ok(url: str) -> bool:
    return httpx.get(url, timeout=2).status_code == 200


def start(*, down_upstream: bool = False, timeout_s: float = 120, tmp: Path | None = None) -> Lab:
    """Start everything; returns once nginx answers /health from a ready gateway and Prometheus sees all targets.

    down_upstream: add a pool smollm2-135m-canary whose one upstream is a port nothing listens on, falling back to
    the main pool; locust sends it a share of requests (fault injection: instance failures, an open circuit,
    fallbacks).
    """
    missing = missing_binaries()
    if missing:
        raise LabError(f"missing {', '.join(missing)}: install with `{APT_HINT}` (Debian packages)")
    names = ["engine-1", "engine-2", "gateway-1", "gateway-2", "nginx", "prometheus", "down"]
    ports = {n: free_port() for n in names}
    own = tmp is None
    tmp = Path(tempfile.mkdtemp(prefix="tokenweir-lab-")) if tmp is None else tmp
    tmp.chmod(0o755)  # nginx workers (nobody when the master is root) reach their temp dirs through it
    lab = Lab(tmp=tmp, ports=ports, db_name=create_database(), own_tmp=own, down_upstream=down_upstream)
    try:
        _start(lab, down_upstream, timeout_s)
    except BaseException:
        lab.stop()
        raise
    return lab


def _start(lab: Lab, down_upstream: bool, timeout_s: float) -> None:
    tmp, ports = lab.tmp, lab.ports
    deadline = time.monotonic() + timeout_s
    engines = []
    for i in (1, 2):
        engines.append(lab.spawn(f"engine-{i}", engine_cmd(ports[f"engine-{i}"])))
    members = [(f"engine-{i}", u) for i, u in zip((1, 2), lab.engine_urls(), strict=True)]
    canary = f"http://127.0.0.1:{ports['down']}" if down_upstream else None  # nothing listens there
    env_key = "tw-" + secrets.token_urlsafe(32)
    gateways = []
    for i in (1, 2):
        (tmp / f"gateway-{i}").mkdir()
        cfg = render.gateway_config(
            members,
            store_url=lab.store_url,
            state_url=REDIS_URL,
            events_path=str(lab.events_path(i)),
            host="127.0.0.1",
            port=ports[f"gateway-{i}"],
            canary_url=canary,
        )
        path = tmp / f"gateway-{i}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        cmd = gateway_cmd(path, ports[f"gateway-{i}"])
        gateways.append(lab.spawn(f"gateway-{i}", cmd, env={render.ADMIN_KEY_ENV: env_key}))
        if i == 1:  # the first replica bootstraps the fresh database alone (no race over the bootstrap key)
            wait_until("gateway-1 start", lambda: "gateway on" in gateways[0].output(), lab, 60, gateways)
    wait_until("gateway-2 start", lambda: "gateway on" in gateways[1].output(), lab, 60, gateways)
    printed = re.search(r"ADMIN key .*: (tw-\S+)", gateways[0].output() + gateways[1].output())
    lab.admin_key = printed.group(1) if printed else env_key

    nginx_dir = tmp / "nginx"
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (nginx_dir / sub).mkdir(parents=True)
        (nginx_dir / sub).chmod(0o777)
    nginx_dir.chmod(0o755)
    conf = render.nginx_conf(
        [u.removeprefix("http://") for u in lab.gateway_urls()], f"127.0.0.1:{ports['nginx']}", prefix=str(nginx_dir)
    )
    (nginx_dir / "nginx.conf").write_text(conf)
    nginx = binary("nginx")
    cmd = [nginx, "-p", str(nginx_dir), "-e", str(nginx_dir / "error.log"), "-c", str(nginx_dir / "nginx.conf")]
    lab.spawn("nginx", [*cmd, "-g", "daemon off;"])

    prom_dir = tmp / "prometheus"
    prom_dir.mkdir()
    prom = render.prometheus_config(
        [u.removeprefix("http://") for u in lab.gateway_urls()],
        [u.removeprefix("http://") for u in lab.engine_urls()],
        interval=SCRAPE_INTERVAL,
    )
    (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(prom, sort_keys=False))
    shutil.copy(render.DEPLOY / "alerts.yml", prom_dir / "alerts.yml")
    lab.spawn(
        "prometheus",
        [
            binary("prometheus"),
            f"--config.file={prom_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={prom_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ],
    )
    left = lambda: max(5.0, deadline - time.monotonic())  # noqa: E731
    for url in lab.engine_urls():
        wait_until(f"engine {url}/health", lambda u=url: _ok(u + "/health"), lab, left(), lab.procs)
    for url in lab.gateway_urls():
        wait_until(f"gateway {url}/health", lambda u=url: _ok(u + "/health"), lab, left(), lab.procs)
    wait_until("nginx", lambda: _ok(lab.nginx_url + "/livez"), lab, left(), lab.procs)
    wait_until("prometheus", lambda: _ok(lab.prometheus_url + "/-/ready"), lab, left(), lab.procs)
    wait_until("every target up", lambda: not targets_down(lab), lab, left(), lab.procs)
    r = httpx.get(lab.nginx_url + "/admin/teams", headers={"Authorization": f"Bearer {lab.admin_key}"}, timeout=5)
    if r.status_code != 200:
        raise LabError(f"the admin key does not work through nginx: {r.status_code} {r.text[:200]}")


def prom_query(lab: Lab, expr: str) -> list[dict]:
    r = httpx.get(lab.prometheus_url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    if body.get("status") != "success":
        raise LabError(f"prometheus rejected {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def targets_down(lab: Lab) -> list[str]:
    """Scrape targets not up (an empty list once all 4 have been scraped successfully)."""
    body = httpx.get(lab.prometheus_url + "/api/v1/targets", timeout=5).json()
    active = body["data"]["activeTargets"]
    down = [
        f"{t['labels']['job']} {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}"
        for t in active
        if t["health"] != "up"
    ]
    return down or ([] if len(active) == 4 else [f"{len(active)} targets, expected 4"])


def run_locust(
    lab: Lab, seconds: int = 20, users: int = 6, extra_env: dict | None = None
) -> subprocess.CompletedProcess:
    """A headless locust run through nginx (bounded: -t seconds, killed 60 s after that)."""
    locust = locust_binary()
    if locust is None:
        raise LabError("locust is not installed: .venv/bin/pip install locust")
    if not lab.admin_key:
        raise LabError("no admin key")
    csv = lab.tmp / "locust"
    cmd = locust_cmd(locust, lab.nginx_url, seconds, users, csv)
    env = {**clean_env(), render.ADMIN_KEY_ENV: lab.admin_key or "", **(extra_env or {})}
    if lab.down_upstream:
        env["TOKENWEIR_CANARY_MODEL"] = render.CANARY_MODEL
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds + 60)


def replica_traffic(lab: Lab) -> dict[str, int]:
    """Requests each gateway replica recorded: lines in its events file."""
    out = {}
    for i in (1, 2):
        path = lab.events_path(i)
        out[f"gateway-{i}"] = len(path.read_text().splitlines()) if path.exists() else 0
    return out


def dashboard_exprs(path: Path | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel of the lab dashboard."""
    dash = json.loads((path or render.DEPLOY / "grafana" / "dashboards" / "tokenweir.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.lab", description="the tokenweir lab as local processes")
    p.add_argument("--locust-seconds", type=int, default=20, help="0: no locust run")
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--down-upstream", action="store_true", help="add a pool member nothing listens on (faults)")
    p.add_argument("--exit", action="store_true", help="stop after the locust run instead of waiting for Ctrl-C")
    p.add_argument("--picture", default=str(ROOT / "loadtests" / "results" / "lab_dashboard.png"))
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # lab.sh's trap: SIGTERM -> clean stop below
    try:
        lab = start(down_upstream=args.down_upstream)
    except LabError as exc:
        print(f"tokenweir lab: {exc}", file=sys.stderr)
        return 2
    try:
        print(lab.summary(), flush=True)
        if args.locust_seconds > 0 and locust_binary() is None:
            print("tokenweir lab: no locust (.venv/bin/pip install locust): no load run", file=sys.stderr)
        elif args.locust_seconds > 0:
            print(f"tokenweir lab: locust for {args.locust_seconds}s with {args.users} users ...", flush=True)
            res = run_locust(lab, args.locust_seconds, args.users)
            print(res.stdout[-4000:] + res.stderr[-4000:], flush=True)
            print(f"tokenweir lab: locust exit {res.returncode}; requests per replica {replica_traffic(lab)}")
            time.sleep(5)  # two more scrapes
            from deploy.render_dashboard import render_png

            print(f"tokenweir lab: dashboard picture {render_png(lab.prometheus_url, Path(args.picture))}")
        if not args.exit:
            print("tokenweir lab: running; Ctrl-C stops everything", flush=True)
            while all(p.popen.poll() is None for p in lab.procs):
                time.sleep(1)
            print("tokenweir lab: a process exited:\n" + lab.logs_tail(10), file=sys.stderr)
            return 1
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        print("tokenweir lab: stopping ...", flush=True)
        lab.stop()


if __name__ == "__main__":
    sys.exit(main())
