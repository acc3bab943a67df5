"""Settings of the trainer service."""

from __future__ import annotations

from pydantic import Field

from services.config import GrpcServerConfig, HttpServerConfig, ServiceConfig


class TrainerConfig(ServiceConfig):
    """The MoE policy trainer; ready when the reconciler and the object store are."""

    grpc: GrpcServerConfig = Field(
        default_factory=lambda: GrpcServerConfig(port=50054), description="gRPC listener."
    )
    http: HttpServerConfig = Field(
        default_factory=lambda: HttpServerConfig(port=9104), description="HTTP listener."
    )
