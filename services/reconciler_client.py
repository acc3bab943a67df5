"""Python client of the reconciler: a futures API for submitters, leases for workers,
batches for the trainer.

    client = ReconcilerClient(make_channel(target, token=token))
    futures = await client.submit_many([GroupSpec(task=task, num_samples=4, kind=TRAIN)])
    async for future in client.as_completed(futures):
        group = await future.result()          # the K rollouts, or GroupDropped

    async with client.lease(claimed) as lease:   # heartbeats in the background, one call
                                                 # for every lease the client holds
        ...                                      # lease.lost tells when it was taken away
        await lease.complete(rollout)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence

import grpc
from grpc import aio

from services.api.v1 import common_pb2, reconciler_pb2, reconciler_pb2_grpc
from services.wire.retry import RetryPolicy, resume_stream, retrying

log = logging.getLogger(__name__)

# A watch is reopened half a second after an outage, for as long as the outage lasts.
WATCH_RETRY = RetryPolicy(initial_backoff_s=0.5, max_backoff_s=0.5)
# The trainer's PullBatch and CommitBatch: an outage pauses training rather than ending
# it, and so does a reconciler that does not answer within the call's deadline.
TRAINER_RETRY = RetryPolicy(
    codes=frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}),
    initial_backoff_s=0.5,
    max_backoff_s=10.0,
)

_DONE_STATES = {
    reconciler_pb2.GROUP_STATE_READY,
    reconciler_pb2.GROUP_STATE_CONSUMED,
    reconciler_pb2.GROUP_STATE_COMMITTED,
}


class GroupDropped(Exception):
    """The group will never be ready (too many dead slots, or too stale under 'drop')."""


class GroupFuture:
    """The eventual result of one submitted group."""

    def __init__(self, client: ReconcilerClient, group_id: str) -> None:
        self.client = client
        self.group_id = group_id
        self._result: reconciler_pb2.Group | None = None
        self._dropped = False

    def done(self) -> bool:
        """The group is ready (or was dropped)."""
        return self._result is not None or self._dropped

    def _settle(self, event: reconciler_pb2.GroupEvent) -> bool:
        if event.state == reconciler_pb2.GROUP_STATE_DROPPED:
            self._dropped = True
        elif event.state in _DONE_STATES and event.HasField("group"):
            self._result = event.group
        return self.done()

    async def _fill(self) -> None:
        if self._result is None and not self._dropped and self.client is not None:
            group = await self.client.get_group(self.group_id)
            if group.state == reconciler_pb2.GROUP_STATE_DROPPED:
                self._dropped = True
            elif group.state in _DONE_STATES:
                self._result = group

    async def result(self) -> reconciler_pb2.Group:
        """The ready group with its K rollouts; raises GroupDropped if it never will be.

        Waits as long as it takes; bound it with ``asyncio.timeout``.
        """
        if not self.done():
            async for _ in self.client.as_completed([self]):
                pass
        await self._fill()
        if self._dropped:
            raise GroupDropped(f"group {self.group_id} was dropped")
        assert self._result is not None
        return self._result


class Lease:
    """A claimed slot kept alive by its client's heartbeats; complete or fail it exactly once."""

    def __init__(self, client: ReconcilerClient, claimed: reconciler_pb2.ClaimedSlot) -> None:
        self.client = client
        self.claimed = claimed
        self.slot_id = claimed.lease.slot_id
        self.token = claimed.lease.lease_token
        self.interval_s = max(claimed.lease.ttl_s / 3, 0.05)
        self.lost = asyncio.Event()

    async def complete(
        self, rollout: common_pb2.RolloutSummary
    ) -> reconciler_pb2.CompleteSlotResponse:
        """Reports the rollout; FAILED_PRECONDITION (as AioRpcError) when the lease was lost."""
        answer: reconciler_pb2.CompleteSlotResponse = await self.client.stub.CompleteSlot(
            reconciler_pb2.CompleteSlotRequest(
                slot_id=self.slot_id, lease_token=self.token, rollout=rollout
            )
        )
        return answer

    async def fail(self, reason: str, retryable: bool = True) -> reconciler_pb2.FailSlotResponse:
        """Reports a failed attempt; the slot is retried unless it was its last."""
        answer: reconciler_pb2.FailSlotResponse = await self.client.stub.FailSlot(
            reconciler_pb2.FailSlotRequest(
                slot_id=self.slot_id, lease_token=self.token, reason=reason, retryable=retryable
            )
        )
        return answer


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the lease keeper stopped", exc_info=task.exception())


