"""common/tracing.py: the W3C traceparent written for a span and read back as the receiver's parent, process clocks
as the epoch nanoseconds spans take, exporters by name (an unknown one, or OTLP without its package, is one clear
line), and a tracer provider of its own (never the global one)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from tokenweir.common.tracing import (
    OTLP_PACKAGE,
    TracingUnavailable,
    epoch_ns,
    exporter_error,
    make_provider,
    parent_context,
    trace_id_of,
    traceparent_of,
)

OTLP_INSTALLED = importlib.util.find_spec("opentelemetry.exporter") is not None


def test_a_spans_traceparent_makes_it_the_receivers_remote_parent():
    span = TracerProvider().get_tracer("t").start_span("hop")
    header = traceparent_of(span)
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", header), header
    assert int(header[-2:], 16) & 1  # sampled: the receiver records its spans too
    parent = trace.get_current_span(parent_context(header)).get_span_context()
    sent = span.get_span_context()
    assert (parent.trace_id, parent.span_id, parent.is_remote) == (sent.trace_id, sent.span_id, True)
    assert trace_id_of(span) == header[3:35]


@pytest.mark.parametrize("header", [None, "", "00-not-a-trace-01", "00-" + "0" * 32 + "-" + "1" * 16 + "-01"])
def test_no_traceparent_or_a_malformed_one_starts_a_new_trace(header):
    context = parent_context(header)
    assert context is None or not trace.get_current_span(context).get_span_context().is_valid


def test_epoch_ns_keeps_a_clocks_instants_in_order_and_apart_as_they_were():
    for clock in (time.monotonic, time.perf_counter):
        now = clock()
        to_ns = epoch_ns(clock)
        assert abs(to_ns(now) - time.time_ns()) < 50_000_000  # now is now, give or take the test's own run
        assert abs(to_ns(now) - to_ns(now - 1.5) - 1_500_000_000) <= 1


def test_exporters_by_name():
    assert exporter_error("none") is None and exporter_error("console") is None
    assert exporter_error("jaeger") == "tracing exporter: expected none, console or otlp, got 'jaeger'"
    with pytest.raises(TracingUnavailable, match="expected none, console or otlp"):
        make_provider("svc", "jaeger")


@pytest.mark.skipif(OTLP_INSTALLED, reason="the OTLP exporter is installed here")
def test_otlp_without_its_package_is_one_line_naming_it():
    error = exporter_error("otlp")
    assert error is not None and f"pip install {OTLP_PACKAGE}" in error and "\n" not in error
    with pytest.raises(TracingUnavailable, match=OTLP_PACKAGE):
        make_provider("svc", "otlp", "http://127.0.0.1:4318/v1/traces")


def test_a_provider_of_its_own_named_for_its_service():
    provider = make_provider("svc", "none")
    assert provider is not trace.get_tracer_provider()
    assert provider.resource.attributes["service.name"] == "svc"


def test_the_console_exporter_prints_the_spans():
    """In a fresh interpreter: the exporter writes to the stdout it found at import, which pytest has replaced."""
    code = (
        "from tokenweir.common.tracing import make_provider\n"
        "provider = make_provider('svc', 'console')\n"
        "provider.get_tracer('t').start_span('printed').end()\n"
        "provider.shutdown()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    span = json.loads(out)
    assert span["name"] == "printed" and span["resource"]["attributes"]["service.name"] == "svc"
