"""Settings of the reconciler service."""

from __future__ import annotations

from pydantic import Field

from services.config import GrpcServerConfig, HttpServerConfig, ServiceConfig


class ReconcilerConfig(ServiceConfig):
    """The reconciler: slot state in Redis (see the shared [redis] section)."""

    grpc: GrpcServerConfig = Field(
        default_factory=lambda: GrpcServerConfig(port=50051), description="gRPC listener."
    )
    http: HttpServerConfig = Field(
        default_factory=lambda: HttpServerConfig(port=9101), description="HTTP listener."
    )
