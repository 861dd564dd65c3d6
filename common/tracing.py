"""OpenTelemetry plumbing that the gateway and the engine share: a tracer provider for an exporter name, the W3C
`traceparent` read and written, and instants of a process clock as the epoch nanoseconds spans take.

Tracing is off by default, and off costs nothing: every opentelemetry import is inside a function here, and only a
process that turned tracing on calls them. The OTLP exporter is an optional package, imported only when chosen.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

EXPORTERS = ("none", "console", "otlp")
OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-http"
_OTLP_MODULE = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


class TracingUnavailable(ValueError):
    """The chosen exporter cannot run here: its message is the one line an operator needs."""


def exporter_error(exporter: str) -> str | None:
    """Why tracing to `exporter` cannot run in this process (an unknown name, a package not installed), or None."""
    if exporter not in EXPORTERS:
        return f"tracing exporter: expected none, console or otlp, got {exporter!r}"
    if not _importable("opentelemetry.sdk.trace"):
        return "tracing needs the package opentelemetry-sdk: pip install 'tokenweir[tracing]'"
    if exporter == "otlp" and not _importable(_OTLP_MODULE):
        return f"tracing exporter otlp needs the package {OTLP_PACKAGE}: pip install {OTLP_PACKAGE}"
    return None


def make_provider(service_name: str, exporter: str, endpoint: str | None = None) -> TracerProvider:
    """A tracer provider of its own (never the global one, which FastAPI and other libraries also read) whose spans
    go to `exporter`: "none" keeps them in the process (trace ids, and processors a caller adds), "console" prints
    them, "otlp" sends them over OTLP/HTTP to `endpoint` (None: the OTEL_EXPORTER_OTLP_* env, else localhost:4318)."""
    if (error := exporter_error(exporter)) is not None:
        raise TracingUnavailable(error)
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    # Batched: exporting runs on the processor's thread, never on the event loop that serves requests.
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        otlp = importlib.import_module(_OTLP_MODULE)
        provider.add_span_processor(BatchSpanProcessor(otlp.OTLPSpanExporter(endpoint=endpoint)))
    return provider


def parent_context(traceparent: str | None) -> Context | None:
    """The remote parent a W3C `traceparent` header names; None without one (a malformed one starts a new trace)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def traceparent_of(span: Span) -> str:
    """The W3C `traceparent` that makes `span` the parent of the receiver's spans."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def trace_id_of(span: Span) -> str:
    """The span's trace id as W3C writes it: 32 lowercase hex characters."""
    return f"{span.get_span_context().trace_id:032x}"


def epoch_ns(clock: Callable[[], float]) -> Callable[[float], int]:
    """Instants of `clock` (time.perf_counter, time.monotonic: seconds from any origin; requests record their times
    on such clocks, which never jump) -> nanoseconds since the epoch, what spans are stamped with. One reading of
    both clocks for all the instants given to it: spans converted together keep their order exactly."""
    now, now_ns = clock(), time.time_ns()
    return lambda instant: now_ns - int((now - instant) * 1e9)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False
