"""The reconciler process: the ReconcilerService contract over the Redis slot store.

Besides answering calls, every replica runs the reaper (expired leases back to
pending), the group-event fan-out for watchers, a metrics snapshot of the state
counts, and, when configured, the task feeder. Replicas are interchangeable: all
state is in Redis and every change is one atomic script.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
import uvloop
from grpc import aio

from services.api.v1 import common_pb2, reconciler_pb2, reconciler_pb2_grpc
from services.config.reconciler import ReconcilerProcessConfig
from services.objectstore import open_store
from services.reconciler import validation
from services.reconciler.events import GroupEvents
from services.reconciler.feeders import build_feeder, run_feeder
from services.reconciler.metrics import GROUP_LATENCY, SNAPSHOT, STALENESS
from services.reconciler.store import REDIS_DOWN, SlotStore
from services.wire.client import Channels
from services.wire.errors import NotFound, ServiceError, Unavailable
from services.wire.server import run_service
from services.wire.service import Readiness, Service

log = logging.getLogger(__name__)

TERMINAL = {"READY", "CONSUMED", "COMMITTED", "DROPPED"}
_SLOT_STATES = {
    "PENDING": reconciler_pb2.SLOT_STATE_PENDING,
    "DEAD": reconciler_pb2.SLOT_STATE_DEAD,
}
WATCH_POLL_S = 2.0
PULL_POLL_S = 0.1


class ReconcilerServicer(reconciler_pb2_grpc.ReconcilerServiceServicer):
    """The ReconcilerService contract."""

    def __init__(self, service: ReconcilerService) -> None:
        self._service = service
        self._store = service.store
        self._settings = service.config.reconciler

    async def SubmitGroups(
        self, request: reconciler_pb2.SubmitGroupsRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.SubmitGroupsResponse:
        validation.validate_submit_groups(request)
        group_ids = await self._store.submit(request.groups)
        return reconciler_pb2.SubmitGroupsResponse(group_ids=group_ids)

    async def ClaimSlots(
        self, request: reconciler_pb2.ClaimSlotsRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.ClaimSlotsResponse:
        validation.validate_claim_slots(request, self._settings.max_lease_ttl_s)
        ttl_s = request.lease_ttl_s or self._settings.lease_ttl_s
        slots = await self._store.claim(request.worker_id, request.kinds, request.max_slots, ttl_s)
        return reconciler_pb2.ClaimSlotsResponse(slots=slots)

    async def HeartbeatSlot(
        self, request: reconciler_pb2.HeartbeatSlotRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.HeartbeatSlotResponse:
        validation.validate_lease(request.slot_id, request.lease_token)
        ttl_s = await self._store.heartbeat(request.slot_id, request.lease_token)
        return reconciler_pb2.HeartbeatSlotResponse(ttl_s=ttl_s)

    async def HeartbeatSlots(
        self, request: reconciler_pb2.HeartbeatSlotsRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.HeartbeatSlotsResponse:
        validation.validate_heartbeat_slots(request)
        renewed = await self._store.heartbeat_many(
            [(lease.slot_id, lease.lease_token) for lease in request.leases]
        )
        return reconciler_pb2.HeartbeatSlotsResponse(
            results=[
                reconciler_pb2.HeartbeatResult(
                    slot_id=lease.slot_id, held=not problem, ttl_s=ttl_s, reason=problem
                )
                for lease, (ttl_s, problem) in zip(request.leases, renewed, strict=True)
            ]
        )

    async def CompleteSlot(
        self, request: reconciler_pb2.CompleteSlotRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.CompleteSlotResponse:
        validation.validate_complete_slot(request)
        state, duplicate = await self._store.complete(
            request.slot_id, request.lease_token, request.rollout
        )
        made_ready = state == "READY" and not duplicate
        if made_ready:
            group_id = request.slot_id.partition("/")[0]
            created, ready = await self._store.redis.hmget(
                self._store.key("group", group_id), "created_at", "ready_at"
            )
            if created and ready:
                GROUP_LATENCY.observe((int(ready) - int(created)) / 1000)
        return reconciler_pb2.CompleteSlotResponse(group_ready=made_ready, duplicate=duplicate)

    async def FailSlot(
        self, request: reconciler_pb2.FailSlotRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.FailSlotResponse:
        validation.validate_fail_slot(request)
        state, attempts = await self._store.fail(
            request.slot_id, request.lease_token, request.reason, request.retryable
        )
        return reconciler_pb2.FailSlotResponse(state=_SLOT_STATES[state], attempts=attempts)

    async def PullBatch(
        self, request: reconciler_pb2.PullBatchRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.PullBatchResponse:
        validation.validate_pull_batch(request)
        deadline = time.monotonic() + request.wait_s
        dropped = 0
        while True:
            partial = time.monotonic() >= deadline
            result = await self._store.pull(
                request.consumer_id,
                request.step,
                request.num_groups,
                request.current_policy_version,
                partial,
            )
            dropped += result.num_dropped
            if result.groups or partial:
                break
            await asyncio.sleep(PULL_POLL_S)
        if not result.repeated:
            for staleness in result.staleness:
                STALENESS.observe(staleness)
        return reconciler_pb2.PullBatchResponse(groups=result.groups, num_stale_dropped=dropped)

    async def CommitBatch(
        self, request: reconciler_pb2.CommitBatchRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.CommitBatchResponse:
        validation.validate_commit_batch(request)
        committed = await self._store.commit(request.consumer_id, request.step, request.group_ids)
        return reconciler_pb2.CommitBatchResponse(num_committed=committed)

    async def ReturnGroups(
        self, request: reconciler_pb2.ReturnGroupsRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.ReturnGroupsResponse:
        validation.validate_return_groups(request)
        states = await self._store.return_slots(request.consumer_id, request.step, request.slots)
        return reconciler_pb2.ReturnGroupsResponse(
            states=[
                _SLOT_STATES.get(state, reconciler_pb2.SLOT_STATE_UNSPECIFIED) for state in states
            ]
        )

    async def GetGroup(
        self, request: reconciler_pb2.GetGroupRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.GetGroupResponse:
        validation.validate_group_id(request.group_id, "group_id")
        return reconciler_pb2.GetGroupResponse(group=await self._store.get_group(request.group_id))

    async def WatchGroups(
        self, request: reconciler_pb2.WatchGroupsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[reconciler_pb2.GroupEvent]:
        validation.validate_watch_groups(request)
        group_ids = list(dict.fromkeys(request.group_ids))
        with self._service.events.watch(group_ids) as queue:
            # Read the states only after subscribing, so no change falls in between.
            states = await self._store.group_states(group_ids)
            if unknown := [gid for gid, state in states.items() if not state]:
                raise NotFound(f"unknown groups: {', '.join(unknown[:5])}")
            sent: dict[str, str] = {}
            while True:
                for gid, state in states.items():
                    if state and sent.get(gid) != state:
                        sent[gid] = state
                        yield await self._event(gid, state)
                open_ids = [gid for gid in group_ids if sent.get(gid) not in TERMINAL]
                if not open_ids:
                    return
                try:
                    gid, state = await asyncio.wait_for(queue.get(), WATCH_POLL_S)
                    states = {gid: state}
                except TimeoutError:
                    states = await self._store.group_states(open_ids)

    async def _event(self, group_id: str, state: str) -> reconciler_pb2.GroupEvent:
        event = reconciler_pb2.GroupEvent(
            group_id=group_id, state=reconciler_pb2.GroupState.Value(f"GROUP_STATE_{state}")
        )
        if state in ("READY", "CONSUMED", "COMMITTED"):  # done: the group comes along
            event.group.CopyFrom(await self._store.get_group(group_id))
        return event

    async def PublishPolicyVersion(
        self, request: reconciler_pb2.PublishPolicyVersionRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.PublishPolicyVersionResponse:
        validation.validate_publish(request)
        current = await self._store.publish_version(request.notice)
        return reconciler_pb2.PublishPolicyVersionResponse(current_policy_version=current)

    async def WatchPolicyVersions(
        self, request: reconciler_pb2.WatchPolicyVersionsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[common_pb2.PolicyVersionNotice]:
        validation.validate_watch_policy_versions(request)
        store = self._service.blocking_store
        # The newest version at once (if newer); then every later one as it is published.
        notices, last_id = await store.version_notices(request.after_version)
        if notices:
            yield notices[-1]
        after = max([request.after_version, *(n.version for n in notices)])
        while True:
            notices, last_id = await store.version_notices(after, last_id, block_ms=5000)
            for notice in notices:
                after = notice.version
                yield notice

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.ReconcilerStatusResponse:
        counts = await self._store.counts()
        return reconciler_pb2.ReconcilerStatusResponse(
            info=await self._service.service_info(request.include_dependencies),
            slots_by_state={
                k.partition(":")[2]: v for k, v in counts.items() if k.startswith("slot:")
            },
            groups_by_state={
                k.partition(":")[2]: v for k, v in counts.items() if k.startswith("group:")
            },
            current_policy_version=await self._store.current_version(),
        )


class ReconcilerService(Service):
    """Ready when Redis answers."""

    name = "reconciler"
    config: ReconcilerProcessConfig

    def __init__(self, config: ReconcilerProcessConfig, channels: Channels) -> None:
        super().__init__(config, channels)
        url = config.redis.url
        self.redis: aioredis.Redis = aioredis.from_url(
            url, socket_timeout=5.0, socket_connect_timeout=2.0, health_check_interval=10
        )
        # Blocking reads (pub/sub, XREAD BLOCK) must not hit the socket timeout.
        self.blocking_redis: aioredis.Redis = aioredis.from_url(
            url, socket_timeout=None, socket_connect_timeout=2.0, health_check_interval=10
        )
        self.store = SlotStore(self.redis, config.run.name, config.reconciler)
        self.blocking_store = SlotStore(self.blocking_redis, config.run.name, config.reconciler)
        self.events = GroupEvents(self.blocking_redis, self.store.key("events"))

    def register(self, server: aio.Server) -> list[str]:
        reconciler_pb2_grpc.add_ReconcilerServiceServicer_to_server(
            ReconcilerServicer(self), server
        )
        return [reconciler_pb2.DESCRIPTOR.services_by_name["ReconcilerService"].full_name]

    async def start(self) -> None:
        # A reaper that stopped would leave expired leases LEASED forever: it is
        # supervised (restarted with backoff, readiness NOT_SERVING while it is down).
        reap_interval = self.config.reconciler.reap_interval_s
        self.background.start(
            "reaper", self._reap_forever, healthy_after_s=max(1.0, 5 * reap_interval)
        )
        self.background.start("group-events", self.events.run)
        feeder_config = self.config.reconciler.feeder
        if feeder_config is not None:
            # Built in the supervised task: a task file the store cannot serve yet is a
            # fault named on readiness and retried with backoff, not a failed start.
            async def feed() -> None:
                store = open_store(self.config.object_store) if feeder_config.key else None
                feeder = await asyncio.to_thread(build_feeder, feeder_config, store)
                await run_feeder(self.store, feeder, feeder_config, self.instance_id)

            self.background.start("feeder", feed)

    async def _reap_forever(self) -> None:
        """Reaps expired leases and refreshes the metrics snapshot, riding out Redis outages."""
        interval = self.config.reconciler.reap_interval_s
        while True:
            try:
                await self.store.write_settings()  # again after a Redis that lost its data
                while await self._reap_batch():
                    pass
                SNAPSHOT.counts = await self.store.counts()
                SNAPSHOT.dead_reasons = await self.store.dead_reasons()
                SNAPSHOT.policy_version = await self.store.current_version()
            except REDIS_DOWN as error:
                log.warning("reaper: redis unavailable (%s)", error)
            await asyncio.sleep(interval)

    async def _reap_batch(self, batch: int = 1000) -> bool:
        return await self.store.reap(batch) >= batch

    def classify_error(self, error: Exception) -> ServiceError | None:
        if isinstance(error, REDIS_DOWN):
            return Unavailable(f"redis unavailable: {error}")
        return None

    async def check_ready(self) -> Readiness:
        try:
            await self.redis.ping()
        except REDIS_DOWN as error:
            return Readiness(False, f"redis unreachable: {error}")
        return Readiness(True, "redis answers")

    async def stop(self) -> None:
        # The background loops were stopped before this (services.wire.server).
        await self.redis.aclose()
        await self.blocking_redis.aclose()

    def status_fields(self) -> dict[str, str]:
        counts = SNAPSHOT.counts
        fields = {"redis": self.config.redis.url, "policy version": str(SNAPSHOT.policy_version)}
        for kind in ("slot", "group"):
            fields[f"{kind}s"] = (
                ", ".join(
                    f"{key.partition(':')[2].lower()} {value}"
                    for key, value in sorted(counts.items())
                    if key.startswith(f"{kind}:") and value
                )
                or "none"
            )
        return fields


def run(config: ReconcilerProcessConfig) -> None:
    """Runs the reconciler until SIGTERM, on uvloop."""
    # Each call is a gRPC answer and a Redis round trip; uvloop spends less CPU on both.
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    run_service(ReconcilerService, config)
