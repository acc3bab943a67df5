"""Running one eval: a suite's tasks as eval-priority groups, scored when all are ready.

The eval of `suite` on version v submits one group of K samples per task with the
idempotency key ``eval:<suite>:v<v>:<task_id>``, so running it again (a retry, a
restart, a second RunEval) finds the same groups instead of sampling more: the
reconciler returns the existing group ids, and the same rollouts are scored again. The
record is stored and indexed only when every group is ready (or dropped).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from services.api.v1 import common_pb2, reconciler_pb2
from services.evals import metrics
from services.evals.config import EvalsConfig
from services.evals.record import EvalRecord, eval_id
from services.evals.results import ResultsStore
from services.evals.scoring import score
from services.evals.suites import Suite
from services.objectstore.base import ObjectStore
from services.reconciler.client import GroupDropped, ReconcilerClient
from services.weights.manifest import Layout, read_latest
from services.wire.errors import FailedPrecondition, NotFound, Unavailable

log = logging.getLogger(__name__)

SUBMIT_CHUNK = 500
Outcome = tuple[EvalRecord, common_pb2.ObjectRef]


class EvalFailed(Exception):
    """The eval cannot produce a result (every group dropped, or it ran out of time)."""


@dataclass
class RunningEval:
    """An eval in progress in this process."""

    suite: str
    version: int
    num_samples: int
    task: asyncio.Task[Outcome] = field(repr=False)


def idempotency_key(suite: str, version: int, task_id: str) -> str:
    """The reconciler key of one task's group in the eval of `suite` on `version`."""
    return f"eval:{suite}:v{version}:{task_id}"


