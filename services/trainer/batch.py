"""Group-relative advantages and the packed RL batch.

Dr. GRPO: a rollout's advantage is its reward minus the mean reward of its group, with
no division by the group's standard deviation; every trained token of every segment of
the rollout (self-summaries included) gets it. A group with fewer than two completed
rollouts has no baseline (K = 1 gives a zero advantage): it is skipped and counted.
Optionally (``rl.skip_uniform_task_groups``) so is a group whose rollouts all earned the
same task reward, all solved or all failed: its advantages are only the small
differences of the length and behaviour parts, and its tokens would cost a forward and
backward for next to no signal (DAPO's dynamic sampling, without resampling). Such a
group is still consumed by the step, and its rewards still count in the step's reward
metrics, which describe what the policy sampled, not what was trained.

A group with a rollout whose record failed to load or to pass its checks is not trained
either: it is handed back to the reconciler (``returned_slots``), which runs that slot
again (the store did not serve the record) or marks it dead with the reason (the record
is bad), and hands the group out again once it settles, or drops it when too few of its
slots completed (``reconciler.min_complete_samples``). The step trains the other groups.

Sequences (one per segment) are packed into a flat token stream and cut into
microbatches of at most ``microbatch_tokens`` tokens (a sequence is never split); the
loss is normalized by one constant for the whole step, so accumulating microbatch
gradients gives exactly the gradient of the full batch. With ``share_prefixes`` a
microbatch is packed as a prefix tree: the prompt its rollouts begin with (the system
prompt, a group's task) is computed once (``services.trainer.model.prefix_tree``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.api.v1 import common_pb2, reconciler_pb2
from services.objectstore.base import ObjectStore
from services.trainer.model.architecture import Architecture
from services.trainer.model.transformer import PackedInputs
from services.trainer.rollouts import (
    Rollout,
    RolloutError,
    SegmentTokens,
    fetch_record,
    parse_record,
)

log = logging.getLogger(__name__)


def dr_grpo_advantages(rewards: Sequence[float]) -> list[float]:
    """``r_i - mean(r)``: no std division (Dr. GRPO)."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    return [reward - mean for reward in rewards]


@dataclass
class PulledGroup:
    """One group as pulled: its reconciler record and each completed rollout, parsed or not
    (none for a group left out on its summaries alone, see ``load_groups``)."""

    group_id: str
    weight: float
    summaries: list[common_pb2.RolloutSummary]
    rollouts: list[Rollout | RolloutError]


