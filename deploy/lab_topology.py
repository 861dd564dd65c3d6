"""What the lab runs and how it is wired: the engine and gateway command lines, each gateway's config, nginx in front
of the two replicas, Prometheus scraping all four with the alert rules; start() brings it up in order and returns
once every piece answers. Configs come from deploy/render.py; processes are deploy/lab_procs.py's.
"""

from __future__ import annotations

import re
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from deploy import render
from deploy.lab_probe import targets_down
from deploy.lab_procs import (
    APT_HINT,
    REDIS_URL,
    Lab,
    LabError,
    binary,
    create_database,
    free_port,
    missing_binaries,
    wait_until,
)

SCRAPE_INTERVAL = "2s"


def engine_cmd(port: int, role: str | None = None) -> list[str]:
    """One engine on the bundled model, kept light (one thread each: the two share the machine); `role` prefill or
    decode in a disaggregated pool."""
    cmd = [sys.executable, "-m", "tokenweir.engine.server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += [*render.ENGINE_ARGS, "--num-threads", "1", "--log-level", "warning"]
    return cmd + (render.engine_role_args(role) if role else [])


def gateway_cmd(config_path: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tokenweir.gateway.process.cli",
        "serve",
        "--no-engine",
        "--config",
        str(config_path),
        "--port",
        str(port),
    ]


def _ok(url: str) -> bool:
    return httpx.get(url, timeout=2).status_code == 200


def start(
    *, down_upstream: bool = False, disaggregated: bool = False, timeout_s: float = 120, tmp: Path | None = None
) -> Lab:
    """Start everything; returns once nginx answers /health from a ready gateway and Prometheus sees all targets.

    down_upstream: add a pool smollm2-135m-canary whose one upstream is a port nothing listens on, falling back to
    the main pool; locust sends it a share of requests (fault injection: instance failures, an open circuit,
    fallbacks).
    disaggregated: engine-1 prefills and engine-2 decodes (a disaggregated pool: every chat takes both hops).
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
        _start(lab, down_upstream, render.DISAGGREGATED_ROLES if disaggregated else None, timeout_s)
    except BaseException:
        lab.stop()
        raise
    return lab


def _start(lab: Lab, down_upstream: bool, roles: tuple[str, ...] | None, timeout_s: float) -> None:
    tmp, ports = lab.tmp, lab.ports
    deadline = time.monotonic() + timeout_s
    engines = []
    engine_key = {render.ENGINE_KEY_ENV: secrets.token_urlsafe(32)}  # in the env: `ps` would show an argument
    engine_key[render.KV_TRANSFER_KEY_ENV] = secrets.token_hex(32)  # one for both: the decoder trusts the prefiller
    for i in (1, 2):
        cmd = engine_cmd(ports[f"engine-{i}"], roles[i - 1] if roles else None)
        engines.append(lab.spawn(f"engine-{i}", cmd, env=engine_key))
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
            roles=roles,
        )
        path = tmp / f"gateway-{i}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        cmd = gateway_cmd(path, ports[f"gateway-{i}"])
        gateways.append(lab.spawn(f"gateway-{i}", cmd, env={render.ADMIN_KEY_ENV: env_key, **engine_key}))
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
