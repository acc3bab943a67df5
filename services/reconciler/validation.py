"""Checks of reconciler requests; each failure names the field (INVALID_ARGUMENT)."""

from __future__ import annotations

from services.api.v1 import common_pb2, reconciler_pb2
from services.messages import validate_object_ref, validate_task
from services.wire.errors import require, require_identifier, require_range

MAX_GROUP_SIZE = 1024
MAX_GROUPS_PER_CALL = 10_000
MAX_SLOTS_PER_CLAIM = 256


def validate_submit_groups(request: reconciler_pb2.SubmitGroupsRequest) -> None:
    """At least one group; each with a valid task, 1..MAX_GROUP_SIZE samples and a kind."""
    require(len(request.groups) > 0, "groups", "must not be empty")
    require(
        len(request.groups) <= MAX_GROUPS_PER_CALL,
        "groups",
        f"at most {MAX_GROUPS_PER_CALL} per call, got {len(request.groups)}",
    )
    for index, group in enumerate(request.groups):
        field = f"groups[{index}]"
        validate_task(group.task, f"{field}.task")
        require_range(group.num_samples, f"{field}.num_samples", 1, MAX_GROUP_SIZE)
        require(
            group.kind != common_pb2.SLOT_KIND_UNSPECIFIED,
            f"{field}.kind",
            "must be SLOT_KIND_TRAIN or SLOT_KIND_EVAL",
        )
        if group.idempotency_key:
            require_identifier(group.idempotency_key, f"{field}.idempotency_key")


def validate_claim_slots(request: reconciler_pb2.ClaimSlotsRequest) -> None:
    """A worker id and 1..MAX_SLOTS_PER_CLAIM slots."""
    require_identifier(request.worker_id, "worker_id")
    require_range(request.max_slots, "max_slots", 1, MAX_SLOTS_PER_CLAIM)
    require(request.lease_ttl_s >= 0, "lease_ttl_s", f"must be >= 0, got {request.lease_ttl_s}")


def validate_lease(slot_id: str, lease_token: str) -> None:
    """A slot id and the lease token that proves the caller holds it."""
    require_identifier(slot_id, "slot_id")
    require(bool(lease_token), "lease_token", "must not be empty")


def validate_complete_slot(request: reconciler_pb2.CompleteSlotRequest) -> None:
    """A lease and a rollout summary that points at its stored record."""
    validate_lease(request.slot_id, request.lease_token)
    require(request.HasField("rollout"), "rollout", "must be set")
    validate_object_ref(request.rollout.record, "rollout.record")


def validate_fail_slot(request: reconciler_pb2.FailSlotRequest) -> None:
    """A lease and a reason."""
    validate_lease(request.slot_id, request.lease_token)
    require(bool(request.reason), "reason", "must not be empty")


def validate_pull_batch(request: reconciler_pb2.PullBatchRequest) -> None:
    """A consumer id, at least one group, a non-negative wait."""
    require_identifier(request.consumer_id, "consumer_id")
    require(request.num_groups >= 1, "num_groups", "must be >= 1")
    require_range(request.wait_s, "wait_s", 0, 3600)


def validate_publish(request: reconciler_pb2.PublishPolicyVersionRequest) -> None:
    """A notice with a version >= 1 and its manifest key."""
    require(request.HasField("notice"), "notice", "must be set")
    require(request.notice.version >= 1, "notice.version", "must be >= 1")
    require(bool(request.notice.manifest_key), "notice.manifest_key", "must not be empty")
