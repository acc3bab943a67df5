"""Generates deploy/helm/etude/values.schema.json.

Types and constraints are declared here; descriptions come from the ``# --`` comments
above each key in values.yaml, so the schema and values.yaml cannot say different
things. The ``config`` key's schema is the services' own config model
(``services.config.deployment.EtudeConfig``) less the keys the chart sets itself. Every object
is closed (``additionalProperties: false``): an unknown key fails ``helm install`` with
the key named.

    python tools/chart_schema.py           # rewrite values.schema.json
    python tools/chart_schema.py --check   # fail when it is not current (make chart)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "etude"
SCHEMA_PATH = CHART / "values.schema.json"
COMPONENTS = ("reconciler", "envs", "inference", "trainer", "evals")

Schema = dict[str, Any]

# Keys of the run config the chart writes itself (addresses, listeners, secrets, paths):
# values.yaml may not set them under `config`, so nothing is overridden silently.
CHART_MANAGED_CONFIG = {
    "EtudeConfig": ("endpoints", "redis", "object_store", "auth", "launcher", "model"),
    "RunConfig": ("state_dir",),
    "EngineConfig": ("model_dir",),
    "GrpcServerConfig": ("port", "tls_cert_file", "tls_key_file"),
    "HttpServerConfig": ("port",),
    "TrainerConfig": ("checkpoint_dir",),
}


# -- small constructors ------------------------------------------------------------


def string(**constraints: Any) -> Schema:
    return {"type": "string", **constraints}


def integer(minimum: int | None = None, maximum: int | None = None) -> Schema:
    schema: Schema = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def number(**constraints: Any) -> Schema:
    return {"type": "number", **constraints}


def boolean() -> Schema:
    return {"type": "boolean"}


def obj(**properties: Schema) -> Schema:
    """A closed object: exactly these keys."""
    return {"type": "object", "additionalProperties": False, "properties": properties}


def free_object() -> Schema:
    """A Kubernetes object passed through as is (resources, affinity, a Volume source)."""
    return {"type": "object"}


def string_map() -> Schema:
    """Labels, annotations, selectors."""
    return {"type": "object", "additionalProperties": {"type": "string"}}


def array(items: Schema | None = None) -> Schema:
    return {"type": "array", "items": items or {"type": "object"}}


PORT = integer(1, 65535)
DURATION = string(pattern=r"^([0-9]+(ms|s|m|h|d|w|y))+$")
QUANTITY = {"type": ["string", "integer"], "pattern": r"^[0-9]+(\.[0-9]+)?([EPTGMK]i?|[mkMGTPE])?$"}
SEVERITY = string(enum=["info", "warning", "critical"])
NAME = string(pattern=r"^$|^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", maxLength=253)


def image() -> Schema:
    return obj(repository=string(minLength=1), tag=string())


def ports() -> Schema:
    return obj(grpc=PORT, http=PORT)


def probes() -> Schema:
    return obj(startupFailureThreshold=integer(1), periodSeconds=integer(1, 300))


def pdb() -> Schema:
    return obj(enabled=boolean(), maxUnavailable=integer(1))


def component(**extra: Schema) -> Schema:
    """What every service's values have, plus its own keys."""
    return obj(
        enabled=boolean(),
        image=image(),
        ports=ports(),
        service=obj(
            type=string(enum=["ClusterIP", "NodePort", "LoadBalancer"]), annotations=string_map()
        ),
        resources=free_object(),
        probes=probes(),
        pdb=pdb(),
        podSecurityContext=free_object(),
        securityContext=free_object(),
        extraEnv=array(),
        podAnnotations=string_map(),
        podLabels=string_map(),
        nodeSelector=string_map(),
        tolerations=array(),
        affinity=free_object(),
        topologySpreadConstraints=array(),
        priorityClassName=string(),
        **extra,
    )


def alert(**extra: Schema) -> Schema:
    return obj(enabled=boolean(), severity=SEVERITY, **{"for": DURATION}, **extra)


