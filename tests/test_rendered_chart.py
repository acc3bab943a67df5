"""The rendered chart runs (issue #31): `examples/single-region.yaml` with `ci/cpu-tiny.yaml`
rendered by Helm and every workload run as a kubelet would (tests/cluster_support.py).

The fast tests show that the emulator fails on what a cluster would fail on: each takes
the rendered reconciler and Redis, breaks one port, Service name, env var, mount path or
probe, and asserts the emulator reports it. The slow test runs the whole release: every
pod ready, 3 RL steps, inference serving a trained version, evals scoring one; then
``kubectl scale`` of inference (1 -> 2, its new replica serving generations) and envs
(1 -> 0 -> 2, the new pods finishing rollouts) while steps advance, and an envs pod
SIGKILLed, restarted and the run going on, with no slot lost. A real Prometheus
(tests/prometheus_support.py) scrapes the pods as the ServiceMonitors say, and every panel
query of the shipped dashboards must return data, every alert rule evaluate.

The region pair (`examples/region-train.yaml` and `examples/region-rollouts.yaml`, each
with the CPU overrides) runs as two releases side by side, as the examples' `helm install`
lines make them: gRPC over TLS with a certificate naming every Service and the training
region's load-balancer name, the rollout region reaching the reconciler by that name only,
both syncing the base model from the bucket's `model.storePrefix`, and the trainer's
checkpoints in the bucket. Both regions share one emulated pod network, so what separates
real regions (their own clusters, the load balancer in between) is not tested; the names,
certificates, Secrets and store layout that must line up are.
"""

from __future__ import annotations

import copy
import functools
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config.trainer import CheckpointConfig
from services.trainer.checkpoint_index import list_store_checkpoints
from tests.chart_run_support import (
    CPU_REGIONS,
    CPU_TINY,
    REGION_ROLLOUTS,
    REGION_TRAIN,
    SINGLE_REGION,
    chart_check,
    claim_dir,
    file_store,
    metric_value,
    metrics,
    model_claim,
    render_release,
    running,
    service_names,
    store_claim,
    tls_secret,
    wait_for,
)
from tests.prometheus_support import Prometheus, as_grafana_sends, dashboard_queries

pytestmark = [pytest.mark.integration]

Manifests = list[dict[str, Any]]


