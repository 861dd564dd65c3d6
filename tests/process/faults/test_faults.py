"""Fault injection against real gateway processes: the reliability contract, one test per fault.

Each test runs one scenario of `scenarios.py` beside it (a gateway started as `python -m
tokenweir.gateway.process.cli serve`, a fake upstream with exact token counters, Redis behind a TCP proxy that can
be cut, a SQLite store) and asserts the scenario found no breach of the contract:
  - every admitted request billed exactly once: one JSONL event per request sent; the events' token sum == what
    the upstream served == the store's usage (after the flush, or after a restart);
  - slot leases and reservations always returned (Redis: nothing left in `slots`/`holds`, meta `reserved` 0);
    a max_concurrency-2 team gets 200 right after the fault (not locked out);
  - never a 500: Redis unreachable is 503 state_unavailable with Retry-After, /health 503 naming the state
    backend while /livez stays 200, start-up waits for Redis instead of exiting; SIGTERM past the grace period
    answers 503 shutting_down (JSON, or an SSE error event), not a plain-text 500;
  - a day budget is not spent twice (SIGKILL + restart), nor by two replicas together;
  - no request served past its reservation unless its event says by how much, each team's store usage == its
    events' sum, no gateway still counting a request in flight afterwards (tests/support/fault_harness.py states all).
Then on a local Redis Cluster (3 primaries, 3 replicas, each node behind a cuttable proxy:
tests/support/redis_cluster.py): two replicas under a cut and a storm, a primary killed mid-load while its replica is
promoted, and the cut, the Redis down at start and the clients leaving (`TW_FAULTS_CLUSTER_ALL=1`: every scenario on
Redis, on the cluster too; about a minute more).
The whole file runs in about two minutes and a half on a slow 2-core machine. Redis is required (CI fails without it),
and so is the cluster (redis-server and redis-cli).
`loadtests/fault_table.py` runs the same scenarios and prints them as a table. `TW_FAULTS_BEFORE=1` writes the
old config format (no `state:` section), to run these tests against a tree from before the reliability fixes.
"""

from __future__ import annotations

import os

import pytest

from tests.process.faults import scenarios
from tests.support.fault_harness import redis_available
from tests.support.services import require_service

BEFORE = os.environ.get("TW_FAULTS_BEFORE") == "1"
ON_CLUSTER = [scenarios.redis_cut, scenarios.redis_down, scenarios.clients_leave]
if os.environ.get("TW_FAULTS_CLUSTER_ALL") == "1":
    ON_CLUSTER += [
        scenarios.redis_cut_fin,
        scenarios.redis_pool_exhaustion,
        scenarios.redis_down_fail_open,
        scenarios.sigterm_past_grace,
        scenarios.upstream_dies,
    ]


@pytest.fixture(scope="module")
def redis_up():
    why = redis_available()
    if why:
        require_service("redis", why)


def check(result: scenarios.FaultResult) -> None:
    if result.skipped:
        pytest.skip(result.skipped)
    assert not result.problems, result.summary()


def test_redis_cut_mid_load_bills_everything_and_leaks_nothing(redis_up, tmp_path):
    check(scenarios.redis_cut(tmp_path, before=BEFORE))


def test_redis_closing_its_connections_mid_load_bills_everything(redis_up, tmp_path):
    check(scenarios.redis_cut_fin(tmp_path, before=BEFORE))


def test_redis_pool_exhaustion_waits_for_a_connection_instead_of_failing(redis_up, tmp_path):
    check(scenarios.redis_pool_exhaustion(tmp_path, before=BEFORE))


def test_redis_down_answers_503_and_startup_waits_for_it(redis_up, tmp_path):
    check(scenarios.redis_down(tmp_path, before=BEFORE))


def test_redis_down_fail_open_admits_under_local_limits(redis_up, tmp_path):
    check(scenarios.redis_down_fail_open(tmp_path, before=BEFORE))


def test_sigkill_after_a_burst_loses_no_usage_and_no_budget(tmp_path):
    check(scenarios.sigkill_after_burst(tmp_path, before=BEFORE))


def test_sigterm_past_grace_answers_openai_errors_and_bills_all(redis_up, tmp_path):
    check(scenarios.sigterm_past_grace(tmp_path, before=BEFORE))


def test_upstream_dying_mid_stream_bills_what_was_served(redis_up, tmp_path):
    check(scenarios.upstream_dies(tmp_path, before=BEFORE))


def test_clients_leaving_at_every_point_leave_nothing_behind(redis_up, tmp_path):
    check(scenarios.clients_leave(tmp_path, before=BEFORE))


def test_two_replicas_under_redis_faults_do_not_overspend(redis_up, tmp_path):
    check(scenarios.two_replicas(tmp_path, before=BEFORE))


# --- on a Redis Cluster ------------------------------------------------------------------------------------------
@pytest.fixture
def cluster(request):
    """The session's proxied Redis Cluster (tests/support/redis_cluster.py)."""
    if BEFORE:
        pytest.skip("HEAD's config has no state.cluster")
    return request.getfixturevalue("redis_cluster_proxied")


def test_two_replicas_on_a_redis_cluster_under_faults_do_not_overspend(cluster, tmp_path):
    check(scenarios.two_replicas(tmp_path, cluster=cluster))


def test_a_cluster_primary_killed_mid_load_fails_over_billing_everything_and_leaking_nothing(cluster, tmp_path):
    check(scenarios.cluster_failover(tmp_path, cluster=cluster))


@pytest.mark.parametrize("scenario", ON_CLUSTER, ids=lambda s: s.__name__)
def test_the_redis_faults_keep_the_contract_on_a_redis_cluster_too(cluster, tmp_path, scenario):
    check(scenario(tmp_path, cluster=cluster))
