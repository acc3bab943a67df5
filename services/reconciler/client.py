"""Python client of the reconciler: a futures API for submitters, leases for workers,
batches for the trainer.

    client = ReconcilerClient(make_channel(target, token=token))
    futures = await client.submit_many([GroupSpec(task=task, num_samples=4, kind=TRAIN)])
    async for future in client.as_completed(futures):
        group = await future.result()          # the K rollouts, or GroupDropped

    async with client.lease(claimed) as lease:   # heartbeats in the background
        ...                                      # lease.lost tells when it was taken away
        await lease.complete(rollout)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Sequence

import grpc
from grpc import aio

from services.api.v1 import common_pb2, reconciler_pb2, reconciler_pb2_grpc

log = logging.getLogger(__name__)

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
    """A claimed slot held by a background heartbeat; complete or fail it exactly once."""

    def __init__(self, client: ReconcilerClient, claimed: reconciler_pb2.ClaimedSlot) -> None:
        self.client = client
        self.claimed = claimed
        self.slot_id = claimed.lease.slot_id
        self.token = claimed.lease.lease_token
        self.lost = asyncio.Event()

    async def heartbeat_forever(self) -> None:
        """Renews the lease every third of its TTL; sets `lost` when it is gone."""
        interval = max(self.claimed.lease.ttl_s / 3, 0.05)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.client.stub.HeartbeatSlot(
                    reconciler_pb2.HeartbeatSlotRequest(
                        slot_id=self.slot_id, lease_token=self.token
                    )
                )
            except aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.lost.set()
                    return
                log.warning(
                    "heartbeat of %s failed (%s); retrying", self.slot_id, error.code().name
                )

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


class ReconcilerClient:
    """The reconciler's API over one channel (see services.wire.client.make_channel)."""

    def __init__(self, channel: aio.Channel) -> None:
        self.stub = reconciler_pb2_grpc.ReconcilerServiceStub(channel)

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

        The watch is re-opened when it ends on the channel's deadline or an outage, so
        this waits as long as it takes; bound it with ``asyncio.timeout``.
        """
        futures = list(futures)
        waiting = {f.group_id: f for f in futures if not f.done()}
        for done in (f for f in futures if f.done()):
            yield done
        while waiting:
            request = reconciler_pb2.WatchGroupsRequest(group_ids=list(waiting))
            try:
                async for event in self.stub.WatchGroups(request):
                    future = waiting.get(event.group_id)
                    if future is not None and future._settle(event):
                        del waiting[event.group_id]
                        yield future
            except aio.AioRpcError as error:
                if error.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    log.warning("watch interrupted (%s); resuming", error.details())
                    await asyncio.sleep(0.5)

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
        """Holds `claimed` with heartbeats while the block runs."""
        lease = Lease(self, claimed)
        heartbeat = asyncio.create_task(lease.heartbeat_forever())
        try:
            yield lease
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat

    # Trainer ----------------------------------------------------------------------------
    async def pull_batch(
        self, consumer_id: str, step: int, num_groups: int, current_version: int, wait_s: float = 0
    ) -> reconciler_pb2.PullBatchResponse:
        """Ready groups for `step` (the same ones again if this step was pulled before)."""
        answer: reconciler_pb2.PullBatchResponse = await self.stub.PullBatch(
            reconciler_pb2.PullBatchRequest(
                consumer_id=consumer_id,
                step=step,
                num_groups=num_groups,
                current_policy_version=current_version,
                wait_s=wait_s,
            ),
            timeout=wait_s + 30,
        )
        return answer

    async def commit(self, consumer_id: str, step: int, group_ids: Sequence[str] = ()) -> int:
        """Marks everything pulled for steps <= `step` (and `group_ids`) as trained."""
        answer = await self.stub.CommitBatch(
            reconciler_pb2.CommitBatchRequest(
                consumer_id=consumer_id, step=step, group_ids=group_ids
            )
        )
        return int(answer.num_committed)

    async def policy_versions(self, after_version: int = 0) -> AsyncIterator[int]:
        """Each newer published version, as announced (the newest at once if newer);
        the watch is re-opened after outages and deadlines, without repeats."""
        last = after_version
        while True:
            request = reconciler_pb2.WatchPolicyVersionsRequest(after_version=last)
            try:
                async for notice in self.stub.WatchPolicyVersions(request):
                    if notice.version > last:
                        last = notice.version
                        yield last
            except aio.AioRpcError as error:
                if error.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    await asyncio.sleep(0.5)

    async def publish_version(self, notice: common_pb2.PolicyVersionNotice) -> int:
        """Announces a published policy version; returns the current one."""
        answer = await self.stub.PublishPolicyVersion(
            reconciler_pb2.PublishPolicyVersionRequest(notice=notice)
        )
        return int(answer.current_policy_version)