@pytest.fixture
def host_root() -> Iterator[Path]:
    """The emulator's host directory, outside /tmp (pods mount their own /tmp)."""
    root = Path("/var/tmp") / f"et-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def reconciler_and_redis(monitoring: bool = False) -> Manifests:
    """The rendered release cut to the reconciler, Redis and what they read (with
    `monitoring`, also the reconciler's ServiceMonitor and the release's rules)."""
    manifests = render_release(SINGLE_REGION, CPU_TINY)
    kept = []
    kinds = {"Service", "Deployment", "StatefulSet"} | ({"ServiceMonitor"} if monitoring else set())
    for manifest in manifests:
        component = manifest["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        config = manifest["kind"] == "ConfigMap" and "config.toml" in manifest.get("data", {})
        workload = manifest["kind"] in kinds
        rules = monitoring and manifest["kind"] == "PrometheusRule"
        if config or rules or (workload and component in ("reconciler", "redis")):
            kept.append(manifest)
    chart_check.find(kept, "Deployment", "etude-reconciler")["spec"]["replicas"] = 1
    return kept


def container(manifests: Manifests, kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = chart_check.find(manifests, kind, name)["spec"]["template"]["spec"]
    return spec["containers"][0]  # type: ignore[no-any-return]


@pytest.mark.slow
def test_emulator_runs_the_rendered_reconciler_and_redis(host_root: Path) -> None:
    manifests = reconciler_and_redis()
    with running(manifests, host_root, {"etude-store": store_claim(host_root)}) as cluster:
        assert cluster.problems == []
        wait_for(
            "reconciler and redis ready",
            lambda: all(p.process.ready for w in cluster.workloads for p in cluster.pods(w)),
            60,
            cluster.describe,
        )
        assert cluster.all_problems() == [], cluster.all_problems()


@pytest.mark.slow
def test_prometheus_scrapes_the_reconciler_as_its_service_monitor_says(host_root: Path) -> None:
    """Debian's prometheus, configured from the rendered ServiceMonitor and PrometheusRule:
    the reconciler's pod is a target with the labels the dashboards and rules select on
    (its own `service` label kept: honorLabels), every rule evaluates without error, and
    the services with no pod are absent: their EtudeServiceAbsent alerts are pending."""
    manifests = reconciler_and_redis(monitoring=True)
    with (
        running(manifests, host_root, {"etude-store": store_claim(host_root)}) as cluster,
        Prometheus(cluster, manifests, host_root / "prometheus") as prometheus,
    ):
        (pod,) = cluster.pods("etude-reconciler")
        selector = f'namespace="{chart_check.NAMESPACE}", release="etude"'

        def ready_series() -> list[dict[str, Any]]:
            return prometheus.query(f"etude_service_ready{{{selector}}} == 1")

        wait_for(
            "the reconciler scraped ready",
            lambda: bool(ready_series()),
            60,
            lambda: f"{cluster.describe()}\n{prometheus.targets()}\n{prometheus.log()}",
        )
        (series,) = ready_series()
        labels = series["metric"]
        assert (labels["pod"], labels["component"], labels["service"], labels["job"]) == (
            pod.name,
            "reconciler",
            "reconciler",  # the service's own label, not the target's Service name
            "etude-reconciler",
        ), labels
        # Only the ClusterIP Service is scraped (the headless one is labelled not to be).
        assert [t["labels"]["service"] for t in prometheus.targets()] == ["etude-reconciler"]

        def absent_alerts() -> set[str]:
            pending = prometheus.query('ALERTS{alertname="EtudeServiceAbsent"}')
            return {alert["metric"]["component"] for alert in pending}

        wait_for(
            "absent services alerted",
            lambda: absent_alerts() == {"envs", "inference", "trainer", "evals"},
            30,
            lambda: str(absent_alerts()),
        )
        states = prometheus.rule_states()
        assert states and all(s["health"] == "ok" for s in states), [
            (s["name"], s["health"], s.get("lastError")) for s in states if s["health"] != "ok"
        ]


def test_what_a_killed_test_left_on_the_host_is_removed_by_the_next_cluster(
    host_root: Path,
) -> None:
    """A cluster's journal names a process that is gone: its empty mount points, its
    network namespaces (and a process left in one) and links go; a file with content
    (not a mount stub) stays."""
    import json
    import subprocess

    from tests.cluster_support import JOURNALS, remove_leftovers
    from tests.podnet_support import netns_pids

    gone = subprocess.Popen(["true"])
    gone.wait()
    stub_dir, stub_file, kept = host_root / "etc-etude", host_root / "config.toml", host_root / "x"
    stub_dir.mkdir()
    stub_file.touch()
    kept.write_text("someone's")
    prefix = f"et{gone.pid % 0xFFFF:04x}z"
    subprocess.run(["ip", "netns", "add", f"{prefix}-pod"], check=True)
    subprocess.run(["ip", "link", "add", f"{prefix}-br", "type", "bridge"], check=True)
    # A pod's process the dead test never stopped, still in the pod's namespace.
    left = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-pod", "sleep", "600"])
    try:
        deadline = time.monotonic() + 10
        while left.pid not in netns_pids(f"{prefix}-pod") and time.monotonic() < deadline:
            time.sleep(0.05)
        JOURNALS.mkdir(parents=True, exist_ok=True)
        journal = JOURNALS / f"{gone.pid}-test.json"
        paths = [str(stub_dir), str(stub_file), str(kept)]
        journal.write_text(json.dumps({"pid": gone.pid, "prefix": prefix, "paths": paths}))
        removed = remove_leftovers()
        assert {
            str(stub_dir),
            str(stub_file),
            f"process {left.pid} in {prefix}-pod",
            f"netns {prefix}-pod",
            f"link {prefix}-br",
        } <= set(removed), removed
        assert left.wait(10) == -signal.SIGKILL
    finally:
        left.kill()
    assert not stub_dir.exists() and not stub_file.exists() and kept.exists()
    assert not journal.exists()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{prefix}-pod" not in namespaces


def _wrong_container_port(manifests: Manifests) -> None:
    ports = container(manifests, "Deployment", "etude-reconciler")["ports"]
    ports[0]["containerPort"] += 10


def _wrong_target_port(manifests: Manifests) -> None:
    service = chart_check.find(manifests, "Service", "etude-redis")
    service["spec"]["ports"][0]["targetPort"] = "redis-server"


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_wrong_container_port, "port 50051 maps to 50061"),
        (_wrong_target_port, "targetPort 'redis-server' is no containerPort"),
    ],
    ids=["container-port", "target-port"],
)
def test_emulator_refuses_services_that_miss_their_pods(
    mutate: Callable[[Manifests], None], expected: str, host_root: Path
) -> None:
    from tests.cluster_support import Cluster

    manifests = copy.deepcopy(reconciler_and_redis())
    mutate(manifests)
    cluster = Cluster(manifests, root=host_root, namespace="etude", secrets={}, claims={})
    assert any(expected in problem for problem in cluster.problems), cluster.problems


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        ("etude-reconciler", "Service/etude-reconciler is of type ClusterIP"),
        ("etude-elsewhere", "no such Service 'etude-elsewhere'"),
    ],
)
def test_emulator_refuses_a_load_balancer_name_without_its_load_balancer(
    service: str, expected: str, host_root: Path
) -> None:
    from tests.cluster_support import Cluster

    cluster = Cluster(
        reconciler_and_redis(),
        root=host_root,
        namespace="etude",
        secrets={},
        claims={},
        load_balancer_names={"reconciler.example.internal": service},
    )
    assert cluster.problems == [f"reconciler.example.internal: {expected}"], cluster.problems


