"""The shape every Etude service process has, and its readiness bookkeeping.

A service subclasses ``Service``: it registers its servicers, acquires what it
needs in ``start`` (which may take minutes: a vLLM engine), runs its background
loops under ``self.background`` (``services.wire.supervise``), says whether it can
do its job in ``check_ready``, and lists the services it depends on. The shared
runner (``services.wire.server``) does the rest: health, reflection, auth,
metrics, tracing, the HTTP side, graceful shutdown.
"""

from __future__ import annotations

import abc
import asyncio
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Gauge

import services
from services.api.v1 import common_pb2
from services.config import ServiceConfig, ServiceName, SharedConfig
from services.wire.client import Channels
from services.wire.errors import ServiceError
from services.wire.supervise import Supervisor

if TYPE_CHECKING:
    from fastapi import FastAPI

READINESS = "readiness"
LIVENESS = "liveness"

READY = Gauge("etude_service_ready", "1 when the service can do its job.", ["service"])
DEPENDENCY_READY = Gauge(
    "etude_dependency_ready", "1 when a dependency answered ready.", ["service", "dependency"]
)


@dataclass(frozen=True)
class Readiness:
    """Whether a service (or one of its parts) can do its job, and why not."""

    ready: bool
    detail: str


class Service(abc.ABC):
    """One Etude process behind the shared gRPC server."""

    name: ClassVar[ServiceName]
    # Services whose readiness this one's readiness requires (checked over gRPC health).
    dependencies: ClassVar[tuple[ServiceName, ...]] = ()

    def __init__(self, config: SharedConfig, channels: Channels) -> None:
        self.config = config
        self.channels = channels
        self.started_at = time.time()
        self.instance_id = f"{socket.gethostname()}:{os.getpid()}"
        self.readiness = Readiness(False, "starting")
        self.dependency_status: list[common_pb2.DependencyStatus] = []
        # Loops that run as long as the process (reaper, watchers, followers): started in
        # `start`, restarted when they crash; the service is not ready while one is down.
        self.background = Supervisor(self.name)

    @property
    def settings(self) -> ServiceConfig:
        """This service's own section of the config."""
        section: ServiceConfig = getattr(self.config, self.name)
        return section

    @abc.abstractmethod
    def register(self, server: aio.Server) -> list[str]:
        """Adds the servicers to `server`; returns their full service names."""

    async def start(self) -> None:  # noqa: B027 - most services acquire nothing slow
        """Acquires what the service needs; the server answers liveness meanwhile."""

    async def check_ready(self) -> Readiness:
        """The service's own readiness, apart from its dependencies."""
        return Readiness(True, "ok")

    async def stop(self) -> None:  # noqa: B027 - most services hold nothing to release
        """Releases what `start` acquired. Called once, after the gRPC server stopped."""

    def status_fields(self) -> dict[str, str]:
        """Key figures shown on the HTTP status page."""
        return {}

    def http_routes(self, app: FastAPI) -> None:  # noqa: B027 - most services add no pages
        """Adds the service's own pages to its HTTP side, beside the shared ones."""

    def classify_error(self, error: Exception) -> ServiceError | None:
        """An expected fault (a dependency down) as the status to answer; None for bugs."""
        return None

    async def probe_dependency(self, dependency: ServiceName) -> common_pb2.DependencyStatus:
        """Asks `dependency`'s health service whether it is ready."""
        target = self.channels.target(dependency)
        stub = health_pb2_grpc.HealthStub(self.channels.get(dependency))
        started = time.perf_counter()
        try:
            answer = await stub.Check(
                health_pb2.HealthCheckRequest(service=READINESS),
                timeout=self.settings.dependency_timeout_s,
            )
            ready = answer.status == health_pb2.HealthCheckResponse.SERVING
            detail = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        except aio.AioRpcError as error:
            ready, detail = False, f"{error.code().name}: {error.details()}"
        latency_ms = (time.perf_counter() - started) * 1e3
        DEPENDENCY_READY.labels(self.name, dependency).set(float(ready))
        return common_pb2.DependencyStatus(
            name=dependency, target=target, ready=ready, detail=detail, latency_ms=latency_ms
        )

    async def probe_dependencies(self) -> list[common_pb2.DependencyStatus]:
        """Probes every dependency concurrently."""
        return list(await asyncio.gather(*map(self.probe_dependency, self.dependencies)))

    async def service_info(self, include_dependencies: bool) -> common_pb2.ServiceInfo:
        """This process's ServiceInfo; probes the dependencies live when asked."""
        info = common_pb2.ServiceInfo(
            service=self.name,
            instance_id=self.instance_id,
            version=services.__version__,
            ready=self.readiness.ready,
            ready_detail=self.readiness.detail,
            uptime_s=time.time() - self.started_at,
        )
        if include_dependencies:
            info.dependencies.extend(await self.probe_dependencies())
        return info
