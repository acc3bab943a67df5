"""A rollout's reward by part, as metrics label it.

The envs service makes rewards (services/envs/rewards.py) and the evals service
averages them; both export the same parts under the same labels, from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class HasRewardParts(Protocol):
    """A reward by part: a rollout's ``RewardParts`` or a mean over rollouts."""

    @property
    def total(self) -> float: ...
    @property
    def task(self) -> float: ...
    @property
    def length_penalty(self) -> float: ...
    @property
    def behaviour(self) -> float: ...
    @property
    def behaviour_parts(self) -> Mapping[str, float]: ...


def reward_parts(reward: HasRewardParts) -> dict[str, float]:
    """A reward by part, as metrics label it: total, task, length_penalty, behaviour and
    ``behaviour:<name>`` for each behaviour penalty."""
    return {
        "total": reward.total,
        "task": reward.task,
        "length_penalty": reward.length_penalty,
        "behaviour": reward.behaviour,
        **{f"behaviour:{name}": value for name, value in reward.behaviour_parts.items()},
    }
