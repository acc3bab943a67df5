"""The training job the trainer service runs: CPT/SFT on a token stream, or RL.

One RL step::

    pull ready groups (reconciler, staleness policy)  ->  fetch + check rollout records
    -> Dr. GRPO batch  ->  forward with router replay, loss, backward, optimizer step
    -> publish version v+1 (background)  ->  checkpoint  ->  commit the pulled groups

Groups are committed only once a checkpoint holds the step that trained them: a crash
before that re-pulls the same groups for the same step (the reconciler hands a step's
groups out again until it is committed), and the resumed job, restored exactly from
the checkpoint, retrains them into the same weights. A group is never in two
optimizer updates that survive. Compute runs in a worker thread so the gRPC server
answers while a step runs; checkpoint requests are served between steps.

Distributed (under torchrun, with a ``Runtime``), every rank runs this job: rank 0 pulls,
reads the data, commits and answers requests, and before each step scatters a
``StepMessage`` to every rank (its share of the step's sequences, the checkpoints to
save); all ranks train, publish their shards and save checkpoints together
(docs/distributed.md).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import torch
from grpc import aio

from services.api.v1 import reconciler_pb2
from services.objectstore.base import ObjectStore
from services.reconciler.client import ReconcilerClient
from services.run_config import EtudeConfig
from services.trainer import metrics
from services.trainer.batch import (
    Microbatch,
    RLBatch,
    RLItems,
    build_rl_batch,
    collect_rl_items,
    load_groups,
)
from services.trainer.checkpoint import CheckpointInfo, CheckpointStore
from services.trainer.config import JobConfig
from services.trainer.distributed.layout import check_job
from services.trainer.learner import Learner
from services.trainer.model import Architecture, resolve_experts_precision, save_pretrained
from services.trainer.paths import checkpoint_root
from services.trainer.publishing import PolicyPublisher
from services.trainer.sft import ExampleStream, example_items, open_source, to_microbatch

if TYPE_CHECKING:
    from services.trainer.distributed.batching import RankPart
    from services.trainer.distributed.packing import CostModel
    from services.trainer.distributed.runtime import Runtime
    from services.trainer.distributed.steps import StepMessage

log = logging.getLogger(__name__)

T = TypeVar("T")


def version_provenance(groups: Sequence[reconciler_pb2.Group], version: int) -> dict[str, Any]:
    """Which policy versions a batch came from, for the step's record: each group's
    staleness (``version`` minus the version it started under), the versions its
    rollouts' tokens came from, and how many rollouts span more than one version."""
    rollouts = [r for group in groups for r in group.rollouts]
    versions = {v for r in rollouts for v in (r.min_policy_version, r.max_policy_version)}
    return {
        "staleness": [max(version - group.start_policy_version, 0) for group in groups],
        "rollout_versions": sorted(versions),
        "rollouts_spanning_versions": sum(
            1 for r in rollouts if r.max_policy_version > r.min_policy_version
        ),
    }


