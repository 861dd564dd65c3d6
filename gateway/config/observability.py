"""What the gateway writes down: its events (`events:`) and its traces (`tracing:`)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenweir.common.tracing import EXPORTERS, exporter_error
from tokenweir.gateway.config.base import STRICT


@dataclass
class EventsConfig:
    path: str = "./data/events.jsonl"
    max_bytes: int = 64 * 1024 * 1024
    backups: int = 5
    flush_interval_s: float = 0.5  # lines are written at once; this is how often they are fsynced
    # Whose events these are, for the usage watermark (default host:absolute path): unique per gateway process.
    writer_id: str | None = None

    __pydantic_config__ = STRICT


@dataclass
class TracingConfig:
    """OpenTelemetry traces of admitted requests (gateway/request/tracing.py), continuing a W3C `traceparent` the
    client sent and passing one to each upstream hop; the trace id goes into the request's event. Off: tokenweir
    imports nothing of opentelemetry."""

    enabled: bool = False
    service_name: str = "tokenweir-gateway"
    # none: spans made (trace ids in events) but not exported; console: printed; otlp: OTLP/HTTP to `endpoint`
    # (needs the opentelemetry-exporter-otlp-proto-http package; null endpoint: the OTEL_EXPORTER_OTLP_* env)
    exporter: str = "none"
    endpoint: str | None = None

    __pydantic_config__ = STRICT

    def __post_init__(self) -> None:
        # The name is checked always; the exporter's package when tracing is on, at load: a missing one stops the
        # start with one line (the OTLP exporter is an optional package)
        checked = self.enabled or self.exporter not in EXPORTERS
        if checked and (error := exporter_error(self.exporter)) is not None:
            raise ValueError(f"tracing: {error}")
