"""The trainer process: the TrainerService contract, readiness, and the training job.

Ready when the reconciler (its source of work) is ready. Without ``[trainer.job]`` it
trains nothing: GetStatus reports phase "idle" and ListCheckpoints lists what the
run's checkpoint directory holds. With a job, the job starts with the service and
GetStatus reports its phase, step, versions and the last step's metrics;
SaveCheckpoint saves a tagged checkpoint at the next step boundary.

Under torchrun (``WORLD_SIZE`` > 1) ``run`` hands over to
``services.trainer.distributed.launch``: global rank 0 serves this API for the job, the
first process of every other node serves its pod's probes and metrics, all ranks train.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import TYPE_CHECKING

from grpc import aio

# Declares the trainer's metrics, so that an idle trainer (no job, no torch) exports them too.
import services.trainer.metrics  # noqa: F401
from services.api.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.run_config import EtudeConfig
from services.wire.client import Channels
from services.wire.errors import FailedPrecondition, require
from services.wire.server import run_service
from services.wire.service import Readiness, Service

if TYPE_CHECKING:
    # torch comes with these: an idle trainer (no job) starts without importing it.
    from services.trainer.checkpoint import CheckpointInfo
    from services.trainer.job import TrainingJob

_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _checkpoint_message(info: CheckpointInfo) -> trainer_pb2.Checkpoint:
    return trainer_pb2.Checkpoint(
        tag=info.tag, step=info.step, location=str(info.location), created_at=info.created_at
    )


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """The TrainerService contract."""

    def __init__(self, service: TrainerService) -> None:
        self._service = service

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> trainer_pb2.TrainerStatusResponse:
        job = self._service.job
        answer = trainer_pb2.TrainerStatusResponse(
            info=await self._service.service_info(request.include_dependencies),
            phase="idle" if job is None else job.job.phase,
        )
        if job is not None:
            answer.step = job.step
            answer.policy_version = job.policy_version
            answer.last_published_version = job.last_published_version
            answer.metrics.update(job.metrics)
        return answer

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        require(
            _TAG.match(request.tag) is not None,
            "tag",
            f"{request.tag[:80]!r} must be 1-64 letters, digits, '.', '_' or '-'",
        )
        job = self._service.job
        if job is None:
            raise FailedPrecondition(
                "no training job is configured ([trainer.job]): nothing to save"
            )
        try:
            info = await job.request_checkpoint(request.tag)
        except FileExistsError as error:
            raise FailedPrecondition(str(error)) from None
        except RuntimeError as error:
            raise FailedPrecondition(str(error)) from None
        return trainer_pb2.SaveCheckpointResponse(checkpoint=_checkpoint_message(info))

    async def ListCheckpoints(
        self, request: trainer_pb2.ListCheckpointsRequest, context: aio.ServicerContext
    ) -> trainer_pb2.ListCheckpointsResponse:
        from services.trainer.checkpoint import CheckpointStore
        from services.trainer.paths import checkpoint_root

        infos = await asyncio.to_thread(CheckpointStore(checkpoint_root(self._service.config)).list)
        return trainer_pb2.ListCheckpointsResponse(
            checkpoints=[_checkpoint_message(i) for i in infos]
        )


class TrainerService(Service):
    """Ready when the reconciler is; runs the configured training job."""

    name = "trainer"
    dependencies = ("reconciler",)

    def __init__(self, config: EtudeConfig, channels: Channels) -> None:
        super().__init__(config, channels)
        self.job: TrainingJob | None = None
        self._task: asyncio.Task[None] | None = None

    def register(self, server: aio.Server) -> list[str]:
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(self), server)
        return [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name]

    async def start(self) -> None:
        job_config = self.config.trainer.job
        if job_config is None:
            return
        from services.objectstore.factory import open_store
        from services.reconciler.client import ReconcilerClient
        from services.trainer.distributed.launch import current_runtime
        from services.trainer.job import TrainingJob

        runtime = current_runtime()
        leader = runtime is None or runtime.is_leader
        reconciler = (
            ReconcilerClient(self.channels.get("reconciler"))
            if job_config.phase == "rl" and leader
            else None
        )
        store = open_store(self.config.object_store)
        self.job = TrainingJob(self.config, store, reconciler, runtime)
        self._task = asyncio.create_task(self.job.run())

    async def check_ready(self) -> Readiness:
        if self.job is not None and self.job.state == "failed":
            return Readiness(False, f"training job failed: {self.job.error}")
        return Readiness(True, "ok" if self.job is None else f"job {self.job.state}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def status_fields(self) -> dict[str, str]:
        if self.job is None:
            return {"phase": "idle"}
        return {
            "phase": self.job.job.phase,
            "job": self.job.state,
            "step": str(self.job.step),
            "policy version": str(self.job.policy_version),
            "published version": str(self.job.last_published_version),
        }


def run(config: EtudeConfig) -> None:
    """Runs the trainer until SIGTERM; under torchrun, this process's rank of it."""
    from services.trainer.distributed.launch import launched_distributed

    if launched_distributed():
        from services.trainer.distributed.launch import run as run_distributed

        run_distributed(config)
        return
    run_service(TrainerService, config)
