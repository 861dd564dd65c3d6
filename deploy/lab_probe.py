"""Driving and reading a running lab: a headless locust run through nginx, Prometheus queries and scrape targets,
the requests each gateway replica recorded, and the dashboard's queries.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx

from deploy import render
from deploy.lab_procs import ROOT, Lab, LabError, clean_env, locust_binary


def locust_cmd(locust: str, host: str, seconds: int, users: int, csv: Path) -> list[str]:
    cmd = [locust, "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless", "-u", str(users), "-r", str(users)]
    return cmd + ["-t", f"{seconds}s", "--host", host, "--csv", str(csv), "--only-summary", "--stop-timeout", "10"]


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
