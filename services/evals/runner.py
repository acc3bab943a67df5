"""Running one eval: a suite's tasks as eval-priority groups, scored when all are ready.

The eval of `suite` on version v submits one group of K samples per task with the
idempotency key ``eval:<suite>:v<v>:<task_id>``, so running it again (a retry, a
restart, a second RunEval) finds the same groups instead of sampling more: the
reconciler returns the existing group ids, and the same rollouts are scored again.
Samples that v did not generate alone are asked for again in retry groups keyed
``<key>:retry<round>`` (``services.evals.versions``), as deterministic as the first ones,
and what is still not v's alone is left out and counted. Version 0, the base model every
gain is measured from, is scored on more tasks (and optionally more samples) than later
versions (``evals.base_tasks_multiplier``). The record is stored and indexed only when
every group is ready (or dropped).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from services.api.v1 import common_pb2, reconciler_pb2
from services.config.evals import EvalsConfig
from services.evals import metrics
from services.evals.base_scores import BaseScores
from services.evals.record import EvalRecord, eval_id
from services.evals.results import ResultsStore
from services.evals.scoring import score
from services.evals.suites import Suite
from services.evals.versions import TaskSamples, retry_key
from services.objectstore.base import ObjectStore
from services.reconciler_client import GroupDropped, ReconcilerClient
from services.weights.manifest import Layout, WeightsError, read_latest, read_manifest
from services.wire.errors import FailedPrecondition, NotFound, Unavailable

log = logging.getLogger(__name__)

SUBMIT_CHUNK = 500
MAX_SAMPLES = 1024
BASE_VERSION = 0  # the base model: the reference every gain is measured from
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
        base_scores: BaseScores | None = None,
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
        self.base_scores = base_scores  # None: version 0 is scored in every run
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
            k = num_samples or self.default_samples(suite, version)
            task = asyncio.create_task(self._run(suite, version, k))
            self.running[(suite.name, version)] = RunningEval(suite.name, version, k, task)
        self.failed.pop((suite.name, version), None)
        task.add_done_callback(lambda t: self._finished(suite.name, version, t))
        return task

    def default_samples(self, suite: Suite, version: int) -> int:
        """K when RunEval does not say: the suite's, or the base version's own."""
        return self.base_plan(suite)[1] if version == BASE_VERSION else suite.num_samples

    def base_plan(self, suite: Suite) -> tuple[list[common_pb2.Task], int]:
        """The base version's tasks and K: base_tasks_multiplier times the tasks (the
        first of the same list) and K times base_samples_multiplier. Where the list runs
        out first (HumanEval has 164), K grows by the tasks it could not give, unless the
        suite's base_num_tasks says how many."""
        settings = self.settings
        tasks = suite.base_tasks(settings.base_tasks_multiplier)
        num_samples = suite.num_samples * settings.base_samples_multiplier
        if suite.settings.base_num_tasks is None:
            wanted = len(suite.tasks) * settings.base_tasks_multiplier
            num_samples *= math.ceil(wanted / len(tasks))
        return tasks, min(num_samples, MAX_SAMPLES)

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
            record = await self._score(suite, version, num_samples, started)
            info = await self.results.save(record)
        except Exception:
            metrics.RUNS.labels(suite.name, "FAILED").inc()
            raise
        finally:
            metrics.RUNNING.dec()
        metrics.export(record)
        metrics.RUNS.labels(suite.name, "DONE").inc()
        metrics.DURATION.labels(suite.name).observe(record.finished_at - started)
        interval = record.pass_at_1_interval
        log.info(
            "%s: pass@1 %.3f [%.3f, %.3f] over %d tasks x K=%d; %d generations retried, "
            "%d left out (not sampled by v%d alone)%s",
            record.eval_id,
            record.pass_at_1,
            interval.low if interval else record.pass_at_1,
            interval.high if interval else record.pass_at_1,
            record.num_tasks,
            record.num_samples,
            record.num_retried,
            record.num_left_out,
            record.policy_version,
            f"; kept from run {record.reused_from}" if record.reused_from else "",
        )
        await self.on_result(record)
        stored = common_pb2.ObjectRef(key=info.key, size_bytes=info.size, sha256=info.sha256)
        return record, stored

    async def _score(
        self, suite: Suite, version: int, num_samples: int, started: float
    ) -> EvalRecord:
        """A fresh score; for version 0 the kept one of the same key when there is one, and
        a fresh one kept (services.evals.base_scores)."""
        key = None
        if version == BASE_VERSION and self.base_scores is not None:
            key = await asyncio.to_thread(self._base_key, suite, num_samples)
            kept = None if key is None else await asyncio.to_thread(self.base_scores.load, key)
            if kept is not None:
                metrics.BASE_SCORES_REUSED.labels(suite.name).inc()
                return kept.model_copy(update={"run": self.run, "reused_from": kept.run})
        record = await self._sample_and_score(suite, version, num_samples, started)
        if key is not None and self.base_scores is not None:
            await asyncio.to_thread(self.base_scores.save, key, record)
        return record

    def _base_key(self, suite: Suite, num_samples: int) -> str | None:
        """The key of version 0's score of `suite` with K `num_samples`; None when version
        0's manifest cannot be read (the eval then samples and keeps nothing)."""
        assert self.base_scores is not None
        try:
            manifest = read_manifest(self.weights_store, self.layout, BASE_VERSION)
        except WeightsError as error:
            log.warning("version 0's score of %s is not kept: %s", suite.name, error)
            return None
        tasks = self.base_plan(suite)[0]
        return self.base_scores.key(manifest, suite, tasks, num_samples, self.settings.pass_at_k)

    async def _sample_and_score(
        self, suite: Suite, version: int, num_samples: int, started: float
    ) -> EvalRecord:
        tasks = self.base_plan(suite)[0] if version == BASE_VERSION else suite.tasks
        timeout_s = self.settings.eval_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                first, samples = await self._sample(suite.name, version, tasks, num_samples)
        except TimeoutError:
            raise EvalFailed(
                f"{eval_id(suite.name, version)} was not settled in eval_timeout_s = {timeout_s:g}"
            ) from None
        groups, left_out_tasks = [], []
        for task_id, group in first.items():
            if group is None:
                continue
            kept = reconciler_pb2.Group()
            kept.CopyFrom(group)
            del kept.rollouts[:]
            kept.rollouts.extend(samples[task_id].kept)
            if kept.rollouts:
                groups.append(kept)
            else:
                left_out_tasks.append(task_id)
        if not groups:
            left_out = sum((s.left_out for s in samples.values()), Counter[str]())
            raise EvalFailed(
                f"no sample of {eval_id(suite.name, version)} was generated by v{version} alone "
                f"({sum(g is None for g in first.values())} of {len(first)} groups dropped; "
                f"{sum(s.num_retried for s in samples.values())} samples retried; left out, "
                f"by version: {dict(sorted(left_out.items())) or 'none'})"
            )
        return score(
            run=self.run,
            suite=suite.name,
            family=suite.family,
            version=version,
            # The groups' own K: an earlier run of this eval may have created them.
            num_samples=max(g.num_samples for g in first.values() if g is not None),
            ks=self.settings.pass_at_k,
            groups=groups,
            dropped_tasks=[task_id for task_id, group in first.items() if group is None],
            is_correct=suite.is_correct,
            started_at=started,
            finished_at=time.time(),
            num_retried=sum(s.num_retried for s in samples.values()),
            left_out_by=sum((s.left_out for s in samples.values()), Counter[str]()),
            left_out_tasks=left_out_tasks,
        )

    async def _sample(
        self, suite: str, version: int, tasks: list[common_pb2.Task], num_samples: int
    ) -> tuple[dict[str, reconciler_pb2.Group | None], dict[str, TaskSamples]]:
        """Each task's first group (None: dropped), and its samples sorted by version over
        that group and its retry rounds."""
        by_id = {task.task_id: task for task in tasks}
        keys = {task_id: idempotency_key(suite, version, task_id) for task_id in by_id}
        samples = {task_id: TaskSamples(version) for task_id in by_id}
        first = await self._settle(version, [(by_id[t], num_samples, keys[t]) for t in by_id])
        for task_id, group in first.items():
            samples[task_id].add(group.rollouts if group else ())
        for round_ in range(1, self.settings.version_retries + 1):
            asked = {t: n for t, s in samples.items() if (n := s.take_retries())}
            if not asked:
                break
            retries = await self._settle(
                version, [(by_id[t], n, retry_key(keys[t], round_)) for t, n in asked.items()]
            )
            for task_id, group in retries.items():
                samples[task_id].retried(group.rollouts if group else (), asked[task_id])
        for task_samples in samples.values():
            task_samples.finish()
        return first, samples

    async def _settle(
        self, version: int, asked: list[tuple[common_pb2.Task, int, str]]
    ) -> dict[str, reconciler_pb2.Group | None]:
        """Submits a group per (task, K, idempotency key) and waits for all of them:
        {task id: the ready group, or None when it was dropped}, in the order asked."""
        reconciler = self.reconciler
        assert reconciler is not None
        specs = [
            reconciler_pb2.GroupSpec(
                task=task,
                num_samples=num_samples,
                kind=common_pb2.SLOT_KIND_EVAL,
                priority=self.settings.priority,
                idempotency_key=key,
                min_policy_version=version,
            )
            for task, num_samples, key in asked
        ]
        futures = []
        for first in range(0, len(specs), SUBMIT_CHUNK):
            futures += await reconciler.submit_many(specs[first : first + SUBMIT_CHUNK])
        task_of = {f.group_id: spec.task.task_id for f, spec in zip(futures, specs, strict=True)}
        settled: dict[str, reconciler_pb2.Group | None] = {}
        async for future in reconciler.as_completed(futures):
            try:
                settled[task_of[future.group_id]] = await future.result()
            except GroupDropped:
                settled[task_of[future.group_id]] = None
        return {task.task_id: settled[task.task_id] for task, _, _ in asked}
