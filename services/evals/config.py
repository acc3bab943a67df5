"""Settings of the evals service."""

from __future__ import annotations

from pydantic import Field

from services.config import GrpcServerConfig, HttpServerConfig, ServiceConfig


class EvalsConfig(ServiceConfig):
    """Evaluations of published versions; ready when the reconciler is."""

    grpc: GrpcServerConfig = Field(
        default_factory=lambda: GrpcServerConfig(port=50055), description="gRPC listener."
    )
    http: HttpServerConfig = Field(
        default_factory=lambda: HttpServerConfig(port=9105), description="HTTP listener."
    )
