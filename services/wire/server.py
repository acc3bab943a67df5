"""Runs a Service: grpc.aio server with health, reflection, auth, metrics and tracing,
its HTTP side, the readiness monitor, and graceful shutdown on SIGTERM/SIGINT.

Health entries: "" and "liveness" are SERVING while the process runs;
"readiness" and each of the service's own gRPC service names are SERVING only
while the service and its dependencies are ready. Kubernetes probes use
``service: liveness`` and ``service: readiness``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import NamedTuple

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.trace import TracerProvider

from services.config import SharedConfig
from services.wire.client import Channels
from services.wire.http import serve_http
from services.wire.interceptors import BearerTokenAuth, ObservedCalls, preregister
from services.wire.options import server_options
from services.wire.service import LIVENESS, READINESS, READY, Readiness, Service

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _QuietStreamDetach(logging.Filter):
    """Drops OpenTelemetry's "Failed to detach context" for cancelled server streams.

    Its aio stream interceptor keeps the span's context attached inside an async
    generator; when a caller cancels a stream between two messages, that generator is
    never resumed, and asyncio finalizes it later in another Context, where resetting
    the context var fails and OpenTelemetry logs ERROR with a traceback. Nothing is
    lost (the span ends, and the context it would have restored is discarded), so it
    is kept only at DEBUG.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Failed to detach context":
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _quiet_cancelled_streams() -> None:
    otel = logging.getLogger("opentelemetry.context")
    if not any(isinstance(f, _QuietStreamDetach) for f in otel.filters):
        otel.addFilter(_QuietStreamDetach())


def _traced(details: grpc.HandlerCallDetails) -> bool:
    """Health checks get a span only inside a caller's trace; bare probes would flood traces."""
    if not details.method.startswith("/grpc.health.v1.Health/"):
        return True
    return any(key == "traceparent" for key, _ in details.invocation_metadata or ())


# How long calls handed back at shutdown get to send their UNAVAILABLE (they take
# milliseconds); gRPC cancels any call still running after that.
HAND_BACK_S = 5.0


class BuiltServer(NamedTuple):
    server: aio.Server
    health: health.aio.HealthServicer
    names: list[str]  # the service's own gRPC service names
    calls: ObservedCalls  # the calls in flight, handed back at shutdown


