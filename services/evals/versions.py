"""Which generations a version's score may use: those its weights sampled alone.

Inference serves whatever version it has loaded, and keeps following new ones while an
eval runs (async RL). An eval of version v is submitted once v is published, with
``min_policy_version = v``, yet a rollout of it can still be sampled

* by an older version, or across the update to v: the replica had not loaded v yet.
  Asked again, it is sampled by v. These are **retried**: re-requested as a new group of
  the task (one slot per such sample) under a key of its own, up to
  ``evals.version_retries`` rounds;
* by a newer version, or across an update past v: inference has moved on, and no replica
  serves v again (there is no pinned request). Asking again would be sampled by the newer
  version too, so these are not retried.

What is still not v's alone after the retries is **left out** of the score and counted.
Such a sample is never relabelled as the newer version's: an eval is one (suite,
version) under a fixed key, and the score labelled v uses only tokens v generated.

A rollout that generated no token (the harness failed before the first call) was sampled
by no version; it is scored, as it always was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from services.api.v1 import common_pb2


def sampled_by_only(rollout: common_pb2.RolloutSummary, version: int) -> bool:
    """Every generated token of the rollout was sampled by `version`."""
    if rollout.stats.num_generated_tokens == 0:
        return True
    return rollout.min_policy_version == rollout.max_policy_version == version


def retryable(rollout: common_pb2.RolloutSummary, version: int) -> bool:
    """Another sample could be `version`'s alone: this one was sampled (partly) before
    inference loaded `version`, and never by a newer one."""
    return not sampled_by_only(rollout, version) and rollout.max_policy_version <= version


def label(rollout: common_pb2.RolloutSummary) -> str:
    """The versions that sampled the rollout: "v3", or "v3-v4" across an update."""
    low, high = rollout.min_policy_version, rollout.max_policy_version
    return f"v{low}" if low == high else f"v{low}-v{high}"


def retry_key(key: str, round_: int) -> str:
    """The idempotency key of retry round `round_` (1, 2, ...) of the group keyed `key`."""
    return f"{key}:retry{round_}"


DROPPED = "dropped"


class TaskSamples:
    """One task's samples over its first group and its retry groups."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.kept: list[common_pb2.RolloutSummary] = []
        self.num_retried = 0
        # Left-out samples by the versions that sampled them (DROPPED: none came back).
        self.left_out = Counter[str]()
        self._waiting: list[common_pb2.RolloutSummary] = []  # retryable, not yet retried

    def add(self, rollouts: Iterable[common_pb2.RolloutSummary]) -> None:
        """Sorts a group's rollouts: kept, waiting for a retry, or left out."""
        for rollout in rollouts:
            if sampled_by_only(rollout, self.version):
                self.kept.append(rollout)
            elif retryable(rollout, self.version):
                self._waiting.append(rollout)
            else:
                self.left_out[label(rollout)] += 1

    def take_retries(self) -> int:
        """How many samples to ask for again this round (the retry group's K)."""
        count = len(self._waiting)
        self._waiting = []
        self.num_retried += count
        return count

    def retried(self, rollouts: Iterable[common_pb2.RolloutSummary], asked: int) -> None:
        """A retry group of `asked` samples came back with `rollouts` (fewer if some died)."""
        rollouts = list(rollouts)
        self.add(rollouts)
        if asked > len(rollouts):
            self.left_out[DROPPED] += asked - len(rollouts)

    def finish(self) -> None:
        """No retries left: the samples still waiting for one are left out."""
        for rollout in self._waiting:
            self.left_out[label(rollout)] += 1
        self._waiting = []

    @property
    def num_left_out(self) -> int:
        """Samples not sampled by the version alone after every retry."""
        return sum(self.left_out.values())
