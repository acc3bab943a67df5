"""Generates the Grafana dashboards shipped in deploy/helm/etude/dashboards/.

One dashboard per service plus an overview, built from the metrics the services
export today (tests/test_chart_metrics.py scrapes running services and fails on a
name they do not export). Every query filters on the `namespace` and `release`
labels the chart's ServiceMonitors add, chosen with dashboard variables.

    python tools/chart_dashboards.py           # rewrite the JSON files
    python tools/chart_dashboards.py --check   # fail when they are not current (make chart)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS = REPO / "deploy" / "helm" / "etude" / "dashboards"

Panel = dict[str, Any]

SEL = 'namespace="$namespace", release="$release"'
GRPC_SERVICES = {
    "reconciler": "etude.v1.ReconcilerService",
    "envs": "etude.v1.EnvService",
    "inference": "etude.v1.InferenceService",
    "trainer": "etude.v1.TrainerService",
    "evals": "etude.v1.EvalsService",
}
# Calls the server failed (not the caller's mistakes such as INVALID_ARGUMENT).
SERVER_ERRORS = "INTERNAL|UNKNOWN|UNAVAILABLE|DATA_LOSS|DEADLINE_EXCEEDED"
RATE = "[$__rate_interval]"
# Each state metric of the reconciler is a snapshot of Redis that every replica exports.
RECONCILER_NOTE = "A snapshot of Redis exported by every reconciler replica: aggregated with max."


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "expr": expr,
        "legendFormat": legend,
        "refId": ref,
    }


def panel(
    title: str,
    targets: list[tuple[str, str]],
    *,
    unit: str = "short",
    kind: str = "timeseries",
    description: str = "",
    stack: bool = False,
) -> Panel:
    """A panel; its position is set when the dashboard is laid out."""
    custom: dict[str, Any] = {}
    if kind == "timeseries":
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
        if stack:
            custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
        "targets": [
            target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)
        ],
    }


def text(title: str, content: str) -> Panel:
    return {"type": "text", "title": title, "options": {"mode": "markdown", "content": content}}


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def quantiles(metric: str, by: str, selector: str, qs: tuple[float, ...]) -> list[tuple[str, str]]:
    grouping = f"{by}, le" if by else "le"
    legend_prefix = f"{{{{{by}}}}} " if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({grouping}) "
            f"(rate({metric}_bucket{{{selector}}}[$__rate_interval])))",
            f"{legend_prefix}p{round(q * 100)}",
        )
        for q in qs
    ]


# -- panels shared by dashboards ---------------------------------------------------


def readiness_panels(service: str) -> list[Panel]:
    return [
        panel(
            "Ready pods",
            [(f'sum(etude_service_ready{{service="{service}", {SEL}}})', "ready")],
            kind="stat",
            description="Pods whose readiness (gRPC health 'readiness') is SERVING.",
        ),
        panel(
            "Not ready pods",
            [(f'count(etude_service_ready{{service="{service}", {SEL}}} == 0) or vector(0)', "")],
            kind="stat",
        ),
        panel(
            "Dependencies ready",
            [
                (
                    f'min by (dependency) (etude_dependency_ready{{service="{service}", {SEL}}})',
                    "{{dependency}}",
                )
            ],
            description="1 when every pod sees the dependency ready; 0 when any does not.",
        ),
    ]


def grpc_panels(service: str) -> list[Panel]:
    grpc = f'grpc_service="{GRPC_SERVICES[service]}", {SEL}'
    return [
        row("gRPC"),
        panel(
            "Calls/s by method",
            [
                (
                    f"sum by (grpc_method) (rate(grpc_server_handled_total{{{grpc}}}{RATE}))",
                    "{{grpc_method}}",
                )
            ],
            unit="reqps",
        ),
        panel(
            "Failed calls/s by code",
            [
                (
                    f"sum by (grpc_method, grpc_code) "
                    f'(rate(grpc_server_handled_total{{grpc_code!="OK", {grpc}}}{RATE}))',
                    "{{grpc_method}} {{grpc_code}}",
                )
            ],
            unit="reqps",
        ),
        panel(
            "Latency by method",
            quantiles("grpc_server_handling_seconds", "grpc_method", grpc, (0.5, 0.99)),
            unit="s",
        ),
        panel(
            "Calls in flight (started - handled)",
            [
                (
                    f"sum(grpc_server_started_total{{{grpc}}})"
                    f" - sum(grpc_server_handled_total{{{grpc}}})",
                    "in flight",
                )
            ],
            description="Streams such as WatchGroups stay in flight for their whole life.",
        ),
    ]


def reconciler_state_panels() -> list[Panel]:
    return [
        panel(
            "Groups by state",
            [(f"max by (state) (etude_reconciler_groups{{{SEL}}})", "{{state}}")],
            description=RECONCILER_NOTE,
        ),
        panel(
            "Slots by state",
            [(f"max by (state) (etude_reconciler_slots{{{SEL}}})", "{{state}}")],
            description=RECONCILER_NOTE,
        ),
        panel(
            "Policy version",
            [(f"max(etude_reconciler_policy_version{{{SEL}}})", "version")],
            kind="stat",
        ),
        panel(
            "Groups committed/s (training progress)",
            [
                (
                    f'max(deriv(etude_reconciler_groups{{state="COMMITTED", {SEL}}}{RATE}))',
                    "committed/s",
                )
            ],
            unit="ops",
        ),
        panel(
            "Staleness of pulled groups (policy versions)",
            quantiles("etude_reconciler_staleness_versions", "", SEL, (0.5, 0.9, 0.99)),
            description="Versions between a group's start and the trainer step that pulled it.",
        ),
        panel(
            "Stale groups by action",
            [
                (
                    f"max by (action) (increase(etude_reconciler_stale_groups_total{{{SEL}}}"
                    "[$__rate_interval]))",
                    "{{action}}",
                )
            ],
        ),
        panel(
            "Lease expiries and rejected completions",
            [
                (
                    f"max(increase(etude_reconciler_lease_expiries_total{{{SEL}}}[$__rate_interval]))",
                    "lease expiries",
                ),
                (
                    f"max(increase(etude_reconciler_rejected_completions_total{{{SEL}}}"
                    "[$__rate_interval]))",
                    "rejected completions",
                ),
            ],
        ),
        panel(
            "Dead slots by reason",
            [
                (
                    f"max by (reason) (increase(etude_reconciler_dead_slots_total{{{SEL}}}"
                    "[$__rate_interval]))",
                    "{{reason}}",
                )
            ],
        ),
        panel(
            "Group latency (submission to ready)",
            quantiles("etude_reconciler_group_latency_seconds", "", SEL, (0.5, 0.9, 0.99)),
            unit="s",
        ),
    ]


def vllm_panels() -> list[Panel]:
    return [
        panel(
            "Tokens/s",
            [
                (
                    f"sum(rate(vllm:generation_tokens_total{{{SEL}}}[$__rate_interval]))",
                    "generated",
                ),
                (f"sum(rate(vllm:prompt_tokens_total{{{SEL}}}[$__rate_interval]))", "prompt"),
            ],
            unit="short",
        ),
        panel(
            "Requests running and waiting",
            [
                (f"sum(vllm:num_requests_running{{{SEL}}})", "running"),
                (f"sum(vllm:num_requests_waiting{{{SEL}}})", "waiting"),
            ],
        ),
        panel(
            "KV cache usage",
            [(f"max by (pod) (vllm:kv_cache_usage_perc{{{SEL}}})", "{{pod}}")],
            unit="percentunit",
        ),
        panel(
            "Time to first token",
            quantiles("vllm:time_to_first_token_seconds", "", SEL, (0.5, 0.99)),
            unit="s",
        ),
        panel(
            "Inter-token latency",
            quantiles("vllm:inter_token_latency_seconds", "", SEL, (0.5, 0.99)),
            unit="s",
        ),
        panel(
            "Request latency (end to end)",
            quantiles("vllm:e2e_request_latency_seconds", "", SEL, (0.5, 0.99)),
            unit="s",
        ),
        panel(
            "Finished requests/s by reason",
            [
                (
                    f"sum by (finished_reason) (rate(vllm:request_success_total{{{SEL}}}"
                    "[$__rate_interval]))",
                    "{{finished_reason}}",
                )
            ],
            unit="reqps",
        ),
        panel(
            "Preemptions/s",
            [(f"sum(rate(vllm:num_preemptions_total{{{SEL}}}[$__rate_interval]))", "preemptions")],
        ),
    ]


# -- dashboards --------------------------------------------------------------------


def pending(what: str) -> Panel:
    return text(
        "Arriving later",
        f"{what} These panels are added when the services export the metrics "
        "(the chart ships only dashboards for metrics that exist).",
    )


def overview() -> list[Panel]:
    return [
        row("Services"),
        panel(
            "Ready pods by service",
            [(f"sum by (service) (etude_service_ready{{{SEL}}})", "{{service}}")],
        ),
        panel(
            "gRPC calls/s by service",
            [
                (
                    "sum by (grpc_service) (rate(grpc_server_handled_total"
                    f'{{grpc_service=~"etude.v1.*", {SEL}}}{RATE}))',
                    "{{grpc_service}}",
                )
            ],
            unit="reqps",
        ),
        panel(
            "gRPC server failures by service",
            [
                (
                    f"sum by (grpc_service) (rate(grpc_server_handled_total"
                    f'{{grpc_code=~"{SERVER_ERRORS}", {SEL}}}[$__rate_interval])) / '
                    f"sum by (grpc_service) (rate(grpc_server_handled_total{{{SEL}}}{RATE}))",
                    "{{grpc_service}}",
                )
            ],
            unit="percentunit",
        ),
        row("Rollouts and training"),
        *reconciler_state_panels(),
        row("Generation"),
        *vllm_panels()[:2],
        pending(
            "Reward, pass@1 by policy version, trainer tokens/s, weight-sync bytes and lag, "
            "and inference update pauses are not exported yet."
        ),
    ]


def service_dashboard(service: str) -> list[Panel]:
    panels: list[Panel] = [row("Readiness"), *readiness_panels(service)]
    if service == "reconciler":
        panels += [row("Slots and groups"), *reconciler_state_panels()]
    if service == "inference":
        panels += [row("vLLM"), *vllm_panels()]
        panels.append(pending("Weight updates (pauses, load time, failures) are not exported yet."))
    if service == "trainer":
        panels.append(
            pending("Loss, reward, tokens/s, step time and weight publishing are not exported yet.")
        )
    if service == "evals":
        panels.append(pending("pass@1, pass@k and reward by policy version are not exported yet."))
    if service == "envs":
        panels.append(pending("Rollouts, sandbox and grading metrics are not exported yet."))
    return panels + grpc_panels(service)


def layout(panels: list[Panel]) -> list[Panel]:
    """Two panels per row of the grid (rows and text panels span it), ids in order."""
    x = y = 0
    for index, item in enumerate(panels, start=1):
        item["id"] = index
        full = item["type"] in ("row", "text")
        width = 24 if full else 12
        height = 1 if item["type"] == "row" else (4 if item["type"] == "text" else 8)
        if item["type"] == "stat":
            width, height = 6, 4
        if x + width > 24 or full:
            if x:
                y += 8
            x = 0
        item["gridPos"] = {"h": height, "w": width, "x": x, "y": y}
        x += width
        if full or x >= 24:
            y += height
            x = 0
    return panels


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"{name}-query"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "includeAll": False,
        "multi": False,
    }


def dashboard(uid: str, title: str, panels: list[Panel]) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "tags": ["etude"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "graphTooltip": 1,
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["etude"], "asDropdown": True, "title": "Etude"}],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                },
                variable("namespace", "Namespace", "label_values(etude_service_ready, namespace)"),
                variable(
                    "release",
                    "Release",
                    'label_values(etude_service_ready{namespace="$namespace"}, release)',
                ),
            ]
        },
        "panels": layout(panels),
    }


def build() -> dict[str, dict[str, Any]]:
    """{file name: dashboard}."""
    boards = {"overview.json": dashboard("etude-overview", "Etude / Overview", overview())}
    for service in GRPC_SERVICES:
        boards[f"{service}.json"] = dashboard(
            f"etude-{service}", f"Etude / {service.capitalize()}", service_dashboard(service)
        )
    return boards


def render(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2) + "\n"


def check() -> list[str]:
    problems = []
    expected = build()
    present = {path.name for path in DASHBOARDS.glob("*.json")}
    for name in sorted(present - set(expected)):
        problems.append(f"dashboards/{name} is not generated by tools/chart_dashboards.py")
    for name, board in expected.items():
        path = DASHBOARDS / name
        if not path.exists() or path.read_text() != render(board):
            problems.append(
                f"deploy/helm/etude/dashboards/{name} is not current: "
                "run python tools/chart_dashboards.py"
            )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when a dashboard is stale")
    args = parser.parse_args()
    if args.check:
        problems = check()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    DASHBOARDS.mkdir(parents=True, exist_ok=True)
    for name, board in build().items():
        (DASHBOARDS / name).write_text(render(board))
        print(f"wrote {(DASHBOARDS / name).relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
