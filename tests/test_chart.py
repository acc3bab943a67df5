"""The Helm chart, proven offline: real Helm (helm-python-sdk), kubernetes-validate,
promtool. Renders the defaults, every example values file and the feature cases, and
checks what users rely on: scaling, roles, probes, bad input named, alerts that fire."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import chart_check  # noqa: E402
import chart_dashboards  # noqa: E402
import chart_schema  # noqa: E402

from services.config import SERVICE_NAMES  # noqa: E402
from services.evals.suites import load_suites  # noqa: E402
from services.reconciler.store import GROUP_STATES, SLOT_STATES  # noqa: E402

chart_check.require_tools()  # a missing tool fails the module loudly, never skips

import helm_python  # noqa: E402

CASES = chart_check.cases()


def render(values: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    return chart_check.render(values or {}, **kwargs)


def kinds(manifests: list[dict[str, Any]]) -> set[str]:
    return {chart_check.ident(m) for m in manifests}


def container(manifest: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = manifest["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


# -- render + validate -------------------------------------------------------------


def test_every_example_role_is_covered() -> None:
    names = {path.name for path in chart_check.EXAMPLES}
    assert {
        "single-region.yaml",
        "region-train.yaml",
        "region-rollouts.yaml",
        "external-redis.yaml",
    } <= names


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_renders_and_validates_strictly(case: str) -> None:
    manifests = render(CASES[case])
    assert manifests
    assert chart_check.manifest_problems(manifests) == []


@pytest.mark.parametrize(
    "case", [c for c in CASES if c == "default" or c.startswith("examples/")], ids=str
)
def test_helm_lint_strict(case: str) -> None:
    assert chart_check.lint(CASES[case]) == []


def test_validators_reject_unknown_fields_and_wrong_types() -> None:
    manifests = render(chart_check.FEATURE_CASES["monitoring"])
    deployment = copy.deepcopy(chart_check.find(manifests, "Deployment", "etude-envs"))
    deployment["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    assert "resourcez" in " ".join(chart_check.validate_manifest(deployment, "1.30.0"))
    deployment = copy.deepcopy(chart_check.find(manifests, "Deployment", "etude-envs"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = (
        "grpc"
    )
    assert "not of type 'integer'" in " ".join(chart_check.validate_manifest(deployment, "1.37.0"))
    monitor = copy.deepcopy(chart_check.find(manifests, "ServiceMonitor", "etude-reconciler"))
    monitor["spec"]["endpoints"][0]["honourLabels"] = True
    assert chart_check.validate_manifest(monitor, "1.30.0") == [
        "ServiceMonitor/etude-reconciler: unknown field spec.endpoints[0].honourLabels"
    ]
    scaled = copy.deepcopy(chart_check.find(manifests, "ScaledObject", "etude-envs"))
    scaled["spec"]["minReplicaCount"] = "one"
    assert "minReplicaCount" in " ".join(chart_check.validate_manifest(scaled, "1.30.0"))
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert chart_check.validate_manifest(unknown, "1.30.0") != []


def test_rendered_config_is_what_the_services_load(tmp_path: Path) -> None:
    from services.config.deployment import load_config

    manifests = render(chart_check.FEATURE_CASES["tls"])
    text = chart_check.find(manifests, "ConfigMap", "etude-config")["data"]["config.toml"]
    path = tmp_path / "config.toml"
    path.write_text(text)
    config = load_config(path, environ={"ETUDE_AUTH__TOKEN": "t"})
    assert config.endpoints.reconciler == "dns:///etude-reconciler-headless:50051"
    assert config.endpoints.inference == "dns:///etude-inference-headless:50053"
    assert config.endpoints.evals == "dns:///etude-evals-headless:50055"
    assert config.endpoints.trainer == "etude-trainer:50054"  # pod 0 only
    assert config.redis.url == "redis://etude-redis:6379/0"
    assert config.object_store.url == "s3://etude/runs"
    assert config.inference.grpc.port == 50053 and config.inference.http.port == 9103
    assert config.reconciler.grpc.tls_cert_file == "/etc/etude/tls/tls.crt"
    assert str(config.endpoints.tls_ca_file) == "/etc/etude/tls/ca.crt"
    assert config.run.name == "etude" and str(config.run.state_dir) == "/var/lib/etude"
    assert config.auth.required


def rendered_config(manifests: list[dict[str, Any]], tmp_path: Path) -> Any:
    from services.config.deployment import load_config

    text = chart_check.find(manifests, "ConfigMap", "etude-config")["data"]["config.toml"]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.toml"
    path.write_text(text)
    return load_config(path, environ={"ETUDE_AUTH__TOKEN": "t"})


def model_mounts(manifests: list[dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Per workload that mounts the model: its mount path and the model volume."""
    found = {}
    for manifest in manifests:
        if manifest["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = manifest["spec"]["template"]["spec"]
        mounts = {m["name"]: m["mountPath"] for m in container(manifest)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        if "model" in mounts:
            found[manifest["metadata"]["name"]] = (mounts["model"], volumes["model"])
    return found


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("examples/")], ids=str)
def test_each_example_is_a_complete_job_on_one_model(case: str, tmp_path: Path) -> None:
    """What `helm install` with the example runs: the trainer has its job, the reconciler a
    task source, evals suites to score, and the trainer, inference and envs pods one model
    (model.dir in the config, the same volume mounted over it, and a way for it to get
    there: a synced prefix, a demo init container, or a volume that holds it)."""
    values = CASES[case]
    manifests = render(values)
    config = rendered_config(manifests, tmp_path)
    components = ("reconciler", "envs", "inference", "trainer", "evals")
    enabled = {c: values.get(c, {}).get("enabled", True) for c in components}
    if enabled["trainer"]:
        assert config.trainer.job is not None and config.trainer.job.phase == "rl"
        assert config.trainer.job.checkpoint.location in ("object_store", "local")
    if enabled["reconciler"]:
        assert config.reconciler.feeder is not None
    if enabled["evals"]:
        suites = load_suites(config.evals.suites)
        assert config.evals.suites and all(suites[name].enabled for name in config.evals.suites)
    model_dir = config.model.dir
    assert model_dir is not None and config.inference.engine.model_dir == model_dir
    mounts = model_mounts(manifests)
    readers = {f"etude-{c}" for c in ("trainer", "inference", "envs") if enabled[c]}
    assert set(mounts) == readers, mounts
    assert len({json.dumps(volume, sort_keys=True) for _, volume in mounts.values()}) == 1
    for mount_path, volume in mounts.values():
        assert str(model_dir).startswith(mount_path.rstrip("/") + "/")
        held = "emptyDir" not in volume  # a persistent volume that holds the model
        assert held or config.model.store_prefix or values.get("model", {}).get("initPreset")


