"""Proves the Helm chart offline with real tools (`make chart`).

* the schema and dashboards are current (tools/chart_schema.py, tools/chart_dashboards.py)
  and every value in values.yaml is documented;
* `helm lint --strict` (Helm's Go library through helm-python-sdk) for the default values
  and every example values file;
* the chart renders for the default values, every examples/*.yaml and a few feature
  cases, and every rendered manifest validates strictly (unknown fields and wrong types
  fail): built-in kinds with kubernetes-validate against the pinned Kubernetes versions,
  the Prometheus Operator and KEDA kinds against models generated from their CRDs;
* the rendered run config loads with the services' own config model;
* the alert rules pass `promtool check rules` and the unit tests in ci/alerts.test.yaml
  (`promtool test rules`), and every PromQL expression of the dashboards and the KEDA
  trigger parses with promtool.

Which metric names the dashboards and alerts use is compared with what running services
export in tests/test_chart_metrics.py (it needs the services up).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "etude"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
ALERT_TESTS = CHART / "ci" / "alerts.test.yaml"

# The chart's floor (Chart.yaml kubeVersion) and the newest Kubernetes that the pinned
# kubernetes-validate (1.37.0) ships schemas for. Both are checked, offline.
KUBE_VERSIONS = ("1.30.0", "1.37.0")
RELEASE = "etude"
NAMESPACE = "etude"

# Feature cases rendered besides the defaults and the examples.
FEATURE_CASES: dict[str, dict[str, Any]] = {
    "monitoring": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "additionalLabels": {"release": "prom"}},
            "prometheusRule": {"enabled": True, "alertLabels": {"team": "ml"}},
            "dashboards": {"enabled": True},
        },
        "envs": {"keda": {"enabled": True}},
    },
    "tls": {"tls": {"enabled": True, "secretName": "etude-grpc-tls"}},
    "hpa": {"envs": {"autoscaling": {"enabled": True}, "replicas": 5}},
    "redis-url": {"redis": {"bundled": False, "external": {"url": "redis://redis.db:6379/0"}}},
    # The two ways to run the envs sandbox in a pod (docs/deploy.md, Sandboxes).
    "sandbox-pod": {
        "envs": {
            "runtimeClassName": "gvisor",
            "podSecurityContext": {"runAsUser": 0, "runAsNonRoot": False},
            "securityContext": {
                "capabilities": {
                    "add": ["SETUID", "SETGID", "CHOWN", "FOWNER", "DAC_OVERRIDE", "KILL"]
                }
            },
        },
        "config": {"envs": {"sandbox": {"backend": "pod"}}},
    },
    "sandbox-bubblewrap": {
        "envs": {
            "podSecurityContext": {"seccompProfile": {"type": "Unconfined"}},
            "securityContext": {"seccompProfile": {"type": "Unconfined"}},
        },
    },
    "cpu-demo": {
        "objectStore": {"url": "file:///var/lib/etude-store", "fileClaim": "etude-store"},
        "model": {"initPreset": "tiny"},
        "inference": {"gpus": 0},
        "trainer": {"gpus": 0, "torchrun": {"maxNodes": 2}},
        "config": {"inference": {"engine": {"dtype": "float32", "enforce_eager": True}}},
    },
}

TOOLS_HELP = (
    "install the chart tools into the venv: .venv/bin/pip install 'helm-python-sdk==0.2.2' "
    "'kubernetes-validate==1.37.0' 'promql-parser==0.11.0' 'cloudcoil==0.6.0' "
    "'cloudcoil-models-prometheus-operator==0.80.1.0' 'cloudcoil-models-keda==2.16.1.0'; "
    "promtool: apt-get install prometheus"
)


class ToolMissing(RuntimeError):
    """A tool the chart checks need is not installed."""


def require_tools() -> None:
    """Raises ToolMissing naming what to install; the checks never skip."""
    missing = []
    for module in (
        "helm_python",
        "kubernetes_validate",
        "promql_parser",
        "cloudcoil.models.prometheus_operator.v1",
        "cloudcoil.models.keda.v1alpha1",
    ):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if shutil.which("promtool") is None:
        missing.append("promtool")
    if missing:
        raise ToolMissing(f"missing: {', '.join(missing)}; {TOOLS_HELP}")


# -- rendering ---------------------------------------------------------------------


@functools.cache
def _chart() -> Any:
    import helm_python

    return helm_python.Chart.load(str(CHART))


def load_values(path: Path) -> dict[str, Any]:
    """A values file as Helm reads it."""
    import helm_python

    values: dict[str, Any] = helm_python.values_from_yaml(path.read_text())
    return values


def cases() -> dict[str, dict[str, Any]]:
    """{case name: values}: the defaults, every example file, the feature cases."""
    found: dict[str, dict[str, Any]] = {"default": {}}
    for path in EXAMPLES:
        found[f"examples/{path.name}"] = load_values(path)
    found.update(FEATURE_CASES)
    return found


def render(
    values: dict[str, Any], *, name: str = RELEASE, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    """Every manifest the chart renders for `values` (raises on schema or template errors)."""
    rendered = _chart().render(values, name=name, namespace=namespace, is_install=True)
    manifests = []
    for template, text in sorted(rendered.items()):
        if template.endswith("NOTES.txt"):
            continue
        for document in yaml.safe_load_all(text):
            if document:
                document.setdefault("metadata", {})
                manifests.append(document)
    return manifests


def ident(manifest: dict[str, Any]) -> str:
    return f"{manifest.get('kind')}/{manifest.get('metadata', {}).get('name')}"


def find(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The manifest of `kind` named `name`."""
    for manifest in manifests:
        if manifest["kind"] == kind and manifest["metadata"]["name"] == name:
            return manifest
    raise KeyError(f"{kind}/{name} not rendered; have {sorted(map(ident, manifests))}")


