"""Server interceptors: bearer-token auth, and decoding, errors + Prometheus metrics.

Order on the server (outermost first): OpenTelemetry (a span for every call,
also rejected ones), ``ObservedCalls`` (decodes and checks the request, maps
ServiceError to a status, counts and times every call), ``BearerTokenAuth``
(rejects callers without the token).

Request bodies are parsed inside the chain, not by gRPC before it: a call that
fails authentication is answered UNAUTHENTICATED without its body ever being
parsed, and a body that does not parse is INVALID_ARGUMENT with a short message
and a rate-limited WARNING (``services.wire.requests``), never UNKNOWN with a
traceback. Request-streaming methods (only server reflection has one) are parsed
by gRPC as before.

``ObservedCalls`` also knows the calls in flight, for a replica's shutdown
(``services.wire.server``): ``hand_back(grace_s)`` lets them finish for ``grace_s``
and then ends those still running with UNAVAILABLE, which callers retry on another
replica. Left to gRPC, a call still running when ``server.stop``'s grace runs out is
cancelled, and its caller reads CANCELLED (which only the envs worker's Generate, the
call that must outlast a replica going away, retries as well).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc import aio
from prometheus_client import Counter, Histogram

from services.wire.errors import ServiceError
from services.wire.requests import RateLimitedLog, request_decoder

log = logging.getLogger(__name__)

# Names follow go-grpc-prometheus, which most gRPC dashboards already use.
STARTED = Counter(
    "grpc_server_started_total",
    "RPCs started on the server.",
    ["grpc_service", "grpc_method", "grpc_type"],
)
HANDLED = Counter(
    "grpc_server_handled_total",
    "RPCs completed on the server, by status code.",
    ["grpc_service", "grpc_method", "grpc_type", "grpc_code"],
)
LATENCY = Histogram(
    "grpc_server_handling_seconds",
    "Time from the start of an RPC to its status, by method.",
    ["grpc_service", "grpc_method", "grpc_type"],
    buckets=(
        0.0005,
        0.001,
        0.0025,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1,
        2.5,
        5,
        10,
        30,
        60,
    ),
)

# Probes and schema discovery answer without a token (Kubernetes probes carry none).
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

Behavior = Callable[..., Any]

# (request_streaming, response_streaming) -> handler factory
_HANDLER_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def preregister(service_names: Iterable[str]) -> None:
    """Every method of `service_names` (full names, e.g. ``etude.v1.EnvService``) gets its
    counters and latency histogram at zero, handled with every status code, as
    go-grpc-prometheus does: a service nobody has called yet shows zero rates and error
    ratios, not an absent series (and increase() sees the first failure too)."""
    pool = descriptor_pool.Default()
    for name in service_names:
        for method in pool.FindServiceByName(name).methods:
            rpc_type = _rpc_type(method.client_streaming, method.server_streaming)
            labels = (name, method.name, rpc_type)
            STARTED.labels(*labels)
            LATENCY.labels(*labels)
            for code in grpc.StatusCode:
                HANDLED.labels(*labels, code.name)


async def _aiter(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def _split_method(full_method: str) -> tuple[str, str]:
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


def _rpc_type(request_streaming: bool, response_streaming: bool) -> str:
    if request_streaming and response_streaming:
        return "bidi_stream"
    if request_streaming:
        return "client_stream"
    if response_streaming:
        return "server_stream"
    return "unary"


def _replace_behavior(
    handler: grpc.RpcMethodHandler,
    unary: Behavior,
    streaming: Behavior,
    *,
    raw_request: bool = False,
) -> grpc.RpcMethodHandler:
    """The same handler type and serializers with a new behavior. With `raw_request`, a
    unary request reaches the behavior as the bytes on the wire (it parses them itself)."""
    make = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    behavior = streaming if handler.response_streaming else unary
    keep = handler.request_streaming or not raw_request
    return make(
        behavior,
        request_deserializer=handler.request_deserializer if keep else None,
        response_serializer=handler.response_serializer,
    )


def _original_behavior(handler: grpc.RpcMethodHandler) -> Behavior:
    behavior: Behavior | None = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    assert behavior is not None, "a method handler always has one behavior"
    return behavior


class BearerTokenAuth(aio.ServerInterceptor):
    """Rejects calls whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_bytes, self._expected):
            return handler
        problem = "missing bearer token" if not given else "invalid bearer token"

        async def deny_unary(request: Any, context: aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

        async def deny_streaming(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
            yield  # pragma: no cover - abort raises

        # The body of a call refused here is never parsed.
        return _replace_behavior(handler, deny_unary, deny_streaming, raw_request=True)


HANDED_BACK = "this replica is shutting down and handed the call back: retry it on another"


@dataclass(eq=False)
class _InFlight:
    """One call being handled: the task that runs it, and where that task is."""

    task: asyncio.Task[Any]
    # False while a streaming call has yielded a response and gRPC is sending it: the
    # task is in gRPC's code then, where a cancellation would end the call CANCELLED.
    in_handler: bool = True
    handed_back: bool = False


class ObservedCalls(aio.ServerInterceptor):
    """Maps ServiceError to its status, logs unexpected errors, counts and times every call,
    and hands back the calls still running at shutdown (``hand_back``).

    `classify` lets a service name faults it expects (a dependency down) as a
    ServiceError; anything left unclassified is a bug and answers INTERNAL.
    """

    def __init__(self, classify: Callable[[Exception], ServiceError | None] | None = None) -> None:
        self._classify = classify or (lambda error: None)
        self._bad_bodies = RateLimitedLog(log)
        self._in_flight: set[_InFlight] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def hand_back(self, grace_s: float) -> None:
        """Waits up to `grace_s` for the calls in flight to finish, then ends each one
        still running with UNAVAILABLE (HANDED_BACK).

        A call inside its handler is cancelled there (a generation's engine request is
        aborted as on a caller's cancel) and answers UNAVAILABLE; a streaming call whose
        response gRPC is sending answers it once the send is done."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        calls = list(self._in_flight)
        for call in calls:
            call.handed_back = True
            if call.in_handler:
                call.task.cancel()
        if calls:
            log.warning(
                "%d call(s) still running %.1f s after shutdown began: handed back UNAVAILABLE",
                len(calls),
                grace_s,
            )

    def _enter(self) -> _InFlight:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - gRPC runs every call in a task
            raise RuntimeError("a call handled outside a task")
        call = _InFlight(task)
        self._in_flight.add(call)
        self._idle.clear()
        return call

    def _leave(self, call: _InFlight) -> None:
        self._in_flight.discard(call)
        if not self._in_flight:
            self._idle.set()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        service, method = _split_method(handler_call_details.method)
        rpc_type = _rpc_type(handler.request_streaming, handler.response_streaming)
        labels = (service, method, rpc_type)
        behavior = _original_behavior(handler)
        deserializer = handler.request_deserializer
        if handler.request_streaming or deserializer is None:
            decode: Callable[[Any], Any] = lambda request: request  # noqa: E731
        else:
            decode = request_decoder(deserializer, handler_call_details.method, self._bad_bodies)

        async def fail(context: aio.ServicerContext, error: Exception) -> None:
            if isinstance(error, ServiceError):
                await context.abort(error.code, str(error))
            if (known := self._classify(error)) is not None:
                await context.abort(known.code, str(known))
            log.exception("unexpected error in %s", handler_call_details.method, exc_info=error)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}")

        def finish(started: float, code: grpc.StatusCode) -> None:
            LATENCY.labels(*labels).observe(time.perf_counter() - started)
            HANDLED.labels(*labels, code.name).inc()

        def status_of(error: Exception) -> grpc.StatusCode:
            if isinstance(error, ServiceError):
                return error.code
            known = self._classify(error)
            return known.code if known is not None else grpc.StatusCode.INTERNAL

        def code_of(context: aio.ServicerContext, default: grpc.StatusCode) -> grpc.StatusCode:
            code = context.code()
            if isinstance(code, grpc.StatusCode):
                return code
            return default

        async def answer_handed_back(call: _InFlight, context: aio.ServicerContext) -> None:
            call.task.uncancel()  # the cancel was ours, and is answered here
            await context.abort(grpc.StatusCode.UNAVAILABLE, HANDED_BACK)

        async def unary(request: Any, context: aio.ServicerContext) -> Any:
            STARTED.labels(*labels).inc()
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            call = self._enter()
            try:
                result = behavior(decode(request), context)
                if inspect.isawaitable(result):
                    result = await result
                code = code_of(context, grpc.StatusCode.OK)
                return result
            except aio.AbortError:
                code = code_of(context, grpc.StatusCode.UNKNOWN)
                raise
            except asyncio.CancelledError:
                if not call.handed_back:
                    code = grpc.StatusCode.CANCELLED
                    raise
                code = grpc.StatusCode.UNAVAILABLE
                await answer_handed_back(call, context)
            except Exception as error:
                code = status_of(error)
                await fail(context, error)
            finally:
                self._leave(call)
                finish(started, code)

        async def streaming(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            STARTED.labels(*labels).inc()
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            call = self._enter()
            result: Any = None
            try:
                result = behavior(decode(request), context)
                if inspect.isawaitable(result):  # a coroutine that uses context.write
                    await result
                else:
                    items = result if hasattr(result, "__aiter__") else _aiter(result)
                    async for item in items:
                        call.in_handler = False
                        yield item
                        call.in_handler = True
                        if call.handed_back:  # while gRPC sent `item`
                            raise asyncio.CancelledError
                code = code_of(context, grpc.StatusCode.OK)
            except aio.AbortError:
                code = code_of(context, grpc.StatusCode.UNKNOWN)
                raise
            except GeneratorExit:  # gRPC closed the stream: the caller went away
                code = grpc.StatusCode.CANCELLED
                raise
            except asyncio.CancelledError:
                if not call.handed_back:
                    code = grpc.StatusCode.CANCELLED
                    raise
                code = grpc.StatusCode.UNAVAILABLE
                if hasattr(result, "aclose"):
                    await result.aclose()
                await answer_handed_back(call, context)
            except Exception as error:
                code = status_of(error)
                await fail(context, error)
            finally:
                self._leave(call)
                finish(started, code)

        return _replace_behavior(handler, unary, streaming, raw_request=True)
