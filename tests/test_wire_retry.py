"""Retries against real aio servers that answer UNAVAILABLE a few times and then OK: the
channel's retry policy (service config), and the outage helpers of services.wire.retry
as the reconciler client, the envs inference client and the group events use them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio

from services.api.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    reconciler_pb2,
    reconciler_pb2_grpc,
)
from services.envs.inference_client import InferenceGenerator
from services.reconciler_client import GroupFuture, ReconcilerClient
from services.wire.client import make_channel
from services.wire.retry import RetryPolicy, resume_stream, retrying

FAST = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.05)


class _Flaky(reconciler_pb2_grpc.ReconcilerServiceServicer):
    """Fails the first `failures` calls of each method with `code`, then answers."""

    def __init__(self, failures: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self.failures = failures
        self.code = code
        self.calls: dict[str, int] = {}
        self.requests: list[object] = []

    async def _maybe_fail(self, method: str, context: aio.ServicerContext) -> int:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.calls[method] <= self.failures:
            await context.abort(self.code, f"{method} attempt {self.calls[method]} refused")
        return self.calls[method]

    async def GetGroup(
        self, request: reconciler_pb2.GetGroupRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.GetGroupResponse:
        await self._maybe_fail("GetGroup", context)
        return reconciler_pb2.GetGroupResponse(group=reconciler_pb2.Group(group_id="g"))

    async def PullBatch(
        self, request: reconciler_pb2.PullBatchRequest, context: aio.ServicerContext
    ) -> reconciler_pb2.PullBatchResponse:
        await self._maybe_fail("PullBatch", context)
        return reconciler_pb2.PullBatchResponse(groups=[reconciler_pb2.Group(group_id="g")])

    async def WatchPolicyVersions(
        self, request: reconciler_pb2.WatchPolicyVersionsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[common_pb2.PolicyVersionNotice]:
        # Each call announces one newer version, then breaks the way the n-th call says:
        # mid-stream UNAVAILABLE, then the deadline, then it stays open.
        self.requests.append(request)
        call = len(self.requests)
        yield common_pb2.PolicyVersionNotice(version=request.after_version + 1)
        yield common_pb2.PolicyVersionNotice(version=request.after_version)  # a repeat
        if call == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "reconciler restarting")
        if call == 2:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "watch outlived its deadline")
        await asyncio.sleep(3600)

    async def WatchGroups(
        self, request: reconciler_pb2.WatchGroupsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[reconciler_pb2.GroupEvent]:
        # The first watch settles its first group and breaks; the next gets the rest.
        self.requests.append(request)
        first, *_ = request.group_ids
        yield reconciler_pb2.GroupEvent(
            group_id=first,
            state=reconciler_pb2.GROUP_STATE_READY,
            group=reconciler_pb2.Group(group_id=first),
        )
        if len(self.requests) == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "reconciler restarting")
        for gid in request.group_ids[1:]:
            yield reconciler_pb2.GroupEvent(group_id=gid, state=reconciler_pb2.GROUP_STATE_DROPPED)


@contextlib.asynccontextmanager
async def _serving(servicer: object) -> AsyncIterator[str]:
    server = aio.server()
    if isinstance(servicer, reconciler_pb2_grpc.ReconcilerServiceServicer):
        reconciler_pb2_grpc.add_ReconcilerServiceServicer_to_server(servicer, server)
    else:
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


# The channel's service config ------------------------------------------------------------
@pytest.mark.parametrize(("failures", "ok"), [(3, True), (4, False)])
async def test_the_channel_retries_unavailable_up_to_its_max_attempts(
    failures: int, ok: bool
) -> None:
    flaky = _Flaky(failures)
    async with _serving(flaky) as target, make_channel(target, token=None) as channel:
        stub = reconciler_pb2_grpc.ReconcilerServiceStub(channel)
        call = stub.GetGroup(reconciler_pb2.GetGroupRequest(group_id="g"))
        if ok:
            assert (await call).group.group_id == "g"
        else:
            with pytest.raises(aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert flaky.calls["GetGroup"] == 4  # make_channel's max_attempts


async def test_the_channel_never_retries_other_codes_and_grpc_caps_attempts_at_five() -> None:
    refused = _Flaky(100, grpc.StatusCode.INVALID_ARGUMENT)
    down = _Flaky(100)
    async with _serving(refused) as target_a, _serving(down) as target_b:
        async with make_channel(target_a, token=None) as channel:
            with pytest.raises(aio.AioRpcError):
                await reconciler_pb2_grpc.ReconcilerServiceStub(channel).GetGroup(
                    reconciler_pb2.GetGroupRequest(group_id="g")
                )
        async with make_channel(target_b, token=None, max_attempts=10) as channel:
            with pytest.raises(aio.AioRpcError):
                await reconciler_pb2_grpc.ReconcilerServiceStub(channel).GetGroup(
                    reconciler_pb2.GetGroupRequest(group_id="g")
                )
    assert refused.calls["GetGroup"] == 1
    assert down.calls["GetGroup"] == 5  # why an outage needs services.wire.retry


# retrying: unary calls through an outage -------------------------------------------------
async def test_retrying_outlasts_the_channels_attempts_and_gives_up_at_its_deadline() -> None:
    flaky = _Flaky(9)  # beyond what the channel's 4 attempts cover
    async with _serving(flaky) as target, make_channel(target, token=None) as channel:
        stub = reconciler_pb2_grpc.ReconcilerServiceStub(channel)

        def get() -> aio.UnaryUnaryCall:
            return stub.GetGroup(reconciler_pb2.GetGroupRequest(group_id="g"))

        told: list[grpc.StatusCode] = []
        answer = await retrying(get, FAST, "GetGroup", lambda error: told.append(error.code()))
        assert answer.group.group_id == "g"
        assert flaky.calls["GetGroup"] == 10
        # on_retry hears of each call retrying makes again; the channel's own attempts
        # are inside one call, so 9 failures are at least 2 calls (4 attempts each).
        assert len(told) >= 2 and set(told) == {grpc.StatusCode.UNAVAILABLE}

        flaky.failures = 10**6
        started = time.monotonic()
        bounded = RetryPolicy(initial_backoff_s=0.05, max_backoff_s=0.1, deadline_s=0.5)
        with pytest.raises(aio.AioRpcError) as caught:
            await retrying(get, bounded, "GetGroup")
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert 0.3 < time.monotonic() - started < 3


async def test_retrying_raises_other_codes_at_once() -> None:
    flaky = _Flaky(1, grpc.StatusCode.NOT_FOUND)
    async with _serving(flaky) as target, make_channel(target, token=None) as channel:
        stub = reconciler_pb2_grpc.ReconcilerServiceStub(channel)
        with pytest.raises(aio.AioRpcError) as caught:
            await retrying(
                lambda: stub.GetGroup(reconciler_pb2.GetGroupRequest(group_id="g")), FAST, "x"
            )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert flaky.calls["GetGroup"] == 1


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
async def test_the_trainers_pull_waits_out_an_outage(code: grpc.StatusCode) -> None:
    flaky = _Flaky(6, code)
    policy = RetryPolicy(codes=frozenset({code}), initial_backoff_s=0.01, max_backoff_s=0.05)
    async with _serving(flaky) as target, make_channel(target, token=None) as channel:
        client = ReconcilerClient(channel, trainer_retry=policy)
        answer = await client.pull_batch("trainer", 1, 1, current_version=0)
    assert [g.group_id for g in answer.groups] == ["g"]
    assert flaky.calls["PullBatch"] == 7


# resume_stream: watches reopened where they stopped ----------------------------------------
async def test_a_policy_version_watch_resumes_after_an_outage_and_its_deadline() -> None:
    flaky = _Flaky(0)
    async with _serving(flaky) as target, make_channel(target, token=None) as channel:
        versions = ReconcilerClient(channel).policy_versions(after_version=4)
        async with asyncio.timeout(10):
            seen = [await anext(versions) for _ in range(3)]
        await versions.aclose()
    assert seen == [5, 6, 7]  # no repeats
    assert [r.after_version for r in flaky.requests] == [4, 5, 6]  # type: ignore[attr-defined]


async def test_a_group_watch_resumes_with_the_groups_still_open() -> None:
    flaky = _Flaky(0)
    async with _serving(flaky) as target, make_channel(target, token=None) as channel:
        client = ReconcilerClient(channel)
        futures = [GroupFuture(client, gid) for gid in ("a", "b", "c")]
        async with asyncio.timeout(10):
            done = [f.group_id async for f in client.as_completed(futures)]
    assert done == ["a", "b", "c"]
    assert [list(r.group_ids) for r in flaky.requests] == [["a", "b", "c"], ["b", "c"]]  # type: ignore[attr-defined]


async def test_resume_stream_waits_out_other_transports_faults_and_gives_up_at_its_deadline() -> (
    None
):
    opened = 0

    async def subscription() -> AsyncIterator[int]:
        nonlocal opened
        opened += 1
        yield opened
        if opened < 3:
            raise ConnectionResetError("redis went away")

    policy = RetryPolicy(codes=frozenset(), errors=(OSError,), initial_backoff_s=0.01)
    stream = resume_stream(subscription, policy, "subscription")
    assert [await anext(stream) for _ in range(4)] == [1, 2, 3, 4]
    await stream.aclose()

    async def down() -> AsyncIterator[int]:
        raise ConnectionRefusedError("redis is down")
        yield 0

    bounded = RetryPolicy(errors=(OSError,), initial_backoff_s=0.05, deadline_s=0.3)
    with pytest.raises(ConnectionRefusedError):
        async with asyncio.timeout(5):
            async for _ in resume_stream(down, bounded, "subscription"):
                pass


# The envs inference client ----------------------------------------------------------------
class _Restarting(inference_pb2_grpc.InferenceServiceServicer):
    """Breaks `failures` Generate streams after their first chunk with `code`, then
    answers whole."""

    def __init__(self, failures: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self.failures = failures
        self.code = code
        self.calls = 0

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        self.calls += 1
        yield inference_pb2.GenerateResponse(token_ids=[self.calls], logprobs=[-1.0])
        if self.calls <= self.failures:
            await context.abort(self.code, "replica restarting")
        yield inference_pb2.GenerateResponse(
            token_ids=[99],
            logprobs=[-1.0],
            offset=1,
            finish_reason=inference_pb2.FINISH_REASON_STOP,
        )


async def test_generate_starts_over_after_a_broken_stream_until_its_wait_is_spent() -> None:
    replica = _Restarting(2)  # mid-stream: the channel's policy cannot retry these
    async with _serving(replica) as target, make_channel(target, token=None) as channel:
        generation = await InferenceGenerator(channel, 1.0, seed=None)([1, 2], 4, [])
        assert generation.token_ids == [3, 99]  # the broken streams' tokens are dropped
        assert replica.calls == 3

        replica.failures = 10**6
        started = time.monotonic()
        with pytest.raises(aio.AioRpcError) as caught:
            await InferenceGenerator(channel, 1.0, seed=None, unavailable_wait_s=0.5)([1], 4, [])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 3


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE])
async def test_generate_starts_over_when_the_replica_gives_the_call_up(
    code: grpc.StatusCode,
) -> None:
    """A replica shutting down may end a call CANCELLED (gRPC's own cancel at the end of
    its stop grace) instead of handing it back UNAVAILABLE: the generation starts over."""
    replica = _Restarting(1, code)
    async with _serving(replica) as target, make_channel(target, token=None) as channel:
        generation = await InferenceGenerator(channel, 1.0, seed=None)([1, 2], 4, [])
        assert generation.token_ids == [2, 99]
        assert replica.calls == 2


async def test_generate_raises_a_replicas_refusal_at_once() -> None:
    replica = _Restarting(1, grpc.StatusCode.INVALID_ARGUMENT)
    async with _serving(replica) as target, make_channel(target, token=None) as channel:
        with pytest.raises(aio.AioRpcError) as caught:
            await InferenceGenerator(channel, 1.0, seed=None)([1, 2], 4, [])
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert replica.calls == 1
