"""Publishing policy versions without blocking the training loop.

``publish(model, version)`` snapshots this rank's shard of the model's HF-layout bf16
weights (the weights inference serves; ``TrainerRuntime.served_weights``: all of them in
one process) and hands them to ``WeightPublisher``, which encodes deltas and uploads in
the background. Every rank publishes its shard of every version (gathering is
collective); shard 0 (rank 0) writes the manifest once every shard part is in. When a
version's manifest is written, rank 0 tells the reconciler (``PublishPolicyVersion``),
so inference replicas and evals follow it. A resumed job retrains steps whose versions
may already be in the store; since resume is exact, those versions are skipped rather
than written twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future

from services.api.v1 import common_pb2
from services.config import WeightsConfig
from services.objectstore.base import ObjectStore
from services.reconciler.client import ReconcilerClient
from services.trainer import metrics
from services.trainer.model import Qwen3MoE
from services.trainer.runtime import TrainerRuntime
from services.weights.manifest import Layout, read_latest
from services.weights.publisher import PublishResult, WeightPublisher

log = logging.getLogger(__name__)


class PolicyPublisher:
    """Versions of one run: this rank's shard uploaded in the background, then (rank 0)
    a notice to the reconciler."""

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        config: WeightsConfig,
        reconciler: ReconcilerClient | None,
        runtime: TrainerRuntime,
    ) -> None:
        self.layout = Layout(run)
        self.reconciler = reconciler if runtime.is_leader else None
        self.runtime = runtime
        self.publisher = WeightPublisher(
            store, run, config, shard=runtime.rank, num_shards=runtime.world_size
        )
        # Read once at start, so the same on every rank.
        latest = read_latest(store, self.layout)
        self.already_published = -1 if latest is None else latest
        self.last_published_version = max(self.already_published, 0)
        self._announcements: set[asyncio.Task[None]] = set()
        self.failures = 0

    async def publish(self, model: Qwen3MoE, version: int) -> bool:
        """Starts publishing this rank's shard of ``version`` (collective; waits only to copy
        the weights); False if skipped.

        The copy runs in a thread: it also waits when uploads fall a version behind, which
        is the backpressure training should feel.
        """
        if version <= self.already_published:
            return False
        tensors = await asyncio.to_thread(self.runtime.served_weights, model)
        future = await asyncio.to_thread(self.publisher.publish, tensors, version)
        task = asyncio.get_running_loop().create_task(self._announce(version, future))
        self._announcements.add(task)
        task.add_done_callback(self._announcements.discard)
        return True

    async def _announce(self, version: int, future: Future[PublishResult]) -> None:
        try:
            result = await asyncio.wrap_future(future)
        except Exception as error:  # the publisher already retried; training goes on
            self.failures += 1
            log.error("version %d was not published: %s", version, error)
            return
        self.last_published_version = max(self.last_published_version, version)
        metrics.PUBLISHED_VERSION.set(self.last_published_version)
        if self.reconciler is None:
            return
        notice = common_pb2.PolicyVersionNotice(
            version=version,
            manifest_key=self.layout.manifest(version),
            keyframe=result.keyframe,
            published_at=time.time(),
        )
        try:
            await self.reconciler.publish_version(notice)
        except Exception as error:  # followers also poll `latest`; a lost notice only delays
            log.warning("could not announce version %d to the reconciler: %s", version, error)

    async def drain(self) -> None:
        """Waits until every started version is published and announced."""
        while self._announcements:
            await asyncio.gather(*list(self._announcements), return_exceptions=True)

    def close(self) -> None:
        """Stops the background publisher thread (after the queued versions)."""
        self.publisher.close()
