"""Whose fault a slot's failed attempts were, as the reconciler keeps them: the contract
between the envs workers that fail slots (``services.envs.faults``) and the trainer that
reports the rate (its step records). Torch- and service-free.

Every failed attempt of a slot is the infrastructure's (the code's faults complete the
slot with their score): its reason is ``infra:<kind>: <detail>`` (an ``InfraKind``), or
the reconciler's own "lease expired" when the worker died or stalled.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable

from services.api.v1 import reconciler_pb2

INFRA_PREFIX = "infra:"
# The reconciler's reason for an attempt whose worker died or stalled (its lease expired).
LEASE_EXPIRED = "lease expired"


class InfraKind(enum.StrEnum):
    """Faults of the infrastructure, never of the code under test."""

    SANDBOX_START = "sandbox_start"  # the sandbox could not be set up, or fork failed
    KILLED_OUTSIDE = "killed_outside"  # a signal from outside the sandbox ended it
    HOST_OVERLOADED = "host_overloaded"  # starved of CPU twice, or not set up in time
    INFERENCE = "inference"  # generation failed (an RPC error from inference)
    OBJECT_STORE = "object_store"  # the rollout record could not be stored
    WORKER = "worker"  # anything else the worker raised (its own bug, not the code's)


def slot_faults(slot: reconciler_pb2.SlotInfo) -> tuple[int, str]:
    """(faulted attempts, kind of the last fault) of a slot of a pulled group.

    Every failed attempt is the infrastructure's, so a completed slot's faults are its
    attempts but one and a dead slot's all of them. Only the last reason is kept: the
    kind is an ``InfraKind`` value, "lease_expired", or "other" (e.g. a record the
    trainer handed back); "" when the slot had no fault.
    """
    num_faults = slot.attempts - (slot.state == reconciler_pb2.SLOT_STATE_COMPLETE)
    if num_faults <= 0:
        return 0, ""
    reason = slot.last_failure
    if reason.startswith(INFRA_PREFIX):
        kind = reason[len(INFRA_PREFIX) :].split(":", 1)[0]
        return num_faults, kind if kind in set(InfraKind) else "other"
    return num_faults, "lease_expired" if reason == LEASE_EXPIRED else "other"


def fault_counts(groups: Iterable[reconciler_pb2.Group]) -> dict[str, object]:
    """The infrastructure faults behind pulled groups, for a step's record: attempts,
    faulted attempts, their rate, and faults by the kind of each slot's last fault."""
    attempts = faults = 0
    by_kind: Counter[str] = Counter()
    for group in groups:
        for slot in group.slots:
            attempts += slot.attempts
            num_faults, kind = slot_faults(slot)
            faults += num_faults
            if num_faults:
                by_kind[kind] += num_faults
    return {
        "rollout_attempts": attempts,
        "infra_faults": faults,
        "infra_fault_rate": faults / attempts if attempts else 0.0,
        "infra_faults_by_kind": dict(sorted(by_kind.items())),
    }