def chart_schema() -> Schema:
    """The values' types and constraints (descriptions are added from values.yaml)."""
    replicas = integer(0)
    return obj(
        nameOverride=string(),
        fullnameOverride=string(),
        commonLabels=string_map(),
        image=obj(
            registry=string(),
            tag=string(),
            pullPolicy=string(enum=["Always", "IfNotPresent", "Never"]),
            pullSecrets=array(string()),
        ),
        serviceAccount=obj(
            create=boolean(), name=NAME, annotations=string_map(), automountToken=boolean()
        ),
        auth=obj(existingSecret=NAME, secretKey=string(minLength=1), token=string()),
        tls=obj(enabled=boolean(), secretName=NAME),
        endpoints=obj(**{name: string(pattern=r"^$|^[^\s:]+:[0-9]{1,5}$") for name in COMPONENTS}),
        redis=obj(
            bundled=boolean(),
            port=PORT,
            image=string(minLength=1),
            appendfsync=string(enum=["everysec", "always"]),
            resources=free_object(),
            persistence=obj(size=QUANTITY, storageClass=string()),
            nodeSelector=string_map(),
            tolerations=array(),
            networkPolicy=obj(enabled=boolean(), extraFrom=array()),
            external=obj(
                url=string(pattern=r"^$|^rediss?://"),
                existingSecret=NAME,
                secretKey=string(minLength=1),
            ),
        ),
        objectStore=obj(
            url=string(pattern=r"^(s3|file)://."),
            endpointUrl=string(pattern=r"^$|^https?://"),
            region=string(),
            credentials=obj(
                existingSecret=NAME,
                accessKeyIdKey=string(minLength=1),
                secretAccessKeyKey=string(minLength=1),
            ),
            fileClaim=NAME,
        ),
        model=obj(
            dir=string(pattern=r"^/."),
            mountPath=string(pattern=r"^/"),
            volume=free_object(),
            storePrefix=string(
                pattern=r"^$|^[A-Za-z0-9_][A-Za-z0-9._=+@,:-]*(/[A-Za-z0-9_][A-Za-z0-9._=+@,:-]*)*$"
            ),
            initPreset=string(enum=["", "tiny", "small"]),
        ),
        config={"$ref": "#/$defs/EtudeConfig"},
        podSecurityContext=free_object(),
        securityContext=free_object(),
        terminationGracePeriodSeconds=integer(1),
        reconciler=component(replicas=replicas),
        envs=component(
            replicas=replicas,
            runtimeClassName=string(),
            autoscaling=obj(
                enabled=boolean(),
                minReplicas=integer(1),
                maxReplicas=integer(1),
                targetCPUUtilizationPercentage=integer(1, 100),
            ),
            keda=obj(
                enabled=boolean(),
                minReplicaCount=integer(0),
                maxReplicaCount=integer(1),
                pendingSlotsPerReplica=integer(1),
                prometheusAddress=string(pattern=r"^https?://"),
                pollingInterval=integer(1),
                cooldownPeriod=integer(0),
                query=string(),
            ),
            networkPolicy=obj(
                enabled=boolean(),
                allowEgress=array(),
                extraIngress=array(),
                metricsNamespaceSelector=free_object(),
            ),
        ),
        inference=component(
            replicas=replicas,
            gpus=integer(0),
            runtimeClassName=string(),
            shmSize=QUANTITY,
            terminationGracePeriodSeconds=integer(1),
        ),
        trainer=component(
            nodes=integer(1),
            gpus=integer(0),
            runtimeClassName=string(),
            shmSize=QUANTITY,
            torchrun=obj(
                nprocPerNode=integer(1),
                rendezvousPort=PORT,
                maxNodes=integer(0),
                maxRestarts=integer(0),
            ),
            checkpoints=obj(
                mountPath=string(pattern=r"^/"),
                existingClaim=NAME,
                size=QUANTITY,
                storageClass=string(),
            ),
            terminationGracePeriodSeconds=integer(1),
        ),
        evals=component(replicas=replicas),
        metrics=obj(
            serviceMonitor=obj(
                enabled=boolean(),
                additionalLabels=string_map(),
                interval=DURATION,
                scrapeTimeout=DURATION,
            ),
            prometheusRule=obj(
                enabled=boolean(), additionalLabels=string_map(), alertLabels=string_map()
            ),
            dashboards=obj(
                enabled=boolean(),
                label=string(minLength=1),
                labelValue=string(),
                folder=string(),
                namespace=NAME,
            ),
        ),
        alerts=obj(
            stalenessTooHigh=alert(
                threshold=number(minimum=0), quantile=number(minimum=0, maximum=1), window=DURATION
            ),
            staleGroupsDropped=alert(threshold=number(minimum=0), window=DURATION),
            deadSlotsRising=alert(threshold=number(minimum=0), window=DURATION),
            noProgress=alert(window=DURATION),
            leaseExpiriesSpiking=alert(threshold=number(minimum=0), window=DURATION),
            infraFaultsHigh=alert(threshold=number(minimum=0, maximum=1), window=DURATION),
            serviceNotReady=alert(),
            podDown=alert(),
            serviceAbsent=alert(),
            grpcErrors=alert(threshold=number(minimum=0, maximum=1), window=DURATION),
            weightPublishLag=alert(
                threshold=number(minimum=0), quantile=number(minimum=0, maximum=1), window=DURATION
            ),
            weightPublishFailures=alert(threshold=number(minimum=0), window=DURATION),
            inferenceUpdateFailures=alert(threshold=number(minimum=0), window=DURATION),
        ),
    )


# -- descriptions from values.yaml -------------------------------------------------

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.\-/]+):(?:\s|$)")