def build_server(service: Service, tracer_provider: TracerProvider | None) -> BuiltServer:
    """The aio server of `service`, with every shared interceptor and servicer added."""
    settings = service.settings.grpc
    token = service.config.auth.token
    _quiet_cancelled_streams()
    calls = ObservedCalls(service.classify_error)
    interceptors: list[aio.ServerInterceptor] = [
        aio_server_interceptor(tracer_provider=tracer_provider, filter_=_traced),
        calls,
    ]
    if token is not None:
        interceptors.append(BearerTokenAuth(token.get_secret_value()))
    elif service.config.auth.required:
        raise ValueError(
            "auth.required is true but no token is set (set ETUDE_AUTH__TOKEN, "
            "or auth.required = false for a trusted network)"
        )
    server = aio.server(
        interceptors=interceptors,
        options=server_options(settings),
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = service.register(server)
    preregister(names)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    address = f"{settings.host}:{settings.port}"
    if settings.tls_cert_file and settings.tls_key_file:
        with open(settings.tls_key_file, "rb") as key, open(settings.tls_cert_file, "rb") as cert:
            credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
        server.add_secure_port(address, credentials)
    else:
        server.add_insecure_port(address)
    return BuiltServer(server, health_servicer, names, calls)


async def _monitor_readiness(
    service: Service,
    health_servicer: health.aio.HealthServicer,
    names: list[str],
    started: asyncio.Event,
) -> None:
    """Re-evaluates readiness every interval and publishes it to health and metrics."""
    while True:
        with suppress_instrumentation():  # periodic probes would flood traces
            own = await service.check_ready() if started.is_set() else service.readiness
            service.dependency_status = await service.probe_dependencies()
        waiting = [d.name for d in service.dependency_status if not d.ready]
        if own.ready and (fault := service.background.fault()) is not None:
            own = Readiness(False, fault)
        if own.ready and waiting:
            own = Readiness(False, f"waiting for {', '.join(waiting)}")
        if own != service.readiness:
            log.info("readiness: %s (%s)", "ready" if own.ready else "not ready", own.detail)
        service.readiness = own
        status = SERVING if own.ready else NOT_SERVING
        for name in (READINESS, *names):
            await health_servicer.set(name, status)
        READY.labels(service.name).set(float(own.ready))
        await asyncio.sleep(service.settings.readiness_interval_s)


async def _start(service: Service, started: asyncio.Event) -> None:
    service.readiness = Readiness(False, "starting")
    await service.start()
    service.readiness = await service.check_ready()
    started.set()


async def serve(
    service: Service,
    *,
    tracer_provider: TracerProvider | None = None,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """Runs `service` until SIGTERM/SIGINT (or `stop`), then shuts down gracefully."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(RuntimeError, ValueError):  # not the main thread (tests)
            loop.add_signal_handler(signum, stop.set)
    server, health_servicer, names, calls = build_server(service, tracer_provider)
    await server.start()
    for name in ("", LIVENESS):
        await health_servicer.set(name, SERVING)
    for name in (READINESS, *names):
        await health_servicer.set(name, NOT_SERVING)
    settings = service.settings
    log.info(
        "%s listening: grpc %s:%d, http %s:%d",
        service.name,
        settings.grpc.host,
        settings.grpc.port,
        settings.http.host,
        settings.http.port,
    )
    if on_listening is not None:
        on_listening()

    started = asyncio.Event()
    start_task = asyncio.create_task(_start(service, started), name="start")
    stop_task = asyncio.create_task(stop.wait(), name="stop")
    readiness_task = asyncio.create_task(
        _monitor_readiness(service, health_servicer, names, started), name="readiness"
    )
    pending = {start_task, stop_task, readiness_task}
    if settings.http.port:
        http = serve_http(service, settings.http.host, settings.http.port, stop)
        pending.add(asyncio.create_task(http, name="http"))
    failure: BaseException | None = None
    try:
        while failure is None and not stop.is_set():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stop_task}:
                if task.exception() is not None:
                    failure = task.exception()
                elif task is not start_task:
                    failure = RuntimeError(f"the {task.get_name()} task ended unexpectedly")
        if failure is not None:
            log.error("%s failed: %r", service.name, failure, exc_info=failure)
    finally:
        log.info("%s shutting down", service.name)
        # The readiness monitor stops first: left running through the grace, it set the
        # service ready again (/readyz, etude_service_ready) while it drained.
        readiness_task.cancel()
        service.readiness = Readiness(False, "shutting down")
        READY.labels(service.name).set(0.0)
        await health_servicer.enter_graceful_shutdown()
        # New calls are refused at once (GOAWAY); those in flight get the grace to
        # finish, and the rest are handed back UNAVAILABLE so their callers retry.
        stopping = asyncio.create_task(server.stop(settings.grpc.shutdown_grace_s + HAND_BACK_S))
        await calls.hand_back(settings.grpc.shutdown_grace_s)
        await stopping
        stop.set()  # lets the HTTP side finish on its own
        for task in pending:
            if task.get_name() != "http":
                task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await service.background.stop()
        await service.stop()
        await service.channels.close()
        log.info("%s stopped", service.name)
    if failure is not None:
        raise failure


def make_service(
    service_cls: type[Service], config: SharedConfig, tracer_provider: TracerProvider | None = None
) -> Service:
    """Instantiates `service_cls` with channels to the rest of the deployment."""
    return service_cls(config, Channels(config, tracer_provider))


def run_service(service_cls: type[Service], config: SharedConfig) -> None:
    """Runs `service_cls` in this process until it is told to stop (the `run` of a service)."""
    from services.telemetry import configure_tracing

    tracer_provider = configure_tracing(config.telemetry, service_cls.name)
    try:
        asyncio.run(
            serve(
                make_service(service_cls, config, tracer_provider), tracer_provider=tracer_provider
            )
        )
    finally:
        tracer_provider.shutdown()