def _missing_secret_key(manifests: Manifests) -> None:
    env = container(manifests, "Deployment", "etude-reconciler")["env"]
    env[0]["valueFrom"]["secretKeyRef"]["key"] = "tokn"


def _wrong_mount_path(manifests: Manifests) -> None:
    mounts = container(manifests, "Deployment", "etude-reconciler")["volumeMounts"]
    mounts[0]["mountPath"] = "/etc/etude/run.toml"


def _probe_on_closed_port(manifests: Manifests) -> None:
    probe = container(manifests, "Deployment", "etude-reconciler")["readinessProbe"]
    probe["grpc"]["port"] = 50059


def _wrong_service_name(manifests: Manifests) -> None:
    chart_check.find(manifests, "Service", "etude-redis")["metadata"]["name"] = "etude-redis-0"


def _wrong_env_name(manifests: Manifests) -> None:
    env = container(manifests, "Deployment", "etude-reconciler")["env"]
    env[0]["name"] = "ETUDE_AUTH_TOKEN"


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_missing_secret_key, "env ETUDE_AUTH__TOKEN: secret 'etude-token' has no key 'tokn'"),
        (_wrong_mount_path, "exited"),
        (_probe_on_closed_port, "readiness probe failed"),
        (_wrong_service_name, "looked up 'etude-redis'"),
        (_wrong_env_name, "exited"),
    ],
    ids=["secret-key", "mount-path", "probe-port", "service-name", "env-name"],
)
def test_a_broken_reconciler_never_turns_ready_and_says_why(
    mutate: Callable[[Manifests], None], expected: str, host_root: Path
) -> None:
    manifests = copy.deepcopy(reconciler_and_redis())
    mutate(manifests)
    with running(manifests, host_root, {"etude-store": store_claim(host_root)}) as cluster:
        (pod,) = cluster.pods("etude-reconciler")
        wait_for(
            f"the emulator reports {expected!r}",
            lambda: expected in "\n".join(cluster.all_problems() + pod.process.events),
            40,
            lambda: f"{cluster.describe()}\n{pod.process.log().read_text(errors='replace')[-3000:]}"
            if pod.process.log().exists()
            else cluster.describe(),
        )
        assert not pod.process.ready


# -- the whole release -----------------------------------------------------------------


def _port(pod: Any, name: str) -> int:
    """The containerPort named `name` of the pod's container, as rendered."""
    (container,) = pod.process.spec["containers"]
    return next(int(p["containerPort"]) for p in container["ports"] if p.get("name") == name)


def _value(cluster: Any, workload: str, index: int, name: str, **labels: str) -> float:
    pod = cluster.pods(workload)[index]
    try:
        text = metrics(pod.ip, _port(pod, "http"))
    except OSError:
        return -1.0
    found = metric_value(text, name, **labels)
    return -1.0 if found is None else found


def _every_pod_ready(cluster: Any) -> bool:
    return all(p.process.ready for w in cluster.workloads for p in cluster.pods(w))