def lint(values: dict[str, Any]) -> list[str]:
    """helm lint --strict findings (warnings and errors)."""
    import helm_python

    report = helm_python.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
    problems = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
    return problems + list(report.get("errors") or [])


# -- manifest validation -----------------------------------------------------------


def _custom_resource_models() -> dict[tuple[str, str], Any]:
    from cloudcoil.models.keda.v1alpha1 import ScaledObject
    from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor

    return {
        ("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
        ("monitoring.coreos.com/v1", "PrometheusRule"): PrometheusRule,
        ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
    }


def _unknown_keys(given: Any, kept: Any, path: str) -> Iterator[str]:
    """Keys in `given` that the model dropped: fields the CRD does not have."""
    if isinstance(given, dict) and isinstance(kept, dict):
        for key, value in given.items():
            if key not in kept:
                yield f"{path}.{key}".lstrip(".")
            else:
                yield from _unknown_keys(value, kept[key], f"{path}.{key}")
    elif isinstance(given, list) and isinstance(kept, list):
        for index, (value, kept_value) in enumerate(zip(given, kept, strict=False)):
            yield from _unknown_keys(value, kept_value, f"{path}[{index}]")


def validate_custom_resource(manifest: dict[str, Any]) -> list[str]:
    """Strict validation of a CRD kind with models generated from the CRD's schema."""
    from pydantic import ValidationError

    model = _custom_resource_models().get((manifest.get("apiVersion", ""), manifest["kind"]))
    if model is None:
        return [f"{ident(manifest)}: no schema for {manifest.get('apiVersion')} {manifest['kind']}"]
    try:
        parsed = model.model_validate(manifest)
    except ValidationError as error:
        return [f"{ident(manifest)}: {error}"]
    kept = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    # Labels and annotations are free-form maps; the model keeps them as given.
    return [
        f"{ident(manifest)}: unknown field {path}"
        for path in _unknown_keys(manifest, kept, "")
        if not path.startswith("metadata.")
    ]


def validate_manifest(manifest: dict[str, Any], kube_version: str) -> list[str]:
    """Problems of one rendered manifest (empty when it validates strictly)."""
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    try:
        kubernetes_validate.validate(manifest, kube_version, strict=True)
    except kubernetes_validate.ValidationError as error:
        where = ".".join(str(part) for part in error.path)
        return [f"{ident(manifest)} (Kubernetes {kube_version}): {where}: {error.message}"]
    except SchemaNotFoundError:
        return validate_custom_resource(manifest)
    return []


def config_problems(manifests: list[dict[str, Any]], release: str = RELEASE) -> list[str]:
    """The rendered config.toml must load with the services' config model."""
    from pydantic import ValidationError

    sys.path.insert(0, str(REPO))
    from services.config.deployment import load_config

    configmaps = [
        m for m in manifests if m["kind"] == "ConfigMap" and "config.toml" in m.get("data", {})
    ]
    if len(configmaps) != 1:
        return [f"expected one ConfigMap with config.toml, found {len(configmaps)}"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(configmaps[0]["data"]["config.toml"])
        # What the pods add from Secrets.
        environ = {"ETUDE_AUTH__TOKEN": "from-the-secret"}
        try:
            load_config(path, environ=environ)
        except (ValidationError, ValueError) as error:
            return [f"config.toml does not load: {error}"]
    return []


def manifest_problems(manifests: list[dict[str, Any]]) -> list[str]:
    problems = []
    for manifest in manifests:
        for version in KUBE_VERSIONS:
            problems += validate_manifest(manifest, version)
    return problems + config_problems(manifests)


# -- PromQL: alerts, dashboards, KEDA ------------------------------------------------

# Grafana variables, replaced by sample values before parsing.
_GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$namespace": NAMESPACE,
    "$release": RELEASE,
}
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def grafana_to_promql(expr: str) -> str:
    """A dashboard query as Prometheus would receive it."""
    for variable, value in _GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    match = _LABEL_VALUES.match(expr)
    return match["selector"] if match else expr


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every query of every shipped dashboard, variables included."""
    queries = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                queries.append(
                    (f"{path.name} ${variable['name']}", grafana_to_promql(variable["definition"]))
                )
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                where = f"{path.name} '{panel['title']}' {target['refId']}"
                queries.append((where, grafana_to_promql(target["expr"])))
    return queries


def alert_rules(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rule groups of the rendered PrometheusRules."""
    groups = []
    for manifest in manifests:
        if manifest["kind"] == "PrometheusRule":
            groups += manifest["spec"]["groups"]
    return groups


def keda_queries(manifests: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [
        (f"{ident(m)} trigger {i}", trigger["metadata"]["query"])
        for m in manifests
        if m["kind"] == "ScaledObject"
        for i, trigger in enumerate(m["spec"]["triggers"])
        if trigger["type"] == "prometheus"
    ]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, cwd=cwd, check=False, timeout=120
    )


def check_rules(groups: list[dict[str, Any]]) -> list[str]:
    """`promtool check rules` on the rule groups."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rules.yaml"
        path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
        result = promtool("check", "rules", str(path))
    if result.returncode != 0:
        return [f"promtool check rules: {result.stdout}{result.stderr}".strip()]
    return []


def run_rule_tests(groups: list[dict[str, Any]]) -> tuple[list[str], str]:
    """`promtool test rules` with ci/alerts.test.yaml against the rendered rules."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
        shutil.copy(ALERT_TESTS, Path(tmp) / "alerts.test.yaml")
        result = promtool("test", "rules", "alerts.test.yaml", cwd=Path(tmp))
    output = f"{result.stdout}{result.stderr}".strip()
    return ([f"promtool test rules:\n{output}"] if result.returncode != 0 else []), output


def check_queries(queries: list[tuple[str, str]]) -> list[str]:
    """Parses every expression with Prometheus's own parser (as recording rules)."""
    rules = [
        {"record": f"etude:check:{index}", "expr": expr} for index, (_, expr) in enumerate(queries)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "queries.yaml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
        result = promtool("check", "rules", str(path))
    if result.returncode == 0:
        return []
    # Name the failing queries: promtool numbers the rules.
    output = f"{result.stdout}{result.stderr}"
    failing = [queries[int(n) - 1][0] for n in re.findall(r"rule (\d+)", output)]
    return [f"PromQL does not parse ({', '.join(failing) or 'see output'}): {output.strip()}"]


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (by name or by an exact __name__ matcher)."""
    import promql_parser

    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    names.add(matcher.value)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def label_matchers(expr: str) -> list[tuple[str | None, str, str, str]]:
    """(metric, label, operator, value) of every label matcher in an expression."""
    import promql_parser

    found: list[tuple[str | None, str, str, str]] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            for matcher in node.matchers.matchers:
                op = str(matcher.op).rsplit(".", 1)[-1]
                found.append((node.name, matcher.name, op, matcher.value))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def monitoring_manifests() -> list[dict[str, Any]]:
    """The render with every monitoring object on (alerts, ServiceMonitors, KEDA)."""
    return render(FEATURE_CASES["monitoring"])


def referenced_queries() -> list[tuple[str, str]]:
    """Every PromQL the chart ships: dashboards, alert rules, the KEDA trigger."""
    manifests = monitoring_manifests()
    queries = dashboard_queries() + keda_queries(manifests)
    for group in alert_rules(manifests):
        for rule in group["rules"]:
            queries.append((f"alert {rule['alert']}", rule["expr"]))
    return queries


def referenced_metrics() -> dict[str, list[str]]:
    """{metric name: where it is used} over dashboards, alerts and the KEDA trigger."""
    used: dict[str, list[str]] = {}
    for where, expr in referenced_queries():
        for name in metric_names(expr):
            used.setdefault(name, []).append(where)
    return used


# -- the whole check ---------------------------------------------------------------


def run_all(verbose: bool = True) -> list[str]:
    """Every check; returns the problems (empty when the chart is good)."""
    sys.path.insert(0, str(REPO / "tools"))
    import chart_dashboards
    import chart_schema

    def say(message: str) -> None:
        if verbose:
            print(message, flush=True)

    problems: list[str] = []
    started = time.monotonic()

    def verdict(found: list[str]) -> str:
        return "ok" if not found else "FAIL"

    found = chart_schema.check()
    say(f"schema: values.schema.json current, every value documented: {verdict(found)}")
    problems += found
    found = chart_dashboards.check()
    say(f"dashboards: generated JSON current: {verdict(found)}")
    problems += found

    all_cases = cases()
    for name, values in all_cases.items():
        if name == "default" or name.startswith("examples/"):
            found = [f"lint {name}: {p}" for p in lint(values)]
            problems += found
            say(f"helm lint --strict {name}: {verdict(found)}")
    num_manifests = 0
    for name, values in all_cases.items():
        try:
            manifests = render(values)
        except Exception as error:  # a render error is the finding
            problems.append(f"render {name}: {error}")
            say(f"render {name}: FAIL")
            continue
        found = [f"{name}: {p}" for p in manifest_problems(manifests)]
        problems += found
        num_manifests += len(manifests)
        say(
            f"render {name}: {len(manifests)} manifests, kubernetes-validate --strict "
            f"{' and '.join(KUBE_VERSIONS)}, CRDs, config.toml: {verdict(found)}"
        )

    manifests = monitoring_manifests()
    groups = alert_rules(manifests)
    found = check_rules(groups)
    problems += found
    num_rules = sum(len(group["rules"]) for group in groups)
    say(f"promtool check rules: {num_rules} alerts: {verdict(found)}")
    found, _ = run_rule_tests(groups)
    problems += found
    say(f"promtool test rules (ci/alerts.test.yaml): {verdict(found)}")
    queries = dashboard_queries() + keda_queries(manifests)
    found = check_queries(queries)
    problems += found
    say(f"PromQL of dashboards and KEDA: {len(queries)} queries parse: {verdict(found)}")
    say(
        f"{len(all_cases)} cases, {num_manifests} manifests, "
        f"{len(referenced_metrics())} metric names referenced, {time.monotonic() - started:.1f} s"
    )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quiet", action="store_true", help="print only problems")
    args = parser.parse_args()
    try:
        require_tools()
    except ToolMissing as error:
        print(f"make chart: {error}", file=sys.stderr)
        return 2
    problems = run_all(verbose=not args.quiet)
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if problems:
        print(f"chart check: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("chart check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
