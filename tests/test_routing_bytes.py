"""What the run summary reads from the stored rollout records (services.launcher.summary):
routed-expert bytes per rollout, and the trained rollouts that summarized."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from services import routed_experts
from services.api.v1 import common_pb2
from services.launcher.observe import Snapshot
from services.launcher.summary import RunSummary, print_summary, record_figures, summarize
from services.objectstore.local import FileObjectStore


def _record(
    num_tokens: int, group: str = "g1", summaries: int = 0, task_reward: float = 0.0
) -> bytes:
    table = np.zeros((num_tokens - 1, 2, 2), dtype=np.int64)  # uint8 on the wire: 4 B a row
    segment = common_pb2.Segment(
        token_ids=list(range(num_tokens)),
        num_prompt_tokens=1,
        routed_experts=routed_experts.encode(table),
    )
    summary = common_pb2.RolloutSummary(
        group_id=group,
        stats=common_pb2.RolloutStats(num_summaries=summaries),
        reward=common_pb2.RewardParts(task=task_reward),
    )
    return common_pb2.RolloutRecord(summary=summary, segments=[segment]).SerializeToString()


def test_summary_reports_mean_routing_bytes_per_rollout(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "store")
    store.put("rollouts/r/g1/0-a0.pb", _record(11))  # 10 rows
    store.put("rollouts/r/g1/1-a0.pb", _record(31))  # 30 rows
    store.put("rollouts/other/g1/0-a0.pb", _record(101))  # another run's: not counted
    figures = record_figures(store, "r", set())
    per_rollout = figures.routing_bytes_per_rollout
    assert per_rollout == (10 + 30) * 4 / 2
    assert figures.routing_bytes_per_token == (10 + 30) * 4 / (11 + 31)
    summary = summarize("r", Snapshot(taken_at=0.0, steps=[], evals={}), store)
    assert summary.routing_bytes_per_rollout == per_rollout
    nothing = record_figures(store, "nothing", set())
    assert (nothing.routing_bytes_per_rollout, nothing.routing_bytes_per_token) == (None, None)


def test_summary_compares_trained_rollouts_with_and_without_a_summary(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    store = FileObjectStore(tmp_path / "store")
    store.put("rollouts/r/g1/0-a0.pb", _record(5, "g1", summaries=1, task_reward=1.0))
    store.put("rollouts/r/g1/1-a0.pb", _record(5, "g1", summaries=2, task_reward=0.5))
    store.put("rollouts/r/g1/2-a0.pb", _record(5, "g1", task_reward=0.25))
    store.put("rollouts/r/g2/0-a0.pb", _record(5, "g2", task_reward=0.0))
    store.put("rollouts/r/eval/0-a0.pb", _record(5, "eval", summaries=1))  # never trained
    steps = [{"step": 1, "group_ids": ["g1"]}, {"step": 2, "group_ids": ["g2"]}]
    summary = summarize("r", Snapshot(taken_at=0.0, steps=steps, evals={}), store)
    assert (summary.rollouts_summarized, summary.rollouts_with_records) == (2, 4)
    assert summary.task_reward_summarized == 0.75
    assert summary.task_reward_unsummarized == 0.125
    out = io.StringIO()
    print_summary(Console(file=out, width=200), summary, None)
    expected = "2 of 4 trained (50%); task reward 0.750 with a summary, 0.125 without"
    assert expected in out.getvalue()
    assert '"rollouts_summarized": 2' in summary.to_json()
    assert isinstance(summary, RunSummary)
