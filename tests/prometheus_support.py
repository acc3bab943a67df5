"""A real Prometheus (Debian's ``prometheus``) on an emulated cluster (tests/cluster_support.py),
configured from the release's ServiceMonitors and PrometheusRules as the Prometheus
Operator would configure it.

For each ServiceMonitor endpoint there is one scrape job
(``serviceMonitor/<namespace>/<name>/<i>``, the operator's name) whose targets are every
pod behind every Service the monitor selects (matchLabels and matchExpressions, in the
namespaces of its namespaceSelector), ready or not, at the container port the endpoint's
Service port targets. Each target carries the labels the operator's generated config gives
it (``job`` = the Service's name, ``namespace``, ``service``, ``pod``, ``container``,
``endpoint``) and the Service's and pod's labels as ``__meta_kubernetes_*`` labels, and
the monitor's own relabelings run on them in Prometheus itself. Targets are written to a
file_sd file that follows the pods as they come and go. The PrometheusRules' groups are
the rule file, evaluated every `evaluation_s`.

Not emulated: the operator's other CRDs (PodMonitor, Probe), TLS and authorization on
endpoints, sample limits, and its per-target relabelings for endpoint slices.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from services.wire.ports import free_port
from tests.cluster_support import Cluster, selects

_RELABEL_KEYS = {
    "sourceLabels": "source_labels",
    "targetLabel": "target_label",
    "separator": "separator",
    "regex": "regex",
    "replacement": "replacement",
    "action": "action",
    "modulus": "modulus",
}


def _meta(prefix: str, labels: dict[str, str]) -> dict[str, str]:
    return {f"{prefix}{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v for k, v in labels.items()}


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selects(selector.get("matchLabels") or {}, labels):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        present = key in labels
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def _container_port(pod_spec: dict[str, Any], target: str | int) -> tuple[str, int] | None:
    """(container name, port number) of the containerPort a Service's targetPort names."""
    for container in pod_spec["containers"]:
        for declared in container.get("ports", []):
            if target in (declared.get("name"), declared["containerPort"]):
                return container["name"], int(declared["containerPort"])
    return None


def _duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text).groups()  # type: ignore[union-attr]
    return float(number) * units[unit]


