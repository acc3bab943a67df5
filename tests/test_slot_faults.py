"""Infrastructure faults reach the step record and the run summary: counted from the
pulled groups' slots as the reconciler keeps them (attempts, last failure), never as
rewards."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from services.api.v1 import reconciler_pb2
from services.launcher.observe import Snapshot
from services.launcher.summary import print_summary, summarize
from services.objectstore.local import FileObjectStore
from services.slot_faults import INFRA_PREFIX, LEASE_EXPIRED, InfraKind, fault_counts, slot_faults

COMPLETE = reconciler_pb2.SLOT_STATE_COMPLETE
DEAD = reconciler_pb2.SLOT_STATE_DEAD


def slot(attempts: int, state: int = COMPLETE, last_failure: str = "") -> reconciler_pb2.SlotInfo:
    return reconciler_pb2.SlotInfo(attempts=attempts, state=state, last_failure=last_failure)  # type: ignore[arg-type]


def test_each_failed_attempt_is_counted_once_by_its_slots_last_kind() -> None:
    killed = f"{INFRA_PREFIX}{InfraKind.KILLED_OUTSIDE}: bwrap ended by SIGKILL"
    assert slot_faults(slot(1)) == (0, "")  # completed at the first attempt
    assert slot_faults(slot(3, last_failure=killed)) == (2, "killed_outside")
    assert slot_faults(slot(2, DEAD, LEASE_EXPIRED)) == (2, "lease_expired")
    assert slot_faults(slot(2, last_failure=f"{INFRA_PREFIX}nonsense: x")) == (1, "other")
    groups = [
        reconciler_pb2.Group(slots=[slot(1), slot(3, last_failure=killed)]),
        reconciler_pb2.Group(slots=[slot(2, last_failure=LEASE_EXPIRED), slot(1)]),
    ]
    assert fault_counts(groups) == {
        "rollout_attempts": 7,
        "infra_faults": 3,
        "infra_fault_rate": 3 / 7,
        "infra_faults_by_kind": {"killed_outside": 2, "lease_expired": 1},
    }
    assert fault_counts([])["infra_fault_rate"] == 0.0


def test_the_summary_states_the_runs_fault_rate_and_its_worst_step(tmp_path: Path) -> None:
    steps = [
        {"step": 1, "version": 1, "group_ids": ["a"], "rollout_attempts": 4, "infra_faults": 0,
         "infra_fault_rate": 0.0, "infra_faults_by_kind": {}},
        {"step": 2, "version": 2, "group_ids": ["b"], "rollout_attempts": 6, "infra_faults": 2,
         "infra_fault_rate": 2 / 6, "infra_faults_by_kind": {"host_overloaded": 2}},
        {"step": 3, "version": 3, "group_ids": ["c"]},  # a record from before faults were kept
    ]  # fmt: skip
    summary = summarize(
        "r", Snapshot(taken_at=0.0, steps=steps, evals={}), FileObjectStore(tmp_path)
    )
    assert (summary.rollout_attempts, summary.infra_faults) == (10, 2)
    assert summary.infra_fault_rate == 0.2 and summary.max_step_infra_fault_rate == 2 / 6
    assert summary.infra_faults_by_kind == {"host_overloaded": 2}
    assert json.loads(summary.to_json())["infra_fault_rate"] == 0.2
    out = io.StringIO()
    print_summary(Console(file=out, width=200), summary, None)
    assert "2 of 10 attempts (20.0%, worst step 33.3%)  host_overloaded: 2" in out.getvalue()

    none = summarize(
        "r", Snapshot(taken_at=0.0, steps=steps[2:], evals={}), FileObjectStore(tmp_path)
    )
    assert none.infra_fault_rate is None and none.rollout_attempts == 0
