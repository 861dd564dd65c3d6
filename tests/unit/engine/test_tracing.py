"""The engine's tracing: off unless a flag turns it on (--enable-tracing prints spans, vLLM's --otlp-traces-endpoint
sends them over OTLP, whose missing package stops the start before the model loads, in one line), and the phases
of a request's trace as its own timings say them, up to where it got."""

from __future__ import annotations

import importlib.util

import pytest

from tokenweir.engine.api.tracing import phases
from tokenweir.engine.core.output import RequestTimings
from tokenweir.engine.flags import parse_args, tracing_exporter
from tokenweir.engine.server import main

OTLP_INSTALLED = importlib.util.find_spec("opentelemetry.exporter") is not None


def test_tracing_is_off_unless_a_flag_says():
    assert tracing_exporter(parse_args([])) is None
    assert tracing_exporter(parse_args(["--enable-tracing"])) == "console"
    endpoint = ["--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]
    assert tracing_exporter(parse_args(endpoint)) == "otlp"
    assert tracing_exporter(parse_args(["--enable-tracing", *endpoint])) == "otlp"


@pytest.mark.skipif(OTLP_INSTALLED, reason="the OTLP exporter is installed here")
def test_otlp_without_its_package_stops_the_start_in_one_line(tmp_path):
    missing_model = str(tmp_path / "not-there.gguf")  # never reached: the exporter is checked first
    with pytest.raises(SystemExit) as exc:
        main(["--model", missing_model, "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"])
    assert exc.value.code == (
        "tokenweir engine: cannot start: tracing exporter otlp needs the package "
        "opentelemetry-exporter-otlp-proto-http: pip install opentelemetry-exporter-otlp-proto-http"
    )


def test_a_finished_request_went_through_queue_prefill_and_decode():
    timings = RequestTimings(arrival=10.0, first_scheduled=10.5, first_token=10.75, last_token=12.0)
    assert phases(timings, ended=12.5) == [("queue", 10.0, 10.5), ("prefill", 10.5, 10.75), ("decode", 10.75, 12.0)]


def test_a_request_that_ended_early_has_the_phases_it_reached_up_to_its_end():
    waited = RequestTimings(arrival=10.0, first_scheduled=None, first_token=None, last_token=None)
    assert phases(waited, ended=11.0) == [("queue", 10.0, 11.0)]
    computing = RequestTimings(arrival=10.0, first_scheduled=10.5, first_token=None, last_token=None)
    assert phases(computing, ended=11.0) == [("queue", 10.0, 10.5), ("prefill", 10.5, 11.0)]
