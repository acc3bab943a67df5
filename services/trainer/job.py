"""The training job the trainer service runs: CPT/SFT on a token stream, or RL.

One RL step (``TrainingJob._run_rl``): pull ready groups (reconciler, staleness policy),
fetch and check their records, Dr. GRPO batch -> forward with router replay, loss,
backward, optimizer step -> publish version v+1 (background) -> checkpoint -> commit.
Groups are committed only once a checkpoint holds the step that trained them: a crash
before that re-pulls the same groups for the same step (the reconciler hands them out
again until committed), and the resumed job, restored exactly from the checkpoint,
retrains them into the same weights. A group is never in two surviving updates.
Compute runs in a worker thread so the gRPC server answers while a step runs;
checkpoint requests are served between steps.

Every rank of the job runs this code, in one process as under torchrun (the
``TrainerRuntime`` the trainer built at start): rank 0 pulls, reads the data, commits
and answers requests, and before each step scatters a ``StepMessage`` to every rank (its
share of the step's sequences, the checkpoints to save); all ranks train, publish their
shards and save checkpoints together (docs/distributed.md). In one process rank 0 is the
only rank and every collective is a pass-through.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from services.api.v1 import reconciler_pb2
from services.config.trainer import JobConfig, TrainerProcessConfig
from services.model_source import fingerprint
from services.objectstore.base import ObjectStore
from services.reconciler_client import ReconcilerClient
from services.slot_faults import fault_counts
from services.trainer import metrics
from services.trainer.batch import collect_rl_items, load_groups, returned_slots
from services.trainer.checkpoint import CheckpointInfo, Checkpoints, open_checkpoints
from services.trainer.checkpoint_requests import CheckpointRequests
from services.trainer.distributed.layout import check_job
from services.trainer.learner import Learner
from services.trainer.model import Architecture
from services.trainer.planning import StepMessage, StepPlanner
from services.trainer.publishing import PolicyPublisher
from services.trainer.runtime import TrainerRuntime
from services.trainer.sft import ExampleStream, example_items, open_source
from services.wire.supervise import Supervisor

log = logging.getLogger(__name__)

Plan = Callable[[float], Awaitable["list[StepMessage] | None"]]
"""Rank 0's plan of the next step, a message per rank (None on the other ranks); its
argument is when the step began to wait for work."""


def version_provenance(groups: Sequence[reconciler_pb2.Group]) -> dict[str, Any]:
    """Which policy versions a batch came from, for the step's record: each group's
    staleness as the reconciler judged it (``Group.staleness``, by its staleness anchor;
    the trainer computes none of its own), the versions its rollouts' tokens came from,
    and how many rollouts span more than one version."""
    rollouts = [r for group in groups for r in group.rollouts]
    versions = {v for r in rollouts for v in (r.min_policy_version, r.max_policy_version)}
    return {
        "staleness": [group.staleness for group in groups],
        "rollout_versions": sorted(versions),
        "rollouts_spanning_versions": sum(
            1 for r in rollouts if r.max_policy_version > r.min_policy_version
        ),
    }


class TrainingJob:
    """One job, built complete (``build``); its fields are what GetStatus reports."""

    def __init__(
        self,
        config: TrainerProcessConfig,
        job: JobConfig,
        reconciler: ReconcilerClient | None,
        runtime: TrainerRuntime,
        learner: Learner,
        planner: StepPlanner,
        checkpoints: Checkpoints,
        publisher: PolicyPublisher,
        store: ObjectStore,
        resumed: dict[str, Any],
    ) -> None:
        self.config, self.job, self.store = config, job, store
        self.reconciler = reconciler  # rank 0 of an RL job: what to pull and commit
        self.runtime, self.learner, self.planner = runtime, learner, planner
        self.checkpoints, self.publisher = checkpoints, publisher
        self.model_dir = job.model.model_dir or config.model.directory
        self.state, self.error = "starting", ""
        self.step, self.cursor = int(resumed["step"]), int(resumed["cursor"])
        self.initial_version = int(resumed["initial_version"])
        self.uncommitted: list[str] = list(resumed["uncommitted"])
        self.metrics: dict[str, float] = {}
        self.requests = CheckpointRequests()
        # The job's background loops (the publisher's), supervised: a crash is logged with
        # its traceback, reported by fault() (the service's readiness) and restarted.
        self.background = Supervisor("trainer")

    @classmethod
    def build(
        cls,
        config: TrainerProcessConfig,
        store: ObjectStore,
        reconciler: ReconcilerClient | None,
        runtime: TrainerRuntime,
    ) -> TrainingJob:
        """The job of ``config`` on this rank: model, optimizers and planner built, resumed
        from the newest checkpoint (collective: every rank builds its job together)."""
        job = config.trainer.job
        assert job is not None, "the trainer builds a job only when [trainer.job] is set"
        if job.phase == "rl" and runtime.is_leader and reconciler is None:
            raise ValueError("rank 0 of an RL job pulls from the reconciler: it needs a client")
        model_dir = job.model.model_dir or config.model.directory
        if job.num_threads:
            torch.set_num_threads(job.num_threads)
        check_job(job, Architecture.from_model_dir(model_dir), runtime.world_size)
        torch.manual_seed(job.seed)
        random.seed(job.seed)
        learner = Learner.load(model_dir, job, runtime)
        planner = runtime.planner(job, learner.model)
        checkpoints = open_checkpoints(config, store, runtime)
        resumed = cls._resume(checkpoints, learner, model_dir)
        publisher = PolicyPublisher(
            store, config.run.name, config.weights, reconciler, runtime, fingerprint(model_dir)
        )
        parts = (learner, planner, checkpoints, publisher, store, resumed)
        return cls(config, job, reconciler, runtime, *parts)

    @staticmethod
    def _resume(checkpoints: Checkpoints, learner: Learner, model_dir: Path) -> dict[str, Any]:
        """The newest checkpoint's job state, ``learner`` restored from it; or a fresh
        start's: step 0 at the model card's version."""
        checkpoints.discard_partial()
        latest = checkpoints.latest()
        if latest is not None:
            log.info("resuming from %s at step %d", latest.location, latest.step)
            return checkpoints.load(latest, learner)
        card, version = model_dir / "etude_model.json", 0
        if card.is_file():
            version = int(json.loads(card.read_text()).get("policy_version", 0))
        return {"step": 0, "cursor": 0, "initial_version": version, "uncommitted": []}

    @property
    def policy_version(self) -> int:
        """The version of the current weights."""
        return self.initial_version + self.step

    def fault(self) -> str | None:
        """What keeps the newest versions from being published and announced (None when
        nothing does): the publisher's own faults, or its loop's crash."""
        return self.publisher.fault() or self.background.fault()

    @property
    def last_published_version(self) -> int:
        """The newest version whose manifest is written (the start version before any)."""
        return max(self.publisher.last_published_version, self.initial_version)

    async def run(self) -> None:
        """Runs the job to its end; a failure is logged and reported, not raised."""
        self.background.start("publisher", self.publisher.run)
        try:
            await self._commit()  # groups a previous process checkpointed but did not commit
            self.state = "running"
            await (self._run_rl() if self.job.phase == "rl" else self._run_stream())
            await self._finish()
            self.state = "done"
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.exception("the training job failed")
            self.state, self.error = "failed", f"{type(error).__name__}: {error}"
        finally:
            self.publisher.close()
            await self.background.stop()
        # Requests that came in while the job was ending: saved if it ended well in one
        # process (the ranks of a distributed job have stopped).
        can_save = self.state == "done" and self.runtime.world_size == 1
        refusal = f"the training job {self.state}: {self.error}"
        await self.requests.answer_late(self._checkpoint if can_save else None, refusal)

    async def _run_rl(self) -> None:
        """RL: pull -> train -> publish -> checkpoint and commit, one step per pass."""
        reconciler, refresh = self.reconciler, self.job.rl.reference_refresh_steps
        plan = self._follow if reconciler is None else functools.partial(self._plan_rl, reconciler)
        waiting_since = time.perf_counter()  # the step's wait spans its empty pulls
        while not self._finished():
            self.state = "waiting"
            message = await self._next_message(plan, waiting_since)
            if message.part is None or message.stats is None:
                continue
            self.state, started = "running", time.perf_counter()
            local = await asyncio.to_thread(self.planner.microbatches, message.part)
            batch = message.stats.batch(local, self.policy_version)
            step_metrics = await asyncio.to_thread(self.learner.rl_step, batch, self.step)
            computed = time.perf_counter() - started
            metrics.export_lags(step_metrics)
            step_metrics |= metrics.batch_metrics(batch, message.num_stale_dropped) | {
                "groups": float(len(message.group_ids)),
                "tokens_per_s": step_metrics["tokens"] / max(computed, 1e-9),
                "time_wait_s": message.waited_s,
                "time_compute_s": computed,
            }
            self.step += 1
            self.uncommitted.extend(message.group_ids)
            if refresh and self.step % refresh == 0:
                self.learner.refresh_reference()  # before the checkpoint, which then holds it
            step_metrics["time_publish_s"] = await self._publish()
            await self._checkpoint_if_due()  # which commits the groups it holds
            await self._report(step_metrics, self._rl_record(message, step_metrics))
            waiting_since = time.perf_counter()

    async def _run_stream(self) -> None:
        """CPT/SFT: read -> train -> publish -> checkpoint, one step per pass."""
        plan = self._stream_plan() if self.runtime.is_leader else self._follow
        while not self._finished():
            started = time.perf_counter()
            message = await self._next_message(plan, started)
            if message.stop or message.part is None:
                log.info("the data ended after %d steps", self.step)
                return
            local = await asyncio.to_thread(self.planner.microbatches, message.part)
            step_metrics = await asyncio.to_thread(self.learner.sft_step, local, self.step)
            computed = time.perf_counter() - started
            step_metrics |= {
                "examples": float(sum(len(items) for items in message.part)),
                "tokens_per_s": step_metrics["tokens"] / max(computed, 1e-9),
                "time_compute_s": computed,
            }
            self.step, self.cursor = self.step + 1, message.cursor
            step_metrics["time_publish_s"] = await self._publish()
            await self._checkpoint_if_due()
            await self._report(step_metrics, {"cursor": self.cursor})

    def _finished(self) -> bool:
        return bool(self.job.max_steps) and self.step >= self.job.max_steps

    async def _next_message(self, plan: Plan, waiting_since: float) -> StepMessage:
        """Rank 0 plans the step; every rank gets its message and saves the checkpoints
        requested since the last step."""
        messages = await plan(waiting_since)
        message: StepMessage = await asyncio.to_thread(self.runtime.scatter, messages)
        await self.requests.save(message.checkpoint_tags, self._checkpoint)
        return message

    async def _follow(self, waiting_since: float) -> None:
        """The plan of a rank other than 0: none (rank 0's comes through ``scatter``)."""

    async def _plan_rl(
        self, reconciler: ReconcilerClient, waiting_since: float
    ) -> list[StepMessage]:
        """Rank 0: this step's groups (retried while the reconciler is unreachable), their
        records fetched and checked (a group with a record that fails goes back to the
        reconciler), the sequences cut into every rank's part."""
        rl, base = self.job.rl, StepMessage(checkpoint_tags=self.requests.take())
        answer = await reconciler.pull_batch(
            rl.consumer_id, self.step, rl.groups_per_step, self.policy_version, rl.pull_wait_s
        )
        base.waited_s = time.perf_counter() - waiting_since
        if not answer.groups:
            return [base] * self.runtime.world_size
        skip, arch = rl.skip_uniform_task_groups, self.learner.model.arch
        load = functools.partial(load_groups, self.store, skip_uniform_task_groups=skip)
        pulled = await asyncio.to_thread(load, answer.groups, arch, self.job.replay.mode)
        if returned := returned_slots(pulled):  # records that failed: their groups go back
            await reconciler.return_groups(rl.consumer_id, self.step, returned)
        back = {slot.slot_id.partition("/")[0] for slot in returned}
        groups = [group for group in answer.groups if group.group_id not in back]
        if not groups:  # pulls again for this step
            return [base] * self.runtime.world_size
        collected = collect_rl_items(pulled, skip_uniform_task_groups=skip)
        base.stats = replace(collected, items=[])  # the sequences travel in the parts
        base.group_ids = [group.group_id for group in groups]
        base.num_stale_dropped = answer.num_stale_dropped
        base.provenance = version_provenance(groups) | fault_counts(groups)
        parts = self.planner.plan(collected.items, rl.microbatch_tokens)
        return [replace(base, part=part) for part in parts]

    def _stream_plan(self) -> Plan:
        """Rank 0's plan of CPT/SFT steps: the next examples from the data's cursor."""
        data = self.job.data
        assert data is not None, "the job's config requires data for cpt and sft"
        stream = ExampleStream(open_source(data, self.model_dir), data.tokens_per_step, self.cursor)

        async def plan(waiting_since: float) -> list[StepMessage]:
            base = StepMessage(checkpoint_tags=self.requests.take())
            examples = await asyncio.to_thread(stream.next_batch)
            base.cursor, base.stop = stream.cursor, not examples
            if not examples:
                return [base] * self.runtime.world_size
            parts = self.planner.plan(example_items(examples), data.tokens_per_step)
            return [replace(base, part=part) for part in parts]

        return plan

    def _rl_record(self, message: StepMessage, step_metrics: dict[str, float]) -> dict[str, Any]:
        """The step's record: its groups and where their versions came from."""
        metrics.STEP_SECONDS.labels("wait").observe(message.waited_s)
        metrics.STEP_SECONDS.labels("compute").observe(step_metrics["time_compute_s"])
        record: dict[str, Any] = {"group_ids": message.group_ids, "time": time.time()}
        if message.provenance:
            staleness = message.provenance["staleness"]
            step_metrics["staleness_mean"] = sum(staleness) / max(len(staleness), 1)
            # Attempts the infrastructure failed (retried, never trained): the step's share.
            step_metrics["infra_fault_rate"] = message.provenance["infra_fault_rate"]
            record |= message.provenance
        return record

    async def _publish(self) -> float:
        """Starts publishing the new version when one is due; the seconds it took."""
        started = time.perf_counter()
        interval = self.job.publish_interval_steps
        if interval and self.step % interval == 0:
            await self.publisher.publish(self.learner.model, self.policy_version)
        seconds = time.perf_counter() - started
        metrics.STEP_SECONDS.labels("publish").observe(seconds)
        return seconds

    async def _checkpoint_if_due(self) -> None:
        every = self.job.checkpoint.interval_steps
        if every and self.step % every == 0:
            await self._checkpoint()

    async def _report(self, step_metrics: dict[str, float], record: dict[str, Any]) -> None:
        """The step's metrics: for GetStatus, Prometheus and (rank 0) the metrics file."""
        self.metrics = step_metrics
        metrics.export(self.step, step_metrics)
        metrics.POLICY_VERSION.set(self.policy_version)
        if self.job.metrics_file is not None and self.runtime.is_leader:
            record = {"step": self.step, "version": self.policy_version, **record, **step_metrics}
            await asyncio.to_thread(metrics.append_record, self.job.metrics_file, record)

    async def _checkpoint(self, tag: str | None = None) -> CheckpointInfo:
        started = time.perf_counter()
        state = {
            "step": self.step,
            "cursor": self.cursor,
            "initial_version": self.initial_version,
            "last_published_version": self.last_published_version,
            "uncommitted": self.uncommitted,
        }
        info = await asyncio.to_thread(
            self.checkpoints.save, self.learner, state, step=self.step, tag=tag
        )
        metrics.STEP_SECONDS.labels("checkpoint").observe(time.perf_counter() - started)
        await self._commit()
        return info

    async def _commit(self) -> None:
        """Commits what the newest checkpoint holds (idempotent; rank 0 commits, and its
        checkpoint metadata lists the groups)."""
        reconciler, groups, step = self.reconciler, list(self.uncommitted), self.step - 1
        if reconciler is not None and groups and self.step:
            await reconciler.commit(self.job.rl.consumer_id, step, groups)
        self.uncommitted = []

    async def request_checkpoint(self, tag: str) -> CheckpointInfo:
        """Saves a tagged checkpoint at the next step boundary (at once when the job is
        done in one process; the ranks of a distributed job have stopped by then)."""
        if not self.runtime.is_leader:
            raise RuntimeError("checkpoint requests go to global rank 0 (the trainer Service)")
        if self.state == "done" and self.runtime.world_size > 1:
            raise RuntimeError(
                "the distributed job has ended and its ranks stopped; use the last checkpoint"
            )
        if self.state == "done":
            return await self._checkpoint(tag)
        if self.state in ("starting", "failed"):
            raise RuntimeError(f"the training job is {self.state}; there is no state to save")
        return await self.requests.wait_for(tag)

    async def _finish(self) -> None:
        """The last checkpoint (and commit), the requests of the last step, the last
        version published, and the export."""
        tags = self.requests.take() if self.runtime.is_leader else None
        await self.requests.save(
            await asyncio.to_thread(self.runtime.share, tags), self._checkpoint
        )
        latest = self.checkpoints.latest()
        if latest is None or latest.step != self.step:
            await self._checkpoint()
        await self._commit()
        await self.publisher.drain()
        if self.job.export_dir is not None:
            export = functools.partial(self.runtime.export, policy_version=self.policy_version)
            await asyncio.to_thread(
                export, self.learner.model, self.job.export_dir, source_dir=self.model_dir
            )
        log.info("the %s job finished at step %d", self.job.phase, self.step)