def values_comments(text: str) -> dict[tuple[str, ...], str]:
    """{key path: the "# --" comment above the key} for every mapping key in values.yaml."""
    comments: dict[tuple[str, ...], str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = [stripped[4:].strip()]
            continue
        if stripped.startswith("#"):
            if pending and stripped.startswith("#  "):
                pending.append(stripped[1:].strip())
            else:
                pending = []
            continue
        match = _KEY.match(line)
        if not match:
            pending = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        path = tuple(key for _, key in stack)
        if pending:
            comments[path] = " ".join(pending)
        pending = []
    return comments


def _walk_values(node: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every key path in the values (not into lists)."""
    paths: list[tuple[str, ...]] = []
    if isinstance(node, dict):
        for key, child in node.items():
            paths.append((*path, key))
            paths.extend(_walk_values(child, (*path, key)))
    return paths


def _closed(schema: Schema) -> bool:
    return schema.get("additionalProperties") is False and "properties" in schema


def documentation_problems(values: dict[str, Any], text: str, schema: Schema) -> list[str]:
    """Keys of values.yaml that lack a comment, or that the schema does not declare.

    Every value needs a "# --" comment; a section whose keys are all declared is
    documented by its keys' comments.
    """
    comments = values_comments(text)
    problems = []
    for path in _walk_values(values, ()):
        value: Any = values
        for key in path:
            value = value[key]
        node = schema
        declared = True
        for key in path[:-1]:
            if "$ref" in node or not _closed(node):
                node = {}
                break
            node = node["properties"].get(key, {})
        if node and _closed(node) and path[-1] not in node["properties"]:
            declared = False
        parent_is_free = bool(node) and not _closed(node)
        dotted = ".".join(path)
        if not declared:
            problems.append(f"values.yaml: {dotted} is not declared in tools/chart_schema.py")
        # A section of closed keys is documented by its keys; every value needs its own.
        is_section = (
            isinstance(value, dict)
            and bool(value)
            and _closed(node.get("properties", {}).get(path[-1], {}) if node else {})
        )
        if node and not parent_is_free and not is_section and path not in comments:
            problems.append(f'values.yaml: {dotted} has no "# --" comment above it')
    # The reverse: a declared key missing from values.yaml would go undocumented.
    problems.extend(_missing_from_values(schema, values, ()))
    return problems


def _missing_from_values(schema: Schema, values: Any, path: tuple[str, ...]) -> list[str]:
    if not _closed(schema) or not isinstance(values, dict):
        return []
    problems = []
    for key, child in schema["properties"].items():
        if key not in values:
            problems.append(f"values.yaml: {'.'.join((*path, key))} is declared but has no default")
        else:
            problems.extend(_missing_from_values(child, values[key], (*path, key)))
    return problems


def _describe(schema: Schema, comments: dict[tuple[str, ...], str], path: tuple[str, ...]) -> None:
    if path in comments:
        schema["description"] = comments[path]
    for key, child in schema.get("properties", {}).items():
        if "$ref" not in child:
            _describe(child, comments, (*path, key))
        elif (*path, key) in comments:
            child["description"] = comments[(*path, key)]


# -- the run config's schema, from pydantic ------------------------------------------


def config_defs() -> dict[str, Schema]:
    """$defs for the `config` key: EtudeConfig's JSON schema less the chart-managed keys."""
    sys.path.insert(0, str(REPO))
    from services.config.deployment import EtudeConfig

    schema = EtudeConfig.model_json_schema()
    defs: dict[str, Schema] = schema.pop("$defs")
    defs["EtudeConfig"] = schema

    def strip_titles(node: Any) -> None:
        if isinstance(node, dict):
            node.pop("title", None)
            for child in node.values():
                strip_titles(child)
        elif isinstance(node, list):
            for child in node:
                strip_titles(child)

    for name, keys in CHART_MANAGED_CONFIG.items():
        model = defs[name]
        for key in keys:
            del model["properties"][key]
            if key in model.get("required", []):
                model["required"].remove(key)
        if "required" in model and not model["required"]:
            del model["required"]
    for name in ("EndpointsConfig", "RedisConfig", "ObjectStoreConfig", "AuthConfig"):
        del defs[name]
    del defs["LauncherConfig"]
    strip_titles(defs)
    defs["EtudeConfig"]["description"] = (
        "The Etude run config (services/config/deployment.py), less the keys the chart sets."
    )
    return dict(sorted(defs.items()))


def build() -> Schema:
    """The complete values.schema.json."""
    text = (CHART / "values.yaml").read_text()
    # A JSON round trip unshares the constants (PORT, ...) so each key gets its own text.
    schema = json.loads(json.dumps(chart_schema()))
    _describe(schema, values_comments(text), ())
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Values of the Etude Helm chart",
        **schema,
        "$defs": config_defs(),
    }


def render(schema: Schema) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def check() -> list[str]:
    """Problems: a stale values.schema.json, or values.yaml keys undocumented or undeclared."""
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    problems = documentation_problems(values, text, chart_schema())
    current = SCHEMA_PATH.read_text() if SCHEMA_PATH.exists() else ""
    if current != render(build()):
        problems.append(
            "deploy/helm/etude/values.schema.json is not current: run python tools/chart_schema.py"
        )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when the schema is stale")
    args = parser.parse_args()
    if args.check:
        problems = check()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    SCHEMA_PATH.write_text(render(build()))
    print(f"wrote {SCHEMA_PATH.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