def _trains_serves_and_scores(
    cluster: Any, trainer: str, inference: str, evals: str
) -> Callable[[], float]:
    """Waits until every pod is ready, the `trainer` workload has trained 3 RL steps, the
    `inference` one serves a trained version and the `evals` one scored a version;
    returns the trainer's step as a function."""

    def step() -> float:
        return _value(cluster, trainer, 0, "etude_trainer_step")

    wait_for("every pod ready", lambda: _every_pod_ready(cluster), 480, cluster.describe)
    wait_for("3 RL steps", lambda: step() >= 3, 300, cluster.describe)
    wait_for(
        "inference serves a trained version",
        lambda: _value(cluster, inference, 0, "etude_inference_serving_version") >= 1,
        120,
        cluster.describe,
    )
    wait_for(
        "evals scored a version",
        lambda: _value(cluster, evals, 0, "etude_evals_version") >= 0,
        180,
        cluster.describe,
    )
    return step


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_rendered_single_region_release_trains_scales_and_heals(host_root: Path) -> None:
    manifests = render_release(SINGLE_REGION, CPU_TINY)
    claims = {
        "etude-store": store_claim(host_root),
        "etude-models": model_claim(host_root),
        "etude-checkpoints": claim_dir(host_root, "etude-checkpoints"),
    }
    with (
        running(manifests, host_root, claims) as cluster,
        Prometheus(cluster, manifests, host_root / "prometheus") as prometheus,
    ):
        assert cluster.problems == [], cluster.problems
        # The trainer trains, inference follows the published versions, evals score one.
        step = _trains_serves_and_scores(cluster, "etude-trainer", "etude-inference", "etude-evals")

        # kubectl scale, mid-run: inference 1 -> 2 and envs 1 -> 2. A vLLM start beside a
        # generating engine took over 4 minutes on 2 cores, so the rollouts pause while
        # the new replica loads (envs to 0: its workers hand their slots back, nothing is
        # lost), as its own node would spare it on a cluster; then envs come back at 2.
        cluster.scale("etude-envs", 0)
        cluster.scale("etude-inference", 2)
        all_ready = functools.partial(_every_pod_ready, cluster)
        wait_for("the new inference replica ready", all_ready, 300, cluster.describe)
        cluster.scale("etude-envs", 2)
        at_scale = step()
        wait_for("the new envs pods ready", all_ready, 180, cluster.describe)
        for index in (0, 1):
            wait_for(
                f"envs pod {index} finishes rollouts",
                lambda i=index: _value(cluster, "etude-envs", i, "etude_envs_rollouts_total") > 0,
                120,
                cluster.describe,
            )
        # The headless Service lists the new replica once ready; the envs workers' channels
        # (dns:///, round_robin, 5-s connection ages here) reach it.
        wait_for(
            "the new inference replica serves generations",
            lambda: _value(
                cluster,
                "etude-inference",
                1,
                "grpc_server_handled_total",
                grpc_method="Generate",
                grpc_code="OK",
            )
            > 0,
            60,
            cluster.describe,
        )
        wait_for("steps advance after scaling", lambda: step() > at_scale, 180, cluster.describe)

        # A pod's process dies (SIGKILL): it is restarted and the run goes on.
        (victim, *_) = cluster.pods("etude-envs")
        victim.process.kill()
        wait_for(
            "the killed pod restarted", lambda: victim.process.restarts >= 1, 60, cluster.describe
        )
        wait_for("the killed pod ready again", lambda: victim.process.ready, 120, cluster.describe)
        after_kill = step()
        wait_for("steps advance after the kill", lambda: step() > after_kill, 180, cluster.describe)

        # Nothing lost: no slot died, no pod reported a problem.
        dead = _value(cluster, "etude-reconciler", 0, "etude_reconciler_dead_slots_total")
        assert dead <= 0, dead
        assert cluster.all_problems() == [], cluster.all_problems()
        _observed(prometheus, manifests, cluster)
        # The killed pod was seen down: `up` (what EtudePodDown watches) went to 0 for it
        # while its process was gone, though its own series had stopped.
        down = prometheus.query(f'min_over_time(up{{pod="{victim.name}"}}[15m]) == 0')
        assert down, prometheus.query(f'up{{pod="{victim.name}"}}')


def _observed(prometheus: Prometheus, manifests: Manifests, cluster: Any) -> None:
    """What Prometheus made of the run: every pod a target that is up, every panel query
    of the shipped dashboards answering data, every alert rule evaluated without error."""
    pods = {p.name for w in cluster.workloads for p in cluster.pods(w)}
    pods -= {p.name for p in cluster.pods("etude-redis")}  # Redis has no ServiceMonitor

    def targets() -> dict[str, str]:
        return {t["labels"]["pod"]: t["health"] for t in prometheus.targets()}

    wait_for(
        "every pod scraped",
        lambda: {pod for pod, health in targets().items() if health == "up"} >= pods,
        30,
        lambda: f"{targets()}\n{prometheus.log()}",
    )
    rate_interval_s = 4 * prometheus.scrape_s
    queries = dashboard_queries(manifests)
    assert len(queries) > 100, len(queries)
    # A rate panel has data only while what it counts goes on (a tool call within the last
    # rate interval): the queries still empty are asked again while the job runs.
    empty = {f"{dashboard} / {title}": expr for dashboard, title, expr in queries}

    def every_query_answers() -> bool:
        for panel, expr in list(empty.items()):
            sent = as_grafana_sends(expr, chart_check.NAMESPACE, "etude", rate_interval_s)
            if prometheus.query(sent):
                del empty[panel]
        return not empty

    wait_for(
        "every dashboard query answers",
        every_query_answers,
        90,
        lambda: "\n".join(f"{panel}: {expr}" for panel, expr in empty.items()),
    )
    states = prometheus.rule_states()
    assert len(states) >= 10 and all(
        s["health"] == "ok" and not s["lastEvaluation"].startswith("0001-")  # 0001: never
        for s in states
    ), [(s["name"], s["health"], s.get("lastError")) for s in states]


