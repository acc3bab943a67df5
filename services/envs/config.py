"""Settings of the envs service."""

from __future__ import annotations

from pydantic import Field

from services.config import GrpcServerConfig, HttpServerConfig, ServiceConfig


class EnvsConfig(ServiceConfig):
    """Rollout workers and the sandbox API; ready when the reconciler and inference are."""

    grpc: GrpcServerConfig = Field(
        default_factory=lambda: GrpcServerConfig(port=50052), description="gRPC listener."
    )
    http: HttpServerConfig = Field(
        default_factory=lambda: HttpServerConfig(port=9102), description="HTTP listener."
    )