class LeaseKeeper:
    """Renews every lease a client holds with one HeartbeatSlots call per round.

    A round runs when the earliest lease is due (a third of its TTL after its last
    renewal) and renews every lease due within the next half interval too, so a worker
    with many rollouts in flight sends one call where it would send one per lease. A
    lease the reconciler no longer holds for us gets `lost` set and leaves the keeper.
    """

    def __init__(self, client: ReconcilerClient) -> None:
        self.client = client
        self._leases: dict[str, Lease] = {}
        self._due: dict[str, float] = {}  # slot id -> loop time of its next renewal
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, lease: Lease) -> None:
        """Keeps `lease` alive from now on."""
        self._leases[lease.slot_id] = lease
        self._due[lease.slot_id] = asyncio.get_running_loop().time() + lease.interval_s
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="lease-keeper")
            self._task.add_done_callback(_log_failure)

    def discard(self, lease: Lease) -> None:
        """Stops renewing `lease` (completed, failed or abandoned)."""
        if self._leases.get(lease.slot_id) is lease:
            del self._leases[lease.slot_id]
            del self._due[lease.slot_id]
            self._changed.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._leases:
            self._changed.clear()
            wait_s = min(self._due.values()) - loop.time()
            if wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=wait_s)
                continue  # a lease came or went: look again at what is due
            await self._round(loop.time())

    async def _round(self, now: float) -> None:
        horizon = now + min(lease.interval_s for lease in self._leases.values()) / 2
        due = [lease for sid, lease in self._leases.items() if self._due[sid] <= horizon]
        request = reconciler_pb2.HeartbeatSlotsRequest(
            leases=[
                reconciler_pb2.HeartbeatSlotRequest(slot_id=lease.slot_id, lease_token=lease.token)
                for lease in due
            ]
        )
        try:
            answer = await self.client.stub.HeartbeatSlots(request)
        except aio.AioRpcError as error:
            # An outage: try again soon; a lease that expires meanwhile is reported lost
            # by the next answer, and the reconciler's reaper re-queues its slot.
            log.warning("heartbeat of %d leases failed (%s); retrying", len(due), error.code().name)
            for lease in due:
                if lease.slot_id in self._due:
                    self._due[lease.slot_id] = now + min(lease.interval_s, 1.0)
            return
        for lease, result in zip(due, answer.results, strict=True):
            if self._leases.get(lease.slot_id) is not lease:
                continue  # completed while the call was in flight
            if result.held:
                self._due[lease.slot_id] = now + lease.interval_s
            else:
                log.warning("lease of %s lost: %s", lease.slot_id, result.reason)
                lease.lost.set()
                self.discard(lease)


