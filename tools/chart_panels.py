"""Grafana panel primitives and the panels of the services' plumbing: readiness, gRPC,
the reconciler's state and vLLM (tools/chart_dashboards.py arranges them into
dashboards; tools/chart_rl_panels.py holds the panels of the RL loop).

Every query filters on the `namespace` and `release` labels the chart's ServiceMonitors
add. How each source aggregates across pods:

* the reconciler's state metrics are a snapshot of Redis that every replica exports:
  `max`, never `sum`;
* the trainer's step metrics are reduced over every rank before they are exported, so
  every trainer pod shows the same figure: `avg`;
* the evals gauges hold the newest scored version of a suite: `max`;
* counters and histograms of envs, inference and the weight exchange add up over pods.
"""

from __future__ import annotations

from typing import Any

Panel = dict[str, Any]

SEL = 'namespace="$namespace", release="$release"'
GRPC_SERVICES = {
    "reconciler": "etude.v1.ReconcilerService",
    "envs": "etude.v1.EnvService",
    "inference": "etude.v1.InferenceService",
    "trainer": "etude.v1.TrainerService",
    "evals": "etude.v1.EvalsService",
}
# The services each service probes over gRPC health (the `dependencies` of its service
# class; tests/test_chart.py holds them equal). Only they export etude_dependency_ready,
# so only their dashboards get a "Dependencies ready" panel.
GRPC_DEPENDENCIES = {
    "reconciler": (),
    "envs": ("reconciler", "inference"),
    "inference": (),
    "trainer": ("reconciler",),
    "evals": ("reconciler", "inference"),
}
# Calls the server failed (not the caller's mistakes such as INVALID_ARGUMENT).
SERVER_ERRORS = "INTERNAL|UNKNOWN|UNAVAILABLE|DATA_LOSS|DEADLINE_EXCEEDED"
RATE = "[$__rate_interval]"
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
    right_axis: str = "",
) -> Panel:
    """A panel; its position is set when the dashboard is laid out. Series whose legend
    ends with `right_axis` are drawn against a second axis on the right, as plain numbers."""
    custom: dict[str, Any] = {}
    if kind == "timeseries":
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
        if stack:
            custom["stacking"] = {"mode": "normal", "group": "A"}
    overrides = []
    if right_axis:
        overrides.append(
            {
                "matcher": {"id": "byRegexp", "options": f".*{right_axis}$"},
                "properties": [
                    {"id": "custom.axisPlacement", "value": "right"},
                    {"id": "unit", "value": "none"},
                    {"id": "decimals", "value": 0},
                    {"id": "custom.fillOpacity", "value": 0},
                ],
            }
        )
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": overrides},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
        "targets": [
            target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)
        ],
    }


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def quantiles(
    metric: str, by: str, selector: str, qs: tuple[float, ...], prefix: str = ""
) -> list[tuple[str, str]]:
    """One (query, legend) per quantile of a histogram, grouped by the label `by` if any."""
    grouping = f"{by}, le" if by else "le"
    legend_prefix = prefix + (f"{{{{{by}}}}} " if by else "")
    return [
        (
            f"histogram_quantile({q}, sum by ({grouping}) "
            f"(rate({metric}_bucket{{{selector}}}[$__rate_interval])))",
            f"{legend_prefix}p{round(q * 100)}",
        )
        for q in qs
    ]


def step_metric(names: str, legend: str = "{{name}}") -> tuple[str, str]:
    """The trainer's last-step scalars whose name matches the regex `names`."""
    return (f'avg by (name) (etude_trainer_step_metric{{name=~"{names}", {SEL}}})', legend)


def increase(metric: str, by: str, selector: str = SEL) -> str:
    """What a counter added per rate interval, summed over pods (grouped by `by` if any)."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (increase({metric}{{{selector}}}{RATE}))"


# -- every service -----------------------------------------------------------------


def readiness_panels(service: str) -> list[Panel]:
    panels = [
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
    ]
    if GRPC_DEPENDENCIES[service]:
        panels.append(
            panel(
                "Dependencies ready",
                [
                    (
                        f"min by (dependency) "
                        f'(etude_dependency_ready{{service="{service}", {SEL}}})',
                        "{{dependency}}",
                    )
                ],
                description="1 when every pod sees the dependency ready; 0 when any does not.",
            )
        )
    return panels


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


# -- reconciler --------------------------------------------------------------------


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


# -- inference ---------------------------------------------------------------------


def tokens_per_second_panel() -> Panel:
    return panel(
        "Tokens/s",
        [
            (f"sum(rate(vllm:generation_tokens_total{{{SEL}}}[$__rate_interval]))", "generated"),
            (f"sum(rate(vllm:prompt_tokens_total{{{SEL}}}[$__rate_interval]))", "prompt"),
            (
                f'avg(etude_trainer_step_metric{{name="tokens_per_s", {SEL}}})',
                "trained (last step)",
            ),
        ],
        description="Generated and prompt tokens over every inference replica; the tokens "
        "the trainer's last step went through per second of compute.",
    )


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
