"""The trainer process: the TrainerService contract, readiness, and the training job.

Ready when the reconciler (its source of work) is ready. Without ``[trainer.job]`` it
trains nothing: GetStatus reports phase "idle" and ListCheckpoints lists what the
run's checkpoint directory holds. With a job, the job starts with the service and
GetStatus reports its phase, step, versions and the last step's metrics;
SaveCheckpoint saves a tagged checkpoint at the next step boundary.

``run`` builds the process's runtime once (``services.trainer.distributed.launch``: one
process, or this rank of a job under torchrun, ``WORLD_SIZE`` > 1) and hands it to the
service: global rank 0 serves this API for the job, the first process of every other
node serves its pod's probes and metrics, all ranks train.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import TYPE_CHECKING

from grpc import aio

# Declares the trainer's metrics, so that an idle trainer (no job, no torch) exports them too.
import services.trainer.metrics  # noqa: F401
from services.api.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.config.trainer import TrainerProcessConfig
from services.wire.client import Channels
from services.wire.errors import FailedPrecondition, require
from services.wire.service import Readiness, Service

if TYPE_CHECKING:
    # torch comes with these: an idle trainer (no job) starts without importing it.
    from services.trainer.checkpoint_index import CheckpointInfo
    from services.trainer.job import TrainingJob
    from services.trainer.runtime import TrainerRuntime

log = logging.getLogger(__name__)

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


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
            phase=self._service.phase,
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
            _TAG.fullmatch(request.tag) is not None,
            "tag",
            f"{request.tag[:80]!r} must be 1-64 letters, digits, '.', '_' or '-'",
        )
        job = self._service.job
        if job is None:
            raise FailedPrecondition(self._service.no_job_reason())
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
        from services.objectstore.factory import open_store
        from services.trainer.checkpoint_index import list_checkpoints

        config, job = self._service.config, self._service.job
        # Without a job, the listing reads metadata and manifests only: an idle trainer
        # imports no torch, and the first call must not wait for it.
        if job:
            infos = await asyncio.to_thread(job.checkpoints.list)
        else:
            store = open_store(config.object_store)
            infos = await asyncio.to_thread(list_checkpoints, config, store)
        return trainer_pb2.ListCheckpointsResponse(
            checkpoints=[_checkpoint_message(i) for i in infos]
        )


class TrainerService(Service):
    """Ready when the reconciler is; runs the configured training job on ``runtime``
    (None: an idle trainer, without ``[trainer.job]``)."""

    name = "trainer"
    config: TrainerProcessConfig
    dependencies = ("reconciler",)

    def __init__(
        self,
        config: TrainerProcessConfig,
        channels: Channels,
        runtime: TrainerRuntime | None = None,
    ) -> None:
        super().__init__(config, channels)
        self.runtime = runtime
        self.job: TrainingJob | None = None  # None while it is built, or without a job
        self.job_state, self.job_error = "starting", ""  # until the job is built
        self._task: asyncio.Task[None] | None = None

    @property
    def phase(self) -> str:
        """The configured job's phase, or "idle"."""
        job = self.config.trainer.job
        return "idle" if job is None else job.phase

    def no_job_reason(self) -> str:
        """Why there is no job to ask for a checkpoint."""
        if self.config.trainer.job is None or self.runtime is None:
            return "no training job is configured ([trainer.job]): nothing to save"
        return f"the training job is {self.job_state}; there is no state to save"

    def register(self, server: aio.Server) -> list[str]:
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(self), server)
        return [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name]

    async def start(self) -> None:
        if self.config.trainer.job is not None and self.runtime is not None:
            self._task = asyncio.create_task(self._train(self.runtime))

    async def _train(self, runtime: TrainerRuntime) -> None:
        """Builds the job (the server answers meanwhile), then runs it."""
        from services.objectstore.factory import open_store
        from services.reconciler_client import ReconcilerClient
        from services.trainer.job import TrainingJob

        rl = self.phase == "rl" and runtime.is_leader
        try:  # any failure here is the job's, reported by readiness, never a silent end
            reconciler = ReconcilerClient(self.channels.get("reconciler")) if rl else None
            store = open_store(self.config.object_store)
            self.job = await asyncio.to_thread(
                TrainingJob.build, self.config, store, reconciler, runtime
            )
        except Exception as error:
            log.exception("the training job could not be built")
            self.job_state, self.job_error = "failed", f"{type(error).__name__}: {error}"
            return
        await self.job.run()

    async def check_ready(self) -> Readiness:
        state, error = self._job_state()
        if state == "failed":
            return Readiness(False, f"training job failed: {error}")
        if self.job is not None and (fault := self.job.fault()) is not None:
            return Readiness(False, fault)
        return Readiness(True, "ok" if self.runtime is None else f"job {state}")

    def _job_state(self) -> tuple[str, str]:
        if self.job is None:
            return self.job_state, self.job_error
        return self.job.state, self.job.error

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def status_fields(self) -> dict[str, str]:
        if self.runtime is None:
            return {"phase": "idle"}
        fields = {"phase": self.phase, "job": self._job_state()[0]}
        if self.job is not None:
            fields |= {
                "step": str(self.job.step),
                "policy version": str(self.job.policy_version),
                "published version": str(self.job.last_published_version),
            }
        return fields


def run(config: TrainerProcessConfig) -> None:
    """Runs the trainer until SIGTERM; under torchrun, this process's rank of it."""
    from services.trainer.distributed.launch import local_rank, start_runtime

    if config.trainer.job is None:  # an idle trainer: local rank 0 serves, torch unused
        if local_rank() == 0:
            _serve(config, None)
        else:
            log.info("no [trainer.job]: local rank %d has nothing to do", local_rank())
        return
    from services.trainer.distributed.launch import train_without_listeners

    runtime = start_runtime(config)
    try:
        if runtime.serves_http:
            _serve(config, runtime)
        else:
            asyncio.run(train_without_listeners(config, runtime))
    finally:
        runtime.close()


def _serve(config: TrainerProcessConfig, runtime: TrainerRuntime | None) -> None:
    """``run_service`` for a service built with this process's runtime."""
    from services.telemetry import configure_tracing
    from services.wire.server import serve

    tracer_provider = configure_tracing(config.telemetry, TrainerService.name)
    try:
        service = TrainerService(config, Channels(config, tracer_provider), runtime)
        asyncio.run(serve(service, tracer_provider=tracer_provider))
    finally:
        tracer_provider.shutdown()