class ReconcilerClient:
    """The reconciler's API over one channel (see services.wire.client.make_channel)."""

    def __init__(self, channel: aio.Channel, trainer_retry: RetryPolicy = TRAINER_RETRY) -> None:
        self.stub = reconciler_pb2_grpc.ReconcilerServiceStub(channel)
        self.leases = LeaseKeeper(self)
        self.trainer_retry = trainer_retry

    # Submitters -------------------------------------------------------------------------
    async def submit_many(self, specs: Sequence[reconciler_pb2.GroupSpec]) -> list[GroupFuture]:
        """Submits groups; one future each, in order."""
        answer = await self.stub.SubmitGroups(reconciler_pb2.SubmitGroupsRequest(groups=specs))
        return [GroupFuture(self, gid) for gid in answer.group_ids]

    async def submit(
        self,
        task: common_pb2.Task,
        num_samples: int,
        *,
        kind: common_pb2.SlotKind.ValueType = common_pb2.SLOT_KIND_TRAIN,
        priority: int = 0,
        idempotency_key: str = "",
    ) -> GroupFuture:
        """Submits one group of `num_samples` slots for `task`."""
        spec = reconciler_pb2.GroupSpec(
            task=task,
            num_samples=num_samples,
            kind=kind,
            priority=priority,
            idempotency_key=idempotency_key,
        )
        (future,) = await self.submit_many([spec])
        return future

    async def as_completed(self, futures: Iterable[GroupFuture]) -> AsyncIterator[GroupFuture]:
        """Yields each future as its group becomes ready or is dropped.

        The watch is re-opened when it ends on the channel's deadline or an outage
        (``WATCH_RETRY``), so this waits as long as it takes; bound it with
        ``asyncio.timeout``.
        """
        futures = list(futures)
        waiting = {f.group_id: f for f in futures if not f.done()}
        for done in (f for f in futures if f.done()):
            yield done
        if not waiting:
            return

        def watch() -> AsyncIterable[reconciler_pb2.GroupEvent]:  # the groups still open
            request = reconciler_pb2.WatchGroupsRequest(group_ids=list(waiting))
            events: AsyncIterable[reconciler_pb2.GroupEvent] = self.stub.WatchGroups(request)
            return events

        async with contextlib.aclosing(resume_stream(watch, WATCH_RETRY, "WatchGroups")) as events:
            async for event in events:
                future = waiting.get(event.group_id)
                if future is not None and future._settle(event):
                    del waiting[event.group_id]
                    yield future
                    if not waiting:
                        return

    async def get_group(self, group_id: str) -> reconciler_pb2.Group:
        """The group's current record."""
        answer = await self.stub.GetGroup(reconciler_pb2.GetGroupRequest(group_id=group_id))
        group: reconciler_pb2.Group = answer.group
        return group

    # Workers ----------------------------------------------------------------------------
    async def claim(
        self,
        worker_id: str,
        max_slots: int = 1,
        kinds: Sequence[common_pb2.SlotKind.ValueType] = (),
        lease_ttl_s: float = 0.0,
    ) -> list[reconciler_pb2.ClaimedSlot]:
        """Leases up to `max_slots` slots; empty when there is nothing to do."""
        answer = await self.stub.ClaimSlots(
            reconciler_pb2.ClaimSlotsRequest(
                worker_id=worker_id, kinds=kinds, max_slots=max_slots, lease_ttl_s=lease_ttl_s
            )
        )
        return list(answer.slots)

    @contextlib.asynccontextmanager
    async def lease(self, claimed: reconciler_pb2.ClaimedSlot) -> AsyncIterator[Lease]:
        """Holds `claimed` with heartbeats while the block runs (one call renews every
        lease this client holds, see LeaseKeeper)."""
        lease = Lease(self, claimed)
        self.leases.add(lease)
        try:
            yield lease
        finally:
            self.leases.discard(lease)

    # Trainer ----------------------------------------------------------------------------
    async def pull_batch(
        self, consumer_id: str, step: int, num_groups: int, current_version: int, wait_s: float = 0
    ) -> reconciler_pb2.PullBatchResponse:
        """Ready groups for `step` (the same ones again if this step was pulled before);
        retried through an outage by ``trainer_retry``."""
        request = reconciler_pb2.PullBatchRequest(
            consumer_id=consumer_id,
            step=step,
            num_groups=num_groups,
            current_policy_version=current_version,
            wait_s=wait_s,
        )

        async def pull() -> reconciler_pb2.PullBatchResponse:
            answer: reconciler_pb2.PullBatchResponse = await self.stub.PullBatch(
                request, timeout=wait_s + 30
            )
            return answer

        return await retrying(pull, self.trainer_retry, "PullBatch")

    async def commit(self, consumer_id: str, step: int, group_ids: Sequence[str] = ()) -> int:
        """Marks everything pulled for steps <= `step` (and `group_ids`) as trained;
        retried through an outage by ``trainer_retry`` (committing twice is harmless)."""
        request = reconciler_pb2.CommitBatchRequest(
            consumer_id=consumer_id, step=step, group_ids=group_ids
        )

        async def commit() -> int:
            return int((await self.stub.CommitBatch(request)).num_committed)

        return await retrying(commit, self.trainer_retry, "CommitBatch")

    async def return_groups(
        self, consumer_id: str, step: int, slots: Sequence[reconciler_pb2.ReturnedSlot]
    ) -> list[reconciler_pb2.SlotState.ValueType]:
        """Hands back the groups of `slots` pulled for `step` (their records failed to load
        or check): each slot runs again or is dead; per slot its new state (UNSPECIFIED:
        unchanged). Retried through an outage by ``trainer_retry`` (a repeat changes nothing)."""
        request = reconciler_pb2.ReturnGroupsRequest(
            consumer_id=consumer_id, step=step, slots=slots
        )

        async def hand_back() -> list[reconciler_pb2.SlotState.ValueType]:
            return list((await self.stub.ReturnGroups(request)).states)

        return await retrying(hand_back, self.trainer_retry, "ReturnGroups")

    async def policy_versions(self, after_version: int = 0) -> AsyncIterator[int]:
        """Each newer published version, as announced (the newest at once if newer);
        the watch is re-opened after outages and deadlines (``WATCH_RETRY``), without
        repeats."""
        last = after_version

        def watch() -> AsyncIterable[common_pb2.PolicyVersionNotice]:  # from the last seen
            request = reconciler_pb2.WatchPolicyVersionsRequest(after_version=last)
            notices: AsyncIterable[common_pb2.PolicyVersionNotice] = self.stub.WatchPolicyVersions(
                request
            )
            return notices

        async with contextlib.aclosing(
            resume_stream(watch, WATCH_RETRY, "WatchPolicyVersions")
        ) as notices:
            async for notice in notices:
                if notice.version > last:
                    last = notice.version
                    yield last

    async def publish_version(self, notice: common_pb2.PolicyVersionNotice) -> int:
        """Announces a published policy version; returns the current one."""
        answer = await self.stub.PublishPolicyVersion(
            reconciler_pb2.PublishPolicyVersionRequest(notice=notice)
        )
        return int(answer.current_policy_version)
