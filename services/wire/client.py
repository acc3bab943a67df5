"""Client channels to other services: auth, deadlines, retries, tracing.

Every call gets the bearer token, a default deadline when the caller set none,
W3C trace context (OpenTelemetry), ``round_robin`` over every address the target
resolves to, and gRPC's retry policy for UNAVAILABLE from the channel's service config: a
few attempts for blips (``services.wire.options`` holds the options). Waiting out an
outage, which that policy cannot do, is ``services.wire.retry``'s. Mutating RPCs of the platform are
idempotent (lease tokens, idempotency keys), which is what makes retrying them safe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.trace import TracerProvider

from services.config import MIB, ServiceName, SharedConfig
from services.wire.options import channel_options


class _CallDefaults:
    """Adds the bearer token, and a deadline when the call has none."""

    def __init__(self, token: str | None, default_timeout_s: float | None) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = default_timeout_s

    def _details(self, details: aio.ClientCallDetails) -> aio.ClientCallDetails:
        metadata = aio.Metadata(*(details.metadata or ()), *self._metadata)
        timeout = details.timeout if details.timeout is not None else self._timeout
        return aio.ClientCallDetails(
            details.method, timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files each interceptor under the first call type it implements, so every
# call type needs an object of its own.
class _UnaryUnaryDefaults(_CallDefaults, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStreamDefaults(_CallDefaults, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnaryDefaults(_CallDefaults, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _StreamStreamDefaults(_CallDefaults, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def make_channel(
    target: str,
    *,
    token: str | None,
    default_timeout_s: float | None = 30.0,
    max_message_bytes: int = 64 * MIB,
    tls_ca_file: Path | None = None,
    tracer_provider: TracerProvider | None = None,
    max_attempts: int = 4,
    min_resolution_interval_s: float = 30.0,
) -> aio.Channel:
    """An aio channel to `target` with auth, deadlines, retries, round-robin over the
    target's addresses and trace propagation (options: ``services.wire.options``).

    `default_timeout_s` applies to calls made without a timeout; None leaves them
    unbounded (streams that live as long as the process, such as watches).
    """
    options = channel_options(
        max_message_bytes=max_message_bytes,
        max_attempts=max_attempts,
        min_resolution_interval_s=min_resolution_interval_s,
    )
    interceptors: list[aio.ClientInterceptor] = [
        *aio_client_interceptors(tracer_provider=tracer_provider),
        *(
            defaults(token, default_timeout_s)
            for defaults in (
                _UnaryUnaryDefaults,
                _UnaryStreamDefaults,
                _StreamUnaryDefaults,
                _StreamStreamDefaults,
            )
        ),
    ]
    if tls_ca_file is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca_file.read_bytes())
        return aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
    return aio.insecure_channel(target, options=options, interceptors=interceptors)


class Channels:
    """One lazily-created channel per service of the deployment, closed together."""

    def __init__(self, config: SharedConfig, tracer_provider: TracerProvider | None = None) -> None:
        self._config = config
        self._tracer_provider = tracer_provider
        self._channels: dict[ServiceName, aio.Channel] = {}

    def target(self, service: ServiceName) -> str:
        """The address `service` is reached at."""
        return self._config.endpoints.target(service)

    def get(self, service: ServiceName) -> aio.Channel:
        """The channel to `service`, created on first use."""
        if service not in self._channels:
            token = self._config.auth.token
            self._channels[service] = make_channel(
                self.target(service),
                token=token.get_secret_value() if token else None,
                tls_ca_file=self._config.endpoints.tls_ca_file,
                tracer_provider=self._tracer_provider,
                min_resolution_interval_s=self._config.endpoints.min_resolution_interval_s,
            )
        return self._channels[service]

    async def close(self) -> None:
        """Closes every channel opened so far."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