# examples/region-rollouts.yaml's endpoints.reconciler: the training region's reconciler
# behind its internal load balancer, and the DNS record of that load balancer.
RECONCILER_LB = "reconciler.train.example.internal"
MODEL_PREFIX = "models/prod-base"  # both examples' model.storePrefix


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_rendered_region_pair_trains_over_tls_on_the_bucket_model(host_root: Path) -> None:
    train = render_release(REGION_TRAIN, CPU_TINY, CPU_REGIONS, name="etude-train")
    rollouts = render_release(REGION_ROLLOUTS, CPU_TINY, CPU_REGIONS, name="etude-rollouts")
    manifests = train + rollouts
    store = store_claim(host_root, model_prefix=MODEL_PREFIX)
    namespace = chart_check.NAMESPACE
    certificate = tls_secret([*service_names(manifests, namespace), RECONCILER_LB])
    # The examples name Secrets the user creates: the bucket's credentials (unused by the
    # file:// bucket of the CPU overrides, but every pod that reads the store mounts them).
    bucket = {"AWS_ACCESS_KEY_ID": "unused", "AWS_SECRET_ACCESS_KEY": "unused"}
    claims = {"etude-store": store, "etude-checkpoints": claim_dir(host_root, "etude-checkpoints")}
    with running(
        manifests,
        host_root,
        claims,
        more_secrets={"etude-grpc-tls": certificate, "etude-s3": bucket},
        load_balancer_names={RECONCILER_LB: "etude-train-reconciler"},
    ) as cluster:
        assert cluster.problems == [], cluster.problems
        assert set(cluster.workloads) == {
            "etude-train-reconciler",
            "etude-train-redis",
            "etude-train-trainer",
            "etude-rollouts-envs",
            "etude-rollouts-inference",
            "etude-rollouts-evals",
        }, sorted(cluster.workloads)
        # Every pod of both releases: the training region trains on the rollout region's
        # rollouts, whose inference serves its versions and whose evals score one.
        _trains_serves_and_scores(
            cluster, "etude-train-trainer", "etude-rollouts-inference", "etude-rollouts-evals"
        )
        # The rollout region looked the reconciler up by the load balancer's name (steps
        # advancing show it reached it there), over TLS (the reconciler's certificate
        # verifies under that name, a plaintext call fails); both regions synced the model
        # from the bucket, and the trainer's checkpoints are in the bucket.
        assert cluster.network is not None
        assert cluster.network.zone.queries.get(RECONCILER_LB, 0) > 0, cluster.network.zone.queries
        for workload in ("etude-train-trainer", "etude-rollouts-inference", "etude-rollouts-envs"):
            log = cluster.pods(workload)[0].process.log().read_text(errors="replace")
            assert f"model synced from {MODEL_PREFIX}" in log, (workload, log[-2000:])
        reconciler = cluster.pods("etude-train-reconciler")[0]
        target = f"{reconciler.ip}:{_port(reconciler, 'grpc')}"
        assert _health(target, certificate["ca.crt"], RECONCILER_LB) == "SERVING"
        assert _health(target, None, None).startswith("UNAVAILABLE")
        bucket_store = file_store(store)
        run_name = chart_check.load_values(CPU_TINY)["config"]["run"]["name"]
        saved = list_store_checkpoints(bucket_store, f"{CheckpointConfig().prefix}/{run_name}")
        assert saved and saved[-1].step >= 2, saved
        assert cluster.all_problems() == [], cluster.all_problems()


def _health(target: str, ca: str | None, name: str | None) -> str:
    """The gRPC health status of `target` over TLS verified for `name` with `ca`, or in
    plaintext without `ca`; the status code's name when the call fails."""
    if ca is None:
        channel = grpc.insecure_channel(target)
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.encode())
        options = [("grpc.ssl_target_name_override", name)]
        channel = grpc.secure_channel(target, credentials, options=options)
    with channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
