"""The evals process: the EvalsService contract and readiness.

Ready when the reconciler and inference are ready. Suites, scoring and reports
are not in this release yet: their methods validate input and answer
UNIMPLEMENTED.
"""

from __future__ import annotations

from grpc import aio

from services.api.v1 import common_pb2, evals_pb2, evals_pb2_grpc
from services.run_config import EtudeConfig
from services.wire.errors import Unimplemented, require_identifier, require_range
from services.wire.server import run_service
from services.wire.service import Service

MAX_SAMPLES = 1024
_NOT_YET = "eval suites are not implemented in this release"


class EvalsServicer(evals_pb2_grpc.EvalsServiceServicer):
    """The EvalsService contract."""

    def __init__(self, service: EvalsService) -> None:
        self._service = service

    async def RunEval(
        self, request: evals_pb2.RunEvalRequest, context: aio.ServicerContext
    ) -> evals_pb2.RunEvalResponse:
        require_identifier(request.suite, "suite")
        require_range(request.num_samples, "num_samples", 0, MAX_SAMPLES)
        raise Unimplemented(f"RunEval: {_NOT_YET}")

    async def GetResults(
        self, request: evals_pb2.GetResultsRequest, context: aio.ServicerContext
    ) -> evals_pb2.GetResultsResponse:
        if request.suite:
            require_identifier(request.suite, "suite")
        raise Unimplemented(f"GetResults: {_NOT_YET}")

    async def ListSuites(
        self, request: evals_pb2.ListSuitesRequest, context: aio.ServicerContext
    ) -> evals_pb2.ListSuitesResponse:
        raise Unimplemented(f"ListSuites: {_NOT_YET}")

    async def GetReport(
        self, request: evals_pb2.GetReportRequest, context: aio.ServicerContext
    ) -> evals_pb2.GetReportResponse:
        raise Unimplemented(f"GetReport: {_NOT_YET}")

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> evals_pb2.EvalsStatusResponse:
        return evals_pb2.EvalsStatusResponse(
            info=await self._service.service_info(request.include_dependencies)
        )


class EvalsService(Service):
    """Ready when the reconciler and inference are."""

    name = "evals"
    dependencies = ("reconciler", "inference")

    def register(self, server: aio.Server) -> list[str]:
        evals_pb2_grpc.add_EvalsServiceServicer_to_server(EvalsServicer(self), server)
        return [evals_pb2.DESCRIPTOR.services_by_name["EvalsService"].full_name]


def run(config: EtudeConfig) -> None:
    """Runs the evals service until SIGTERM."""
    run_service(EvalsService, config)