@dataclass
class Microbatch:
    """Packed sequences and per-token training data, ``[T]`` each."""

    inputs: PackedInputs
    targets: torch.Tensor
    trained: torch.Tensor  # bool
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    # [T] int64: the policy version that generated each target (-1: not generated, or
    # not known); the step's version lag of a trained token (``services.trainer.offpolicy``).
    generating_versions: torch.Tensor
    # [T] bool: tokens added only to align sequences for context parallelism or to give
    # an idle rank something to run (never trained); None when there are none.
    padding: torch.Tensor | None = None
    # Tokens of the packed sequences before their shared prefixes were merged (padding
    # left out); None when the stream holds every sequence whole (it equals num_tokens).
    num_sequence_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens of the data in the stream (padding left out): what the forward computes."""
        total = int(self.targets.shape[0])
        return total if self.padding is None else total - int(self.padding.sum())

    @property
    def num_data_tokens(self) -> int:
        """Tokens of the sequences, each counted whole (shared prefixes once per sequence)."""
        return self.num_tokens if self.num_sequence_tokens is None else self.num_sequence_tokens

    def to(self, device: torch.device) -> Microbatch:
        """This microbatch on ``device`` (itself when it is there already)."""
        if self.targets.device == device:
            return self
        inputs = self.inputs

        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device)

        return Microbatch(
            inputs=PackedInputs(
                inputs.input_ids.to(device),
                inputs.position_ids.to(device),
                inputs.cu_seqlens,
                move(inputs.replay_experts),
                move(inputs.replay_mask),
                inputs.ancestors,
            ),
            targets=self.targets.to(device),
            trained=self.trained.to(device),
            behaviour_logprobs=self.behaviour_logprobs.to(device),
            advantages=self.advantages.to(device),
            weights=self.weights.to(device),
            generating_versions=self.generating_versions.to(device),
            padding=move(self.padding),
            num_sequence_tokens=self.num_sequence_tokens,
        )


@dataclass
class RLBatch:
    """What one RL step trains on, and what was left out and why."""

    microbatches: list[Microbatch]
    num_rollouts: int
    rewards: list[common_pb2.RewardParts]
    advantages: list[float]
    group_weights: list[float]
    skipped: Counter[str] = field(default_factory=Counter)
    # Groups whose rollouts all earned the same task reward, skipped or not.
    uniform_task_groups: int = 0
    # The policy version the step trains from (its weights before the update): the
    # version lags of its tokens are counted from it.
    policy_version: int = 0

    @property
    def num_trained_tokens(self) -> int:
        """Tokens whose loss is taken."""
        return sum(int(mb.trained.sum()) for mb in self.microbatches)


def load_groups(
    store: ObjectStore,
    groups: Sequence[reconciler_pb2.Group],
    arch: Architecture,
    replay_mode: str,
    *,
    skip_uniform_task_groups: bool = False,
) -> list[PulledGroup]:
    """Each pulled group with its rollout records fetched and checked (or the reason not).

    A group the step will leave out whatever its records hold (one rollout, or one task
    reward for all when such groups are skipped) is decided from its summaries alone:
    its records are not fetched, and it comes back with no rollouts.
    """
    pulled = []
    for group in groups:
        summaries = sorted(group.rollouts, key=lambda s: s.sample_index)
        rollouts: list[Rollout | RolloutError] = []
        trained = left_out(summaries, skip_uniform_task_groups=skip_uniform_task_groups) is None
        for summary in summaries if trained else []:
            try:
                record = fetch_record(store, summary.record)
                rollouts.append(
                    parse_record(record, summary.reward.total, arch, replay_mode=replay_mode)
                )
            except RolloutError as error:
                log.warning("rollout %s handed back: %s", summary.rollout_id, error)
                rollouts.append(error)
        # Weight 0 means a reconciler that does not set it: full weight.
        pulled.append(PulledGroup(group.group_id, group.weight or 1.0, summaries, rollouts))
    return pulled


def returned_slots(groups: Sequence[PulledGroup]) -> list[reconciler_pb2.ReturnedSlot]:
    """The slots to hand back to the reconciler: each rollout whose record failed to load
    or check, with its reason, retryable when the store did not serve it. Their groups
    are left out of the step (``collect_rl_items``)."""
    slots = []
    for group in groups:
        for summary, rollout in zip(group.summaries, group.rollouts, strict=False):
            if isinstance(rollout, RolloutError):
                slots.append(
                    reconciler_pb2.ReturnedSlot(
                        slot_id=f"{group.group_id}/{summary.sample_index}",
                        reason=f"trainer: {rollout.reason}",
                        retryable=rollout.retryable,
                    )
                )
    return slots


TrainItem = tuple[SegmentTokens, float, float]
"""One packed sequence to train on: its tokens, its rollout's advantage, its group's weight."""


def pack_microbatch(
    items: Sequence[TrainItem],
    num_layers: int,
    top_k: int,
    *,
    share_prefixes: bool = False,
    padding: Sequence[Sequence[bool]] | None = None,
) -> Microbatch:
    """Packs ``items`` (in order) into one microbatch.

    With ``share_prefixes`` the sequences are packed as a prefix tree
    (``services.trainer.model.prefix_tree``): the system prompt and a group's task are
    computed once for every rollout that starts with them. ``padding[i]`` flags the
    tokens of item ``i`` that are padding (``Microbatch.padding``).
    """
    segments = [segment for segment, _, _ in items]
    replay = [s.replay for s in segments]
    if share_prefixes:
        inputs, source = PackedInputs.pack_shared(
            [s.input_ids for s in segments],
            [s.trained for s in segments],
            replay,
            num_layers=num_layers,
            top_k=top_k,
        )
    else:
        inputs = PackedInputs.pack(
            [s.input_ids for s in segments], replay, num_layers=num_layers, top_k=top_k
        )
        source = None

    def stream(values: torch.Tensor) -> torch.Tensor:
        """Per-token ``values`` of the concatenated sequences, in stream order."""
        return values if source is None else values[source]

    def per_token(values: list[float]) -> torch.Tensor:
        """One value per sequence, repeated over its tokens."""
        counts = torch.tensor([len(s.targets) for s in segments])
        return stream(torch.tensor(values, dtype=torch.float32).repeat_interleave(counts))

    versions = [
        version for s in segments for version in (s.generating_versions or [-1] * len(s.targets))
    ]
    flags = None
    if padding is not None:
        flags = torch.tensor([flag for item in padding for flag in item], dtype=torch.bool)
    num_sequence_tokens = None
    if source is not None:
        num_padding = 0 if flags is None else int(flags.sum())
        num_sequence_tokens = sum(len(s.targets) for s in segments) - num_padding
    return Microbatch(
        inputs=inputs,
        targets=stream(torch.tensor([t for s in segments for t in s.targets], dtype=torch.long)),
        trained=stream(torch.tensor([t for s in segments for t in s.trained], dtype=torch.bool)),
        behaviour_logprobs=stream(
            torch.tensor([lp for s in segments for lp in s.behaviour_logprobs], dtype=torch.float32)
        ),
        advantages=per_token([advantage for _, advantage, _ in items]),
        weights=per_token([weight for _, _, weight in items]),
        generating_versions=stream(torch.tensor(versions, dtype=torch.long)),
        padding=None if flags is None else stream(flags),
        num_sequence_tokens=num_sequence_tokens,
    )


@dataclass
class RLItems:
    """The sequences of one RL step before packing, and the step's batch statistics."""

    items: list[TrainItem]
    num_rollouts: int
    rewards: list[common_pb2.RewardParts]
    advantages: list[float]
    group_weights: list[float]
    skipped: Counter[str] = field(default_factory=Counter)
    # Groups whose rollouts all earned the same task reward, skipped or not.
    uniform_task_groups: int = 0

    def batch(self, microbatches: list[Microbatch], policy_version: int) -> RLBatch:
        """The ``RLBatch`` of these statistics over ``microbatches``, trained from
        ``policy_version``."""
        return RLBatch(
            microbatches,
            self.num_rollouts,
            self.rewards,
            self.advantages,
            self.group_weights,
            self.skipped,
            self.uniform_task_groups,
            policy_version,
        )


