"""Rollout workers: claim a slot, run the harness in a forked workspace, grade, reward,
store the rollout record, complete the slot.

The K slots of a group start from the same prepared workspace: the first slot a worker
takes of a group builds it and snapshots it, the others fork from the snapshot. What the
code under test does is scored (a timeout, a crash, wrong output: usually 0); what the
infrastructure does (a sandbox that did not start or was killed from outside, a host
that starved the tests of CPU twice, inference or the object store down, a bug of the
worker) is never scored: the slot fails as retryable with the reason
``infra:<kind>: <detail>`` (``services.envs.faults``), so it is retried; a lease lost
meanwhile (the worker was too slow) drops the result, since another worker
owns the slot now. Heartbeats run in the background for as long as a slot is held (one
call renews all of a worker's leases).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api.v1 import common_pb2, reconciler_pb2
from services.config.envs import RewardConfig
from services.envs import faults, metrics
from services.envs.harness import Harness, HarnessConfig
from services.envs.inference_client import InferenceGenerator
from services.envs.rewards import Behaviour, reasoning_comment_lines, reward
from services.envs.tools import Tools
from services.envs.workspace import Workspaces
from services.objectstore.base import ObjectStore
from services.reconciler_client import ReconcilerClient

log = logging.getLogger(__name__)

GradeFn = Callable[[Workspaces, str, common_pb2.GradingSpec], common_pb2.GradeResult]
KEEP_SNAPSHOTS = 32


class RolloutWorker:
    """Runs rollouts for slots claimed from the reconciler, `concurrency` at a time."""

    def __init__(
        self,
        *,
        worker_id: str,
        reconciler: ReconcilerClient,
        inference: aio.Channel,
        workspaces: Workspaces,
        store: ObjectStore,
        tokenizer: Any,
        grade: GradeFn,
        run_name: str,
        harness: HarnessConfig,
        rewards: RewardConfig,
        lease_ttl_s: float,
    ) -> None:
        self.worker_id = worker_id
        self.reconciler = reconciler
        self.inference = inference
        self.workspaces = workspaces
        self.store = store
        self.tokenizer = tokenizer
        self.grade = grade
        self.run_name = run_name
        self.harness_config = harness
        self.rewards = rewards
        self.lease_ttl_s = lease_ttl_s
        self._snapshots: OrderedDict[str, str] = OrderedDict()  # group id -> snapshot id
        self._snapshot_lock = asyncio.Lock()
        self.active = 0
        self.completed = 0
        self._inference_health = health_pb2_grpc.HealthStub(inference)
        self._inference_ready_until = 0.0

    async def inference_ready(self) -> bool:
        """Whether inference is ready to generate (answers are trusted for a second).

        Workers claim only while it is: a slot claimed during an inference restart would
        only wait for it, holding work other replicas' workers could do.
        """
        if time.monotonic() < self._inference_ready_until:
            return True
        try:
            answer = await self._inference_health.Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=2.0
            )
        except aio.AioRpcError:
            return False
        if answer.status != health_pb2.HealthCheckResponse.SERVING:
            return False
        self._inference_ready_until = time.monotonic() + 1.0
        return True

    async def run(self, concurrency: int, idle_s: float = 0.5) -> None:
        """Runs up to `concurrency` rollouts at a time until cancelled.

        One claim asks for as many slots as there are free places (all of them at the
        start, after an inference restart, or when several rollouts end together), and
        the client renews every held lease in one heartbeat call: a worker's calls to the
        reconciler do not grow with its concurrency.
        """
        running: set[asyncio.Task[None]] = set()
        freed = asyncio.Event()

        def finished(task: asyncio.Task[None]) -> None:
            running.discard(task)
            freed.set()
            if not task.cancelled() and task.exception() is not None:
                log.error("rollout task failed", exc_info=task.exception())

        try:
            while True:
                free = concurrency - len(running)
                if free <= 0:
                    freed.clear()
                    await freed.wait()
                    continue
                if not await self.inference_ready():
                    await asyncio.sleep(idle_s)
                    continue
                try:
                    claimed = await self.reconciler.claim(
                        self.worker_id, free, lease_ttl_s=self.lease_ttl_s
                    )
                except aio.AioRpcError as error:
                    log.warning("claim failed (%s); retrying", error.code().name)
                    await asyncio.sleep(idle_s)
                    continue
                if not claimed:
                    await asyncio.sleep(idle_s)
                    continue
                for slot in claimed:
                    task = asyncio.create_task(self._handle(slot), name=slot.lease.slot_id)
                    running.add(task)
                    task.add_done_callback(finished)
        finally:
            for task in list(running):
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _handle(self, slot: reconciler_pb2.ClaimedSlot) -> None:
        self.active += 1
        metrics.IN_PROGRESS.inc()
        async with self.reconciler.lease(slot) as lease:
            try:
                summary = await self.rollout(slot)
            except Exception as error:  # the infrastructure's fault: the slot is retried
                log.exception("rollout of %s failed", slot.lease.slot_id)
                metrics.ROLLOUTS.labels("failed").inc()
                metrics.ERRORS.labels(type(error).__name__).inc()
                metrics.INFRA_FAULTS.labels(faults.infra_kind(error)).inc()
                reason = faults.failure_reason(error)
                try:
                    await lease.fail(reason, retryable=True)
                except aio.AioRpcError as fail_error:
                    log.warning("could not fail %s: %s", slot.lease.slot_id, fail_error.details())
                return
            finally:
                self.active -= 1
                metrics.IN_PROGRESS.dec()
            if lease.lost.is_set():
                log.warning(
                    "lease of %s was lost during the rollout; result dropped", slot.lease.slot_id
                )
                metrics.ROLLOUTS.labels("lease_lost").inc()
                return
            try:
                await lease.complete(summary)
                self.completed += 1
                metrics.ROLLOUTS.labels("completed").inc()
            except aio.AioRpcError as error:
                log.warning("completion of %s refused: %s", slot.lease.slot_id, error.details())
                metrics.ROLLOUTS.labels("refused").inc()

    async def _workspace(self, slot: reconciler_pb2.ClaimedSlot) -> str:
        """A fresh fork of the group's prepared workspace."""
        group = slot.lease.group_id
        async with self._snapshot_lock:
            snapshot = self._snapshots.get(group)
            if snapshot is None:
                prepared = await asyncio.to_thread(self.workspaces.create, slot.task)
                snapshot = await asyncio.to_thread(self.workspaces.snapshot, prepared.workspace_id)
                await asyncio.to_thread(self.workspaces.delete, prepared.workspace_id)
                self._snapshots[group] = snapshot
                while len(self._snapshots) > KEEP_SNAPSHOTS:
                    _, old = self._snapshots.popitem(last=False)
                    await asyncio.to_thread(self.workspaces.delete, old)
            self._snapshots.move_to_end(group)
        (fork,) = await asyncio.to_thread(self.workspaces.fork, snapshot, 1)
        return fork.workspace_id

    async def rollout(self, slot: reconciler_pb2.ClaimedSlot) -> common_pb2.RolloutSummary:
        """One rollout of the slot's task; its record is stored, its summary returned."""
        started = time.perf_counter()
        lease = slot.lease
        rollout_id = f"{lease.group_id}-{lease.sample_index}-a{lease.attempt}"
        workspace_id = await self._workspace(slot)
        harness = self.harness_config.for_family(slot.task.family)
        try:
            grading = slot.task.grading
            tools = Tools(
                self.workspaces,
                workspace_id,
                lambda ws: self.grade(self.workspaces, ws, grading),
                harness.command_timeout_s,
            )
            # A seed that is the same in every process (str hashes are salted per process).
            seed = zlib.crc32(rollout_id.encode())
            generate = InferenceGenerator(
                self.inference,
                harness.temperature,
                seed if harness.seeded_sampling else None,
            )
            result = await Harness(generate, self.tokenizer, harness).run(slot.task, tools)
            grade = await asyncio.to_thread(self.grade, self.workspaces, workspace_id, grading)
            comments = 0
            for path in sorted(tools.state.written):
                if path.endswith(".py"):
                    source = await asyncio.to_thread(
                        self.workspaces.read_file, workspace_id, path, 1 << 20
                    )
                    comments += reasoning_comment_lines(source)
        finally:
            await asyncio.to_thread(self.workspaces.delete, workspace_id)
        behaviour = Behaviour(
            open_todos=sum(not done for done in tools.state.todos.values()),
            comment_reasoning_lines=comments,
            tool_names=tools.state.calls,
        )
        result.stats.wall_s = time.perf_counter() - started
        summary = common_pb2.RolloutSummary(
            rollout_id=rollout_id,
            group_id=lease.group_id,
            sample_index=lease.sample_index,
            task_id=slot.task.task_id,
            reward=reward(grade.score, result.stats, behaviour, self.rewards),
            stats=result.stats,
            finish_reason=result.finish_reason,
            min_policy_version=result.min_version,
            max_policy_version=result.max_version,
            grade=grade,
        )
        record = common_pb2.RolloutRecord(summary=summary, segments=result.segments)
        key = f"rollouts/{self.run_name}/{lease.group_id}/{lease.sample_index}-a{lease.attempt}.pb"
        info = await asyncio.to_thread(self.store.put, key, record.SerializeToString())
        summary.record.CopyFrom(
            common_pb2.ObjectRef(key=info.key, size_bytes=info.size, sha256=info.sha256)
        )
        metrics.observe(summary, tools.state.calls)
        return summary


def worker_id(prefix: str) -> str:
    """A worker id unique to this process."""
    return f"{prefix}-{os.uname().nodename}-{os.getpid()}"
