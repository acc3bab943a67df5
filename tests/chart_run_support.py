"""Rendering the chart as `helm install -f A -f B` does and handing it to the emulated
cluster (tests/cluster_support.py) with the volumes and Secrets a cluster would have."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import secrets
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.cluster_support import Cluster
from tests.podnet_support import CLUSTER_DOMAIN

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import chart_check  # noqa: E402

if TYPE_CHECKING:
    from services.objectstore import ObjectStore

log = logging.getLogger(__name__)

SINGLE_REGION = chart_check.CHART / "examples" / "single-region.yaml"
REGION_TRAIN = chart_check.CHART / "examples" / "region-train.yaml"
REGION_ROLLOUTS = chart_check.CHART / "examples" / "region-rollouts.yaml"
CPU_TINY = chart_check.CHART / "ci" / "cpu-tiny.yaml"
CPU_REGIONS = chart_check.CHART / "ci" / "cpu-regions.yaml"
APP_UID = 10001


def merge_values(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of two values files: maps deep-merged, anything else replaced."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def render_release(
    *files: Path, name: str = chart_check.RELEASE, namespace: str = chart_check.NAMESPACE
) -> list[dict[str, Any]]:
    """`helm template <name> -n <namespace> -f files[0] -f files[1] ...`"""
    values: dict[str, Any] = {}
    for path in files:
        values = merge_values(values, chart_check.load_values(path))
    return chart_check.render(values, name=name, namespace=namespace)


def claim_dir(root: Path, name: str, uid: int = APP_UID) -> Path:
    """A bound volume: a host directory the pods' user owns."""
    path = root / "claims" / name
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, uid)
    return path


def wait_for(
    what: str, check: Callable[[], bool], timeout_s: float, describe: Callable[[], str]
) -> None:
    start = time.monotonic()
    while not check():
        if time.monotonic() > start + timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{describe()}")
        time.sleep(0.5)
    log.info("%s: %.1f s", what, time.monotonic() - start)


def metrics(address: str, port: int) -> str:
    """A pod's /metrics, read over the pod network."""
    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=5) as answer:
        text: str = answer.read().decode()
    return text


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of `name` whose labels include `labels`."""
    found = None
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            found = (found or 0.0) + float(value)
    return found


@contextlib.contextmanager
def running(
    manifests: list[dict[str, Any]],
    root: Path,
    claims: dict[str, Path],
    token: str | None = None,
    more_secrets: dict[str, dict[str, str]] | None = None,
    load_balancer_names: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """The manifests running; the token Secret the examples name exists (as
    `kubectl create secret generic etude-token --from-literal=token=...` makes it), and
    `more_secrets` beside it."""
    token = token or secrets.token_hex(16)
    cluster = Cluster(
        manifests,
        root=root / "cluster",
        namespace=chart_check.NAMESPACE,
        secrets={"etude-token": {"token": token}, **(more_secrets or {})},
        claims=claims,
        load_balancer_names=load_balancer_names,
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def file_store(path: Path) -> ObjectStore:
    """The file bucket at `path`, as the pods open it (a file:// object store)."""
    from services.config import ObjectStoreConfig
    from services.objectstore import open_store

    return open_store(ObjectStoreConfig(url=f"file://{path}"))


def store_claim(root: Path, num_tasks: int = 200, model_prefix: str | None = None) -> Path:
    """The bucket's claim (objectStore.fileClaim) holding the task file the example's jsonl
    feeder reads, as `etude tasks export --key tasks/train.jsonl` writes it, and with
    `model_prefix` the tiny model under it, as `etude model push --prefix` uploads it."""
    from google.protobuf import json_format

    from services.config.reconciler import FeederConfig
    from services.model_factory.build import init_model
    from services.model_source import push_model
    from services.reconciler.feeders import build_feeder

    path = claim_dir(root, "etude-store")
    store = file_store(path)
    feeder = build_feeder(
        FeederConfig(kind="generator", generator="services.families.synthetic:task_at")
    )
    text = "".join(
        json_format.MessageToJson(task, indent=None) + "\n"
        for task in feeder.tasks_from(0, num_tasks)
    )
    store.put("tasks/train.jsonl", text.encode())
    if model_prefix is not None:
        with tempfile.TemporaryDirectory() as scratch:
            init_model("tiny", Path(scratch) / "model", seed=0)
            push_model(store, Path(scratch) / "model", model_prefix)
    _give_to_app(path)
    return path


def tls_secret(names: list[str]) -> dict[str, str]:
    """A kubernetes.io/tls Secret's keys (ca.crt, tls.crt, tls.key): a certificate for
    `names` issued by a CA made for the test (what cert-manager would issue)."""
    import trustme

    authority = trustme.CA()
    issued = authority.issue_cert(*names)
    return {
        "ca.crt": authority.cert_pem.bytes().decode(),
        "tls.crt": "".join(blob.bytes().decode() for blob in issued.cert_chain_pems),
        "tls.key": issued.private_key_pem.bytes().decode(),
    }


def service_names(manifests: list[dict[str, Any]], namespace: str) -> list[str]:
    """Every name a client may dial a rendered Service by: short, namespaced, cluster."""
    names = []
    for manifest in manifests:
        if manifest["kind"] == "Service":
            name = manifest["metadata"]["name"]
            names += [name, f"{name}.{namespace}", f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"]
    return names


def model_claim(root: Path) -> Path:
    """The model claim: the tiny model at model.dir (/models/etude) under its mount."""
    from services.model_factory.build import init_model

    path = claim_dir(root, "etude-models")
    init_model("tiny", path / "etude", seed=0)
    _give_to_app(path)
    return path


def _give_to_app(path: Path) -> None:
    for child in [path, *path.rglob("*")]:
        os.chown(child, APP_UID, APP_UID)
