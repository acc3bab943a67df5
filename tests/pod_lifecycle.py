"""A pod's life as a kubelet runs it: init containers in order, then the container,
restarted with backoff whenever it exits (restartPolicy Always); startup, liveness and
readiness probes polled at their periods and acted on; SIGTERM then SIGKILL after
terminationGracePeriodSeconds on stop.

Probes are the kubelet's kinds: ``grpc`` (the standard health service), ``httpGet``
(2xx/3xx), ``tcpSocket`` (a connection) from the node, here the test process's veth into
the pod network, and ``exec`` run inside the container's namespaces with ``nsenter``.
Readiness changes are reported to the cluster (Service endpoints). Once ready, every
declared TCP containerPort must accept connections: one that does not is reported (a
Service targeting it would send traffic nowhere). The crash-loop backoff is 1 s doubling
to 8 s (a kubelet's is 10 s to 5 min), so a test's restarts fit its budget.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.kubelet_support import ContainerCommand, PodError, container_pid, start

BACKOFF_S = (1.0, 2.0, 4.0, 8.0)


def _port(value: Any, ports: dict[str, int]) -> int:
    if isinstance(value, int):
        return value
    if value not in ports:
        raise PodError(f"probe port {value!r} names no containerPort (have {sorted(ports)})")
    return ports[value]


def run_probe(probe: dict[str, Any], ip: str, ports: dict[str, int], pid: int | None) -> str | None:
    """None when the probe succeeds, else why it failed."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "grpc" in probe:
            target = f"{ip}:{_port(probe['grpc']['port'], ports)}"
            with grpc.insecure_channel(target) as channel:
                request = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
                status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout).status
            ok = status == health_pb2.HealthCheckResponse.SERVING
            return (
                None
                if ok
                else f"grpc {target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
            )
        if "httpGet" in probe:
            spec = probe["httpGet"]
            connection = http.client.HTTPConnection(ip, _port(spec["port"], ports), timeout=timeout)
            try:
                connection.request("GET", spec.get("path", "/"))
                code = connection.getresponse().status
            finally:
                connection.close()
            return None if 200 <= code < 400 else f"httpGet {spec.get('path')}: HTTP {code}"
        if "tcpSocket" in probe:
            with socket.create_connection((ip, _port(probe["tcpSocket"]["port"], ports)), timeout):
                return None
        if "exec" in probe:
            if pid is None:
                return "exec: container not running"
            argv = ["nsenter", "-t", str(pid), "-n", "-m", "-u", "--", *probe["exec"]["command"]]
            done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
            return None if done.returncode == 0 else f"exec: exit {done.returncode}"
    except (grpc.RpcError, OSError, subprocess.TimeoutExpired) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    raise PodError(f"probe {sorted(probe)} not emulated")


class Prober:
    """One probe's schedule and its consecutive successes and failures."""

    def __init__(self, spec: dict[str, Any] | None, started: float) -> None:
        self.spec = spec
        self.next_at = started + float((spec or {}).get("initialDelaySeconds", 0))
        self.failures = 0
        self.successes = 0
        self.last_error: str | None = None

    def due(self, now: float) -> bool:
        return self.spec is not None and now >= self.next_at

    def record(self, error: str | None, now: float) -> str | None:
        """Counts one result; returns an event on the first failure of a streak."""
        assert self.spec is not None
        self.next_at = now + float(self.spec.get("periodSeconds", 10))
        self.last_error = error
        if error is None:
            self.successes, self.failures = self.successes + 1, 0
        else:
            self.successes, self.failures = 0, self.failures + 1
        return error if self.failures == 1 else None

    @property
    def failed(self) -> bool:
        return self.spec is not None and self.failures >= int(self.spec.get("failureThreshold", 3))

    @property
    def passed(self) -> bool:
        return self.spec is not None and self.successes >= int(self.spec.get("successThreshold", 1))


