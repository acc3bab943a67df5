"""What rank 0 tells the other ranks before each step of a distributed job.

Rank 0 alone talks to the reconciler (one pull per step, one commit) and reads the
training data; it turns what it got into a ``StepMessage`` per rank: the checkpoints
requested since the last step (every rank saves them together), whether to stop, and,
when there is something to train, the rank's data-parallel replica's sequences per
microbatch (``batching.assign``: global, cost-balanced packing) with the statistics of
the whole step. Messages are scattered over a gloo group (``Runtime.scatter``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from services.trainer.batch import RLItems, TrainItem
from services.trainer.distributed.batching import RankPart, assign
from services.trainer.distributed.packing import CostModel
from services.trainer.distributed.runtime import Runtime


@dataclass
class StepMessage:
    """One rank's instructions for the next step."""

    checkpoint_tags: list[str] = field(default_factory=list)
    stop: bool = False
    part: RankPart | None = None  # None: nothing to train this time
    stats: RLItems | None = None  # RL: the step's statistics (``items`` left empty)
    group_ids: list[str] = field(default_factory=list)
    num_stale_dropped: int = 0
    waited_s: float = 0.0
    cursor: int = 0
    provenance: dict[str, Any] = field(default_factory=dict)  # RL: ``version_provenance``


def scatter_plan(
    base: StepMessage,
    items: list[TrainItem],
    runtime: Runtime,
    cost_model: CostModel,
    token_budget: int,
) -> list[StepMessage]:
    """``base`` for every rank, each with its replica's part of ``items``."""
    parts = assign(items, runtime.layout, cost_model, token_budget)
    return [
        replace(base, part=parts[runtime.layout.dp_index(rank)])
        for rank in range(runtime.world_size)
    ]


def stats_only(collected: RLItems) -> RLItems:
    """``collected`` without its sequences (they travel in the parts)."""
    return replace(collected, items=[])