class TrainingJob:
    """One job; its fields are what GetStatus reports."""

    def __init__(
        self,
        config: EtudeConfig,
        store: ObjectStore,
        reconciler: ReconcilerClient | None,
        runtime: Runtime | None = None,
    ) -> None:
        assert config.trainer.job is not None
        self.config = config
        self.job: JobConfig = config.trainer.job
        self.store = store
        self.reconciler = reconciler
        self.runtime = runtime
        self.model_dir = self.job.model.model_dir or config.inference.engine.model_dir
        root, keep_last = checkpoint_root(config), self.job.checkpoint.keep_last
        if runtime is None:
            self.checkpoints = CheckpointStore(root, keep_last)
        else:
            from services.trainer.distributed.checkpoint import DistributedCheckpointStore

            self.checkpoints = DistributedCheckpointStore(root, keep_last, runtime)
        self.cost_model: CostModel | None = None
        self.state = "starting"
        self.error = ""
        self.step = 0
        self.initial_version = 0
        self.metrics: dict[str, float] = {}
        self.cursor = 0
        self.uncommitted: list[str] = []
        self.learner: Learner | None = None
        self.publisher: PolicyPublisher | None = None
        self._requests: asyncio.Queue[tuple[str, asyncio.Future[CheckpointInfo]]] = asyncio.Queue()
        self._tag_futures: dict[str, list[asyncio.Future[CheckpointInfo]]] = {}

    @property
    def policy_version(self) -> int:
        """The version of the current weights."""
        return self.initial_version + self.step

    @property
    def last_published_version(self) -> int:
        """The newest version whose manifest is written (the start version before any)."""
        published = self.publisher.last_published_version if self.publisher else 0
        return max(published, self.initial_version)

    async def run(self) -> None:
        """Runs the job to its end; a failure is logged and reported, not raised."""
        try:
            await asyncio.to_thread(self._setup)
            self.publisher = self._publisher()
            await self._commit()  # groups a previous process checkpointed but did not commit
            self.state = "running"
            if self.job.phase == "rl":
                await (self._run_rl() if self.runtime is None else self._run_rl_distributed())
            else:
                await (
                    self._run_stream() if self.runtime is None else self._run_stream_distributed()
                )
            await self._finish()
            self.state = "done"
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.exception("the training job failed")
            self.state, self.error = "failed", f"{type(error).__name__}: {error}"
        finally:
            if self.publisher is not None:
                self.publisher.close()
        await self._answer_late_requests()

    def _publisher(self) -> PolicyPublisher:
        run, weights = self.config.run.name, self.config.weights
        if self.runtime is None:
            return PolicyPublisher(self.store, run, weights, self.reconciler)
        from services.trainer.distributed.publishing import ShardedPolicyPublisher

        return ShardedPolicyPublisher(self.store, run, weights, self.reconciler, self.runtime)

    async def _answer_late_requests(self) -> None:
        """Requests that arrived while the job was ending: saved if it ended well (in one
        process; the ranks of a distributed job have stopped)."""
        while not self._requests.empty():
            tag, future = self._requests.get_nowait()
            if self.state == "done" and self.runtime is None:
                try:
                    future.set_result(await self._checkpoint(tag))
                except Exception as error:
                    future.set_exception(error)
            else:
                future.set_exception(RuntimeError(f"the training job {self.state}: {self.error}"))

    def _setup(self) -> None:
        if self.job.num_threads:
            torch.set_num_threads(self.job.num_threads)
        arch = Architecture.from_model_dir(self.model_dir)
        if self.runtime is None:
            check_job(self.job, arch, 1)  # a layout for several ranks is an error here
        torch.manual_seed(self.job.seed)
        random.seed(self.job.seed)
        self.learner = Learner.load(self.model_dir, self.job, self.runtime)
        if self.runtime is not None:
            self.cost_model = self._packing_cost(arch)
        card = self.model_dir / "etude_model.json"
        if card.is_file():
            self.initial_version = int(json.loads(card.read_text()).get("policy_version", 0))
        self.checkpoints.discard_partial()
        latest = self.checkpoints.latest()
        if latest is not None:
            state = self.checkpoints.load(latest, self.learner)
            self.step, self.cursor = int(state["step"]), int(state["cursor"])
            self.initial_version = int(state["initial_version"])
            self.uncommitted = list(state["uncommitted"])
            log.info("resumed from %s at step %d", latest.location, self.step)

    def _job_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "cursor": self.cursor,
            "initial_version": self.initial_version,
            "last_published_version": self.last_published_version,
            "uncommitted": self.uncommitted,
        }

    def _finished(self) -> bool:
        return bool(self.job.max_steps) and self.step >= self.job.max_steps

    def _packing_cost(self, arch: Architecture) -> CostModel:
        """The settings' cost model, or one rank 0 measures on this model and shares."""
        from services.trainer.distributed.calibration import calibrate
        from services.trainer.distributed.packing import CostModel

        assert self.runtime is not None
        packing = self.job.dist.packing
        model: CostModel | None = None
        if packing.calibrate and self.runtime.is_leader:
            assert self.learner is not None
            model = calibrate(
                arch,
                dtype=self.learner.model.dtype,
                precision=resolve_experts_precision(
                    self.job.model.experts_precision,
                    self.learner.model.dtype,
                    self.job.model.experts_backend,
                ),
                device=self.runtime.device,
            )
            log.info("packing cost measured: b / a = %.3g", model.per_token_pair)
        elif not packing.calibrate:
            model = CostModel(packing.cost_per_token, packing.cost_per_token_pair)
        shared: CostModel = self.runtime.share(model)
        return shared

    async def request_checkpoint(self, tag: str) -> CheckpointInfo:
        """Saves a tagged checkpoint at the next step boundary (at once when the job is done)."""
        if self.runtime is not None and not self.runtime.is_leader:
            raise RuntimeError("checkpoint requests go to global rank 0 (the trainer Service)")
        if self.state == "done" and self.runtime is not None:
            raise RuntimeError(
                "the distributed job has ended and its ranks stopped; use the last checkpoint"
            )
        if self.state == "done":
            return await self._checkpoint(tag)
        if self.state in ("starting", "failed"):
            raise RuntimeError(f"the training job is {self.state}; there is no state to save")
        future: asyncio.Future[CheckpointInfo] = asyncio.get_running_loop().create_future()
        await self._requests.put((tag, future))
        return await future

    async def _serve_requests(self) -> None:
        if self.runtime is not None:
            return  # every rank saves together: requests travel in the step messages
        while not self._requests.empty():
            tag, future = self._requests.get_nowait()
            try:
                future.set_result(await self._checkpoint(tag))
            except Exception as error:
                future.set_exception(error)

    async def _checkpoint(self, tag: str | None = None) -> CheckpointInfo:
        assert self.learner is not None
        started = time.perf_counter()
        state = self._job_state()
        info = await asyncio.to_thread(
            self.checkpoints.save, self.learner, state, step=self.step, tag=tag
        )
        metrics.STEP_SECONDS.labels("checkpoint").observe(time.perf_counter() - started)
        await self._commit()
        return info

    async def _commit(self) -> None:
        """Commits what the newest checkpoint holds (idempotent)."""
        reconciler = self.reconciler
        if self.runtime is not None and not self.runtime.is_leader:
            self.uncommitted = []  # rank 0 commits (and its checkpoint metadata lists them)
            return
        if reconciler is None or not self.uncommitted or self.step == 0:
            return
        groups, step = list(self.uncommitted), self.step - 1
        await self._retrying(
            "CommitBatch", lambda: reconciler.commit(self.job.rl.consumer_id, step, groups)
        )
        self.uncommitted = []

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, retried while the reconciler is unreachable: an outage pauses training
        (the client already retried with backoff); any other error is raised."""
        delay = 0.5
        while True:
            try:
                return await call()
            except aio.AioRpcError as error:
                if error.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                log.warning("%s: reconciler %s; retrying in %.1f s", what, error.code().name, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)

    async def _after_step(self, step_metrics: dict[str, float], record: dict[str, Any]) -> None:
        """Publish, checkpoint, report: the end of every step of every phase."""
        assert self.learner is not None and self.publisher is not None
        self.step += 1
        refresh = self.job.rl.reference_refresh_steps
        if self.job.phase == "rl" and refresh and self.step % refresh == 0:
            self.learner.refresh_reference()  # before the checkpoint, which then holds it
        started = time.perf_counter()
        interval = self.job.publish_interval_steps
        if interval and self.step % interval == 0:
            await self.publisher.publish(self.learner.model, self.policy_version)
        step_metrics["time_publish_s"] = time.perf_counter() - started
        metrics.STEP_SECONDS.labels("publish").observe(step_metrics["time_publish_s"])
        if (
            self.job.checkpoint.interval_steps
            and self.step % self.job.checkpoint.interval_steps == 0
        ):
            await self._checkpoint()
        self.metrics = step_metrics
        metrics.export(self.step, step_metrics)
        metrics.POLICY_VERSION.set(self.policy_version)
        if self.job.metrics_file is not None and (self.runtime is None or self.runtime.is_leader):
            record = {"step": self.step, "version": self.policy_version, **record, **step_metrics}
            await asyncio.to_thread(metrics.append_record, self.job.metrics_file, record)

    async def _run_rl(self) -> None:
        assert self.reconciler is not None and self.learner is not None
        waiting_since: float | None = None  # the step's wait spans its empty pulls
        while not self._finished():
            await self._serve_requests()
            self.state = "waiting"
            if waiting_since is None:
                waiting_since = time.perf_counter()
            answer = await self._pull_batch()
            if not answer.groups:
                continue
            self.state = "running"
            waited, waiting_since = time.perf_counter() - waiting_since, None
            started = time.perf_counter()
            batch = await asyncio.to_thread(self._prepare, answer.groups)
            provenance = version_provenance(answer.groups, self.policy_version)
            step_metrics = await asyncio.to_thread(self.learner.rl_step, batch, self.step)
            group_ids = [group.group_id for group in answer.groups]
            await self._end_rl_step(
                batch,
                step_metrics,
                group_ids,
                answer.num_stale_dropped,
                waited,
                started,
                provenance,
            )

    async def _pull_batch(self) -> reconciler_pb2.PullBatchResponse:
        """This step's groups from the reconciler (retried while it is unreachable)."""
        assert self.reconciler is not None
        rl = self.job.rl
        pull = functools.partial(
            self.reconciler.pull_batch,
            rl.consumer_id,
            self.step,
            rl.groups_per_step,
            self.policy_version,
            rl.pull_wait_s,
        )
        return await self._retrying("PullBatch", pull)

    async def _end_rl_step(
        self,
        batch: RLBatch,
        step_metrics: dict[str, float],
        group_ids: list[str],
        num_stale_dropped: int,
        waited: float,
        started: float,
        provenance: dict[str, Any] | None = None,
    ) -> None:
        computed = time.perf_counter() - started
        step_metrics |= metrics.batch_metrics(batch, num_stale_dropped) | {
            "groups": float(len(group_ids)),
            "tokens_per_s": step_metrics["tokens"] / max(computed, 1e-9),
            "time_wait_s": waited,
            "time_compute_s": computed,
        }
        metrics.STEP_SECONDS.labels("wait").observe(waited)
        metrics.STEP_SECONDS.labels("compute").observe(computed)
        self.uncommitted.extend(group_ids)
        record: dict[str, Any] = {"group_ids": group_ids, "time": time.time()}
        if provenance:
            staleness = provenance["staleness"]
            step_metrics["staleness_mean"] = sum(staleness) / max(len(staleness), 1)
            record |= provenance
        await self._after_step(step_metrics, record)

    async def _run_rl_distributed(self) -> None:
        """The RL loop on every rank: rank 0 pulls and plans, every rank trains its share."""
        from services.trainer.distributed.steps import StepMessage, scatter_plan, stats_only

        runtime, rl = self.runtime, self.job.rl
        assert runtime is not None and self.learner is not None
        waiting_since: float | None = None  # the step's wait spans its empty pulls
        while not self._finished():
            self.state = "waiting"
            if waiting_since is None:
                waiting_since = time.perf_counter()
            messages: list[StepMessage] | None = None
            if runtime.is_leader:
                assert self.reconciler is not None and self.cost_model is not None
                base = StepMessage(checkpoint_tags=self._take_requests())
                answer = await self._pull_batch()
                base.waited_s = time.perf_counter() - waiting_since
                messages = [base] * runtime.world_size
                if answer.groups:
                    collected = await asyncio.to_thread(self._collect, answer.groups)
                    base.stats = stats_only(collected)
                    base.group_ids = [group.group_id for group in answer.groups]
                    base.num_stale_dropped = answer.num_stale_dropped
                    base.provenance = version_provenance(answer.groups, self.policy_version)
                    messages = scatter_plan(
                        base, collected.items, runtime, self.cost_model, rl.microbatch_tokens
                    )
            message: StepMessage = await asyncio.to_thread(runtime.scatter, messages)
            await self._save_tagged(message.checkpoint_tags)
            if message.part is None or message.stats is None:
                continue
            self.state, waiting_since = "running", None
            started = time.perf_counter()
            local = await asyncio.to_thread(self._local_microbatches, message.part)
            batch = message.stats.batch(local)
            step_metrics = await asyncio.to_thread(self.learner.rl_step, batch, self.step)
            await self._end_rl_step(
                batch,
                step_metrics,
                message.group_ids,
                message.num_stale_dropped,
                message.waited_s,
                started,
                message.provenance,
            )

    def _collect(self, groups: Sequence[reconciler_pb2.Group]) -> RLItems:
        assert self.learner is not None
        skip = self.job.rl.skip_uniform_task_groups
        pulled = load_groups(
            self.store,
            groups,
            self.learner.model.arch,
            self.job.replay.mode,
            skip_uniform_task_groups=skip,
        )
        return collect_rl_items(pulled, skip_uniform_task_groups=skip)

    def _local_microbatches(self, part: RankPart) -> list[Microbatch]:
        from services.trainer.distributed.batching import local_microbatches

        assert self.runtime is not None and self.learner is not None
        arch = self.learner.model.arch
        return local_microbatches(
            part,
            self.runtime.layout,
            self.runtime.cp_index,
            num_layers=arch.num_layers,
            top_k=arch.top_k,
            share_prefixes=self.job.shares_prefixes,
        )

    def _take_requests(self) -> list[str]:
        """Rank 0: the tags requested since the last step (their futures wait in
        ``_tag_futures`` until every rank has saved them)."""
        tags = []
        while not self._requests.empty():
            tag, future = self._requests.get_nowait()
            self._tag_futures.setdefault(tag, []).append(future)
            if tag not in tags:
                tags.append(tag)
        return tags

    async def _save_tagged(self, tags: list[str]) -> None:
        """Every rank saves the tagged checkpoints rank 0 announced; rank 0 answers."""
        for tag in tags:
            futures = self._tag_futures.pop(tag, [])
            try:
                info = await self._checkpoint(tag)
            except Exception as error:  # the same on every rank: rank 0 decided
                for future in futures:
                    future.set_exception(error)
                continue
            for future in futures:
                future.set_result(info)

    def _prepare(self, groups: Sequence[reconciler_pb2.Group]) -> RLBatch:
        """Fetches and checks the pulled groups' rollout records; packs the batch."""
        assert self.learner is not None
        arch = self.learner.model.arch
        skip = self.job.rl.skip_uniform_task_groups
        pulled = load_groups(
            self.store, groups, arch, self.job.replay.mode, skip_uniform_task_groups=skip
        )
        return build_rl_batch(
            pulled,
            microbatch_tokens=self.job.rl.microbatch_tokens,
            num_layers=arch.num_layers,
            top_k=arch.top_k,
            skip_uniform_task_groups=skip,
            share_prefixes=self.job.shares_prefixes,
        )

    async def _run_stream(self) -> None:
        assert self.learner is not None and self.job.data is not None
        source = open_source(self.job.data, self.model_dir)
        stream = ExampleStream(source, self.job.data.tokens_per_step, self.cursor)
        while not self._finished():
            await self._serve_requests()
            started = time.perf_counter()
            examples = await asyncio.to_thread(stream.next_batch)
            if not examples:
                log.info("the data ended after %d steps", self.step)
                return
            step_metrics = await asyncio.to_thread(
                self.learner.sft_step,
                [to_microbatch(examples, share_prefixes=self.job.shares_prefixes)],
                self.step,
            )
            computed = time.perf_counter() - started
            self.cursor = stream.cursor
            step_metrics |= {
                "examples": float(len(examples)),
                "tokens_per_s": step_metrics["tokens"] / max(computed, 1e-9),
                "time_compute_s": computed,
            }
            await self._after_step(step_metrics, {"cursor": self.cursor})

    async def _run_stream_distributed(self) -> None:
        """CPT/SFT on every rank: rank 0 reads the data and plans, every rank trains."""
        from services.trainer.distributed.steps import StepMessage, scatter_plan

        runtime, data = self.runtime, self.job.data
        assert runtime is not None and self.learner is not None and data is not None
        stream = None
        if runtime.is_leader:
            source = open_source(data, self.model_dir)
            stream = ExampleStream(source, data.tokens_per_step, self.cursor)
        while not self._finished():
            started = time.perf_counter()
            messages: list[StepMessage] | None = None
            if stream is not None:
                assert self.cost_model is not None
                base = StepMessage(checkpoint_tags=self._take_requests())
                examples = await asyncio.to_thread(stream.next_batch)
                base.cursor, base.stop = stream.cursor, not examples
                messages = [base] * runtime.world_size
                if examples:
                    messages = scatter_plan(
                        base,
                        example_items(examples),
                        runtime,
                        self.cost_model,
                        data.tokens_per_step,
                    )
            message: StepMessage = await asyncio.to_thread(runtime.scatter, messages)
            await self._save_tagged(message.checkpoint_tags)
            if message.stop or message.part is None:
                log.info("the data ended after %d steps", self.step)
                return
            local = await asyncio.to_thread(self._local_microbatches, message.part)
            step_metrics = await asyncio.to_thread(self.learner.sft_step, local, self.step)
            computed = time.perf_counter() - started
            self.cursor = message.cursor
            step_metrics |= {
                "examples": float(sum(len(items) for items in message.part)),
                "tokens_per_s": step_metrics["tokens"] / max(computed, 1e-9),
                "time_compute_s": computed,
            }
            await self._after_step(step_metrics, {"cursor": self.cursor})

    async def _finish(self) -> None:
        assert self.learner is not None and self.publisher is not None
        if self.runtime is not None:  # requests that came in during the last step
            tags = self._take_requests() if self.runtime.is_leader else None
            await self._save_tagged(await asyncio.to_thread(self.runtime.share, tags))
        latest = self.checkpoints.latest()
        if latest is None or latest.step != self.step:
            await self._checkpoint()
        await self._commit()
        await self._serve_requests()
        await self.publisher.drain()
        if self.job.export_dir is not None:
            await asyncio.to_thread(self._export, self.job.export_dir)
        log.info("the %s job finished at step %d", self.job.phase, self.step)

    def _export(self, out: Path) -> None:
        assert self.learner is not None
        if self.runtime is None:
            save_pretrained(
                self.learner.model,
                out,
                source_dir=self.model_dir,
                policy_version=self.policy_version,
            )
            return
        from services.trainer.distributed.publishing import export_pretrained

        export_pretrained(
            self.learner.model,
            out,
            source_dir=self.model_dir,
            policy_version=self.policy_version,
            runtime=self.runtime,
        )
