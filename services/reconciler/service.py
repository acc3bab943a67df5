"""The reconciler process: its gRPC servicer and readiness (Redis answers PING).

The slot state machine (Lua scripts over Redis) is not in this release yet: its
methods validate their input and answer UNIMPLEMENTED, never made-up data.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from grpc import aio

from services.api.v1 import common_pb2, reconciler_pb2, reconciler_pb2_grpc
from services.reconciler import validation
from services.run_config import EtudeConfig
from services.wire.client import Channels
from services.wire.errors import (
    Unimplemented,
    require,
    require_identifier,
    unimplemented_stream,
)
from services.wire.server import run_service
from services.wire.service import Readiness, Service

_NOT_YET = "the slot state machine is not implemented in this release"


class ReconcilerServicer(reconciler_pb2_grpc.ReconcilerServiceServicer):
    """The ReconcilerService contract."""

    def __init__(self, service: ReconcilerService) -> None:
        self._service = service

    async def SubmitGroups(
        self, request: reconciler_pb2.SubmitGroupsRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.SubmitGroupsResponse:
        validation.validate_submit_groups(request)
        raise Unimplemented(f"SubmitGroups: {_NOT_YET}")

    async def ClaimSlots(
        self, request: reconciler_pb2.ClaimSlotsRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.ClaimSlotsResponse:
        validation.validate_claim_slots(request)
        raise Unimplemented(f"ClaimSlots: {_NOT_YET}")

    async def HeartbeatSlot(
        self, request: reconciler_pb2.HeartbeatSlotRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.HeartbeatSlotResponse:
        validation.validate_lease(request.slot_id, request.lease_token)
        raise Unimplemented(f"HeartbeatSlot: {_NOT_YET}")

    async def CompleteSlot(
        self, request: reconciler_pb2.CompleteSlotRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.CompleteSlotResponse:
        validation.validate_complete_slot(request)
        raise Unimplemented(f"CompleteSlot: {_NOT_YET}")

    async def FailSlot(
        self, request: reconciler_pb2.FailSlotRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.FailSlotResponse:
        validation.validate_fail_slot(request)
        raise Unimplemented(f"FailSlot: {_NOT_YET}")

    async def PullBatch(
        self, request: reconciler_pb2.PullBatchRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.PullBatchResponse:
        validation.validate_pull_batch(request)
        raise Unimplemented(f"PullBatch: {_NOT_YET}")

    async def CommitBatch(
        self, request: reconciler_pb2.CommitBatchRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.CommitBatchResponse:
        require_identifier(request.consumer_id, "consumer_id")
        raise Unimplemented(f"CommitBatch: {_NOT_YET}")

    async def GetGroup(
        self, request: reconciler_pb2.GetGroupRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.GetGroupResponse:
        require_identifier(request.group_id, "group_id")
        raise Unimplemented(f"GetGroup: {_NOT_YET}")

    async def WatchGroups(
        self, request: reconciler_pb2.WatchGroupsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[reconciler_pb2.GroupEvent]:
        require(len(request.group_ids) > 0, "group_ids", "must not be empty")
        for index, group_id in enumerate(request.group_ids):
            require_identifier(group_id, f"group_ids[{index}]")
        async for event in unimplemented_stream(
            f"WatchGroups: {_NOT_YET}", reconciler_pb2.GroupEvent
        ):
            yield event

    async def PublishPolicyVersion(
        self, request: reconciler_pb2.PublishPolicyVersionRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.PublishPolicyVersionResponse:
        validation.validate_publish(request)
        raise Unimplemented(f"PublishPolicyVersion: {_NOT_YET}")

    async def WatchPolicyVersions(
        self, request: reconciler_pb2.WatchPolicyVersionsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[common_pb2.PolicyVersionNotice]:
        async for notice in unimplemented_stream(
            f"WatchPolicyVersions: {_NOT_YET}", common_pb2.PolicyVersionNotice
        ):
            yield notice

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.ReconcilerStatusResponse:
        return reconciler_pb2.ReconcilerStatusResponse(
            info=await self._service.service_info(request.include_dependencies)
        )


class ReconcilerService(Service):
    """Ready when Redis answers."""

    name = "reconciler"

    def __init__(self, config: EtudeConfig, channels: Channels) -> None:
        super().__init__(config, channels)
        self.redis: aioredis.Redis = aioredis.from_url(
            config.redis.url, socket_timeout=2.0, socket_connect_timeout=2.0
        )

    def register(self, server: aio.Server) -> list[str]:
        reconciler_pb2_grpc.add_ReconcilerServiceServicer_to_server(
            ReconcilerServicer(self), server
        )
        return [reconciler_pb2.DESCRIPTOR.services_by_name["ReconcilerService"].full_name]

    async def check_ready(self) -> Readiness:
        try:
            await self.redis.ping()
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError) as error:
            return Readiness(False, f"redis unreachable: {error}")
        return Readiness(True, "redis answers")

    async def stop(self) -> None:
        await self.redis.aclose()

    def status_fields(self) -> dict[str, str]:
        return {"redis": self.config.redis.url}


def run(config: EtudeConfig) -> None:
    """Runs the reconciler until SIGTERM."""
    run_service(ReconcilerService, config)
