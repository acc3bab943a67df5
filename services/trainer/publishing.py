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

Nothing here fails silently: a version that cannot be uploaded (after the publisher's
own tries) is logged with its traceback and reported by ``fault()`` (the trainer's
readiness turns NOT_SERVING with it) until a later version is published, which
supersedes it; a notice the reconciler does not take is tried again with backoff until
it is taken, a newer one is (or a newer version is uploaded, to be announced instead),
or ``ANNOUNCE_RETRY.deadline_s`` passes, reported meanwhile
(``services.wire.retry.retrying``). The versions are settled (upload awaited, notice
sent) by one loop, ``run``, which the job runs under the service's supervisor
(``services.wire.supervise``): an error nobody expected is logged with its traceback,
turns readiness NOT_SERVING and restarts the loop, and the version it was settling
stays pending, so none is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future

import grpc
from grpc import aio

from services.api.v1 import common_pb2
from services.config import WeightsConfig
from services.model_source import Fingerprint
from services.objectstore.base import ObjectStore
from services.reconciler_client import ReconcilerClient
from services.trainer import metrics
from services.trainer.model import Qwen3MoE
from services.trainer.runtime import TrainerRuntime
from services.weights.manifest import Layout, read_latest, read_manifest
from services.weights.publisher import PublishResult, WeightPublisher
from services.wire.retry import RetryPolicy, describe_error, retrying

log = logging.getLogger(__name__)

# A notice the reconciler did not take is tried again on any error but FAILED_PRECONDITION
# (it has a newer version): waits from 0.5 s to 30 s, for 10 minutes in all before the
# version is given up (followers also poll `latest`, so a version given up is still found).
ANNOUNCE_RETRY = RetryPolicy(
    codes=frozenset(
        set(grpc.StatusCode) - {grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION}
    ),
    initial_backoff_s=0.5,
    max_backoff_s=30.0,
    deadline_s=600.0,
)


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
        model: Fingerprint | None = None,
    ) -> None:
        self.layout = Layout(run)
        self.reconciler = reconciler if runtime.is_leader else None
        self.runtime = runtime
        self.publisher = WeightPublisher(
            store, run, config, shard=runtime.rank, num_shards=runtime.world_size, model=model
        )
        # Read once at start, so the same on every rank.
        latest = read_latest(store, self.layout)
        if latest is not None and model is not None:
            # A run's versions all come from one model: a trainer started on another refuses.
            published = read_manifest(store, self.layout, latest).model
            if published is not None:
                model.require_same(Fingerprint.from_dict(published), f"the run's version {latest}")
        self.already_published = -1 if latest is None else latest
        self.last_published_version = max(self.already_published, 0)
        self.last_announced_version = 0
        # Versions started and not yet settled, oldest first (uploads finish in order).
        self._pending: dict[int, Future[PublishResult]] = {}
        self._changed = asyncio.Event()  # set whenever _pending gains or loses a version
        self.failures = 0
        # What is wrong now, by part ("upload", "announce"): (version, reason). A later
        # version that gets through the same part clears it.
        self._faults: dict[str, tuple[int, str]] = {}

    async def publish(self, model: Qwen3MoE, version: int) -> bool:
        """Starts publishing this rank's shard of ``version`` (collective; waits only to copy
        the weights); False if skipped.

        The copy runs in a thread: it also waits when uploads fall a version behind, which
        is the backpressure training should feel.
        """
        if version <= self.already_published:
            return False
        tensors = await asyncio.to_thread(self.runtime.served_weights, model)
        self._pending[version] = await asyncio.to_thread(self.publisher.publish, tensors, version)
        self._changed.set()
        return True

    async def run(self) -> None:
        """Settles the started versions, oldest first, for as long as the job runs (under
        a supervisor: a crash leaves the version it was settling pending for the restart)."""
        while True:
            if not self._pending:
                self._changed.clear()
                await self._changed.wait()
                continue
            version, future = next(iter(self._pending.items()))
            await self._announce(version, future)
            del self._pending[version]
            self._changed.set()

    def fault(self) -> str | None:
        """Why the newest versions are not all published and announced (None when they are)."""
        return next((reason for _, reason in self._faults.values()), None)

    def _report(self, part: str, version: int, reason: str) -> None:
        self._faults[part] = (version, reason)

    def _clear(self, part: str, version: int) -> None:
        if part in self._faults and self._faults[part][0] <= version:
            del self._faults[part]

    async def _announce(self, version: int, future: Future[PublishResult]) -> None:
        try:
            result = await asyncio.wrap_future(future)
        except Exception as error:  # the publisher already retried; the next version supersedes it
            self.failures += 1
            log.error("version %d was not published", version, exc_info=error)
            self._report("upload", version, f"version {version} was not published: {error}")
            return
        self._clear("upload", version)
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
        await self._tell_reconciler(self.reconciler, notice)

    async def _tell_reconciler(
        self, reconciler: ReconcilerClient, notice: common_pb2.PolicyVersionNotice
    ) -> None:
        """Announces `notice`, with backoff, until it is taken or a newer one is."""
        version = notice.version

        async def announce() -> None:
            # Not when a newer one was announced meanwhile, or uploaded: it goes next.
            if self.last_announced_version < version and not self._newer_uploaded(version):
                await reconciler.publish_version(notice)
                self.last_announced_version = max(self.last_announced_version, version)

        def report(error: BaseException) -> None:
            self._report("announce", version, _not_announced(version, error))

        try:
            await retrying(announce, ANNOUNCE_RETRY, f"announcing version {version}", report)
        except aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                report(error)
                log.error(
                    "%s; given up after %.0f s",
                    _not_announced(version, error),
                    ANNOUNCE_RETRY.deadline_s,
                )
                return
            log.warning("version %d is not announced: %s", version, error.details())
        self._clear("announce", version)

    def _newer_uploaded(self, version: int) -> bool:
        """Whether a version newer than `version` is uploaded and waits to be announced."""
        return any(
            newer > version and future.done() and future.exception() is None
            for newer, future in self._pending.items()
        )

    async def drain(self) -> None:
        """Waits until every started version is settled (published and announced, or
        reported); ``run`` must be running."""
        while self._pending:
            self._changed.clear()
            await self._changed.wait()

    def close(self) -> None:
        """Stops the background publisher thread (after the queued versions)."""
        self.publisher.close()


def _not_announced(version: int, error: BaseException) -> str:
    return f"could not announce version {version} to the reconciler: {describe_error(error)}"
