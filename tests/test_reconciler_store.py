"""The reconciler's Lua scripts against the real Redis (127.0.0.1:6379, this worker's database)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from google.protobuf import json_format

from services.api.v1 import common_pb2, reconciler_pb2
from services.config import ObjectStoreConfig
from services.config.reconciler import ReconcilerConfig
from services.objectstore import open_store
from services.reconciler.store import SlotStore
from services.wire.errors import FailedPrecondition, NotFound
from tests.conftest import REDIS_URL

TRAIN, EVAL = common_pb2.SLOT_KIND_TRAIN, common_pb2.SLOT_KIND_EVAL


def task(task_id: str = "t-0") -> common_pb2.Task:
    return common_pb2.Task(
        task_id=task_id, family="synthetic", grading=common_pb2.GradingSpec(command=["pytest"])
    )


def spec(k: int = 4, kind: int = TRAIN, **fields: Any) -> reconciler_pb2.GroupSpec:
    return reconciler_pb2.GroupSpec(task=task(), num_samples=k, kind=kind, **fields)  # type: ignore[arg-type]


def rollout(slot_id: str, attempt: int = 1) -> common_pb2.RolloutSummary:
    return common_pb2.RolloutSummary(
        rollout_id=f"r-{slot_id.replace('/', '-')}-{attempt}",
        record=common_pb2.ObjectRef(key=f"rollouts/{slot_id}", sha256="0" * 64),
    )


async def make_store(**settings: Any) -> tuple[SlotStore, aioredis.Redis]:
    client = aioredis.from_url(REDIS_URL)
    store = SlotStore(client, f"test-{uuid.uuid4().hex[:10]}", ReconcilerConfig(**settings))
    return store, client


async def drop_run(store: SlotStore) -> None:
    keys = [key async for key in store.redis.scan_iter(match=f"{store.prefix}*", count=1000)]
    if keys:
        await store.redis.delete(*keys)
    await store.redis.aclose()


@pytest.fixture
async def store() -> AsyncIterator[SlotStore]:
    store, _ = await make_store(lease_ttl_s=5)
    yield store
    await drop_run(store)


async def complete_all(store: SlotStore, slots: list[reconciler_pb2.ClaimedSlot]) -> list[str]:
    states = []
    for slot in slots:
        state, duplicate = await store.complete(
            slot.lease.slot_id,
            slot.lease.lease_token,
            rollout(slot.lease.slot_id, slot.lease.attempt),
        )
        assert not duplicate
        states.append(state)
    return states


async def check_counts(store: SlotStore) -> dict[str, int]:
    """The counters agree with the slots and groups actually stored."""
    counts = await store.counts()
    actual: dict[str, int] = {}
    async for key in store.redis.scan_iter(match=f"{store.prefix}:slot:*"):
        state = (await store.redis.hget(key, "state")).decode()
        actual[f"slot:{state}"] = actual.get(f"slot:{state}", 0) + 1
    async for key in store.redis.scan_iter(match=f"{store.prefix}:group:*"):
        state, kind = [v.decode() for v in await store.redis.hmget(key, "state", "kind")]
        actual[f"group:{state}"] = actual.get(f"group:{state}", 0) + 1
        if kind == "TRAIN":
            actual[f"train_group:{state}"] = actual.get(f"train_group:{state}", 0) + 1
    prefixes = ("slot:", "group:", "train_group:")
    recorded = {k: v for k, v in counts.items() if k.startswith(prefixes) and v}
    assert recorded == actual
    return counts


async def test_full_lifecycle(store: SlotStore) -> None:
    (gid,) = await store.submit([spec(k=3)])
    slots = await store.claim("w-1", [], 10, 5)
    assert sorted(s.lease.slot_id for s in slots) == [f"{gid}/{i}" for i in range(3)]
    assert {s.lease.attempt for s in slots} == {1}
    assert len({s.lease.lease_token for s in slots}) == 3
    assert await store.claim("w-2", [], 10, 5) == []
    assert await store.heartbeat(slots[0].lease.slot_id, slots[0].lease.lease_token) == 5.0
    assert await complete_all(store, slots) == ["RUNNING", "RUNNING", "READY"]
    group = await store.get_group(gid)
    assert group.state == reconciler_pb2.GROUP_STATE_READY
    assert len(group.rollouts) == 3 and group.task.task_id == "t-0"
    assert [s.state for s in group.slots] == [reconciler_pb2.SLOT_STATE_COMPLETE] * 3
    await check_counts(store)


async def test_submit_is_idempotent_per_key(store: SlotStore) -> None:
    first = await store.submit([spec(idempotency_key="feed:1"), spec(idempotency_key="feed:2")])
    again = await store.submit([spec(idempotency_key="feed:1")])
    assert again == first[:1] and len(set(first)) == 2
    assert (await store.counts())["slot:PENDING"] == 8


async def test_completion_is_idempotent_and_never_twice(store: SlotStore) -> None:
    await store.submit([spec(k=1)])
    (slot,) = await store.claim("w-1", [], 1, 5)
    lease = slot.lease
    assert await store.complete(lease.slot_id, lease.lease_token, rollout(lease.slot_id)) == (
        "READY",
        False,
    )
    # The same completion retried: acknowledged as a duplicate, nothing changes.
    assert await store.complete(lease.slot_id, lease.lease_token, rollout(lease.slot_id)) == (
        "READY",
        True,
    )
    # A different completion of the completed slot: rejected.
    with pytest.raises(FailedPrecondition, match="lease lost"):
        await store.complete(lease.slot_id, lease.lease_token, rollout(lease.slot_id, attempt=2))
    counts = await check_counts(store)
    assert counts["slot:COMPLETE"] == 1 and counts["rejected:lease_lost"] == 1


async def test_expired_lease_is_reaped_and_the_late_worker_rejected() -> None:
    store, _ = await make_store(lease_ttl_s=0.2)
    try:
        (gid,) = await store.submit([spec(k=1)])
        (first,) = await store.claim("slow", [], 1, 0.2)
        await asyncio.sleep(0.3)
        with pytest.raises(FailedPrecondition):  # expired even before the reaper ran
            await store.heartbeat(first.lease.slot_id, first.lease.lease_token)
        assert await store.reap() == 1
        (second,) = await store.claim("fast", [], 1, 5)
        assert second.lease.slot_id == first.lease.slot_id and second.lease.attempt == 2
        with pytest.raises(FailedPrecondition):
            await store.complete(first.lease.slot_id, first.lease.lease_token, rollout(gid, 1))
        assert (
            await store.complete(second.lease.slot_id, second.lease.lease_token, rollout(gid, 2))
        )[0] == "READY"
        counts = await check_counts(store)
        assert counts["lease_expiries"] == 1 and counts["rejected:lease_lost"] == 2
    finally:
        await drop_run(store)


async def test_failures_retry_then_die_and_the_group_drops() -> None:
    store, _ = await make_store(max_attempts=2)
    try:
        (gid,) = await store.submit([spec(k=2)])
        slots = await store.claim("w", [], 2, 5)
        await complete_all(store, slots[:1])
        assert await store.fail(
            slots[1].lease.slot_id, slots[1].lease.lease_token, "boom", True
        ) == ("PENDING", 1)
        (again,) = await store.claim("w", [], 1, 5)
        assert again.lease.attempt == 2
        assert await store.fail(again.lease.slot_id, again.lease.lease_token, "boom", True) == (
            "DEAD",
            2,
        )
        group = await store.get_group(gid)
        assert group.state == reconciler_pb2.GROUP_STATE_DROPPED
        assert group.slots[1].last_failure == "boom"
        assert await store.dead_reasons() == {"boom": 1}
        await check_counts(store)
    finally:
        await drop_run(store)


async def test_min_complete_makes_a_group_ready_despite_dead_slots() -> None:
    store, _ = await make_store(min_complete_samples=2)
    try:
        (gid,) = await store.submit([spec(k=3)])
        slots = await store.claim("w", [], 3, 5)
        await complete_all(store, slots[:2])
        assert (await store.get_group(gid)).state == reconciler_pb2.GROUP_STATE_RUNNING
        assert await store.fail(
            slots[2].lease.slot_id, slots[2].lease.lease_token, "ungradable", False
        ) == ("DEAD", 1)
        group = await store.get_group(gid)
        assert group.state == reconciler_pb2.GROUP_STATE_READY and len(group.rollouts) == 2
    finally:
        await drop_run(store)


async def test_eval_slots_come_first_and_priority_orders_within_a_kind(store: SlotStore) -> None:
    low, high = await store.submit([spec(k=1, priority=0), spec(k=1, priority=5)])
    (evaluation,) = await store.submit([spec(k=1, kind=EVAL)])
    order = [s.lease.group_id for s in await store.claim("w", [], 3, 5)]
    assert order == [evaluation, high, low]


async def test_eval_groups_never_reach_the_trainer_and_expire() -> None:
    store, _ = await make_store(committed_retention_s=60)
    try:
        await store.write_settings()
        (evaluation,) = await store.submit([spec(k=2, kind=EVAL)])
        (train,) = await store.submit([spec(k=1)])
        assert await complete_all(store, await store.claim("w", [], 3, 5)) == [
            "RUNNING",
            "READY",
            "READY",
        ]
        assert (await store.get_group(evaluation)).state == reconciler_pb2.GROUP_STATE_READY
        pulled = await store.pull("trainer", 1, 5, 0, partial=True)
        assert [g.group_id for g in pulled.groups] == [train]
        ttl = await store.redis.pttl(store.key("group", evaluation))
        assert 0 < ttl <= 60_000
        assert 0 < await store.redis.pttl(store.key("slot", f"{evaluation}/1")) <= 60_000
        assert await store.redis.pttl(store.key("group", train)) == -1  # until committed
    finally:
        await drop_run(store)


async def test_a_group_waits_for_its_min_policy_version(store: SlotStore) -> None:
    (later,) = await store.submit([spec(k=1, kind=EVAL, min_policy_version=2)])
    (now,) = await store.submit([spec(k=1, kind=EVAL, priority=-1)])
    assert [s.lease.group_id for s in await store.claim("w", [], 5, 5)] == [now]
    await store.publish_version(common_pb2.PolicyVersionNotice(version=2, manifest_key="m2"))
    (claimed,) = await store.claim("w", [], 5, 5)
    assert claimed.lease.group_id == later
    await check_counts(store)


async def test_kinds_filter_and_weighted_share() -> None:
    store, _ = await make_store(priority_mode="weighted", eval_share=0.0)
    try:
        (train,) = await store.submit([spec(k=1)])
        (evaluation,) = await store.submit([spec(k=1, kind=EVAL)])
        assert [s.lease.group_id for s in await store.claim("w", [EVAL], 5, 5)] == [evaluation]
        await store.submit([spec(k=1, kind=EVAL)])
        # eval_share 0: training slots are looked at first.
        assert (await store.claim("w", [], 1, 5))[0].lease.group_id == train
    finally:
        await drop_run(store)


async def test_backpressure_caps() -> None:
    store, _ = await make_store(max_ready_groups=1, max_leased_per_version=3)
    try:
        await store.submit([spec(k=2), spec(k=2), spec(k=2)])
        first = await store.claim("w", [], 10, 5)
        assert len(first) == 3  # the per-version lease cap
        await complete_all(store, first[:2])  # one group ready: at the ready cap
        assert await store.claim("w", [TRAIN], 10, 5) == []
        await store.pull("trainer", 1, 1, 0, partial=False)
        assert len(await store.claim("w", [TRAIN], 10, 5)) == 2  # 1 still leased + 2 = cap 3
    finally:
        await drop_run(store)


async def test_groups_per_version_cap_makes_generation_wait_for_the_next_version() -> None:
    store, _ = await make_store(max_groups_per_version=2)
    try:
        groups = await store.submit([spec(k=2) for _ in range(3)])
        first = await store.claim("w", [], 10, 5)
        # Two groups start under version 0; the third waits for version 1.
        assert sorted({s.lease.group_id for s in first}) == sorted(groups[:2])
        assert len(first) == 4
        assert await store.claim("w", [], 10, 5) == []
        # A retried slot of a started group is not held back by the cap.
        await store.fail(first[0].lease.slot_id, first[0].lease.lease_token, "boom", True)
        (retried,) = await store.claim("w", [], 10, 5)
        assert retried.lease.slot_id == first[0].lease.slot_id
        await store.publish_version(common_pb2.PolicyVersionNotice(version=1, manifest_key="m1"))
        third = await store.claim("w", [], 10, 5)
        assert {s.lease.group_id for s in third} == {groups[2]}
        assert {s.start_policy_version for s in third} == {1}
        await check_counts(store)
    finally:
        await drop_run(store)


async def test_pull_is_exactly_once_and_repeatable_until_commit(store: SlotStore) -> None:
    await store.submit([spec(k=1) for _ in range(5)])
    await complete_all(store, await store.claim("w", [], 5, 5))
    assert (await store.pull("trainer", 1, 6, 0, partial=False)).groups == []  # not enough yet
    first = await store.pull("trainer", 1, 3, 0, partial=False)
    again = await store.pull("trainer", 1, 3, 0, partial=False)  # a restarted trainer
    assert [g.group_id for g in again.groups] == [g.group_id for g in first.groups]
    assert again.repeated and not first.repeated
    second = await store.pull("trainer", 2, 3, 0, partial=True)
    assert len(second.groups) == 2
    assert not {g.group_id for g in second.groups} & {g.group_id for g in first.groups}
    assert await store.commit("trainer", 2) == 5
    assert await store.commit("trainer", 2) == 0
    with pytest.raises(FailedPrecondition, match="committed"):
        await store.pull("trainer", 2, 3, 0, partial=True)
    assert (await store.pull("trainer", 3, 3, 0, partial=True)).groups == []
    counts = await check_counts(store)
    assert counts["group:COMMITTED"] == 5


@pytest.mark.parametrize(
    ("policy", "anchor", "expected"),
    [
        ("drop", "start", {"taken": 1, "dropped": 1}),
        ("requeue", "start", {"taken": 1, "requeued": 1}),
        ("downweight", "start", {"taken": 2}),
        ("drop", "submit", {"taken": 0, "dropped": 2}),
    ],
)
async def test_staleness_policies(policy: str, anchor: str, expected: dict[str, int]) -> None:
    store, _ = await make_store(
        max_staleness=1, stale_policy=policy, staleness_anchor=anchor, stale_decay=0.5
    )
    try:
        old, fresh = await store.submit([spec(k=1), spec(k=1)])
        await complete_all(store, await store.claim("w", [], 1, 5))  # `old` starts at v0
        for version in (1, 2):
            await store.publish_version(
                common_pb2.PolicyVersionNotice(version=version, manifest_key=f"m{version}")
            )
        await complete_all(store, await store.claim("w", [], 1, 5))  # `fresh` starts at v2
        result = await store.pull("trainer", 1, 2, current_version=3, partial=True)
        taken = {g.group_id: g for g in result.groups}
        assert len(taken) == expected["taken"]
        assert result.num_dropped == expected.get("dropped", 0)
        assert result.num_requeued == expected.get("requeued", 0)
        if policy == "downweight":
            assert taken[old].weight == pytest.approx(0.5 ** (3 - 1)) and taken[fresh].weight == 1
            assert sorted(result.staleness) == [1, 3]
        if policy == "requeue":
            assert (await store.get_group(old)).state == reconciler_pb2.GROUP_STATE_RUNNING
            (rerun,) = await store.claim("w", [], 1, 5)
            assert rerun.lease.group_id == old and rerun.start_policy_version == 2
        await check_counts(store)
    finally:
        await drop_run(store)


async def test_versions_move_forward_only(store: SlotStore) -> None:
    notice = common_pb2.PolicyVersionNotice(
        version=3, manifest_key="weights/v3/manifest.json", keyframe=True
    )
    assert await store.publish_version(notice) == 3
    assert await store.publish_version(notice) == 3  # retried publish: no-op
    with pytest.raises(FailedPrecondition, match="not newer"):
        await store.publish_version(common_pb2.PolicyVersionNotice(version=2, manifest_key="x"))
    notices, last_id = await store.version_notices(0)
    assert [(n.version, n.keyframe) for n in notices] == [(3, True)]
    assert (await store.version_notices(3, last_id))[0] == []


async def test_one_script_renews_many_leases_and_names_the_lost_ones(store: SlotStore) -> None:
    (gid,) = await store.submit([spec(k=3)])
    held, failed, stolen = await store.claim("w-1", [], 3, 5)
    await store.fail(failed.lease.slot_id, failed.lease.lease_token, "crash", True)
    rejected_before = (await store.counts()).get("rejected:lease_lost", 0)
    before = await store.redis.hget(store.key("slot", held.lease.slot_id), "expires")
    await asyncio.sleep(0.01)
    answer = await store.heartbeat_many(
        [
            (held.lease.slot_id, held.lease.lease_token),
            (failed.lease.slot_id, failed.lease.lease_token),  # back to pending: not ours
            (stolen.lease.slot_id, "someone-else"),
            ("0123456789abcdef/0", "token"),
        ]
    )
    assert answer[0] == (5.0, "")
    assert answer[1][0] == 0 and answer[1][1].startswith(f"LEASE_LOST slot {gid}/")
    assert answer[2][0] == 0 and answer[2][1].startswith("LEASE_LOST")
    assert answer[3] == (0.0, "NOT_FOUND slot 0123456789abcdef/0")
    after = await store.redis.hget(store.key("slot", held.lease.slot_id), "expires")
    assert int(after) > int(before)  # renewed
    assert (await store.counts())["rejected:lease_lost"] == rejected_before + 2
    # The lost ones were not touched: the real holder still completes its slot.
    state, _ = await store.complete(
        stolen.lease.slot_id, stolen.lease.lease_token, rollout(stolen.lease.slot_id)
    )
    assert state == "RUNNING"
    await check_counts(store)


async def test_unknown_ids(store: SlotStore) -> None:
    with pytest.raises(NotFound):
        await store.get_group("0123456789abcdef")
    with pytest.raises(NotFound):
        await store.heartbeat("0123456789abcdef/0", "token")
    assert await store.group_states(["0123456789abcdef"]) == {"0123456789abcdef": ""}


def numbered_task(position: int, seed: int) -> common_pb2.Task | None:
    """A generator for the feeder test: 5 tasks, then the source ends."""
    return task(f"gen-{seed}-{position}") if position < 5 else None


async def test_feeders_top_up_once_per_task(tmp_path: Any) -> None:
    from services.config.reconciler import FeederConfig
    from services.reconciler.feeders import build_feeder, top_up

    store, _ = await make_store()
    try:
        config = FeederConfig(
            kind="generator",
            generator="tests.test_reconciler_store:numbered_task",
            seed=7,
            num_samples=2,
            target_in_flight=3,
        )
        feeder = build_feeder(config)
        assert await top_up(store, feeder, config) == 3
        assert await top_up(store, feeder, config) == 0  # 3 in flight already
        await complete_all(store, await store.claim("w", [], 6, 5))
        await store.pull("trainer", 1, 3, 0, partial=False)
        assert await top_up(store, feeder, config) == 2  # the source has 5 tasks
        assert await top_up(store, feeder, config) == 0
        claimed = await store.claim("w", [], 10, 5)
        assert sorted({c.task.task_id for c in claimed}) == ["gen-7-3", "gen-7-4"]
        cursor = await store.redis.get(store.key("feeder", "default", "cursor"))
        assert int(cursor) == 4
    finally:
        await drop_run(store)

    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"taskId": "x"}\n')
    with pytest.raises(ValueError, match=r"tasks\.jsonl:1"):
        build_feeder(FeederConfig(path=bad))
    store = open_store(ObjectStoreConfig(url=f"file://{tmp_path}/store"))
    good = json_format.MessageToJson(task("ok"), indent=None)
    store.put("tasks/bad.jsonl", f'\n{good}\n{{"nope": 1}}\n'.encode())
    with pytest.raises(ValueError, match=r"object tasks/bad\.jsonl:3"):
        build_feeder(FeederConfig(key="tasks/bad.jsonl"), store)
    with pytest.raises(ValueError, match="no object store"):
        build_feeder(FeederConfig(key="tasks/bad.jsonl"))
    for both_or_neither in ({"path": bad, "key": "tasks/t.jsonl"}, {}):
        with pytest.raises(ValueError, match="exactly one of path"):
            FeederConfig(**both_or_neither)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"reconciler\.feeder\.key"):
        FeederConfig(key="../tasks.jsonl")
    with pytest.raises(ValueError, match="needs generator"):
        FeederConfig(kind="generator")