class Prometheus:
    """Scrapes `cluster` per the ServiceMonitors in `manifests`; evaluates their rules."""

    def __init__(
        self,
        cluster: Cluster,
        manifests: list[dict[str, Any]],
        root: Path,
        evaluation_s: float = 2.0,
    ) -> None:
        self.cluster, self.root = cluster, root
        self.monitors = [m for m in manifests if m["kind"] == "ServiceMonitor"]
        self.rules = [m for m in manifests if m["kind"] == "PrometheusRule"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.evaluation_s = evaluation_s
        self.scrape_s = min(
            (_duration_s(e["interval"]) for m in self.monitors for e in m["spec"]["endpoints"]),
            default=evaluation_s,
        )
        self._process: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._written: dict[str, str] = {}
        self._refresher = threading.Thread(target=self._refresh, daemon=True)

    # -- configuration ------------------------------------------------------------

    def _jobs(self) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
        """(job name, ServiceMonitor, endpoint) for every endpoint of every monitor."""
        jobs = []
        for monitor in self.monitors:
            meta = monitor["metadata"]
            for i, endpoint in enumerate(monitor["spec"]["endpoints"]):
                job = f"serviceMonitor/{meta['namespace']}/{meta['name']}/{i}"
                jobs.append((job, monitor, endpoint))
        return jobs

    def _targets(self, monitor: dict[str, Any], endpoint: dict[str, Any]) -> list[dict[str, Any]]:
        namespaces = monitor["spec"].get("namespaceSelector", {}).get("matchNames")
        if namespaces is not None and self.cluster.namespace not in namespaces:
            return []
        groups = []
        for name, service in self.cluster.services.items():
            labels = service["metadata"].get("labels", {})
            if not _matches(monitor["spec"]["selector"], labels):
                continue
            port = next(
                (p for p in service["spec"]["ports"] if p.get("name") == endpoint["port"]), None
            )
            if port is None:
                continue
            selector = service["spec"].get("selector") or {}
            target = port.get("targetPort", port["port"])
            for workload in self.cluster.workloads.values():
                found = _container_port(workload.manifest["spec"]["template"]["spec"], target)
                if found is None:
                    continue
                container, number = found
                for pod in [p for p in list(workload.pods) if selects(selector, p.labels)]:
                    labels_of_target = {
                        "job": name,
                        "namespace": self.cluster.namespace,
                        "service": name,
                        "pod": pod.name,
                        "container": container,
                        "endpoint": endpoint["port"],
                        **_meta("__meta_kubernetes_service_label_", labels),
                        **_meta("__meta_kubernetes_pod_label_", pod.labels),
                    }
                    groups.append({"targets": [f"{pod.ip}:{number}"], "labels": labels_of_target})
        return groups

    def _config(self) -> dict[str, Any]:
        scrape_configs = []
        for job, _, endpoint in self._jobs():
            relabels = [
                {_RELABEL_KEYS[k]: v for k, v in r.items()} for r in endpoint.get("relabelings", [])
            ]
            for relabel in relabels:
                relabel["action"] = relabel.get("action", "replace").lower()
            scrape_configs.append(
                {
                    "job_name": job,
                    "honor_labels": bool(endpoint.get("honorLabels", False)),
                    "metrics_path": endpoint.get("path", "/metrics"),
                    "scrape_interval": endpoint.get("interval", "30s"),
                    "scrape_timeout": endpoint.get("scrapeTimeout", "10s"),
                    "file_sd_configs": [{"files": [str(self._sd_file(job))]}],
                    "relabel_configs": relabels,
                }
            )
        return {
            "global": {"evaluation_interval": f"{self.evaluation_s:g}s"},
            "rule_files": [str(self.root / "rules.yaml")],
            "scrape_configs": scrape_configs,
        }

    def _sd_file(self, job: str) -> Path:
        return self.root / "sd" / (re.sub(r"[^a-zA-Z0-9]", "_", job) + ".json")

    def write_targets(self) -> None:
        """Writes each job's targets as the pods are now (atomically, only when changed)."""
        for job, monitor, endpoint in self._jobs():
            text = json.dumps(self._targets(monitor, endpoint), sort_keys=True)
            if self._written.get(job) == text:
                continue
            path = self._sd_file(job)
            scratch = path.with_suffix(".tmp")
            scratch.write_text(text)
            os.replace(scratch, path)
            self._written[job] = text

    def _refresh(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(Exception):  # a pod list changing under us: next turn
                self.write_targets()

    # -- running ------------------------------------------------------------------

    def start(self) -> None:
        (self.root / "sd").mkdir(parents=True, exist_ok=True)
        groups = [g for rule in self.rules for g in rule["spec"]["groups"]]
        (self.root / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
        (self.root / "prometheus.yml").write_text(yaml.safe_dump(self._config()))
        self.write_targets()
        with (self.root / "prometheus.log").open("wb") as log:
            self._process = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={self.root / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).close()
                break
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start:\n{self.log()}")
            time.sleep(0.2)
        self._refresher.start()

    def log(self) -> str:
        path = self.root / "prometheus.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def close(self) -> None:
        self._stop.set()
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the HTTP API -------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as answer:
            body = json.loads(answer.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) `expr` evaluates to now."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])

    def rule_states(self) -> list[dict[str, Any]]:
        """Every rule of every group with its health, last error and last evaluation."""
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]


def dashboard_queries(manifests: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(dashboard, panel title, PromQL) for every panel query of the dashboards the chart
    ships (its ConfigMaps for Grafana's dashboard sidecar)."""
    found = []

    def walk(dashboard: str, panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((dashboard, panel.get("title", "?"), target["expr"]))
            walk(dashboard, panel.get("panels", []))

    for manifest in manifests:
        if manifest["kind"] != "ConfigMap" or "grafana_dashboard" not in manifest["metadata"].get(
            "labels", {}
        ):
            continue
        for text in manifest.get("data", {}).values():
            dashboard = json.loads(text)
            walk(dashboard.get("title", manifest["metadata"]["name"]), dashboard.get("panels", []))
    return found


def as_grafana_sends(expr: str, namespace: str, release: str, rate_interval_s: float) -> str:
    """`expr` with the dashboards' variables filled in as Grafana would: the namespace and
    release chosen, ``$__rate_interval`` four scrape intervals."""
    for name, value in (
        ("__rate_interval", f"{rate_interval_s:g}s"),
        ("namespace", namespace),
        ("release", release),
    ):
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return expr
