"""Shared fixtures: a tiny model, free ports, and a whole deployment of real processes."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import SERVICE_NAMES
from services.wire.ports import free_port, service_ports
from tests.objectstore_support import CREDENTIALS, MIN_PART

REPO = Path(__file__).resolve().parent.parent
TOKEN = "test-token-0123456789"
# `make test` runs the suite on two pytest-xdist workers (gw0, gw1). Each has a database of
# the CI Redis of its own, so runs of the same name ("test") on both never share keys.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
REDIS_URL = f"redis://127.0.0.1:6379/{int(WORKER.removeprefix('gw') or 0)}"

# Fixtures that start a vLLM engine or the whole deployment (a minute or more on 2 cores):
# a test that uses one is `slow`, so `pytest -m "not slow"` is the fast tier.
ENGINE_FIXTURES = frozenset({"deployment", "replica", "replicas", "served", "pipeline"})
# Fixtures whose processes need Redis (the deployment's and the evals pipeline's reconciler).
REDIS_FIXTURES = frozenset({"deployment", "pipeline"})
# Modules whose functions start a reconciler or a redis-server.
REDIS_HELPERS = frozenset({"tests.reconciler_support", "services.launcher.redis_server"})


def _talks_to_redis(item: pytest.Item) -> bool:
    """A test that uses a Redis-backed fixture, or whose module imports a helper that
    starts a reconciler or a redis-server, or the redis client (a test that reaches Redis
    some other way says so with ``@pytest.mark.redis``)."""
    if REDIS_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    module = getattr(item, "module", None)
    return module is not None and any(
        getattr(value, "__module__", None) in REDIS_HELPERS
        or str(getattr(value, "__name__", "")).split(".")[0] == "redis"
        for value in vars(module).values()
    )


# `make test` runs two pytest-xdist workers; what must not run beside itself on the other
# one is kept on one worker, a module at a time: the tests that run a whole stack or an
# emulated cluster for minutes (two such runs would starve each other's vLLM start on 2
# cores, and the clusters' mount points on the host are one machine's), those that bind
# the loopback aliases 127.0.0.2-6, and the modules on the session's deployment (one
# worker starts it) with test_mtp_draft, whose vLLM engines must not start beside
# test_inference's (on 2 cores, three engine starts at once starved the other worker's
# sandboxed loops into host_overloaded). xdist's own `xdist_group` marks do not group
# under pytest 9.2 (xdist 3.8 renames `item._nodeid`, which pytest no longer reads), so
# the scheduler groups by module name, and the collection hook checks the list of
# deployment modules is whole.
STACK_MODULES = frozenset(
    {
        "test_e2e",
        "test_rendered_chart",
        "test_load_balancing",
        "test_wire_balancing",
        "test_launcher",
    }
)
DEPLOYMENT_MODULES = frozenset(
    {
        "test_chart_metrics",
        "test_envs_harness",
        "test_envs_service",
        "test_fuzz",
        "test_inference",
        "test_mtp_draft",
        "test_services",
    }
)


# Modules whose tests build on what the module's earlier tests did (a module-scoped
# pipeline whose versions and evals later tests read): each runs whole on one worker,
# in order. Elsewhere a test goes where a worker is free, and each worker builds its own
# module fixtures.
ORDERED_MODULES = frozenset({"test_evals_service"})


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N` (xdist's load scheduling), with the stack modules one unit, the deployment
    modules another and each ordered module its own (each runs whole on one worker;
    every other test goes where a worker is free)."""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "load":  # another --dist asked for by name
        return None

    class GroupedScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            if module in STACK_MODULES:
                return "stack"
            if module in DEPLOYMENT_MODULES:
                return "deployment"
            if module in ORDERED_MODULES:
                return module
            return nodeid

    return GroupedScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tiers: `slow` for tests on an engine fixture, `redis` for tests on Redis."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if ENGINE_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
        if _talks_to_redis(item):
            item.add_marker(pytest.mark.redis)
        if "deployment" in fixtures and _module(item.nodeid) not in DEPLOYMENT_MODULES:
            raise pytest.UsageError(
                f"{item.nodeid} uses the deployment fixture: add its module to "
                "DEPLOYMENT_MODULES in tests/conftest.py (one worker starts the deployment)"
            )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `tiny` preset model made by the factory, shared by the session."""
    from services.model_factory.build import init_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    init_model("tiny", out, seed=0)
    return out


def write_config(
    path: Path,
    *,
    model_dir: Path,
    state_dir: Path,
    run_name: str = "test",
    extra: dict[str, list[str]] | None = None,
) -> dict[str, tuple[int, int]]:
    """A run config on free ports; returns {service: (grpc_port, http_port)}.

    `extra` adds lines to sections: {"inference": ["follow_weights = true"], ...}.
    """
    ports = service_ports(SERVICE_NAMES)
    lines = [
        "[run]",
        f'name = "{run_name}"',
        f'state_dir = "{state_dir}"',
        "[redis]",
        f'url = "{REDIS_URL}"',
        "[object_store]",
        f'url = "file://{state_dir}/store"',
        "[endpoints]",
        *[f'{name} = "127.0.0.1:{grpc_port}"' for name, (grpc_port, _) in ports.items()],
    ]
    for name, (grpc_port, http_port) in ports.items():
        lines += [
            f"[{name}]",
            "readiness_interval_s = 0.5",
            f'grpc = {{ host = "127.0.0.1", port = {grpc_port}, shutdown_grace_s = 5 }}',
            f'http = {{ host = "127.0.0.1", port = {http_port} }}',
        ]
    lines += [
        "[model]",
        f'dir = "{model_dir}"',
        "[inference.engine]",
        "max_model_len = 512",
        "max_num_seqs = 8",
        "cpu_kv_cache_gib = 0.25",
        "[launcher]",
        'model_preset = "tiny"',
        "ready_timeout_s = 300",
        "stop_grace_s = 15",
    ]
    for section, added in (extra or {}).items():
        header = f"[{section}]"
        if header not in lines:
            lines += [header, *added]
            continue
        start = lines.index(header) + 1
        end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
        for line in added:  # a key already in the section is replaced, not repeated
            key = line.split("=", 1)[0].strip()
            same = [i for i in range(start, end) if lines[i].split("=", 1)[0].strip() == key]
            if same:
                lines[same[0]] = line
            else:
                lines.insert(start, line)
                end += 1
    path.write_text("\n".join(lines) + "\n")
    return ports


@dataclass
class Deployment:
    """The five services running as real processes from one config."""

    config_path: Path
    ports: dict[str, tuple[int, int]]
    traces_dir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def target(self, service: str) -> str:
        return f"127.0.0.1:{self.ports[service][0]}"

    def http(self, service: str) -> str:
        return f"http://127.0.0.1:{self.ports[service][1]}"

    def log_text(self, service: str) -> str:
        return self.logs[service].read_text(errors="replace")


def service_env(token: str, traces_file: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "ETUDE_AUTH__TOKEN": token, "PYTHONUNBUFFERED": "1"}
    if traces_file is not None:
        env["ETUDE_TELEMETRY__TRACES_EXPORTER"] = "jsonl"
        env["ETUDE_TELEMETRY__TRACES_FILE"] = str(traces_file)
    return env


def wait_ready(target: str, timeout_s: float, process: subprocess.Popen[bytes], log: Path) -> None:
    """Polls gRPC health "readiness" until SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise AssertionError(f"{target} exited {process.returncode}:\n{log.read_text()}")
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{target} not ready after {timeout_s} s:\n{log.read_text()}")
            time.sleep(0.2)


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 30) -> int:
    """SIGTERM by PID, then SIGKILL of its group if it lingers; returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


@pytest.fixture(scope="session")
def deployment(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """All five services as real processes (tiny model, free ports, JSON-lines traces)."""
    root = tmp_path_factory.mktemp("deployment")
    config_path = root / "config.toml"
    traces_dir = root / "traces"
    ports = write_config(config_path, model_dir=tiny_model, state_dir=root / "state")
    deployment = Deployment(config_path=config_path, ports=ports, traces_dir=traces_dir)
    for name in SERVICE_NAMES:
        log = root / f"{name}.log"
        deployment.logs[name] = log
        with log.open("wb") as log_file:
            deployment.processes[name] = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}", "--config", str(config_path)],
                cwd=REPO,
                env=service_env(TOKEN, traces_dir / f"{name}.jsonl"),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    try:
        for name in SERVICE_NAMES:
            wait_ready(
                deployment.target(name), 240, deployment.processes[name], deployment.logs[name]
            )
        yield deployment
    finally:
        for process in deployment.processes.values():
            stop_process(process)


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server process (a real S3 API over HTTP) with a lowered minimum part size."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    env = {**os.environ, **CREDENTIALS, "S3_UPLOAD_PART_MIN_SIZE": str(MIN_PART)}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            connection.request("GET", "/")
            connection.getresponse().read()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"moto did not start:\n{log.read_text()}") from None
            time.sleep(0.1)
    os.environ.update(CREDENTIALS)
    yield endpoint
    process.terminate()
    process.wait(10)
