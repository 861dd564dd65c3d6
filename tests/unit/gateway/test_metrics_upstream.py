"""Per-instance circuit state, failures, hops and fallbacks in the gateway's Prometheus metrics."""

from __future__ import annotations

from tokenweir.gateway.accounting.metrics import Metrics
from tokenweir.gateway.config import BreakerConfig, GatewayConfig, PoolConfig, UpstreamConfig
from tokenweir.gateway.upstream.instance import CLOSED, HALF_OPEN, OPEN
from tokenweir.gateway.upstream.pools import Upstreams


def _value(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _upstreams() -> tuple[Upstreams, Metrics]:
    config = GatewayConfig(
        pools=[
            PoolConfig("main", [UpstreamConfig("http://a:1", name="a", engine=False)], fallbacks=["backup"]),
            PoolConfig("backup", [UpstreamConfig("http://b:1", name="b", engine=False)]),
        ],
        breaker=BreakerConfig(failures=2, cooldown_s=0.0),
    )
    metrics = Metrics()
    return Upstreams(config, metrics), metrics


def test_circuit_opens_and_the_gauge_and_failures_show_it():
    upstreams, m = _upstreams()
    gauge, failures = "tokenweir_gateway_upstream_circuit_state", "tokenweir_gateway_upstream_failures_total"
    assert _value(m, gauge, model="main", upstream="a") == CLOSED
    assert _value(m, gauge, model="backup", upstream="b") == CLOSED
    for t in range(2):
        hop = upstreams.plan("main")[0]
        assert hop.instance.name == "a" and not hop.fallback
        hop.instance.take(t)
        hop.done(False, t)
    assert _value(m, gauge, model="main", upstream="a") == OPEN
    assert _value(m, failures, model="main", upstream="a") == 2
    assert _value(m, "tokenweir_gateway_upstream_hops_total", model="main", upstream="a") == 2
    # cooldown 0: the next dispatch is the half-open probe; its success closes the circuit
    hop = upstreams.plan("main")[0]
    hop.instance.take(10)
    assert _value(m, gauge, model="main", upstream="a") == HALF_OPEN
    hop.done(True, 10)
    assert _value(m, gauge, model="main", upstream="a") == CLOSED
    assert _value(m, failures, model="main", upstream="a") == 2


def test_a_request_served_by_a_fallback_hop_counts():
    upstreams, m = _upstreams()
    first, second = upstreams.plan("main")
    assert (first.model, second.model, second.fallback) == ("main", "backup", True)
    first.instance.take(0)
    first.done(False, 0)  # fails before the first byte: the relay tries the next hop
    second.instance.take(0)
    second.done(True, 0)
    assert _value(m, "tokenweir_gateway_fallbacks_total", model="main", served_model="backup") == 1
    assert _value(m, "tokenweir_gateway_upstream_hops_total", model="backup", upstream="b") == 1
    # a request for the backup pool itself is no fallback
    (own,) = upstreams.plan("backup")
    own.instance.take(1)
    own.done(True, 1)
    assert _value(m, "tokenweir_gateway_fallbacks_total", model="main", served_model="backup") == 1
    assert _value(m, "tokenweir_gateway_fallbacks_total", model="backup", served_model="backup") is None


def test_metrics_render_without_upstreams_attached():
    upstreams, _ = _upstreams()
    upstreams.attach_metrics(None)
    hop = upstreams.plan("main")[0]
    hop.instance.take(0)
    hop.done(False, 0)  # no metrics: nothing to report, nothing raises
    assert b"upstream_circuit_state" in Metrics().render()