def test_the_two_regions_run_one_job_on_one_model(tmp_path: Path) -> None:
    """The training region holds the job and the feeder, the rollout region none; both
    read the run's one model from the same prefix of the same bucket."""
    train = rendered_config(render(CASES["examples/region-train.yaml"]), tmp_path / "t")
    rollouts = rendered_config(render(CASES["examples/region-rollouts.yaml"]), tmp_path / "r")
    assert train.trainer.job is not None and train.reconciler.feeder is not None
    assert train.run.name == rollouts.run.name
    assert train.object_store.url == rollouts.object_store.url
    assert train.model == rollouts.model and train.model.store_prefix


# -- scaling -----------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 7])
def test_envs_replicas_come_from_values_without_an_autoscaler(replicas: int) -> None:
    manifests = render({"envs": {"replicas": replicas}})
    assert chart_check.find(manifests, "Deployment", "etude-envs")["spec"]["replicas"] == replicas
    assert not any(m["kind"] in ("HorizontalPodAutoscaler", "ScaledObject") for m in manifests)


def test_hpa_owns_envs_replicas() -> None:
    manifests = render({"envs": {"replicas": 7, "autoscaling": {"enabled": True}}})
    deployment = chart_check.find(manifests, "Deployment", "etude-envs")
    assert "replicas" not in deployment["spec"]
    hpa = chart_check.find(manifests, "HorizontalPodAutoscaler", "etude-envs")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "etude-envs",
    }
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 32
    assert chart_check.find(manifests, "PodDisruptionBudget", "etude-envs")["spec"] == {
        "maxUnavailable": 1,
        "selector": deployment["spec"]["selector"],
    }


