"""The lab as local processes (deploy/lab.py, what scripts/lab.sh runs): locust through nginx, then the dashboard,
the replicas and the scrape targets checked against the real Prometheus."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from deploy import lab_probe, lab_procs, lab_topology
from tests.support.services import require_service

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def _services_or_skip() -> None:
    missing = lab_procs.missing_binaries()
    if missing:
        require_service(", ".join(missing), f"install with `{lab_procs.APT_HINT}`")
    if lab_procs.locust_binary() is None:
        require_service("locust", ".venv/bin/pip install locust")
    try:
        import psycopg

        psycopg.connect(lab_procs.PG_ADMIN_URL, connect_timeout=3).close()
    except Exception as exc:  # noqa: BLE001
        require_service("PostgreSQL", f"{lab_procs.PG_ADMIN_URL}: {exc}")
    try:
        import redis

        redis.Redis.from_url(lab_procs.REDIS_URL, socket_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001
        require_service("Redis", f"{lab_procs.REDIS_URL}: {exc}")


def metrics_in_source(name: str) -> bool:
    """Whether this tree defines a metric: a prometheus_client definition of it in gateway/ or engine/ code."""
    short = re.escape(name.removeprefix("tokenweir_gateway_").removeprefix("tokenweir:").removesuffix("_total"))
    full = re.escape(name.removesuffix("_total"))
    pattern = re.compile(rf'"{full}"|\+ *"{short}"|(?:gauge|counter|histogram)\(\s*"{short}"')
    return any(pattern.search(p.read_text()) for d in ("gateway", "engine") for p in (ROOT / d).rglob("*.py"))


@pytest.fixture(scope="module")
def running_lab():
    _services_or_skip()
    lab = lab_topology.start(down_upstream=True, timeout_s=120)
    try:
        result = lab_probe.run_locust(lab, seconds=20, users=6)
        time.sleep(5)  # two more scrapes after the last request
        yield lab, result
    finally:
        lab.stop()


def test_locust_ran_through_nginx(running_lab):
    lab, result = running_lab
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    for event in ("TTFT", "PROMPT_TOKENS", "COMPLETION_TOKENS", "REJECTED"):
        assert event in out, f"no {event} events in the locust summary"


def test_both_replicas_served_traffic(running_lab):
    lab, _ = running_lab
    traffic = lab_probe.replica_traffic(lab)
    assert all(n > 0 for n in traffic.values()), traffic
    for url in lab.gateway_urls():  # and their own counters agree
        text = httpx.get(url + "/metrics", timeout=5).text
        served = sum(
            float(v)
            for v in re.findall(r'^tokenweir_gateway_requests_total\{[^}]*status="ok"[^}]*\} (\S+)', text, re.M)
        )
        assert served > 0, url


def test_prometheus_scrapes_every_target(running_lab):
    lab, _ = running_lab
    assert lab_probe.targets_down(lab) == []
    up = lab_probe.prom_query(lab, "up")
    assert len(up) == 4 and all(r["value"][1] == "1" for r in up), up


def test_every_dashboard_query_returns_data(running_lab):
    lab, _ = running_lab
    empty, not_in_tree = [], []
    for title, expr in lab_probe.dashboard_exprs():
        if lab_probe.prom_query(lab, expr):
            continue
        names = re.findall(r"(tokenweir(?:_gateway_|:)[a-z_]+?)(?:_bucket|_total)?\b", expr)
        missing = sorted({n for n in names if not metrics_in_source(n)})
        (not_in_tree if missing else empty).append(
            f"{title}: {expr}" + (f"  (not in this tree: {missing})" if missing else "")
        )
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty + not_in_tree)
    if not_in_tree:
        # Only queries over metrics this tree does not define yet: reported, not hidden; the test turns into a hard
        # check by itself once they exist.
        pytest.xfail("metrics not defined in this tree yet:\n" + "\n".join(not_in_tree))
