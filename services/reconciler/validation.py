"""Checks of reconciler requests; each failure names the field (INVALID_ARGUMENT).

Before these run, every request passed the checks the server makes from the
descriptors (``services.wire.requests``): known enum values, finite floats, 64-bit
integers within ±(2^53 - 1). Versions and steps are at most MAX_VERSION, so the Lua
scripts, which hold numbers as doubles, keep them exact.
"""

from __future__ import annotations

import re

from services.api.v1 import common_pb2, reconciler_pb2
from services.messages import require_object_key, validate_object_ref, validate_task
from services.wire.errors import require, require_identifier, require_range, require_text
from services.wire.requests import MAX_EXACT_INT

MAX_GROUP_SIZE = 1024
# Policy versions and trainer steps: 0 .. 2^53 - 1.
MAX_VERSION = MAX_EXACT_INT
MAX_STEP = MAX_EXACT_INT
MAX_TOKEN_BYTES = 256
MAX_REASON_BYTES = 4096
# A rollout summary is kept in Redis as sent; the rollout itself is in the object store.
MAX_SUMMARY_BYTES = 1024 * 1024
_GROUP_ID = re.compile(r"\A[0-9a-f]{16}\Z")
_SLOT_ID = re.compile(r"\A[0-9a-f]{16}/[0-9]{1,4}\Z")
MAX_GROUPS_PER_CALL = 10_000
MAX_SLOTS_PER_CLAIM = 256
MAX_LEASES_PER_HEARTBEAT = 1024
# Pending slots are ordered by -priority * 1e12 + sequence; this keeps scores exact doubles.
MAX_PRIORITY = 1000


def _require_count(count: int, field: str, most: int, *, at_least_one: bool = True) -> None:
    """A repeated field of 1 (or 0) to `most` entries."""
    if at_least_one:
        require(count > 0, field, "must not be empty")
    require(count <= most, field, f"at most {most} per call, got {count}")


def validate_submit_groups(request: reconciler_pb2.SubmitGroupsRequest) -> None:
    """At least one group; each with a valid task, 1..MAX_GROUP_SIZE samples and a kind."""
    _require_count(len(request.groups), "groups", MAX_GROUPS_PER_CALL)
    for index, group in enumerate(request.groups):
        field = f"groups[{index}]"
        validate_task(group.task, f"{field}.task")
        require_range(group.num_samples, f"{field}.num_samples", 1, MAX_GROUP_SIZE)
        require_range(group.priority, f"{field}.priority", -MAX_PRIORITY, MAX_PRIORITY)
        require(
            group.kind in (common_pb2.SLOT_KIND_TRAIN, common_pb2.SLOT_KIND_EVAL),
            f"{field}.kind",
            "must be SLOT_KIND_TRAIN or SLOT_KIND_EVAL",
        )
        require_range(group.min_policy_version, f"{field}.min_policy_version", 0, MAX_VERSION)
        if group.idempotency_key:
            require_identifier(group.idempotency_key, f"{field}.idempotency_key")


def validate_claim_slots(request: reconciler_pb2.ClaimSlotsRequest, max_ttl_s: float) -> None:
    """A worker id, 1..MAX_SLOTS_PER_CLAIM slots, known kinds, a lease TTL within bounds."""
    require_identifier(request.worker_id, "worker_id")
    require_range(request.max_slots, "max_slots", 1, MAX_SLOTS_PER_CLAIM)
    require_range(request.lease_ttl_s, "lease_ttl_s", 0, max_ttl_s)
    for index, kind in enumerate(request.kinds):
        require(
            kind in (common_pb2.SLOT_KIND_TRAIN, common_pb2.SLOT_KIND_EVAL),
            f"kinds[{index}]",
            "must be SLOT_KIND_TRAIN or SLOT_KIND_EVAL",
        )


def validate_group_id(group_id: str, field: str) -> None:
    """16 lower-case hex digits, as the reconciler makes them."""
    require(
        _GROUP_ID.match(group_id) is not None,
        field,
        f"{group_id[:80]!r} is not a group id (16 lower-case hex digits)",
    )


def validate_lease(slot_id: str, lease_token: str, prefix: str = "") -> None:
    """A slot id ("<group id>/<index>") and the lease token that proves the caller holds it
    (the fields named under `prefix`, e.g. "leases[3].")."""
    require(
        _SLOT_ID.match(slot_id) is not None,
        f"{prefix}slot_id",
        f"{slot_id[:80]!r} is not a slot id ('<16 hex digits>/<index>')",
    )
    require(bool(lease_token), f"{prefix}lease_token", "must not be empty")
    require_text(lease_token, f"{prefix}lease_token", MAX_TOKEN_BYTES)