def test_keda_scales_envs_on_pending_slots() -> None:
    manifests = render({"envs": {"keda": {"enabled": True, "pendingSlotsPerReplica": 4}}})
    assert "replicas" not in chart_check.find(manifests, "Deployment", "etude-envs")["spec"]
    trigger = chart_check.find(manifests, "ScaledObject", "etude-envs")["spec"]["triggers"][0]
    assert trigger["metadata"]["threshold"] == "4"
    assert chart_check.metric_names(trigger["metadata"]["query"]) == {"etude_reconciler_slots"}
    assert ("state", "Equal", "PENDING") in [
        m[1:] for m in chart_check.label_matchers(trigger["metadata"]["query"])
    ]


def test_both_autoscalers_at_once_is_refused() -> None:
    with pytest.raises(helm_python.HelmRenderError, match="exclusive"):
        render({"envs": {"autoscaling": {"enabled": True}, "keda": {"enabled": True}}})


def test_multi_replica_services_get_pdbs_single_ones_do_not() -> None:
    manifests = render({"evals": {"replicas": 1}, "inference": {"replicas": 3}})
    names = kinds(manifests)
    assert "PodDisruptionBudget/etude-reconciler" in names  # 2 replicas by default
    assert "PodDisruptionBudget/etude-inference" in names
    assert "PodDisruptionBudget/etude-evals" not in names
    assert "PodDisruptionBudget/etude-trainer" not in names  # one node


@pytest.mark.parametrize("component", ["reconciler", "inference", "evals"])
def test_balanced_services_are_reached_through_a_headless_service(component: str) -> None:
    manifests = render(CASES["examples/region-train.yaml"] if component == "reconciler" else {})
    name = f"etude-{component}"
    headless = chart_check.find(manifests, "Service", f"{name}-headless")
    # Every ready replica is an address of the name; a loading or stopping one is not.
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False
    deployment = chart_check.find(manifests, "Deployment", name)
    assert headless["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert [p["name"] for p in headless["spec"]["ports"]] == ["grpc"]
    # Scraped once, through the component's own Service, which stays (a LoadBalancer
    # for the training region's reconciler).
    assert headless["metadata"]["labels"]["etude/scrape"] == "false"
    service = chart_check.find(manifests, "Service", name)
    assert "clusterIP" not in service["spec"]
    if component == "reconciler":
        assert service["spec"]["type"] == "LoadBalancer"
    toml = chart_check.find(manifests, "ConfigMap", "etude-config")["data"]["config.toml"]
    port = headless["spec"]["ports"][0]["port"]
    assert f'{component} = "dns:///{name}-headless:{port}"' in toml


def test_inference_drains_generations_within_the_pods_grace(tmp_path: Path) -> None:
    from services.config.deployment import load_config

    manifests = render({})
    path = tmp_path / "config.toml"
    path.write_text(chart_check.find(manifests, "ConfigMap", "etude-config")["data"]["config.toml"])
    config = load_config(path, environ={"ETUDE_AUTH__TOKEN": "t"})
    pod = chart_check.find(manifests, "Deployment", "etude-inference")["spec"]["template"]
    # Generations in flight at a scale-down get most of the pod's grace, not the 10 s default.
    assert config.inference.grpc.shutdown_grace_s == 75
    assert pod["spec"]["terminationGracePeriodSeconds"] == 90


def test_headless_names_stay_dns_labels_for_long_release_names() -> None:
    manifests = render({"fullnameOverride": "x" * 60})
    names = {m["metadata"]["name"] for m in manifests if m["kind"] == "Service"}
    headless = {f"{'x' * 43}-{c}-headless" for c in ("reconciler", "inference", "evals")}
    assert headless <= names and all(len(name) <= 63 for name in headless)


# -- roles and regions -------------------------------------------------------------


def test_training_region_runs_only_its_role() -> None:
    manifests = render(CASES["examples/region-train.yaml"])
    workloads = {
        chart_check.ident(m) for m in manifests if m["kind"] in ("Deployment", "StatefulSet")
    }
    assert workloads == {
        "Deployment/etude-reconciler",
        "StatefulSet/etude-redis",
        "StatefulSet/etude-trainer",
    }


def test_rollout_region_points_at_the_shared_reconciler() -> None:
    values = CASES["examples/region-rollouts.yaml"]
    manifests = render(values)
    workloads = {
        chart_check.ident(m) for m in manifests if m["kind"] in ("Deployment", "StatefulSet")
    }
    assert workloads == {
        "Deployment/etude-envs",
        "Deployment/etude-inference",
        "Deployment/etude-evals",
    }
    toml = chart_check.find(manifests, "ConfigMap", "etude-config")["data"]["config.toml"]
    assert f'reconciler = "{values["endpoints"]["reconciler"]}"' in toml
    assert "[redis]" not in toml  # only the reconciler talks to Redis


def test_a_role_without_the_reconciler_must_name_it() -> None:
    values = copy.deepcopy(CASES["examples/region-rollouts.yaml"])
    values["endpoints"]["reconciler"] = ""
    with pytest.raises(helm_python.HelmRenderError, match=r"set endpoints\.reconciler"):
        render(values)


# -- pods --------------------------------------------------------------------------


def test_probes_are_grpc_health_on_integer_ports() -> None:
    manifests = render()
    for service in SERVICE_NAMES:
        kind = "StatefulSet" if service == "trainer" else "Deployment"
        main = container(chart_check.find(manifests, kind, f"etude-{service}"))
        port = {p["name"]: p["containerPort"] for p in main["ports"]}["grpc"]
        assert main["livenessProbe"]["grpc"] == {"port": port, "service": "liveness"}
        assert main["startupProbe"]["grpc"] == {"port": port, "service": "liveness"}
        assert main["readinessProbe"]["grpc"] == {"port": port, "service": "readiness"}


def test_tls_moves_probes_to_http_because_kubernetes_grpc_probes_are_plaintext() -> None:
    manifests = render(chart_check.FEATURE_CASES["tls"])
    main = container(chart_check.find(manifests, "Deployment", "etude-reconciler"))
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 9101}
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 9101}
    assert {"name": "tls", "mountPath": "/etc/etude/tls", "readOnly": True} in main["volumeMounts"]


