"""The run summary's routed-expert bytes per rollout (services.launcher.summary)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from services import routed_experts
from services.api.v1 import common_pb2
from services.launcher.observe import Snapshot
from services.launcher.summary import routing_bytes, summarize
from services.objectstore.local import FileObjectStore


def _record(num_tokens: int) -> bytes:
    table = np.zeros((num_tokens - 1, 2, 2), dtype=np.int64)  # uint8 on the wire: 4 B a row
    segment = common_pb2.Segment(
        token_ids=list(range(num_tokens)),
        num_prompt_tokens=1,
        routed_experts=routed_experts.encode(table),
    )
    return common_pb2.RolloutRecord(segments=[segment]).SerializeToString()


def test_summary_reports_mean_routing_bytes_per_rollout(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "store")
    store.put("rollouts/r/g1/0-a0.pb", _record(11))  # 10 rows
    store.put("rollouts/r/g1/1-a0.pb", _record(31))  # 30 rows
    store.put("rollouts/other/g1/0-a0.pb", _record(101))  # another run's: not counted
    per_rollout, per_token = routing_bytes(store, "r")
    assert per_rollout == (10 + 30) * 4 / 2
    assert per_token == (10 + 30) * 4 / (11 + 31)
    summary = summarize("r", Snapshot(taken_at=0.0, steps=[], evals={}), store)
    assert summary.routing_bytes_per_rollout == per_rollout
    assert routing_bytes(store, "nothing") == (None, None)
