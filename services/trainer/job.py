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
from typing import Any, TypeVar

import grpc
import torch
from grpc import aio

from services.api.v1 import reconciler_pb2
from services.objectstore.base import ObjectStore
from services.reconciler.client import ReconcilerClient
from services.run_config import EtudeConfig
from services.trainer import metrics
from services.trainer.batch import RLBatch, build_rl_batch, load_groups
from services.trainer.checkpoint import CheckpointInfo, CheckpointStore
from services.trainer.config import JobConfig
from services.trainer.learner import Learner
from services.trainer.model import save_pretrained
from services.trainer.publishing import PolicyPublisher
from services.trainer.sft import ExampleStream, open_source, to_microbatch

log = logging.getLogger(__name__)

T = TypeVar("T")


def checkpoint_root(config: EtudeConfig) -> Path:
    """Where the run's checkpoints live."""
    return config.trainer.checkpoint_dir or config.run.state_dir / "checkpoints" / config.run.name


class TrainingJob:
    """One job; its fields are what GetStatus reports."""

    def __init__(
        self,
        config: EtudeConfig,
        store: ObjectStore,
        reconciler: ReconcilerClient | None,
    ) -> None:
        assert config.trainer.job is not None
        self.config = config
        self.job: JobConfig = config.trainer.job
        self.store = store
        self.reconciler = reconciler
        self.model_dir = self.job.model.model_dir or config.inference.engine.model_dir
        self.checkpoints = CheckpointStore(checkpoint_root(config), self.job.checkpoint.keep_last)
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
            self.publisher = PolicyPublisher(
                self.store, self.config.run.name, self.config.weights, self.reconciler
            )
            await self._commit()  # groups a previous process checkpointed but did not commit
            self.state = "running"
            if self.job.phase == "rl":
                await self._run_rl()
            else:
                await self._run_stream()
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

    async def _answer_late_requests(self) -> None:
        """Requests that arrived while the job was ending: saved if it ended well."""
        while not self._requests.empty():
            tag, future = self._requests.get_nowait()
            if self.state == "done":
                try:
                    future.set_result(await self._checkpoint(tag))
                except Exception as error:
                    future.set_exception(error)
            else:
                future.set_exception(RuntimeError(f"the training job {self.state}: {self.error}"))

    def _setup(self) -> None:
        if self.job.num_threads:
            torch.set_num_threads(self.job.num_threads)
        torch.manual_seed(self.job.seed)
        random.seed(self.job.seed)
        self.learner = Learner.load(self.model_dir, self.job)
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

    async def request_checkpoint(self, tag: str) -> CheckpointInfo:
        """Saves a tagged checkpoint at the next step boundary (at once when the job is done)."""
        if self.state == "done":
            return await self._checkpoint(tag)
        if self.state in ("starting", "failed"):
            raise RuntimeError(f"the training job is {self.state}; there is no state to save")
        future: asyncio.Future[CheckpointInfo] = asyncio.get_running_loop().create_future()
        await self._requests.put((tag, future))
        return await future

    async def _serve_requests(self) -> None:
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
        if self.job.metrics_file is not None:
            record = {"step": self.step, "version": self.policy_version, **record, **step_metrics}
            await asyncio.to_thread(metrics.append_record, self.job.metrics_file, record)

    async def _run_rl(self) -> None:
        assert self.reconciler is not None and self.learner is not None
        rl = self.job.rl
        while not self._finished():
            await self._serve_requests()
            started = time.perf_counter()
            self.state = "waiting"
            pull = functools.partial(
                self.reconciler.pull_batch,
                rl.consumer_id,
                self.step,
                rl.groups_per_step,
                self.policy_version,
                rl.pull_wait_s,
            )
            answer = await self._retrying("PullBatch", pull)
            if not answer.groups:
                continue
            self.state = "running"
            waited = time.perf_counter() - started
            started = time.perf_counter()
            batch = await asyncio.to_thread(self._prepare, answer.groups)
            step_metrics = await asyncio.to_thread(self.learner.rl_step, batch, self.step)
            computed = time.perf_counter() - started
            step_metrics |= metrics.batch_metrics(batch, answer.num_stale_dropped) | {
                "groups": float(len(answer.groups)),
                "tokens_per_s": step_metrics["tokens"] / max(computed, 1e-9),
                "time_wait_s": waited,
                "time_compute_s": computed,
            }
            metrics.STEP_SECONDS.labels("wait").observe(waited)
            metrics.STEP_SECONDS.labels("compute").observe(computed)
            group_ids = [group.group_id for group in answer.groups]
            self.uncommitted.extend(group_ids)
            await self._after_step(step_metrics, {"group_ids": group_ids})

    def _prepare(self, groups: Sequence[reconciler_pb2.Group]) -> RLBatch:
        """Fetches and checks the pulled groups' rollout records; packs the batch."""
        assert self.learner is not None
        arch = self.learner.model.arch
        pulled = load_groups(self.store, groups, arch, self.job.replay.mode)
        return build_rl_batch(
            pulled,
            microbatch_tokens=self.job.rl.microbatch_tokens,
            num_layers=arch.num_layers,
            top_k=arch.top_k,
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
                self.learner.sft_step, [to_microbatch(examples)], self.step
            )
            computed = time.perf_counter() - started
            self.cursor = stream.cursor
            step_metrics |= {
                "examples": float(len(examples)),
                "tokens_per_s": step_metrics["tokens"] / max(computed, 1e-9),
                "time_compute_s": computed,
            }
            await self._after_step(step_metrics, {"cursor": self.cursor})

    async def _finish(self) -> None:
        assert self.learner is not None and self.publisher is not None
        latest = self.checkpoints.latest()
        if latest is None or latest.step != self.step:
            await self._checkpoint()
        await self._commit()
        await self._serve_requests()
        await self.publisher.drain()
        if self.job.export_dir is not None:
            await asyncio.to_thread(
                save_pretrained,
                self.learner.model,
                self.job.export_dir,
                source_dir=self.model_dir,
                policy_version=self.policy_version,
            )
        log.info("the %s job finished at step %d", self.job.phase, self.step)
