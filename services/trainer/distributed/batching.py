"""From a step's sequences to each rank's microbatches.

Rank 0 holds the step's sequences (``TrainItem``: tokens, advantage, group weight).
``assign`` pads each to a multiple of ``2 * cp`` when context parallelism is on (untrained
tokens at the end of the sequence, which no real token attends to), balances them over
the dp ranks and cuts each rank's part into the same number of microbatches
(``packing.plan_step``). Every rank then turns its dp replica's part into microbatches
(``local_microbatches``), keeping its own chunks of each sequence under context
parallelism. A microbatch a rank has nothing for runs one padding sequence of ``2 * cp``
untrained tokens, so every rank takes part in every collective of the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.trainer.batch import Microbatch, TrainItem, pack_microbatch
from services.trainer.distributed.context_parallel import shard_microbatch
from services.trainer.distributed.layout import ParallelLayout
from services.trainer.distributed.packing import CostModel, plan_step
from services.trainer.model.architecture import Architecture
from services.trainer.planning import RankPart, StepPlanner
from services.trainer.rollouts import SegmentTokens


def padded_length(length: int, cp: int) -> int:
    """``length`` rounded up to a multiple of ``2 * cp``."""
    multiple = 2 * cp
    return -(-length // multiple) * multiple


def pad_item(item: TrainItem, cp: int) -> tuple[TrainItem, int]:
    """``item`` with untrained tokens appended up to a multiple of ``2 * cp``; how many."""
    segment, advantage, weight = item
    length = len(segment.input_ids)
    extra = padded_length(length, cp) - length
    if extra == 0:
        return item, 0
    replay = segment.replay
    if replay is not None:  # -1: no recorded routing, the router decides (never trained)
        replay = torch.cat([replay, replay.new_full((extra, *replay.shape[1:]), -1)])
    versions = segment.generating_versions
    padded = SegmentTokens(
        input_ids=[*segment.input_ids, *[0] * extra],
        targets=[*segment.targets, *[0] * extra],
        trained=[*segment.trained, *[False] * extra],
        behaviour_logprobs=[*segment.behaviour_logprobs, *[0.0] * extra],
        replay=replay,
        generating_versions=None if versions is None else [*versions, *[-1] * extra],
    )
    return (padded, advantage, weight), extra


def idle_item(cp: int) -> TrainItem:
    """A sequence of ``2 * cp`` untrained tokens, for a microbatch a rank has no data for."""
    length = 2 * cp
    segment = SegmentTokens(
        input_ids=[0] * length,
        targets=[0] * length,
        trained=[False] * length,
        behaviour_logprobs=[0.0] * length,
        replay=None,
    )
    return segment, 0.0, 0.0


def assign(
    items: Sequence[TrainItem], layout: ParallelLayout, cost_model: CostModel, token_budget: int
) -> list[RankPart]:
    """``parts[dp_index][microbatch]``: the (unpadded) sequences of each dp replica."""
    lengths = [padded_length(len(segment.input_ids), layout.cp) for segment, _, _ in items]
    plan = plan_step(lengths, layout.dp, token_budget, cost_model)
    return [[[items[i] for i in members] for members in bins] for bins in plan]


def local_microbatches(
    part: RankPart,
    layout: ParallelLayout,
    cp_index: int,
    *,
    num_layers: int,
    top_k: int,
    share_prefixes: bool = False,
) -> list[Microbatch]:
    """This rank's microbatches of its replica's ``part`` (its chunks of each sequence).

    ``share_prefixes`` packs each microbatch as a prefix tree; it needs every sequence
    whole on the rank (``cp = 1``: ``context_parallel.shard_inputs`` refuses a tree).
    """
    microbatches = []
    for items in part:
        padded: list[TrainItem] = []
        flags: list[list[bool]] = []
        for item in items or [idle_item(layout.cp)]:
            padded_item, extra = pad_item(item, layout.cp)
            real = len(padded_item[0].input_ids) - extra if items else 0
            padded.append(padded_item)
            flags.append([False] * real + [True] * (len(padded_item[0].input_ids) - real))
        microbatch = pack_microbatch(
            padded, num_layers, top_k, share_prefixes=share_prefixes, padding=flags
        )
        microbatches.append(shard_microbatch(microbatch, cp_index, layout.cp))
    return microbatches


class BalancedPlanner(StepPlanner):
    """``assign`` on rank 0 (every rank of a dp replica gets the replica's part), then
    ``local_microbatches`` on each rank."""

    def __init__(
        self,
        layout: ParallelLayout,
        cp_index: int,
        cost_model: CostModel,
        arch: Architecture,
        *,
        share_prefixes: bool,
    ) -> None:
        self.layout, self.cp_index, self.cost_model = layout, cp_index, cost_model
        self.arch, self.share_prefixes = arch, share_prefixes

    def plan(self, items: Sequence[TrainItem], token_budget: int) -> list[RankPart]:
        """Each rank's replica's part of ``items``, in rank order."""
        parts = assign(items, self.layout, self.cost_model, token_budget)
        return [parts[self.layout.dp_index(rank)] for rank in range(self.layout.world_size)]

    def microbatches(self, part: RankPart) -> list[Microbatch]:
        """This rank's chunks of its replica's sequences (``local_microbatches``)."""
        return local_microbatches(
            part,
            self.layout,
            self.cp_index,
            num_layers=self.arch.num_layers,
            top_k=self.arch.top_k,
            share_prefixes=self.share_prefixes,
        )
