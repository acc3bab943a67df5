"""Generates the Grafana dashboards shipped in deploy/helm/etude/dashboards/.

One dashboard per service plus an overview, arranged from the panels in
tools/chart_panels.py and tools/chart_rl_panels.py, built from the metrics the services
export (tests/test_chart_metrics.py scrapes running services and fails on a name they do
not export). Every query filters on the `namespace` and `release` labels the chart's
ServiceMonitors add, chosen with dashboard variables.

    python tools/chart_dashboards.py           # rewrite the JSON files
    python tools/chart_dashboards.py --check   # fail when they are not current (make chart)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from chart_panels import (
    GRPC_SERVICES,
    RATE,
    SEL,
    SERVER_ERRORS,
    Panel,
    grpc_panels,
    panel,
    readiness_panels,
    reconciler_state_panels,
    row,
    step_metric,
    tokens_per_second_panel,
    vllm_panels,
)
from chart_rl_panels import (
    TRAINER_NOTE,
    envs_panels,
    envs_reward_panel,
    evals_panels,
    inference_update_panels,
    pass_at_1_panel,
    publish_lag_panel,
    trainer_panels,
    trainer_step_panels,
    update_lag_panel,
    update_pause_panel,
    versions_panel,
    weight_bytes_panels,
    weight_failures_panel,
)

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS = REPO / "deploy" / "helm" / "etude" / "dashboards"


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
        row("Reward and evals"),
        panel(
            "Reward of trained rollouts by part (mean)",
            [step_metric("reward_.*_mean")],
            description=TRAINER_NOTE,
        ),
        pass_at_1_panel(),
        envs_reward_panel(),
        row("Rollouts and groups"),
        *reconciler_state_panels(),
        row("Training"),
        *trainer_step_panels(),
        row("Generation"),
        tokens_per_second_panel(),
        vllm_panels()[1],
        row("Weight sync"),
        versions_panel(),
        publish_lag_panel(),
        *weight_bytes_panels(),
        update_pause_panel(),
        update_lag_panel(),
        weight_failures_panel(),
    ]


def service_dashboard(service: str) -> list[Panel]:
    panels: list[Panel] = [row("Readiness"), *readiness_panels(service)]
    if service == "reconciler":
        panels += [row("Slots and groups"), *reconciler_state_panels()]
    if service == "inference":
        panels += [row("vLLM"), *vllm_panels(), row("Weight updates")]
        panels += inference_update_panels()
    if service == "trainer":
        panels += trainer_panels()
    if service == "evals":
        panels += evals_panels()
    if service == "envs":
        panels += envs_panels()
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
