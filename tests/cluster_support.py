"""A one-node cluster for a rendered chart: its Deployments and StatefulSets run as pods
(tests/kubelet_support.py, tests/pod_lifecycle.py) on a pod network of their own
(tests/podnet_support.py), its Services resolve to their ready pods.

`Cluster.apply` checks the manifests the way the API server and the controllers would
act on them, strictly: every Service must select a workload and target a port its pods
declare (and, since a Service name resolves to the pods themselves here, not through a
virtual IP, use the target port's number as its own port); Secrets and claims are given
by the test (`kubectl create secret`, the bound volumes). `scale` does what
`kubectl scale` does. Not emulated: scheduling (nodeSelector, tolerations, affinity,
resources), NetworkPolicies, PodDisruptionBudgets, autoscalers, RuntimeClasses, seccomp,
Service virtual IPs and port remapping, rolling updates, and the CRD kinds
(ServiceMonitor, PrometheusRule), which are read by the test itself.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.kubelet_support import (
    PodContext,
    container_command,
    decode_secret,
    pod_volumes,
)
from tests.pod_lifecycle import PodProcess
from tests.podnet_support import PodNetwork, remove_network

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
IGNORED_KINDS = frozenset(
    {
        "ServiceAccount",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ServiceMonitor",
        "PrometheusRule",
        "HorizontalPodAutoscaler",
        "ScaledObject",
    }
)


# What a cluster leaves on the host while it runs (the mount points it created, its
# network's prefix), one file per cluster: a test process killed before `close` (a CI
# timeout, SIGKILL) leaves them behind, and the next cluster removes them, or a stale
# /etc/etude/config.toml could stand in for a mount a later test breaks on purpose.
JOURNALS = Path("/var/tmp/etude-cluster-journals")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Removes what clusters of dead processes left: their (empty) mount points, network
    namespaces and links. Returns what it removed."""
    removed: list[str] = []
    if not JOURNALS.is_dir():
        return removed
    for journal in JOURNALS.glob("*.json"):
        with contextlib.suppress(ValueError, OSError):
            entry = json.loads(journal.read_text())
            if _alive(int(entry["pid"])):
                continue
            for raw in reversed(entry.get("paths", [])):
                path = Path(raw)
                with contextlib.suppress(OSError):
                    if path.is_dir() and not path.is_mount():
                        path.rmdir()  # only when empty: a mount point, nothing of anyone's
                        removed.append(raw)
                    elif path.is_file() and path.stat().st_size == 0:
                        path.unlink()
                        removed.append(raw)
            if prefix := entry.get("prefix"):
                removed += remove_network(prefix)
            journal.unlink()
    return removed


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


@dataclass
class Pod:
    name: str
    workload: str
    labels: dict[str, str]
    ip: str
    process: PodProcess
    index: int | None = None  # a StatefulSet pod's ordinal


@dataclass
class Workload:
    kind: str
    manifest: dict[str, Any]
    pods: list[Pod] = field(default_factory=list)