class PodProcess:
    """Runs one pod's containers until `stop`; `problems` and `events` say what happened."""

    def __init__(
        self,
        name: str,
        ip: str,
        spec: dict[str, Any],
        build: Callable[[dict[str, Any]], ContainerCommand],
        log_dir: Path,
        on_ready: Callable[[], None],
    ) -> None:
        self.name, self.ip, self.spec = name, ip, spec
        self._build, self._log_dir, self._on_ready = build, log_dir, on_ready
        self.ready = False
        self.restarts = 0
        self.phase = "Pending"
        self.problems: list[str] = []
        self.events: list[str] = []
        self.wrapper: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pod-{name}", daemon=True)
        self._thread.start()

    def log(self, container: str | None = None) -> Path:
        return self._log_dir / f"{container or self.spec['containers'][0]['name']}.log"

    def _event(self, text: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")

    def _set_ready(self, ready: bool) -> None:
        if ready != self.ready:
            self.ready = ready
            self._event("ready" if ready else "not ready")
            self._on_ready()

    def _run(self) -> None:
        try:
            for container in self.spec.get("initContainers", []):
                self._run_init(container)
            if len(self.spec["containers"]) != 1:
                raise PodError("only pods of one container are emulated")
            self._run_container(self.spec["containers"][0])
        except PodError as error:
            self.phase = "CreateContainerConfigError"
            self.problems.append(str(error))
            self._event(str(error))

    def _backoff(self) -> None:
        self._stopping.wait(BACKOFF_S[min(self.restarts, len(BACKOFF_S) - 1)])
        self.restarts += 1

    def _run_init(self, container: dict[str, Any]) -> None:
        command = self._build(container)
        while not self._stopping.is_set():
            self.phase = f"Init:{container['name']}"
            self.wrapper = start(command, self.log(container["name"]))
            code = self.wrapper.wait()
            if code == 0:
                return
            self._event(f"init container {container['name']} exited {code}")
            self._backoff()

    def _run_container(self, container: dict[str, Any]) -> None:
        command = self._build(container)
        tcp_ports = {
            p.get("name", str(p["containerPort"])): p["containerPort"]
            for p in container.get("ports", [])
            if p.get("protocol", "TCP") == "TCP"
        }
        while not self._stopping.is_set():
            self.phase = "Running"
            with self.log().open("a") as out:
                out.write(f"---- {self.name}: start {self.restarts} ----\n")
            self.wrapper = start(command, self.log())
            reason = self._supervise(container, command.ports, tcp_ports)
            self._set_ready(False)
            if self._stopping.is_set():
                return
            self.phase = "CrashLoopBackOff"
            self._event(f"container {reason}; restarting")
            self._backoff()

    def _supervise(
        self, container: dict[str, Any], ports: dict[str, int], tcp_ports: dict[str, int]
    ) -> str:
        """Probes the running container; returns why it ended."""
        assert self.wrapper is not None
        started = time.monotonic()
        startup = Prober(container.get("startupProbe"), started)
        liveness = Prober(container.get("livenessProbe"), started)
        readiness = Prober(container.get("readinessProbe"), started)
        started_up = startup.spec is None
        checked_ports = False
        while not self._stopping.is_set():
            code = self.wrapper.poll()
            if code is not None:
                return f"exited {code}"
            now = time.monotonic()
            pid = container_pid(self.wrapper)
            if not started_up and startup.due(now):
                self._probed(
                    "startup", startup, run_probe(startup.spec or {}, self.ip, ports, pid), now
                )
                started_up = startup.passed
                if started_up:
                    liveness.next_at = readiness.next_at = now
                elif startup.failed:
                    self._terminate(container)
                    return f"failed its startup probe ({startup.last_error})"
            if started_up and liveness.due(now):
                self._probed(
                    "liveness", liveness, run_probe(liveness.spec or {}, self.ip, ports, pid), now
                )
                if liveness.failed:
                    self._terminate(container)
                    return f"failed its liveness probe ({liveness.last_error})"
            if started_up and readiness.due(now):
                self._probed(
                    "readiness",
                    readiness,
                    run_probe(readiness.spec or {}, self.ip, ports, pid),
                    now,
                )
                if readiness.passed:
                    self._set_ready(True)
                elif readiness.failed:
                    self._set_ready(False)
            elif started_up and readiness.spec is None:
                self._set_ready(True)
            if self.ready and not checked_ports:
                checked_ports = True
                self._check_ports(tcp_ports)
            self._stopping.wait(0.2)
        return "stopped"

    def _probed(self, kind: str, prober: Prober, error: str | None, now: float) -> None:
        if prober.record(error, now) is not None:
            self._event(f"{kind} probe failed: {error}")

    def _check_ports(self, ports: dict[str, int]) -> None:
        for name, port in ports.items():
            try:
                with socket.create_connection((self.ip, port), timeout=2):
                    pass
            except OSError:
                self.problems.append(
                    f"containerPort {name} ({port}) is declared but nothing listens on it"
                )

    def probe_errors(self) -> str:
        return "; ".join(self.events[-5:])

    def _terminate(
        self, container: dict[str, Any] | None = None, grace: float | None = None
    ) -> None:
        """SIGTERM to the container's first process, SIGKILL after the grace period."""
        wrapper = self.wrapper
        if wrapper is None or wrapper.poll() is not None:
            return
        if grace is None:
            grace = float(self.spec.get("terminationGracePeriodSeconds", 30))
        pid = container_pid(wrapper)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        try:
            wrapper.wait(grace)
        except subprocess.TimeoutExpired:
            self._event(f"not stopped after {grace} s: SIGKILL")
            self.kill()
            wrapper.wait(30)

    def kill(self) -> None:
        """SIGKILL of the container's first process (PID 1 of its namespace: all of it)."""
        wrapper = self.wrapper
        pid = container_pid(wrapper) if wrapper is not None else None
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        elif wrapper is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(wrapper.pid, signal.SIGKILL)

    def stop(self, grace: float | None = None) -> None:
        """Leaves the Service endpoints, then SIGTERM, then SIGKILL after the grace."""
        self._stopping.set()
        self._set_ready(False)
        self._terminate(grace=grace)
        self._thread.join(60)
        # The pod's thread may have started a container (a restart) between its last look
        # at `_stopping` and `_terminate` reading the wrapper: that one would outlive the pod.
        wrapper = self.wrapper
        if wrapper is not None and wrapper.poll() is None:
            self._event("a container started while stopping: SIGKILL")
            self.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                wrapper.wait(30)
        self.phase = "Terminated"
