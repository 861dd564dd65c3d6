"""A Prometheus text endpoint read into a dict, for tests that check what the metrics say."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def gateway_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, its labels as sorted (name, value) pairs) -> value, from `url`/metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
