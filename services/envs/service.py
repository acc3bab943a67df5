"""The envs process: the EnvService API over sandboxed workspaces, and rollout workers.

Ready when a sandbox can run untrusted code here (bubblewrap) and the reconciler and
inference are ready. With ``envs.workers > 0`` the process also claims slots from the
reconciler and runs rollouts (``services.envs.worker``).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path

from grpc import aio

from services.api.v1 import common_pb2, envs_pb2, envs_pb2_grpc
from services.config.envs import EnvsProcessConfig
from services.envs import validation
from services.envs.faults import InfraFault
from services.envs.grading import grade
from services.envs.sandbox import SandboxUnavailable, make_sandbox
from services.envs.worker import RolloutWorker
from services.envs.workspace import Workspaces
from services.wire.client import Channels
from services.wire.errors import FailedPrecondition, Unavailable, require_identifier
from services.wire.server import run_service
from services.wire.service import Readiness, Service

log = logging.getLogger(__name__)


class EnvServicer(envs_pb2_grpc.EnvServiceServicer):
    """The EnvService contract."""

    def __init__(self, service: EnvsService) -> None:
        self._service = service

    @property
    def _workspaces(self) -> Workspaces:
        workspaces = self._service.workspaces
        if workspaces is None:
            raise Unavailable(f"no sandbox: {self._service.sandbox_problem}")
        return workspaces

    async def CreateWorkspace(
        self, request: envs_pb2.CreateWorkspaceRequest, context: aio.ServicerContext
    ) -> envs_pb2.CreateWorkspaceResponse:
        validation.validate_create(request)
        workspace = await asyncio.to_thread(self._workspaces.create, request.task)
        return envs_pb2.CreateWorkspaceResponse(workspace_id=workspace.workspace_id)

    async def ForkWorkspace(
        self, request: envs_pb2.ForkWorkspaceRequest, context: aio.ServicerContext
    ) -> envs_pb2.ForkWorkspaceResponse:
        validation.validate_fork(request)
        forks = await asyncio.to_thread(self._workspaces.fork, request.source_id, request.num_forks)
        return envs_pb2.ForkWorkspaceResponse(workspace_ids=[f.workspace_id for f in forks])

    async def SnapshotWorkspace(
        self, request: envs_pb2.SnapshotWorkspaceRequest, context: aio.ServicerContext
    ) -> envs_pb2.SnapshotWorkspaceResponse:
        require_identifier(request.workspace_id, "workspace_id")
        snapshot = await asyncio.to_thread(self._workspaces.snapshot, request.workspace_id)
        return envs_pb2.SnapshotWorkspaceResponse(snapshot_id=snapshot)

    async def Exec(
        self, request: envs_pb2.ExecRequest, context: aio.ServicerContext
    ) -> envs_pb2.ExecResponse:
        validation.validate_exec(request)
        workspaces = self._workspaces
        path = workspaces.path(request.workspace_id)
        if request.workspace_id.startswith("snap-"):
            raise FailedPrecondition(
                f"{request.workspace_id} is a snapshot: fork it to run commands"
            )
        outcome = await asyncio.to_thread(
            workspaces.sandbox.run,
            path,
            list(request.argv),
            stdin=request.stdin,
            env=dict(request.env),
            wall_s=request.timeout_s or None,
        )
        return envs_pb2.ExecResponse(
            result=common_pb2.ExecResult(
                exit_code=outcome.exit_code,
                stdout=outcome.stdout,
                stderr=outcome.stderr,
                timed_out=outcome.timed_out,
                killed_by=outcome.killed_by,
                stdout_truncated=outcome.stdout_truncated,
                stderr_truncated=outcome.stderr_truncated,
                wall_s=outcome.wall_s,
            )
        )

    async def Grade(
        self, request: envs_pb2.GradeRequest, context: aio.ServicerContext
    ) -> envs_pb2.GradeResponse:
        validation.validate_grade(request)
        workspace = self._workspaces.get(request.workspace_id)
        grading = request.grading if request.HasField("grading") else None
        if grading is None:
            if workspace.task is None:
                raise FailedPrecondition(
                    f"{request.workspace_id} was not created from a task: give grading"
                )
            grading = workspace.task.grading
        try:
            result = await asyncio.to_thread(grade, self._workspaces, request.workspace_id, grading)
        except InfraFault as fault:  # the host's fault, not the code's: worth a retry
            raise Unavailable(f"grading was not scored: {fault}") from fault
        return envs_pb2.GradeResponse(result=result)

    async def DeleteWorkspace(
        self, request: envs_pb2.DeleteWorkspaceRequest, context: aio.ServicerContext
    ) -> envs_pb2.DeleteWorkspaceResponse:
        require_identifier(request.workspace_id, "workspace_id")
        await asyncio.to_thread(self._workspaces.delete, request.workspace_id)
        return envs_pb2.DeleteWorkspaceResponse()

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> envs_pb2.EnvsStatusResponse:
        service = self._service
        workspaces = service.workspaces
        count = 0
        if workspaces is not None:
            count = len(list((workspaces.root / "workspaces").iterdir()))
        return envs_pb2.EnvsStatusResponse(
            info=await service.service_info(request.include_dependencies),
            num_workspaces=count,
            num_active_rollouts=service.worker.active if service.worker else 0,
            sandbox_backend=workspaces.sandbox.name if workspaces else "",
        )


class EnvsService(Service):
    """Ready when a sandbox is available and the reconciler and inference are ready."""

    name = "envs"
    config: EnvsProcessConfig
    dependencies = ("reconciler", "inference")

    def __init__(self, config: EnvsProcessConfig, channels: Channels) -> None:
        super().__init__(config, channels)
        settings = config.envs
        self.sandbox_problem = ""
        self.workspaces: Workspaces | None = None
        try:
            # Workspaces are scratch space the sandbox uid must reach: /tmp by default.
            default = Path(tempfile.gettempdir()) / f"etude-workspaces-{config.run.name}"
            self.workspaces = Workspaces(
                settings.workspaces_dir or default, make_sandbox(settings.sandbox)
            )
        except (SandboxUnavailable, ValueError) as error:
            self.sandbox_problem = str(error)
            log.error("envs cannot run untrusted code: %s", error)
        self.worker: RolloutWorker | None = None
        self.sandbox_works = asyncio.Event()

    def register(self, server: aio.Server) -> list[str]:
        envs_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(self), server)
        return [envs_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name]

    async def start(self) -> None:
        settings = self.config.envs
        if settings.workers == 0 or self.workspaces is None:
            return
        from transformers import AutoTokenizer

        from services.envs.worker import worker_id
        from services.objectstore import open_store
        from services.reconciler_client import ReconcilerClient

        tokenizer_dir = settings.tokenizer_dir or self.config.model.directory
        worker = RolloutWorker(
            worker_id=worker_id("envs"),
            reconciler=ReconcilerClient(self.channels.get("reconciler")),
            inference=self.channels.get("inference"),
            workspaces=self.workspaces,
            store=open_store(self.config.object_store),
            tokenizer=await asyncio.to_thread(AutoTokenizer.from_pretrained, tokenizer_dir),
            grade=grade,
            run_name=self.config.run.name,
            harness=settings.harness,
            rewards=settings.rewards,
            lease_ttl_s=settings.lease_ttl_s,
        )
        self.worker = worker

        # Supervised: workers that crashed are logged, restarted with backoff, and the
        # service is not ready meanwhile (services.wire.supervise).
        # They take rollouts only once a sandbox has run a command (check_ready).
        async def work() -> None:
            await self.sandbox_works.wait()
            await worker.run(settings.workers)

        self.background.start("rollout-workers", work)

    async def check_ready(self) -> Readiness:
        if self.workspaces is None:
            return Readiness(False, f"no sandbox: {self.sandbox_problem}")
        if not self.sandbox_works.is_set():
            # Not only that bwrap exists: that it can make a sandbox in this pod (user
            # namespaces, the uid drop), tried again at every readiness check until it can.
            sandbox = self.workspaces.sandbox
            problem = await asyncio.to_thread(sandbox.self_test, self.workspaces.root)
            if problem is not None:
                if problem != self.sandbox_problem:
                    log.error("envs cannot run untrusted code: %s", problem)
                self.sandbox_problem = problem
                return Readiness(False, problem)
            self.sandbox_problem = ""
            self.sandbox_works.set()
        return Readiness(True, f"sandbox: {self.workspaces.sandbox.name}")

    def status_fields(self) -> dict[str, str]:
        fields = {"sandbox": self.workspaces.sandbox.name if self.workspaces else "none"}
        if self.workspaces is not None:
            fields["workspaces"] = str(self.workspaces.root)
        if self.worker is not None:
            fields["rollouts running"] = str(self.worker.active)
            fields["rollouts completed"] = str(self.worker.completed)
        return fields


def run(config: EnvsProcessConfig) -> None:
    """Runs the envs service until SIGTERM."""
    run_service(EnvsService, config)