def uniform_task_reward(summaries: Sequence[common_pb2.RolloutSummary]) -> bool:
    """Every rollout of the group earned the same task reward (all solved or all failed)."""
    return len({summary.reward.task for summary in summaries}) <= 1


def left_out(
    summaries: Sequence[common_pb2.RolloutSummary], *, skip_uniform_task_groups: bool
) -> str | None:
    """Why a group is not trained whatever its records hold (its skip reason), or None."""
    if len(summaries) < 2:
        return "group_single_sample"
    if skip_uniform_task_groups and uniform_task_reward(summaries):
        return "group_uniform_task_reward"
    return None


def collect_rl_items(
    groups: Sequence[PulledGroup], *, skip_uniform_task_groups: bool = False
) -> RLItems:
    """Dr. GRPO advantages per group, computed before any packing; the trainable segments.

    Packing may later put a group's rollouts on different ranks: each carries its
    advantage, so the loss never needs the rest of its group.
    """
    skipped: Counter[str] = Counter()
    items: list[TrainItem] = []
    rewards: list[common_pb2.RewardParts] = []
    advantages: list[float] = []
    weights: list[float] = []
    num_rollouts = uniform = 0
    for group in groups:
        reason = left_out(group.summaries, skip_uniform_task_groups=skip_uniform_task_groups)
        if reason == "group_single_sample":
            skipped[reason] += 1
            continue
        failed = [r.reason for r in group.rollouts if isinstance(r, RolloutError)]
        if failed:  # handed back (``returned_slots``): it comes again or is dropped
            skipped["group_returned"] += 1
            skipped.update(f"rollout_{why}" for why in failed)
            continue
        if uniform_task_reward(group.summaries):
            uniform += 1
        if reason is not None:
            skipped[reason] += 1
            rewards.extend(summary.reward for summary in group.summaries)
            continue
        group_advantages = dr_grpo_advantages([s.reward.total for s in group.summaries])
        for summary, rollout, advantage in zip(
            group.summaries, group.rollouts, group_advantages, strict=True
        ):
            rewards.append(summary.reward)
            assert isinstance(rollout, Rollout)
            num_rollouts += 1
            advantages.append(advantage)
            weights.append(group.weight)
            items.extend((segment, advantage, group.weight) for segment in rollout.segments)
    return RLItems(items, num_rollouts, rewards, advantages, weights, skipped, uniform)


def build_rl_batch(
    groups: Sequence[PulledGroup],
    *,
    microbatch_tokens: int,
    num_layers: int,
    top_k: int,
    skip_uniform_task_groups: bool = False,
    share_prefixes: bool = False,
    policy_version: int = 0,
) -> RLBatch:
    """Advantages per group, then the trainable segments packed in order into microbatches
    (a group's rollouts side by side, so that with ``share_prefixes`` they share their
    prompt; ``microbatch_tokens`` counts every sequence whole), trained from
    ``policy_version``."""
    collected = collect_rl_items(groups, skip_uniform_task_groups=skip_uniform_task_groups)
    microbatches = [
        pack_microbatch(items, num_layers, top_k, share_prefixes=share_prefixes)
        for items in split_in_order(collected.items, microbatch_tokens)
    ]
    return collected.batch(microbatches, policy_version)


def split_in_order(items: Sequence[TrainItem], token_budget: int) -> list[list[TrainItem]]:
    """``items`` cut in order into runs of at most ``token_budget`` tokens (a sequence is
    never split: one longer than the budget is a run of its own)."""
    runs: list[list[TrainItem]] = []
    current: list[TrainItem] = []
    size = 0
    for item in items:
        length = len(item[0].input_ids)
        if current and size + length > token_budget:
            runs.append(current)
            current, size = [], 0
        current.append(item)
        size += length
    if current:
        runs.append(current)
    return runs
