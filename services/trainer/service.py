"""The trainer process: the TrainerService contract and readiness.

Ready when the reconciler (its source of work) is ready. The MoE policy, the
training loop and checkpoints are not in this release yet: GetStatus reports the
trainer idle, and checkpoint methods validate input and answer UNIMPLEMENTED.
"""

from __future__ import annotations

import re

from grpc import aio

from services.api.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.run_config import EtudeConfig
from services.wire.errors import Unimplemented, require
from services.wire.server import run_service
from services.wire.service import Service

_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_NOT_YET = "checkpoints are not implemented in this release"


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """The TrainerService contract."""

    def __init__(self, service: TrainerService) -> None:
        self._service = service

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> trainer_pb2.TrainerStatusResponse:
        return trainer_pb2.TrainerStatusResponse(
            info=await self._service.service_info(request.include_dependencies),
            phase="idle",
        )

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        require(
            _TAG.match(request.tag) is not None,
            "tag",
            f"{request.tag[:80]!r} must be 1-64 letters, digits, '.', '_' or '-'",
        )
        raise Unimplemented(f"SaveCheckpoint: {_NOT_YET}")

    async def ListCheckpoints(
        self, request: trainer_pb2.ListCheckpointsRequest, context: aio.ServicerContext
    ) -> trainer_pb2.ListCheckpointsResponse:
        raise Unimplemented(f"ListCheckpoints: {_NOT_YET}")


class TrainerService(Service):
    """Ready when the reconciler is."""

    name = "trainer"
    dependencies = ("reconciler",)

    def register(self, server: aio.Server) -> list[str]:
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(self), server)
        return [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name]

    def status_fields(self) -> dict[str, str]:
        return {"phase": "idle"}


def run(config: EtudeConfig) -> None:
    """Runs the trainer until SIGTERM."""
    run_service(TrainerService, config)