class Evaluator:
    """Starts evals, joins running ones, answers stored ones without sampling again."""

    def __init__(
        self,
        *,
        run: str,
        suites: Mapping[str, Suite],
        settings: EvalsConfig,
        results: ResultsStore,
        weights_store: ObjectStore,
        on_result: Callable[[EvalRecord], Awaitable[None]],
    ) -> None:
        self.run = run
        self.suites = suites
        self.settings = settings
        # Set by the service's start: channels belong to the serving event loop.
        self.reconciler: ReconcilerClient | None = None
        self.results = results
        self.weights_store = weights_store
        self.layout = Layout(run)
        self.on_result = on_result
        self.running: dict[tuple[str, int], RunningEval] = {}
        self._starting = asyncio.Lock()  # one task per (suite, version), even when asked twice
        self.failed: dict[tuple[str, int], str] = {}

    def suite(self, name: str) -> Suite:
        """The suite called `name`; NOT_FOUND naming the known suites."""
        if name not in self.suites:
            known = ", ".join(sorted(self.suites))
            raise NotFound(f"unknown suite {name!r}; known suites: {known}")
        return self.suites[name]

    async def check_published(self, version: int) -> None:
        """NOT_FOUND unless `version` has a manifest in the store (it was published)."""
        key = self.layout.manifest(version)
        if await asyncio.to_thread(self.weights_store.exists, key):
            return
        latest = await asyncio.to_thread(read_latest, self.weights_store, self.layout)
        newest = "none yet" if latest is None else f"the newest is {latest}"
        raise NotFound(
            f"policy version {version} of run {self.run} was never published "
            f"(no manifest at {key}); {newest}"
        )

    async def request(self, suite_name: str, version: int, num_samples: int = 0) -> Outcome:
        """The eval of `suite_name` on `version`: stored, joined, or started and awaited.

        Cancelling the caller does not cancel the eval.
        """
        return await asyncio.shield(await self.start(suite_name, version, num_samples))

    async def start(
        self, suite_name: str, version: int, num_samples: int = 0
    ) -> asyncio.Future[Outcome]:
        """The eval's future: done for a stored result, the running one, or a new one.

        `num_samples` 0 means the suite's K. An eval exists once per (suite, version):
        asking for it with another K is FAILED_PRECONDITION.
        """
        suite = self.suite(suite_name)
        async with self._starting:
            stored = await self.results.load(suite.name, version)
            if stored is not None:
                self._check_samples(suite.name, version, stored[0].num_samples, num_samples)
                done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
                done.set_result(stored)
                return done
            running = self.running.get((suite.name, version))
            if running is not None:
                self._check_samples(suite.name, version, running.num_samples, num_samples)
                return running.task
            await self.check_published(version)
            if self.reconciler is None:
                raise Unavailable("the evals service is starting")
            k = num_samples or suite.num_samples
            task = asyncio.create_task(self._run(suite, version, k))
            self.running[(suite.name, version)] = RunningEval(suite.name, version, k, task)
        self.failed.pop((suite.name, version), None)
        task.add_done_callback(lambda t: self._finished(suite.name, version, t))
        return task

    def _check_samples(self, suite: str, version: int, existing: int, asked: int) -> None:
        if asked and asked != existing:
            raise FailedPrecondition(
                f"{eval_id(suite, version)} is evaluated with K = {existing}; "
                f"num_samples = {asked} would be another eval (leave it 0 for the existing one)"
            )

    def _finished(self, suite: str, version: int, task: asyncio.Task[Outcome]) -> None:
        self.running.pop((suite, version), None)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self.failed[(suite, version)] = f"{type(error).__name__}: {error}"
            log.error("eval %s failed: %s", eval_id(suite, version), error)

    async def _run(self, suite: Suite, version: int, num_samples: int) -> Outcome:
        started = time.time()
        metrics.RUNNING.inc()
        try:
            record = await self._sample_and_score(suite, version, num_samples, started)
            info = await self.results.save(record)
        except Exception:
            metrics.RUNS.labels(suite.name, "FAILED").inc()
            raise
        finally:
            metrics.RUNNING.dec()
        metrics.export(record)
        metrics.RUNS.labels(suite.name, "DONE").inc()
        metrics.DURATION.labels(suite.name).observe(record.finished_at - started)
        log.info(
            "%s: pass@1 %.3f over %d tasks x K=%d (sampled by v%d-v%d)",
            record.eval_id,
            record.pass_at_1,
            record.num_tasks,
            record.num_samples,
            record.generated_by.min_version,
            record.generated_by.max_version,
        )
        await self.on_result(record)
        stored = common_pb2.ObjectRef(key=info.key, size_bytes=info.size, sha256=info.sha256)
        return record, stored

    async def _sample_and_score(
        self, suite: Suite, version: int, num_samples: int, started: float
    ) -> EvalRecord:
        reconciler = self.reconciler
        assert reconciler is not None
        specs = [
            reconciler_pb2.GroupSpec(
                task=task,
                num_samples=num_samples,
                kind=common_pb2.SLOT_KIND_EVAL,
                priority=self.settings.priority,
                idempotency_key=idempotency_key(suite.name, version, task.task_id),
                min_policy_version=version,
            )
            for task in suite.tasks
        ]
        futures = []
        for first in range(0, len(specs), SUBMIT_CHUNK):
            futures += await reconciler.submit_many(specs[first : first + SUBMIT_CHUNK])
        task_of = {f.group_id: spec.task.task_id for f, spec in zip(futures, specs, strict=True)}
        ready: dict[str, reconciler_pb2.Group] = {}
        dropped: set[str] = set()
        timeout_s = self.settings.eval_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                async for future in reconciler.as_completed(futures):
                    try:
                        ready[future.group_id] = await future.result()
                    except GroupDropped:
                        dropped.add(future.group_id)
        except TimeoutError:
            raise EvalFailed(
                f"{len(ready) + len(dropped)} of {len(futures)} groups settled in "
                f"eval_timeout_s = {timeout_s:g}"
            ) from None
        groups = [ready[f.group_id] for f in futures if f.group_id in ready]
        if not groups:
            raise EvalFailed(f"every group of {eval_id(suite.name, version)} was dropped")
        return score(
            run=self.run,
            suite=suite.name,
            family=suite.family,
            version=version,
            # The groups' own K: an earlier run of this eval may have created them.
            num_samples=max(g.num_samples for g in groups),
            ks=self.settings.pass_at_k,
            groups=groups,
            dropped_tasks=[task_of[f.group_id] for f in futures if f.group_id in dropped],
            is_correct=suite.is_correct,
            started_at=started,
            finished_at=time.time(),
        )
