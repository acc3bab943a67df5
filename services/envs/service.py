"""The envs process: the EnvService contract and readiness.

Ready when a sandbox is available (bubblewrap on a machine) and the reconciler
and inference are ready. Workspaces, the harness and the rollout workers are not
in this release yet: their methods validate input and answer UNIMPLEMENTED.
"""

from __future__ import annotations

import shutil

from grpc import aio

from services.api.v1 import common_pb2, envs_pb2, envs_pb2_grpc
from services.envs import validation
from services.run_config import EtudeConfig
from services.wire.client import Channels
from services.wire.errors import Unimplemented, require_identifier
from services.wire.server import run_service
from services.wire.service import Readiness, Service

_NOT_YET = "sandboxed workspaces are not implemented in this release"


class EnvServicer(envs_pb2_grpc.EnvServiceServicer):
    """The EnvService contract."""

    def __init__(self, service: EnvsService) -> None:
        self._service = service

    async def CreateWorkspace(
        self, request: envs_pb2.CreateWorkspaceRequest, context: aio.ServicerContext
    ) -> envs_pb2.CreateWorkspaceResponse:
        validation.validate_create(request)
        raise Unimplemented(f"CreateWorkspace: {_NOT_YET}")

    async def ForkWorkspace(
        self, request: envs_pb2.ForkWorkspaceRequest, context: aio.ServicerContext
    ) -> envs_pb2.ForkWorkspaceResponse:
        validation.validate_fork(request)
        raise Unimplemented(f"ForkWorkspace: {_NOT_YET}")

    async def SnapshotWorkspace(
        self, request: envs_pb2.SnapshotWorkspaceRequest, context: aio.ServicerContext
    ) -> envs_pb2.SnapshotWorkspaceResponse:
        require_identifier(request.workspace_id, "workspace_id")
        raise Unimplemented(f"SnapshotWorkspace: {_NOT_YET}")

    async def Exec(
        self, request: envs_pb2.ExecRequest, context: aio.ServicerContext
    ) -> envs_pb2.ExecResponse:
        validation.validate_exec(request)
        raise Unimplemented(f"Exec: {_NOT_YET}")

    async def Grade(
        self, request: envs_pb2.GradeRequest, context: aio.ServicerContext
    ) -> envs_pb2.GradeResponse:
        validation.validate_grade(request)
        raise Unimplemented(f"Grade: {_NOT_YET}")

    async def DeleteWorkspace(
        self, request: envs_pb2.DeleteWorkspaceRequest, context: aio.ServicerContext
    ) -> envs_pb2.DeleteWorkspaceResponse:
        require_identifier(request.workspace_id, "workspace_id")
        raise Unimplemented(f"DeleteWorkspace: {_NOT_YET}")

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> envs_pb2.EnvsStatusResponse:
        return envs_pb2.EnvsStatusResponse(
            info=await self._service.service_info(request.include_dependencies),
            sandbox_backend=self._service.sandbox_backend or "",
        )


class EnvsService(Service):
    """Ready when bubblewrap is available and the reconciler and inference are ready."""

    name = "envs"
    dependencies = ("reconciler", "inference")

    def __init__(self, config: EtudeConfig, channels: Channels) -> None:
        super().__init__(config, channels)
        self.sandbox_backend = "bubblewrap" if shutil.which("bwrap") else None

    def register(self, server: aio.Server) -> list[str]:
        envs_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(self), server)
        return [envs_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name]

    async def check_ready(self) -> Readiness:
        if self.sandbox_backend is None:
            return Readiness(False, "no sandbox: bubblewrap (bwrap) is not installed")
        return Readiness(True, f"sandbox: {self.sandbox_backend}")

    def status_fields(self) -> dict[str, str]:
        return {"sandbox": self.sandbox_backend or "none"}


def run(config: EtudeConfig) -> None:
    """Runs the envs service until SIGTERM."""
    run_service(EnvsService, config)
