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

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import SERVICE_NAMES
from services.wire.ports import free_port, service_ports
from tests.objectstore_support import CREDENTIALS, MIN_PART

REPO = Path(__file__).resolve().parent.parent
TOKEN = "test-token-0123456789"

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tiers: `slow` for tests on an engine fixture, `redis` for tests on Redis."""
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if _talks_to_redis(item):
            item.add_marker(pytest.mark.redis)


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
