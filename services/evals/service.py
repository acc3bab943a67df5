"""The evals process: every published policy version scored on held-out suites.

The watcher (``services.evals.watcher``) follows published versions and runs the enabled
suites on every N-th one; RunEval runs one suite on one version on demand. An eval
submits eval-priority groups to the reconciler, the envs workers run them against
inference like any rollout, and the ready groups are scored (``scoring``), stored in
the object store (``results``) and exported to Prometheus (``metrics``). After each
eval the report (``report``) is rendered again, stored, and served on the HTTP side at
``/report/``. Ready when the object store answers and the reconciler and inference are
ready. Only the reconciler talks to Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

from services.api.v1 import common_pb2, evals_pb2, evals_pb2_grpc
from services.config.evals import EvalsProcessConfig
from services.evals.base_scores import BaseScores
from services.evals.record import EvalRecord, eval_id
from services.evals.report import render
from services.evals.results import ResultsStore, read_record, report_prefix
from services.evals.runner import EvalFailed, Evaluator
from services.evals.suites import Suite, load_suites
from services.evals.watcher import VersionWatcher
from services.objectstore import ObjectNotFound, open_store
from services.reconciler_client import ReconcilerClient
from services.wire.client import Channels
from services.wire.errors import (
    FailedPrecondition,
    NotFound,
    ServiceError,
    Unavailable,
    require_identifier,
    require_range,
)
from services.wire.server import run_service
from services.wire.service import Readiness, Service

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger(__name__)

MAX_SAMPLES = 1024
Stored = tuple[EvalRecord, common_pb2.ObjectRef]
REPORT_PATH = "/report/"
_REPORT_FILE = re.compile(r"\A[A-Za-z0-9_.-]{1,100}\Z")
_MEDIA_TYPES = {".html": "text/html", ".json": "application/json", ".png": "image/png"}


class EvalsServicer(evals_pb2_grpc.EvalsServiceServicer):
    """The EvalsService contract."""

    def __init__(self, service: EvalsService) -> None:
        self._service = service

    async def RunEval(
        self, request: evals_pb2.RunEvalRequest, context: aio.ServicerContext
    ) -> evals_pb2.RunEvalResponse:
        require_identifier(request.suite, "suite")
        require_range(request.num_samples, "num_samples", 0, MAX_SAMPLES)
        evaluator = self._service.evaluator
        future = await evaluator.start(request.suite, request.policy_version, request.num_samples)
        answer = evals_pb2.RunEvalResponse(eval_id=eval_id(request.suite, request.policy_version))
        if request.wait:
            try:
                record, stored = await asyncio.shield(future)
            except EvalFailed as error:
                raise FailedPrecondition(f"{answer.eval_id} failed: {error}") from error
            answer.result.CopyFrom(record.to_proto(stored))
        return answer

    async def GetResults(
        self, request: evals_pb2.GetResultsRequest, context: aio.ServicerContext
    ) -> evals_pb2.GetResultsResponse:
        service = self._service
        if request.suite:
            require_identifier(request.suite, "suite")
            suites = [service.evaluator.suite(request.suite).name]
        else:
            suites = sorted(service.suites)
        version = request.policy_version if request.HasField("policy_version") else None
        results = []
        for suite in suites:
            results += await service.results_of(suite, version)
        return evals_pb2.GetResultsResponse(results=results)

    async def ListSuites(
        self, request: evals_pb2.ListSuitesRequest, context: aio.ServicerContext
    ) -> evals_pb2.ListSuitesResponse:
        return evals_pb2.ListSuitesResponse(
            suites=[
                evals_pb2.Suite(
                    name=suite.name,
                    family=suite.family,
                    num_tasks=len(suite.tasks),
                    default_num_samples=suite.num_samples,
                )
                for suite in self._service.suites.values()
            ]
        )

    async def GetReport(
        self, request: evals_pb2.GetReportRequest, context: aio.ServicerContext
    ) -> evals_pb2.GetReportResponse:
        service = self._service
        refs = service.report_refs
        if not refs:
            raise NotFound(f"no report yet for run {service.config.run.name}: no eval finished")
        return evals_pb2.GetReportResponse(
            html=refs["index.html"], json=refs["results.json"], url=service.report_url()
        )

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> evals_pb2.EvalsStatusResponse:
        service = self._service
        return evals_pb2.EvalsStatusResponse(
            info=await service.service_info(request.include_dependencies),
            last_evaluated_version=service.last_evaluated_version(),
            num_running_evals=len(service.evaluator.running),
        )


class EvalsService(Service):
    """Ready when the object store answers and the reconciler and inference are ready."""

    name = "evals"
    config: EvalsProcessConfig
    dependencies = ("reconciler", "inference")

    def __init__(self, config: EvalsProcessConfig, channels: Channels) -> None:
        super().__init__(config, channels)
        settings = config.evals
        self.suites: dict[str, Suite] = load_suites(settings.suites)
        for suite in self.suites.values():  # fixed task lists, built (and checked) at start-up
            log.info("suite %s: %d tasks, K=%d", suite.name, len(suite.tasks), suite.num_samples)
        self.store = open_store(config.object_store)
        self.results = ResultsStore(self.store, config.run.name)
        self.evaluator = Evaluator(
            run=config.run.name,
            suites=self.suites,
            settings=settings,
            results=self.results,
            weights_store=self.store,
            on_result=self._on_result,
            base_scores=BaseScores(self.store, config.envs) if settings.reuse_base_scores else None,
        )
        self._stored: dict[str, dict[int, Stored]] = {}
        self._report_task: asyncio.Task[None] | None = None
        self.report_refs: dict[str, common_pb2.ObjectRef] = {}
        self._report_lock = asyncio.Lock()
        self.watcher: VersionWatcher | None = None

    def register(self, server: aio.Server) -> list[str]:
        evals_pb2_grpc.add_EvalsServiceServicer_to_server(EvalsServicer(self), server)
        return [evals_pb2.DESCRIPTOR.services_by_name["EvalsService"].full_name]

    async def start(self) -> None:
        reconciler = ReconcilerClient(self.channels.get("reconciler"))
        self.evaluator.reconciler = reconciler
        found = await self.results.all_versions()
        if any(found.get(suite) for suite in self.suites):
            self._report_task = asyncio.create_task(self._refresh_report())
        settings = self.config.evals
        if not settings.watch:
            return
        last = await self._newest_fully_scored()
        self.watcher = VersionWatcher(
            reconciler=reconciler,
            store=self.store,
            run=self.config.run.name,
            every=settings.every_n_versions,
            poll_interval_s=settings.poll_interval_s,
            evaluate=self._evaluate_enabled,
            last=last if last >= 0 else None,
        )
        # Supervised: a watcher that crashed is logged, restarted with backoff, and the
        # service is not ready meanwhile (services.wire.supervise).
        self.background.start("version-watcher", self.watcher.run)

    def _enabled(self) -> list[str]:
        """The suites the watcher scores."""
        return [name for name, s in self.suites.items() if s.enabled]

    async def _newest_fully_scored(self) -> int:
        """The newest version every enabled suite has a stored result for (-1: none)."""
        found = await self.results.all_versions()
        scored = (found.get(name, {}) for name in self._enabled())
        return min((max(versions, default=-1) for versions in scored), default=-1)

    async def _evaluate_enabled(self, version: int) -> None:
        """The watcher's step: every enabled suite on `version`, concurrently."""
        suites = self._enabled()
        outcomes = await asyncio.gather(
            *(self.evaluator.request(name, version) for name in suites), return_exceptions=True
        )
        for name, outcome in zip(suites, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                log.error("watcher: %s on version %d: %s", name, version, outcome)

    async def _on_result(self, record: EvalRecord) -> None:
        """A new result: the watcher's stride runs from the newest version scored on every
        enabled suite (by it or through RunEval), and the report is rendered again."""
        if self.watcher is not None:
            newest = await self._newest_fully_scored()
            if newest >= 0:
                self.watcher.scored(newest)
        await self._refresh_report(record)

    async def _refresh_report(self, record: EvalRecord | None = None) -> None:
        """After a new result (and at start): render, store and serve the report again."""
        try:
            await self.render_report()
        except Exception:  # the result is stored; the next one renders the report again
            log.exception("report of run %s could not be rendered", self.config.run.name)

    async def stored(self, suite: str) -> dict[int, Stored]:
        """{version: (record, ref)} of `suite`'s results, read once from the store."""
        known = self._stored.setdefault(suite, {})
        for version, key in (await self.results.versions(suite)).items():
            if version not in known or known[version][1].key != key:
                with contextlib.suppress(ObjectNotFound):
                    known[version] = await asyncio.to_thread(read_record, self.store, key)
        return known

    async def render_report(self) -> None:
        """Renders every result of the run into the report and stores it."""
        async with self._report_lock:
            records = {
                suite: [record for record, _ in (await self.stored(suite)).values()]
                for suite in self.suites
            }
            files = await asyncio.to_thread(render, self.config.run.name, records)
            self.report_refs = await self.results.put_report(files)

    async def results_of(self, suite: str, version: int | None) -> list[evals_pb2.EvalResult]:
        """Stored, running and failed evals of `suite` (one version, or all)."""
        results = {
            v: record.to_proto(ref)
            for v, (record, ref) in (await self.stored(suite)).items()
            if version is None or v == version
        }
        states = [
            *((v, evals_pb2.EVAL_STATE_FAILED) for s, v in self.evaluator.failed if s == suite),
            *((v, evals_pb2.EVAL_STATE_RUNNING) for s, v in self.evaluator.running if s == suite),
        ]
        for other_version, state in states:
            if (version is None or other_version == version) and other_version not in results:
                results[other_version] = evals_pb2.EvalResult(
                    eval_id=eval_id(suite, other_version),
                    suite=suite,
                    policy_version=other_version,
                    state=state,
                )
        return [results[v] for v in sorted(results)]

    def last_evaluated_version(self) -> int:
        """The newest version the watcher finished, or the newest with any result."""
        if self.watcher is not None and self.watcher.last is not None:
            return self.watcher.last
        return max((v for by in self._stored.values() for v in by), default=0)

    def report_url(self) -> str:
        """Where the HTTP side serves the report."""
        http = self.settings.http
        host = http.host if http.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        return f"http://{host}:{http.port}{REPORT_PATH}"

    def http_routes(self, app: FastAPI) -> None:
        """The latest report at /report/ (index.html, its PNGs, results.json)."""
        from fastapi import HTTPException, Response
        from fastapi.responses import RedirectResponse

        @app.get("/report", include_in_schema=False)
        def report_root() -> RedirectResponse:
            return RedirectResponse(REPORT_PATH)

        @app.get(REPORT_PATH + "{name}")
        @app.get(REPORT_PATH, include_in_schema=False)
        def report_file(name: str = "index.html") -> Response:
            if not _REPORT_FILE.match(name) or name.startswith("."):
                raise HTTPException(404, f"no report file {name!r}")
            try:
                data = self.results.report_file(name)
            except ObjectNotFound:
                problem = f"no report file {name!r} (has an eval finished?)"
                raise HTTPException(404, problem) from None
            suffix = name[name.rfind(".") :]
            return Response(data, media_type=_MEDIA_TYPES.get(suffix, "application/octet-stream"))

    async def check_ready(self) -> Readiness:
        try:
            await asyncio.to_thread(self.store.list, report_prefix(self.config.run.name))
        except Exception as error:  # any store failure: not ready, say why
            return Readiness(False, f"object store: {type(error).__name__}: {error}")
        return Readiness(True, f"suites: {', '.join(self.suites)}")

    def classify_error(self, error: Exception) -> ServiceError | None:
        if isinstance(error, aio.AioRpcError) and error.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ):
            return Unavailable(f"reconciler: {error.code().name}: {error.details()}")
        return None

    async def stop(self) -> None:
        # The version watcher was stopped before this (services.wire.server).
        tasks: list[asyncio.Future[Any]] = [t for t in (self._report_task,) if t is not None]
        tasks += [running.task for running in self.evaluator.running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def status_fields(self) -> dict[str, str]:
        fields = {
            "suites": ", ".join(
                f"{s.name} ({len(s.tasks)} tasks, K={s.num_samples}"
                f"{'' if s.enabled else ', not watched'})"
                for s in self.suites.values()
            ),
            "evals running": str(len(self.evaluator.running)),
            "last evaluated version": str(self.last_evaluated_version()),
            "report": REPORT_PATH,
        }
        return fields


def run(config: EvalsProcessConfig) -> None:
    """Runs the evals service until SIGTERM."""
    run_service(EvalsService, config)
