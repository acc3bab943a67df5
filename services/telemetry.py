"""Logging and OpenTelemetry tracing set-up shared by every process.

Spans go where ``[telemetry] traces_exporter`` says: an OTLP/gRPC collector in a
cluster, stderr, or a JSON-lines file (what the tests read to follow one trace
across several service processes). gRPC calls propagate the W3C ``traceparent``
through the interceptors in ``services.wire``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from services.config import TelemetryConfig


class JsonFormatter(logging.Formatter):
    """One JSON object per log record, with the active trace id when there is one."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": record.created,
            "level": record.levelname,
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = f"{context.trace_id:032x}"
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(config: TelemetryConfig, service: str) -> None:
    """Root logger to stderr in the configured format and level; quiets chatty libraries."""
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.log_level)
    for noisy in ("uvicorn.access", "botocore", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line (trace/span/parent ids, name, attributes)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            context = span.get_span_context()
            assert context is not None
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "trace_id": f"{context.trace_id:032x}",
                        "span_id": f"{context.span_id:016x}",
                        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
                        "kind": span.kind.name,
                        "service": span.resource.attributes.get("service.name"),
                        "status": span.status.status_code.name,
                        "attributes": {k: str(v) for k, v in (span.attributes or {}).items()},
                        "start_ns": span.start_time,
                        "end_ns": span.end_time,
                    }
                )
            )
        with self._lock:
            self._file.write("".join(line + "\n" for line in lines))
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def configure_tracing(config: TelemetryConfig, service: str) -> TracerProvider:
    """Installs the global tracer provider for this process and returns it."""
    provider = TracerProvider(resource=Resource.create({"service.name": f"etude-{service}"}))
    if config.traces_exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(config.otlp_endpoint)))
    elif config.traces_exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    elif config.traces_exporter == "jsonl":
        assert config.traces_file is not None  # the config validator guarantees it
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(config.traces_file)))
    trace.set_tracer_provider(provider)
    return provider