def validate_heartbeat_slots(request: reconciler_pb2.HeartbeatSlotsRequest) -> None:
    """1..MAX_LEASES_PER_HEARTBEAT well-formed leases, each slot once."""
    _require_count(len(request.leases), "leases", MAX_LEASES_PER_HEARTBEAT)
    seen: set[str] = set()
    for index, lease in enumerate(request.leases):
        validate_lease(lease.slot_id, lease.lease_token, f"leases[{index}].")
        require(
            lease.slot_id not in seen,
            f"leases[{index}].slot_id",
            f"{lease.slot_id!r} appears twice",
        )
        seen.add(lease.slot_id)


def validate_complete_slot(request: reconciler_pb2.CompleteSlotRequest) -> None:
    """A lease and a rollout summary that points at its stored record."""
    validate_lease(request.slot_id, request.lease_token)
    require(request.HasField("rollout"), "rollout", "must be set")
    size = request.rollout.ByteSize()
    require(size <= MAX_SUMMARY_BYTES, "rollout", f"at most {MAX_SUMMARY_BYTES} bytes, got {size}")
    require_identifier(request.rollout.rollout_id, "rollout.rollout_id")
    validate_object_ref(request.rollout.record, "rollout.record")


def validate_fail_slot(request: reconciler_pb2.FailSlotRequest) -> None:
    """A lease and a reason."""
    validate_lease(request.slot_id, request.lease_token)
    require(bool(request.reason), "reason", "must not be empty")
    require_text(request.reason, "reason", MAX_REASON_BYTES)


def validate_return_groups(request: reconciler_pb2.ReturnGroupsRequest) -> None:
    """A consumer id, a step, 1..MAX_GROUPS_PER_CALL slots (each once) with a reason."""
    require_identifier(request.consumer_id, "consumer_id")
    require_range(request.step, "step", 0, MAX_STEP)
    _require_count(len(request.slots), "slots", MAX_GROUPS_PER_CALL)
    seen: set[str] = set()
    for index, slot in enumerate(request.slots):
        field = f"slots[{index}]"
        require(
            _SLOT_ID.match(slot.slot_id) is not None,
            f"{field}.slot_id",
            f"{slot.slot_id[:80]!r} is not a slot id ('<16 hex digits>/<index>')",
        )
        require(slot.slot_id not in seen, f"{field}.slot_id", f"{slot.slot_id!r} appears twice")
        seen.add(slot.slot_id)
        require(bool(slot.reason), f"{field}.reason", "must not be empty")
        require_text(slot.reason, f"{field}.reason", MAX_REASON_BYTES)


def validate_pull_batch(request: reconciler_pb2.PullBatchRequest) -> None:
    """A consumer id, 1..MAX_GROUPS_PER_CALL groups, a wait of at most an hour."""
    require_identifier(request.consumer_id, "consumer_id")
    require_range(request.num_groups, "num_groups", 1, MAX_GROUPS_PER_CALL)
    require_range(request.step, "step", 0, MAX_STEP)
    require_range(request.current_policy_version, "current_policy_version", 0, MAX_VERSION)
    require_range(request.wait_s, "wait_s", 0, 3600)


def validate_watch_groups(request: reconciler_pb2.WatchGroupsRequest) -> None:
    """1..MAX_GROUPS_PER_CALL group ids."""
    _require_count(len(request.group_ids), "group_ids", MAX_GROUPS_PER_CALL)
    for index, group_id in enumerate(request.group_ids):
        validate_group_id(group_id, f"group_ids[{index}]")


def validate_publish(request: reconciler_pb2.PublishPolicyVersionRequest) -> None:
    """A notice with a version in 1..MAX_VERSION and its manifest key."""
    require(request.HasField("notice"), "notice", "must be set")
    require_range(request.notice.version, "notice.version", 1, MAX_VERSION)
    require_object_key(request.notice.manifest_key, "notice.manifest_key")


def validate_watch_policy_versions(request: reconciler_pb2.WatchPolicyVersionsRequest) -> None:
    """A version to start after, in 0..MAX_VERSION."""
    require_range(request.after_version, "after_version", 0, MAX_VERSION)


def validate_commit_batch(request: reconciler_pb2.CommitBatchRequest) -> None:
    """A consumer id and well-formed group ids."""
    require_identifier(request.consumer_id, "consumer_id")
    require_range(request.step, "step", 0, MAX_STEP)
    _require_count(len(request.group_ids), "group_ids", MAX_GROUPS_PER_CALL, at_least_one=False)
    for index, group_id in enumerate(request.group_ids):
        validate_group_id(group_id, f"group_ids[{index}]")
