"""ReturnGroups: the trainer hands back groups whose rollout records failed to load or
check. A retryable slot runs again, a bad record's slot is dead with its reason, the
group leaves the step it was pulled for and settles again; a repeated call changes
nothing; bad requests are refused naming the field."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc import aio

from services.api.v1 import common_pb2, reconciler_pb2
from services.reconciler_client import ReconcilerClient
from services.wire.client import make_channel
from tests.conftest import TOKEN
from tests.reconciler_support import reconciler
from tests.test_reconciler_store import rollout, task

pytestmark = pytest.mark.integration

PENDING, DEAD = reconciler_pb2.SLOT_STATE_PENDING, reconciler_pb2.SLOT_STATE_DEAD
UNCHANGED = reconciler_pb2.SLOT_STATE_UNSPECIFIED


async def _complete_all(client: ReconcilerClient) -> None:
    for slot in await client.claim("worker", max_slots=64):
        async with client.lease(slot) as lease:
            await lease.complete(rollout(slot.lease.slot_id, slot.lease.attempt))


def _returned(slot_id: str, reason: str, retryable: bool) -> reconciler_pb2.ReturnedSlot:
    return reconciler_pb2.ReturnedSlot(slot_id=slot_id, reason=reason, retryable=retryable)


def test_returned_slots_run_again_or_die_and_their_groups_leave_the_step(tmp_path: Path) -> None:
    async def scenario(target: str) -> None:
        async with make_channel(target, token=TOKEN) as channel:
            client = ReconcilerClient(channel)
            # min_complete_samples = 2 of 3: a group with one dead slot is still trained.
            kept, retried, dropped = [
                (await client.submit(task(name), 3)).group_id
                for name in ("kept", "retried", "dropped")
            ]
            await _complete_all(client)
            pulled = await client.pull_batch("trainer", 0, 3, current_version=0)
            assert {g.group_id for g in pulled.groups} == {kept, retried, dropped}
            slots = [
                _returned(f"{kept}/1", "trainer: record_corrupt", False),
                _returned(f"{retried}/0", "trainer: store_unavailable", True),
                _returned(f"{dropped}/0", "trainer: record_missing", False),
                _returned(f"{dropped}/2", "trainer: routed_experts_shape", False),
            ]
            states = await client.return_groups("trainer", 0, slots)
            assert states == [DEAD, PENDING, DEAD, DEAD]
            # Retried (a lost answer): nothing changes.
            assert await client.return_groups("trainer", 0, slots) == [UNCHANGED] * 4

            group = await client.get_group(kept)
            assert group.state == reconciler_pb2.GROUP_STATE_READY
            assert [s.state for s in group.slots][1] == DEAD
            assert group.slots[1].last_failure == "trainer: record_corrupt"
            assert sorted(r.rollout_id for r in group.rollouts) == [
                f"r-{kept}-0-1",
                f"r-{kept}-2-1",
            ]
            group = await client.get_group(retried)
            assert group.state == reconciler_pb2.GROUP_STATE_RUNNING
            assert group.slots[0].state == PENDING and group.slots[0].attempts == 1
            assert group.slots[0].last_failure == "trainer: store_unavailable"
            assert len(group.rollouts) == 2
            group = await client.get_group(dropped)
            assert group.state == reconciler_pb2.GROUP_STATE_DROPPED

            # The step no longer holds the returned groups: pulled again, it hands out
            # what is ready now, the kept group with its two rollouts.
            again = await client.pull_batch("trainer", 0, 3, current_version=0)
            assert [g.group_id for g in again.groups] == [kept]
            assert len(again.groups[0].rollouts) == 2
            # The retried slot runs again (attempt 2), and its group is ready once more.
            (slot,) = await client.claim("worker", max_slots=64)
            assert slot.lease.slot_id == f"{retried}/0" and slot.lease.attempt == 2
            async with client.lease(slot) as lease:
                answer = await lease.complete(rollout(slot.lease.slot_id, 2))
            assert answer.group_ready
            later = await client.pull_batch("trainer", 1, 3, current_version=0)
            assert [g.group_id for g in later.groups] == [retried]
            assert len(later.groups[0].rollouts) == 3
            # Not this consumer's, or not this step's: nothing changes.
            other = [_returned(f"{retried}/1", "trainer: record_corrupt", False)]
            assert await client.return_groups("other", 1, other) == [UNCHANGED]
            assert await client.return_groups("trainer", 0, other) == [UNCHANGED]
            assert await client.commit("trainer", 1, [kept, retried]) == 2
            assert await client.return_groups("trainer", 1, other) == [UNCHANGED]
            status = await client.stub.GetStatus(common_pb2.StatusRequest())
            assert status.groups_by_state["COMMITTED"] == 2
            assert status.groups_by_state["DROPPED"] == 1

    extra = "min_complete_samples = 2\nmax_attempts = 3"
    with reconciler(tmp_path, extra=extra) as server:
        asyncio.run(scenario(server.target))


def test_a_retryable_slot_past_its_attempts_is_dead(tmp_path: Path) -> None:
    async def scenario(target: str) -> None:
        async with make_channel(target, token=TOKEN) as channel:
            client = ReconcilerClient(channel)
            group_id = (await client.submit(task("once"), 2)).group_id
            await _complete_all(client)
            await client.pull_batch("trainer", 0, 1, current_version=0)
            slot = _returned(f"{group_id}/0", "trainer: store_unavailable", True)
            assert await client.return_groups("trainer", 0, [slot]) == [DEAD]
            group = await client.get_group(group_id)
            assert group.state == reconciler_pb2.GROUP_STATE_DROPPED
            assert group.slots[0].last_failure == "trainer: store_unavailable"

    with reconciler(tmp_path, extra="max_attempts = 1") as server:
        asyncio.run(scenario(server.target))


def test_bad_returns_are_refused_naming_the_field(tmp_path: Path) -> None:
    slot = reconciler_pb2.ReturnedSlot(slot_id="0123456789abcdef/0", reason="x")
    request = reconciler_pb2.ReturnGroupsRequest
    cases = [
        (request(consumer_id="", slots=[slot]), "consumer_id"),
        (request(consumer_id="t"), "slots"),
        (request(consumer_id="t", step=2**53, slots=[slot]), "step"),
        (
            request(consumer_id="t", slots=[reconciler_pb2.ReturnedSlot(slot_id="x", reason="x")]),
            "slots[0].slot_id",
        ),
        (
            request(consumer_id="t", slots=[reconciler_pb2.ReturnedSlot(slot_id=slot.slot_id)]),
            "slots[0].reason",
        ),
        (request(consumer_id="t", slots=[slot, slot]), "slots[1].slot_id"),
    ]

    async def scenario(target: str) -> None:
        async with make_channel(target, token=TOKEN) as channel:
            client = ReconcilerClient(channel)
            for bad, field in cases:
                with pytest.raises(aio.AioRpcError) as error:
                    await client.stub.ReturnGroups(bad)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
                assert field in (error.value.details() or ""), (field, error.value.details())

    with reconciler(tmp_path) as server:
        asyncio.run(scenario(server.target))