def test_inference_gets_gpus_shm_and_a_long_startup() -> None:
    values = {"inference": {"gpus": 2, "runtimeClassName": "nvidia"}}
    deployment = chart_check.find(render(values), "Deployment", "etude-inference")
    pod = deployment["spec"]["template"]["spec"]
    main = container(deployment)
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod["runtimeClassName"] == "nvidia"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800


def test_envs_pods_are_locked_down() -> None:
    manifests = render({"envs": {"runtimeClassName": "gvisor"}})
    deployment = chart_check.find(manifests, "Deployment", "etude-envs")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    context = container(deployment)["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]}
    policy = chart_check.find(manifests, "NetworkPolicy", "etude-envs")["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    # Egress: DNS and this release only; nothing to the outside without an allow-list.
    assert len(policy["egress"]) == 2
    assert not any("ipBlock" in peer for rule in policy["egress"] for peer in rule["to"])


def test_the_pod_sandbox_option_runs_envs_as_root_in_the_runtime_with_the_uid_drop(
    tmp_path: Path,
) -> None:
    """gVisor/Kata: the runtime class, root inside the pod with just the capabilities the
    uid drop needs (the rest stay dropped), and the pod backend in the run config."""
    manifests = render(chart_check.FEATURE_CASES["sandbox-pod"])
    deployment = chart_check.find(manifests, "Deployment", "etude-envs")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "gvisor" and pod["securityContext"]["runAsUser"] == 0
    capabilities = container(deployment)["securityContext"]["capabilities"]
    assert capabilities["drop"] == ["ALL"] and {"SETUID", "SETGID", "KILL"} <= set(
        capabilities["add"]
    )
    assert rendered_config(manifests, tmp_path).envs.sandbox.backend == "pod"
    # Only envs: the other services keep running as non-root.
    inference = chart_check.find(manifests, "Deployment", "etude-inference")
    assert inference["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_envs_egress_allow_list_is_added() -> None:
    rule = {"to": [{"ipBlock": {"cidr": "10.1.0.0/16"}}], "ports": [{"port": 443}]}
    policy = chart_check.find(
        render({"envs": {"networkPolicy": {"allowEgress": [rule]}}}), "NetworkPolicy", "etude-envs"
    )
    assert policy["spec"]["egress"][-1] == rule


def test_trainer_is_a_torchrun_statefulset_with_a_rendezvous_service() -> None:
    values = {"trainer": {"nodes": 4, "gpus": 8, "torchrun": {"maxNodes": 6}}}
    manifests = render(values)
    statefulset = chart_check.find(manifests, "StatefulSet", "etude-trainer")
    assert statefulset["spec"]["replicas"] == 4
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
    assert statefulset["spec"]["serviceName"] == "etude-trainer-headless"
    main = container(statefulset)
    assert main["command"] == ["torchrun"]
    assert "--nnodes=4:6" in main["args"]
    assert "--rdzv-endpoint=etude-trainer-0.etude-trainer-headless:29400" in main["args"]
    assert main["args"][-6:] == [
        "--no-python",
        "etude",
        "serve",
        "trainer",
        "--config",
        "/etc/etude/config.toml",
    ]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 8
    claim = statefulset["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "checkpoints"
    headless = chart_check.find(manifests, "Service", "etude-trainer-headless")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    entry = chart_check.find(manifests, "Service", "etude-trainer")["spec"]
    assert entry["selector"]["apps.kubernetes.io/pod-index"] == "0"
    assert chart_check.find(manifests, "PodDisruptionBudget", "etude-trainer")


def test_bundled_redis_keeps_an_aof_and_never_evicts() -> None:
    values = {"redis": {"appendfsync": "always"}}
    redis = chart_check.find(render(values), "StatefulSet", "etude-redis")
    args = container(redis)["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "always"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_secrets_reach_pods_as_env_from_secrets() -> None:
    values = {
        "auth": {"existingSecret": "tok", "secretKey": "t"},
        "redis": {"bundled": False, "external": {"existingSecret": "redis-url"}},
        "objectStore": {"credentials": {"existingSecret": "s3"}},
    }
    manifests = render(values)
    assert not any(m["kind"] == "Secret" for m in manifests)
    reconciler = {e["name"]: e for e in container(manifests_get(manifests, "reconciler"))["env"]}
    assert reconciler["ETUDE_AUTH__TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "tok",
        "key": "t",
    }
    assert reconciler["ETUDE_REDIS__URL"]["valueFrom"]["secretKeyRef"]["name"] == "redis-url"
    inference = {e["name"]: e for e in container(manifests_get(manifests, "inference"))["env"]}
    assert inference["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3"
    assert "ETUDE_REDIS__URL" not in inference
    toml = chart_check.find(manifests, "ConfigMap", "etude-config")["data"]["config.toml"]
    assert "[redis]" not in toml and "token" not in toml


def manifests_get(manifests: list[dict[str, Any]], service: str) -> dict[str, Any]:
    return chart_check.find(manifests, "Deployment", f"etude-{service}")


def test_pods_roll_when_the_config_changes() -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = chart_check.find(render(values), "Deployment", "etude-reconciler")
        annotation: str = deployment["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"
        ]
        return annotation

    assert checksum({}) != checksum({"config": {"reconciler": {"max_staleness": 5}}})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"dir": "/elsewhere/m"}}, "must lie under model.mountPath"),
        (
            {"model": {"initPreset": "tiny", "storePrefix": "models/m"}},
            "two sources of the model",
        ),
        (
            {
                "inference": {"gpus": 1},
                "config": {"inference": {"engine": {"tensor_parallel_size": 2}}},
            },
            "tensor_parallel_size",
        ),
        ({"terminationGracePeriodSeconds": 5}, "terminationGracePeriodSeconds"),
        ({"tls": {"enabled": True}}, "tls.secretName"),
        ({"redis": {"bundled": False}}, "redis.external.url"),
        (
            {"envs": {"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}}},
            "requests.cpu",
        ),
    ],
)
def test_inconsistent_values_fail_with_a_reason(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message.replace(".", r"\.")):
        render(values)


# -- bad input is named ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("envs:\n  replicas: two\n", "/envs/replicas"),
        ("envs:\n  replica: 3\n", "'replica'"),
        ("reconcilr:\n  enabled: true\n", "'reconcilr'"),
        ("inference:\n  gpus: -1\n", "/inference/gpus"),
        ("redis:\n  appendfsync: sometimes\n", "/redis/appendfsync"),
        ("config:\n  reconciler:\n    max_staleness: lots\n", "/config/reconciler/max_staleness"),
        ("config:\n  reconciler:\n    max_stalenes: 1\n", "'max_stalenes'"),
        ("config:\n  redis:\n    url: redis://x:1/0\n", "'redis'"),  # the chart sets it
        ("config:\n  inference:\n    grpc:\n      port: 1\n", "'port'"),  # the chart sets it
        ("config:\n  inference:\n    engine:\n      model_dir: /m\n", "'model_dir'"),  # model.dir
        ("config:\n  model:\n    dir: /m\n", "'model'"),  # the top-level model values
        ("model:\n  storePrefix: ../m\n", "/model/storePrefix"),
        ("alerts:\n  noProgress:\n    for: soon\n", "/alerts/noProgress/for"),
    ],
)
def test_bad_values_file_fails_schema_validation_naming_the_key(
    tmp_path: Path, text: str, named: str
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(text)
    values = chart_check.load_values(path)
    with pytest.raises(helm_python.HelmValuesError) as error:
        render(values)
    assert named in str(error.value)


def test_schema_is_current_and_every_value_documented() -> None:
    assert chart_schema.check() == []


def test_schema_check_catches_an_undocumented_or_undeclared_value() -> None:
    text = (chart_check.CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    values["envs"]["surprise"] = 1
    edited = text.replace("  # -- Run the rollout workers in this release.\n", "")
    problems = chart_schema.documentation_problems(values, edited, chart_schema.chart_schema())
    assert "values.yaml: envs.surprise is not declared in tools/chart_schema.py" in problems
    assert 'values.yaml: envs.enabled has no "# --" comment above it' in problems


def test_schema_descriptions_come_from_values_comments() -> None:
    schema = helm_python.Chart.load(str(chart_check.CHART)).schema
    assert schema is not None
    replicas = schema["properties"]["envs"]["properties"]["replicas"]
    assert replicas["description"].startswith("Replicas when neither autoscaler owns them")
    assert schema["properties"]["envs"]["additionalProperties"] is False


# -- alerts and dashboards ---------------------------------------------------------


def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    groups = chart_check.alert_rules(chart_check.monitoring_manifests())
    alerts = {rule["alert"] for group in groups for rule in group["rules"]}
    assert alerts == {
        "EtudeStalenessTooHigh",
        "EtudeStaleGroupsDropped",
        "EtudeDeadSlotsRising",
        "EtudeNoProgress",
        "EtudeLeaseExpiriesSpiking",
        "EtudeInfraFaultsHigh",
        "EtudeServiceNotReady",
        "EtudeDependencyNotReady",
        "EtudeGrpcServerErrors",
        "EtudePodDown",
        "EtudeServiceAbsent",
        "EtudeWeightPublishLag",
        "EtudeWeightPublishFailures",
        "EtudeInferenceUpdateFailures",
    }
    assert chart_check.check_rules(groups) == []
    problems, output = chart_check.run_rule_tests(groups)
    assert problems == [], output
    assert "SUCCESS" in output


def test_each_region_alerts_on_the_weights_it_handles() -> None:
    """A release alerts on publishing only where the trainer runs, on loading only where
    inference runs (one release per region)."""
    monitoring = chart_check.FEATURE_CASES["monitoring"]["metrics"]
    expected = {
        "region-train.yaml": {"EtudeWeightPublishLag", "EtudeWeightPublishFailures"},
        "region-rollouts.yaml": {"EtudeInferenceUpdateFailures"},
    }
    for example, alerts in expected.items():
        values = chart_check.load_values(chart_check.CHART / "examples" / example)
        values["metrics"] = monitoring
        groups = chart_check.alert_rules(render(values))
        weights = [group for group in groups if group["name"] == "etude.weights"]
        assert {rule["alert"] for group in weights for rule in group["rules"]} == alerts
    values = copy.deepcopy(chart_check.FEATURE_CASES["monitoring"])
    values |= {name: {"enabled": False} for name in ("envs", "inference", "trainer", "evals")}
    groups = chart_check.alert_rules(render(values))
    assert "etude.weights" not in {group["name"] for group in groups}


def test_a_release_alerts_on_the_absence_of_the_services_it_runs() -> None:
    """One EtudeServiceAbsent per enabled service: a region's release does not page for
    the services another release runs."""
    monitoring = chart_check.FEATURE_CASES["monitoring"]["metrics"]
    expected = {
        "region-train.yaml": {"reconciler", "trainer"},
        "region-rollouts.yaml": {"envs", "inference", "evals"},
        "single-region.yaml": {"reconciler", "envs", "inference", "trainer", "evals"},
    }
    for example, components in expected.items():
        values = chart_check.load_values(chart_check.CHART / "examples" / example)
        values["metrics"] = monitoring
        rules = [r for g in chart_check.alert_rules(render(values)) for r in g["rules"]]
        absent = {r["labels"]["component"] for r in rules if r["alert"] == "EtudeServiceAbsent"}
        assert absent == components, example
        for rule in rules:
            if rule["alert"] == "EtudeServiceAbsent":
                assert f'component="{rule["labels"]["component"]}"' in rule["expr"]


def test_alert_unit_tests_fail_when_a_threshold_moves() -> None:
    values = copy.deepcopy(chart_check.FEATURE_CASES["monitoring"])
    values["alerts"] = {"deadSlotsRising": {"threshold": 100}}
    groups = chart_check.alert_rules(render(values))
    problems, output = chart_check.run_rule_tests(groups)
    assert problems and "EtudeDeadSlotsRising" in output


def test_promtool_rejects_a_broken_rule() -> None:
    groups = [{"name": "g", "rules": [{"alert": "A", "expr": "sum(rate(x[5m])"}]}]
    assert chart_check.check_rules(groups) != []


def test_every_dashboard_and_keda_query_parses() -> None:
    manifests = chart_check.monitoring_manifests()
    queries = chart_check.dashboard_queries() + chart_check.keda_queries(manifests)
    assert len(queries) > 50
    assert chart_check.check_queries(queries) == []
    assert chart_check.check_queries([("broken", "rate(x[5m]")]) != []


def test_dashboards_are_current_and_ship_through_labelled_configmaps() -> None:
    assert chart_dashboards.check() == []
    manifests = render({"metrics": {"dashboards": {"enabled": True}}})
    configmaps = [m for m in manifests if m["metadata"]["name"].startswith("etude-dashboard-")]
    assert {m["metadata"]["name"] for m in configmaps} == {
        f"etude-dashboard-{name}" for name in ("overview", *SERVICE_NAMES)
    }
    for configmap in configmaps:
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        (board,) = configmap["data"].values()
        assert yaml.safe_load(board)["uid"].startswith("etude-")


def test_dependency_panels_follow_the_services_own_probes() -> None:
    """A "Dependencies ready" panel only where the service probes dependencies (and so
    exports etude_dependency_ready); the chart's map equals the service classes'."""
    import importlib

    import chart_panels

    from services.wire.service import Service

    for name in SERVICE_NAMES:
        module = importlib.import_module(f"services.{name}.service")
        (service_class,) = {
            value
            for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, Service) and value is not Service
        }
        assert tuple(service_class.dependencies) == chart_panels.GRPC_DEPENDENCIES[name], name
        titles = {panel["title"] for panel in chart_panels.readiness_panels(name)}
        assert ("Dependencies ready" in titles) == bool(service_class.dependencies), name


def test_dashboards_only_use_label_values_that_exist() -> None:
    """Enumerated labels in dashboards, alerts and KEDA name real states, codes, services."""
    from services.api.v1 import (
        envs_pb2,
        evals_pb2,
        inference_pb2,
        reconciler_pb2,
        trainer_pb2,
    )

    grpc_services = {
        service.full_name
        for module in (envs_pb2, evals_pb2, inference_pb2, reconciler_pb2, trainer_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
    }
    allowed = {
        ("etude_reconciler_slots", "state"): set(SLOT_STATES),
        ("etude_reconciler_groups", "state"): set(GROUP_STATES),
        ("etude_reconciler_stale_groups_total", "action"): {"dropped", "requeued"},
        (None, "grpc_code"): {code.name for code in grpc.StatusCode},
        (None, "grpc_service"): grpc_services,
        (None, "service"): set(SERVICE_NAMES),
    }
    checked = 0
    for where, expr in chart_check.referenced_queries():
        for metric, label, op, value in chart_check.label_matchers(expr):
            known = allowed.get((metric, label)) or allowed.get((None, label))
            if known is None:
                continue
            if op in ("Equal", "NotEqual"):
                options = [value]
            else:  # a regex: every alternative must be a real value (or a prefix pattern)
                options = [v for v in value.split("|") if not v.endswith(".*")]
            for option in options:
                assert option in known, f"{where}: {label}={option!r} is not one of {sorted(known)}"
                checked += 1
    assert checked > 30
