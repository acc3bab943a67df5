"""The reconciler as a real process: futures API, bad input, versions, feeder, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from grpc import aio

from services.api.v1 import common_pb2, reconciler_pb2
from services.config import ObjectStoreConfig
from services.objectstore import open_store
from services.reconciler_client import GroupDropped, GroupFuture, ReconcilerClient
from services.wire.client import make_channel
from tests.conftest import TOKEN
from tests.reconciler_support import ReconcilerProcess, reconciler
from tests.test_reconciler_store import rollout, spec, task

pytestmark = pytest.mark.integration


@pytest.fixture
def server(tmp_path: Path) -> AsyncIterator[ReconcilerProcess]:
    with reconciler(tmp_path, extra="lease_ttl_s = 5\nmax_attempts = 2") as process:
        yield process  # type: ignore[misc]


async def work(client: ReconcilerClient, stop: asyncio.Event, fail_task: str = "") -> int:
    """A worker: claims slots and completes them (or fails the ones of `fail_task`)."""
    done = 0
    while not stop.is_set():
        claimed = await client.claim("test-worker", max_slots=4)
        if not claimed:
            await asyncio.sleep(0.05)
            continue
        for slot in claimed:
            async with client.lease(slot) as lease:
                if slot.task.task_id == fail_task:
                    await lease.fail("cannot grade", retryable=False)
                else:
                    await lease.complete(rollout(slot.lease.slot_id, slot.lease.attempt))
                    done += 1
    return done


async def test_futures_resolve_as_groups_complete(server: ReconcilerProcess) -> None:
    async with make_channel(server.target, token=TOKEN) as channel:
        client = ReconcilerClient(channel)
        futures = await client.submit_many([spec(k=2) for _ in range(5)])
        doomed = await client.submit(
            common_pb2.Task(
                task_id="doomed", family="synthetic", grading=common_pb2.GradingSpec(command=["x"])
            ),
            2,
        )
        stop = asyncio.Event()
        worker = asyncio.create_task(work(client, stop, fail_task="doomed"))
        async with asyncio.timeout(30):
            finished = [f async for f in client.as_completed(futures)]
            with pytest.raises(GroupDropped):
                await doomed.result()
        stop.set()
        assert await worker == 10
        assert {f.group_id for f in finished} == {f.group_id for f in futures}
        for future in futures:
            group = await future.result()
            assert group.state == reconciler_pb2.GROUP_STATE_READY
            assert sorted(r.rollout_id for r in group.rollouts) == sorted(
                f"r-{future.group_id}-{i}-1" for i in range(2)
            )
        batch = await client.pull_batch("trainer", 1, 5, current_version=0)
        assert {g.group_id for g in batch.groups} == {f.group_id for f in futures}
        assert await client.commit("trainer", 1) == 5
        # A future asked after its group was trained still has its result.
        assert (await futures[0].result()).group_id == futures[0].group_id
        # Watching a trained group answers at once, with the group (not a bare state).
        late = GroupFuture(client, futures[1].group_id)
        async with asyncio.timeout(5):
            assert [f.group_id async for f in client.as_completed([late])] == [late.group_id]
        assert late.done() and len((await late.result()).rollouts) == 2


async def _status(client: ReconcilerClient) -> reconciler_pb2.ReconcilerStatusResponse:
    return await client.stub.GetStatus(common_pb2.StatusRequest())


async def _code(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(aio.AioRpcError) as error:
        await call  # type: ignore[misc]
    return error.value.code(), error.value.details()


async def test_bad_input_is_refused_and_changes_nothing(server: ReconcilerProcess) -> None:
    async with make_channel(server.target, token=TOKEN) as channel:
        client = ReconcilerClient(channel)
        stub = client.stub
        (gid,) = [f.group_id for f in await client.submit_many([spec(k=1)])]
        (slot,) = await client.claim("w", 1)
        before = await _status(client)
        unknown_slot = "0123456789abcdef/0"
        cases = [
            (
                stub.SubmitGroups(reconciler_pb2.SubmitGroupsRequest(groups=[spec(k=0)])),
                grpc.StatusCode.INVALID_ARGUMENT,
                "groups[0].num_samples: ",
            ),
            (
                stub.HeartbeatSlot(
                    reconciler_pb2.HeartbeatSlotRequest(slot_id=unknown_slot, lease_token="x")
                ),
                grpc.StatusCode.NOT_FOUND,
                "slot 0123456789abcdef/0",
            ),
            (
                stub.HeartbeatSlot(
                    reconciler_pb2.HeartbeatSlotRequest(slot_id="not-a-slot", lease_token="x")
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "slot_id: ",
            ),
            (
                stub.HeartbeatSlots(reconciler_pb2.HeartbeatSlotsRequest()),
                grpc.StatusCode.INVALID_ARGUMENT,
                "leases: must not be empty",
            ),
            (
                stub.HeartbeatSlots(
                    reconciler_pb2.HeartbeatSlotsRequest(
                        leases=[
                            reconciler_pb2.HeartbeatSlotRequest(
                                slot_id=slot.lease.slot_id, lease_token=slot.lease.lease_token
                            ),
                            reconciler_pb2.HeartbeatSlotRequest(slot_id="x/0", lease_token="t"),
                        ]
                    )
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "leases[1].slot_id: ",
            ),
            (
                stub.HeartbeatSlots(
                    reconciler_pb2.HeartbeatSlotsRequest(
                        leases=[
                            reconciler_pb2.HeartbeatSlotRequest(
                                slot_id=slot.lease.slot_id, lease_token=slot.lease.lease_token
                            )
                        ]
                        * 2
                    )
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "leases[1].slot_id: ",
            ),
            (
                stub.CompleteSlot(
                    reconciler_pb2.CompleteSlotRequest(
                        slot_id=slot.lease.slot_id,
                        lease_token="wrong-token",
                        rollout=rollout(slot.lease.slot_id),
                    )
                ),
                grpc.StatusCode.FAILED_PRECONDITION,
                "lease lost",
            ),
            (
                stub.CompleteSlot(
                    reconciler_pb2.CompleteSlotRequest(
                        slot_id=slot.lease.slot_id,
                        lease_token=slot.lease.lease_token,
                        rollout=common_pb2.RolloutSummary(
                            rollout_id="r", record=common_pb2.ObjectRef(key="k", sha256="zz")
                        ),
                    )
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "rollout.record.sha256: ",
            ),
            (
                stub.GetGroup(reconciler_pb2.GetGroupRequest(group_id="fedcba9876543210")),
                grpc.StatusCode.NOT_FOUND,
                "fedcba9876543210",
            ),
            (
                stub.PullBatch(reconciler_pb2.PullBatchRequest(consumer_id="t", num_groups=0)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "num_groups: ",
            ),
            (
                stub.ClaimSlots(
                    reconciler_pb2.ClaimSlotsRequest(worker_id="w", max_slots=1, lease_ttl_s=1e6)
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "lease_ttl_s: ",
            ),
            (
                stub.PublishPolicyVersion(
                    reconciler_pb2.PublishPolicyVersionRequest(
                        notice=common_pb2.PolicyVersionNotice(version=0, manifest_key="m")
                    )
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "notice.version: ",
            ),
        ]
        for call, code, message in cases:
            got_code, details = await _code(call)
            assert got_code == code, (message, details)
            assert message in details, details
        watch = stub.WatchGroups(reconciler_pb2.WatchGroupsRequest(group_ids=["fedcba9876543210"]))
        with pytest.raises(aio.AioRpcError) as unknown:
            async for _ in watch:
                pass
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        after = await _status(client)
        assert dict(after.slots_by_state) == dict(before.slots_by_state)
        assert dict(after.groups_by_state) == dict(before.groups_by_state)
        # The real lease still works.
        async with client.lease(slot) as lease:
            assert (await lease.complete(rollout(slot.lease.slot_id))).group_ready
        assert (await client.get_group(gid)).state == reconciler_pb2.GROUP_STATE_READY


async def test_one_heartbeat_call_keeps_every_lease_of_a_client(
    server: ReconcilerProcess,
) -> None:
    async with make_channel(server.target, token=TOKEN) as channel:
        client = ReconcilerClient(channel)
        await client.submit_many([spec(k=3), spec(k=3)])
        slots = await client.claim("w", max_slots=6, lease_ttl_s=0.6)  # renewed every 0.2 s
        assert len(slots) == 6
        calls: list[int] = []
        heartbeat = client.stub.HeartbeatSlots

        def counting(request: reconciler_pb2.HeartbeatSlotsRequest, **kwargs: object) -> object:
            calls.append(len(request.leases))
            return heartbeat(request, **kwargs)

        client.stub.HeartbeatSlots = counting  # type: ignore[method-assign]
        async with contextlib.AsyncExitStack() as stack:
            leases = [await stack.enter_async_context(client.lease(slot)) for slot in slots]
            # The reconciler takes one slot back: the next round reports it lost.
            taken = leases[0]
            await client.stub.FailSlot(
                reconciler_pb2.FailSlotRequest(
                    slot_id=taken.slot_id, lease_token=taken.token, reason="test", retryable=True
                )
            )
            await asyncio.sleep(1.5)  # 2.5 TTLs: unrenewed leases would have expired
            assert taken.lost.is_set()
            assert not any(lease.lost.is_set() for lease in leases[1:])
            for lease in leases[1:]:
                assert not (await lease.complete(rollout(lease.slot_id))).duplicate
        # One call a round for all six (then five) leases, not one per lease.
        assert 4 <= len(calls) <= 12, calls
        assert calls[0] == 6 and set(calls[1:]) == {5}, calls


async def test_policy_versions_are_streamed(server: ReconcilerProcess) -> None:
    async with make_channel(server.target, token=TOKEN) as channel:
        client = ReconcilerClient(channel)
        received: list[int] = []

        async def follow() -> None:
            stream = client.stub.WatchPolicyVersions(
                reconciler_pb2.WatchPolicyVersionsRequest(after_version=0)
            )
            async for notice in stream:
                received.append(notice.version)
                if notice.version == 2:
                    return

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        for version in (1, 2):
            notice = common_pb2.PolicyVersionNotice(
                version=version, manifest_key=f"weights/v{version}/manifest.json"
            )
            assert await client.publish_version(notice) == version
        async with asyncio.timeout(10):
            await follower
        assert received == [1, 2]
        versions = client.policy_versions(after_version=1)
        async with asyncio.timeout(10):
            assert await anext(versions) == 2
        await versions.aclose()
        # A late follower gets the newest version at once, not the history.
        stream = client.stub.WatchPolicyVersions(
            reconciler_pb2.WatchPolicyVersionsRequest(after_version=0)
        )
        async with asyncio.timeout(10):
            first = await stream.read()
        stream.cancel()
        assert first.version == 2
        assert (await _status(client)).current_policy_version == 2


async def test_pull_waits_for_enough_groups(server: ReconcilerProcess) -> None:
    async with make_channel(server.target, token=TOKEN) as channel:
        client = ReconcilerClient(channel)
        await client.submit_many([spec(k=1) for _ in range(3)])

        async def later() -> None:
            await asyncio.sleep(0.5)
            await work_once(client, 3)

        helper = asyncio.create_task(later())
        batch = await client.pull_batch("trainer", 1, 3, current_version=0, wait_s=10)
        await helper
        assert len(batch.groups) == 3
        # Nothing more: waiting ends with what there is (nothing).
        assert (
            len((await client.pull_batch("trainer", 2, 1, current_version=0, wait_s=0.3)).groups)
            == 0
        )


async def work_once(client: ReconcilerClient, count: int) -> None:
    while count:
        for slot in await client.claim("w", count):
            async with client.lease(slot) as lease:
                await lease.complete(rollout(slot.lease.slot_id))
            count -= 1


@pytest.mark.parametrize("source", ["path", "key"])
def test_feeder_resumes_after_restart_without_duplicates(tmp_path: Path, source: str) -> None:
    """From a task file, or the same file in the object store (as in a cluster)."""
    lines = "\n".join(json_format.MessageToJson(task(f"t-{i}"), indent=None) for i in range(10))
    store_url = f"file://{tmp_path}/store"
    if source == "path":
        tasks_file = tmp_path / "tasks.jsonl"
        tasks_file.write_text(lines + "\n")
        where = f'path = "{tasks_file}"'
    else:
        open_store(ObjectStoreConfig(url=store_url)).put("tasks/train.jsonl", lines.encode())
        where = 'kind = "jsonl", key = "tasks/train.jsonl"'
    extra = f"feeder = {{ {where}, num_samples = 2, target_in_flight = 3, interval_s = 0.1 }}"
    run_name = f"test-feeder-{source}-" + tmp_path.name[-8:].replace("_", "")
    trained: list[str] = []

    async def drive(server: ReconcilerProcess, until: int) -> None:
        async with make_channel(server.target, token=TOKEN) as channel:
            client = ReconcilerClient(channel)
            async with asyncio.timeout(60):
                while len(trained) < until:
                    await work_once_if_any(client)
                    step = len(trained) + 1
                    batch = await client.pull_batch("trainer", step, 1, 0, wait_s=0.2)
                    if batch.groups:
                        trained.extend(g.task.task_id for g in batch.groups)
                        await client.commit("trainer", step)

    with reconciler(tmp_path, extra=extra, run_name=run_name, store_url=store_url) as server:
        asyncio.run(drive(server, 4))
        server.stop()
        server.process = None
        server.start()  # same run, same Redis: resumes from the stored cursor
        asyncio.run(drive(server, 10))
        expected = [
            'etude_reconciler_groups{state="COMMITTED"} 10.0',
            'etude_reconciler_training_groups{state="COMMITTED"} 10.0',
            'etude_reconciler_slots{state="COMPLETE"} 20.0',
        ]
        deadline = time.monotonic() + 10  # the snapshot refreshes every reap interval
        while True:
            with urllib.request.urlopen(f"{server.http}/metrics", timeout=5) as response:
                metrics = response.read().decode()
            if all(line in metrics for line in expected) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert sorted(trained, key=lambda t: int(t[2:])) == [f"t-{i}" for i in range(10)]
    for line in expected:
        assert line in metrics


async def work_once_if_any(client: ReconcilerClient) -> None:
    for slot in await client.claim("w", 8):
        async with client.lease(slot) as lease:
            await lease.complete(rollout(slot.lease.slot_id))


def test_status_page_and_metrics(tmp_path: Path) -> None:
    with reconciler(tmp_path) as server:
        with urllib.request.urlopen(f"{server.http}/status.json", timeout=5) as response:
            status = json.load(response)
        assert status["ready"] and "policy version" in status["fields"]
