"""What rank 0 tells every rank before a step, and how a step's sequences become each
rank's microbatches.

Rank 0 alone talks to the reconciler (one pull per step, one commit) and reads the
training data; it turns what it got into a ``StepMessage`` per rank: the checkpoints
requested since the last step (every rank saves them together), whether to stop, and,
when there is something to train, the rank's part of the step's sequences with the
statistics of the whole step. Messages go out through ``TrainerRuntime.scatter`` (in one
process: the one message is handed over).

Rank 0 holds the step's sequences (``TrainItem``: tokens, advantage, group weight) and
``plan`` gives every rank its part: per microbatch, the sequences it trains on. Each rank
then packs its part (``microbatches``). In one process the sequences are packed in the
order they came (a group's rollouts side by side, so that shared prefixes are found);
the distributed planner (``services.trainer.distributed.batching``) balances them over
the data-parallel replicas by cost and cuts them for context parallelism.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.trainer.batch import (
    Microbatch,
    RLItems,
    TrainItem,
    pack_microbatch,
    split_in_order,
)
from services.trainer.model.architecture import Architecture

RankPart = list[list[TrainItem]]
"""One rank's sequences, per microbatch."""


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


class StepPlanner(abc.ABC):
    """Cuts a step's sequences into each rank's microbatches."""

    @abc.abstractmethod
    def plan(self, items: Sequence[TrainItem], token_budget: int) -> list[RankPart]:
        """Rank 0: the part of ``items`` of every rank, in rank order."""

    @abc.abstractmethod
    def microbatches(self, part: RankPart) -> list[Microbatch]:
        """This rank's microbatches of its ``part``."""


class InOrderPlanner(StepPlanner):
    """One process: sequences in order, microbatches of at most the token budget."""

    def __init__(self, arch: Architecture, *, share_prefixes: bool) -> None:
        self.arch = arch
        self.share_prefixes = share_prefixes

    def plan(self, items: Sequence[TrainItem], token_budget: int) -> list[RankPart]:
        """The single rank's part: ``items`` cut in order (``batch.split_in_order``)."""
        return [split_in_order(items, token_budget)]

    def microbatches(self, part: RankPart) -> list[Microbatch]:
        """Each run of sequences packed as it is."""
        return [
            pack_microbatch(
                items, self.arch.num_layers, self.arch.top_k, share_prefixes=self.share_prefixes
            )
            for items in part
        ]