class Cluster:
    """Runs the workloads of `manifests` in `namespace`; `close` removes every trace."""

    def __init__(
        self,
        manifests: list[dict[str, Any]],
        *,
        root: Path,
        namespace: str,
        secrets: dict[str, dict[str, str]],
        claims: dict[str, Path],
        load_balancer_names: dict[str, str] | None = None,
    ) -> None:
        """`load_balancer_names`: DNS names outside the cluster and the LoadBalancer
        Service each is the record of (what a provider's load balancer and its DNS entry
        give another region); the name resolves to that Service's ready pods."""
        self.namespace, self.root = namespace, root
        self.load_balancer_names = dict(load_balancer_names or {})
        self.claims = dict(claims)
        self.config_maps: dict[str, dict[str, str]] = {}
        self.secrets = dict(secrets)
        self.services: dict[str, dict[str, Any]] = {}
        self.workloads: dict[str, Workload] = {}
        self.problems: list[str] = []
        self._made_paths: list[Path] = []
        self._journal = JOURNALS / f"{os.getpid()}-{id(self):x}.json"
        self._lock = threading.RLock()
        for manifest in manifests:
            kind, name = manifest["kind"], manifest["metadata"]["name"]
            if kind == "ConfigMap":
                self.config_maps[name] = dict(manifest.get("data", {}))
            elif kind == "Secret":
                self.secrets[name] = decode_secret(manifest)
            elif kind == "Service":
                self.services[name] = manifest
            elif kind in WORKLOAD_KINDS:
                self.workloads[name] = Workload(kind, manifest)
            elif kind not in IGNORED_KINDS:
                self.problems.append(f"{kind}/{name}: kind not emulated")
        self.problems += self._check_services()
        for name, service in self.load_balancer_names.items():
            if service not in self.services:
                self.problems.append(f"{name}: no such Service {service!r}")
            elif (kind := self.services[service]["spec"].get("type", "ClusterIP")) != (
                "LoadBalancer"
            ):
                self.problems.append(f"{name}: Service/{service} is of type {kind}")
        self.network: PodNetwork | None = None
        atexit.register(self.close)

    def _check_services(self) -> list[str]:
        found = []
        for name, service in self.services.items():
            selector = service["spec"].get("selector") or {}
            templates = [
                w.manifest["spec"]["template"]
                for w in self.workloads.values()
                if selects(selector, w.manifest["spec"]["template"]["metadata"].get("labels", {}))
                or (
                    "apps.kubernetes.io/pod-index" in selector
                    and selects(
                        {k: v for k, v in selector.items() if k != "apps.kubernetes.io/pod-index"},
                        w.manifest["spec"]["template"]["metadata"].get("labels", {}),
                    )
                    and w.kind == "StatefulSet"
                )
            ]
            if not templates:
                found.append(f"Service/{name}: its selector {selector} selects no workload's pods")
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                for template in templates:
                    declared = {
                        p.get("name"): p["containerPort"]
                        for c in template["spec"]["containers"]
                        for p in c.get("ports", [])
                    }
                    number = declared.get(target) if isinstance(target, str) else target
                    if number is None or number not in declared.values():
                        found.append(
                            f"Service/{name} port {port.get('name', port['port'])}: targetPort "
                            f"{target!r} is no containerPort of its pods ({declared})"
                        )
                    elif number != port["port"]:
                        found.append(
                            f"Service/{name}: port {port['port']} maps to {number}; the emulator "
                            "resolves Services to pod addresses, so ports must be equal"
                        )
        return found

    # -- running ------------------------------------------------------------------

    def start(self) -> None:
        """Creates the pod network and every workload's pods."""
        self.root.mkdir(parents=True, exist_ok=True)
        remove_leftovers()
        self.network = PodNetwork(self.namespace)
        self._write_journal()
        self._update_endpoints()  # every Service name exists, with no ready pod yet
        for name, workload in self.workloads.items():
            self.scale(name, int(workload.manifest["spec"].get("replicas", 1)))

    def _new_pod(self, workload: Workload, index: int | None) -> Pod:
        assert self.network is not None
        meta, spec = workload.manifest["metadata"], workload.manifest["spec"]
        template = spec["template"]
        labels = dict(template["metadata"].get("labels", {}))
        subdomain = None
        if index is not None:
            name = f"{meta['name']}-{index}"
            labels["apps.kubernetes.io/pod-index"] = str(index)
            labels["statefulset.kubernetes.io/pod-name"] = name
            subdomain = spec.get("serviceName")
        else:
            name = f"{meta['name']}-{secrets.token_hex(3)}"
        netns, ip = self.network.add_pod(name, name, subdomain)
        root = self.root / "pods" / name
        root.mkdir(parents=True, exist_ok=True)
        pod_spec = template["spec"]
        fs_group = pod_spec.get("securityContext", {}).get("fsGroup")
        context = PodContext(
            name=name,
            namespace=self.namespace,
            ip=ip,
            labels=labels,
            service_account=pod_spec.get("serviceAccountName", "default"),
            config_maps=self.config_maps,
            secrets=self.secrets,
            claims=self.claims,
            root=root,
            made_paths=self._made,
        )
        templates = {}
        for claim in spec.get("volumeClaimTemplates", []):  # one volume per pod, kept
            path = self.root / "claims" / f"{claim['metadata']['name']}-{name}"
            path.mkdir(parents=True, exist_ok=True)
            templates[claim["metadata"]["name"]] = path
        volumes: dict[str, Any] = {}

        def build(container: dict[str, Any]) -> Any:
            if not volumes:
                volumes.update(pod_volumes(context, pod_spec, templates, fs_group))
            return container_command(context, netns, pod_spec, container, volumes)

        process = PodProcess(name, ip, pod_spec, build, root, self._update_endpoints)
        return Pod(name, meta["name"], labels, ip, process, index)

    def _made(self, path: Path) -> None:
        self._made_paths.append(path)
        self._write_journal()

    def _write_journal(self) -> None:
        JOURNALS.mkdir(parents=True, exist_ok=True)
        entry = {
            "pid": os.getpid(),
            "prefix": self.network.prefix if self.network is not None else None,
            "paths": [str(path) for path in self._made_paths],
        }
        scratch = self._journal.with_suffix(".tmp")
        scratch.write_text(json.dumps(entry))
        os.replace(scratch, self._journal)

    def scale(self, workload_name: str, replicas: int) -> None:
        """`kubectl scale`: new pods started, surplus pods stopped gracefully (newest, or
        the highest ordinals, first)."""
        workload = self.workloads[workload_name]
        with self._lock:
            while len(workload.pods) < replicas:
                index = len(workload.pods) if workload.kind == "StatefulSet" else None
                workload.pods.append(self._new_pod(workload, index))
                self._update_endpoints()
            surplus = workload.pods[replicas:]
            del workload.pods[replicas:]
        for pod in reversed(surplus):
            pod.process.stop()
            assert self.network is not None
            self.network.remove_pod(pod.name)

    def _update_endpoints(self) -> None:
        """Every Service name resolves to its ready pods (all of them with
        publishNotReadyAddresses); a StatefulSet pod's name under its Service to it."""
        if self.network is None:
            return
        with self._lock:
            pods = [pod for w in self.workloads.values() for pod in w.pods]
            resolved: dict[str, list[str]] = {}
            for name, service in self.services.items():
                selector = service["spec"].get("selector") or {}
                everyone = service["spec"].get("publishNotReadyAddresses", False)
                resolved[name] = [
                    pod.ip
                    for pod in pods
                    if selects(selector, pod.labels) and (everyone or pod.process.ready)
                ]
                self.network.zone.set(self.network.fqdn(name), resolved[name])
                for pod in pods:
                    if selects(selector, pod.labels) and service["spec"].get("clusterIP") == "None":
                        self.network.zone.set(self.network.fqdn(f"{pod.name}.{name}"), [pod.ip])
            for name, service_name in self.load_balancer_names.items():
                self.network.zone.set(name, resolved.get(service_name, []))

    def pods(self, workload: str) -> list[Pod]:
        return list(self.workloads[workload].pods)

    def all_problems(self) -> list[str]:
        """The apply-time problems, every pod's, and Service names pods asked for in vain."""
        found = list(self.problems)
        for workload in self.workloads.values():
            for pod in workload.pods:
                found += [f"pod {pod.name}: {p}" for p in pod.process.problems]
        if self.network is not None:
            found += [
                f"a pod looked up {name!r}: no such Service"
                for name in self.network.unknown_service_lookups()
            ]
        return found

    def describe(self, log_lines: int = 12) -> str:
        lines = []
        for workload in self.workloads.values():
            for pod in workload.pods:
                p = pod.process
                lines.append(
                    f"{pod.name} {pod.ip} {p.phase} ready={p.ready} restarts={p.restarts} "
                    f"events={p.events[-4:]}"
                )
                if p.log().exists():
                    tail = p.log().read_text(errors="replace").splitlines()[-log_lines:]
                    lines += [f"  | {line}" for line in tail]
        return "\n".join(lines)

    def close(self) -> None:
        """Stops every pod (SIGTERM, then SIGKILL), removes the network and host paths."""
        stoppers = []
        for workload in self.workloads.values():
            pods, workload.pods = workload.pods, []
            for pod in pods:
                stopper = threading.Thread(target=pod.process.stop, kwargs={"grace": 10})
                stopper.start()
                stoppers.append(stopper)
        for stopper in stoppers:
            stopper.join(60)
        if self.network is not None:
            self.network.close()
        for path in reversed(self._made_paths):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()
        self._made_paths.clear()
        self._journal.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)
