"""Every metric the chart's dashboards, alerts and KEDA trigger use is exported by a
running service: scrapes the five real services (the session's `deployment`)."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from services.config import SERVICE_NAMES
from tests.conftest import Deployment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import chart_check

chart_check.require_tools()

# Labels Prometheus adds when it scrapes (the chart's ServiceMonitors add release and
# component); `le` belongs to histogram buckets.
TARGET_LABELS = {"namespace", "release", "component", "pod", "instance", "job", "le"}
# Series Prometheus makes itself for every target (the pod-down alerts watch them).
PROMETHEUS_SERIES = {"up"}
SUFFIXES = {
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "counter": ("",),
    "gauge": ("",),
    "untyped": ("",),
    "info": ("",),
}


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text: str = response.read().decode()
    return text


def exported(text: str) -> dict[str, set[str]]:
    """{series name: label names seen} from an exposition: declared families and samples."""
    series: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            for suffix in SUFFIXES[kind]:
                series.setdefault(name + suffix, set())
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            name = name.split(" ")[0]
            labels = series.setdefault(name, set())
            if rest:
                body = rest.rsplit("}", 1)[0]
                labels.update(part.split("=", 1)[0].strip() for part in body.split('",') if part)
    return series


def touch_every_service(deployment: Deployment) -> None:
    """One call to each service, so the labelled gRPC series have samples."""
    for service in SERVICE_NAMES:
        with grpc.insecure_channel(deployment.target(service)) as channel:
            method = channel.unary_unary("/grpc.health.v1.Health/Check")
            method(b"", timeout=5)


@pytest.mark.integration
def test_every_metric_in_dashboards_and_alerts_is_exported(deployment: Deployment) -> None:
    touch_every_service(deployment)
    series: dict[str, set[str]] = {}
    for service in SERVICE_NAMES:
        for name, labels in exported(scrape(deployment.http(service))).items():
            series.setdefault(name, set()).update(labels)

    used = chart_check.referenced_metrics()
    assert len(used) >= 20
    missing = {
        name: where
        for name, where in used.items()
        if name not in series and name not in PROMETHEUS_SERIES
    }
    assert not missing, f"used in the chart but exported by no service: {missing}"

    # The labels the queries filter or group on exist on those series.
    wrong = []
    for where, expr in chart_check.referenced_queries():
        for metric, label, _, _ in chart_check.label_matchers(expr):
            if metric in PROMETHEUS_SERIES and label in TARGET_LABELS:
                continue
            if metric is None or label in TARGET_LABELS or label == "__name__":
                continue
            if series[metric] and label not in series[metric]:
                wrong.append(f"{where}: {metric} has no label {label!r} ({sorted(series[metric])})")
    assert not wrong, "\n".join(wrong)


def test_exposition_parser_reads_families_and_labels() -> None:
    text = (
        "# TYPE a_seconds histogram\n"
        'a_seconds_bucket{le="1.0",method="X"} 0.0\n'
        "# TYPE b_total counter\n"
        'c{state="PENDING"} 1.0\n'
    )
    series = exported(text)
    assert series["a_seconds_bucket"] == {"le", "method"}
    assert "a_seconds_count" in series and "b_total" in series
    assert series["c"] == {"state"}
