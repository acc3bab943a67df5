"""Prometheus metrics of the trainer, and the per-step record the job keeps.

Every scalar of a step (loss parts, KL, importance-ratio statistics, entropy,
advantages, replay replacement rate, train/inference logprob mismatch, tokens/s, the
wait/compute/publish split, reward parts) is exported as
``etude_trainer_step_metric{name=...}`` and returned in ``GetStatus.metrics``;
skipped groups and rollouts are counted by reason. How far off-policy the trained tokens
were (``services.trainer.offpolicy``) is also exported by version lag, on a bounded label
set (``LAG_BUCKETS`` and "unknown").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram

from services.api.v1 import common_pb2

if TYPE_CHECKING:
    # torch comes with it: the service imports this module without a job (and torch).
    from services.trainer.batch import RLBatch

STEP = Gauge("etude_trainer_step", "Optimizer steps completed by the running job.")
POLICY_VERSION = Gauge("etude_trainer_policy_version", "Policy version of the trainer's weights.")
PUBLISHED_VERSION = Gauge(
    "etude_trainer_published_version", "Newest policy version whose manifest was written."
)
STEP_METRIC = Gauge("etude_trainer_step_metric", "Scalar metrics of the last step.", ["name"])
SKIPPED = Counter(
    "etude_trainer_skipped_total", "Groups and rollouts left out of training.", ["reason"]
)
# The group reasons services/trainer/batch.py gives, present from the start (a rollout's
# own, rollout_<reason>, are the envs workers' free text).
for _reason in ("group_single_sample", "group_uniform_task_reward", "group_returned"):
    SKIPPED.labels(_reason)
TRAINED_TOKENS = Counter(
    "etude_trainer_trained_tokens_total",
    "Trained tokens by version lag (trainer version - generating version; 3+ is every lag "
    "of 3 or more; unknown: no version span covers the token, or names a version newer "
    "than the trainer's).",
    ["lag"],
)
IMPORTANCE_RATIO_BY_LAG = Gauge(
    "etude_trainer_importance_ratio_by_lag",
    "Mean importance ratio pi_train / pi_behaviour (before truncation) of the last step's "
    "trained tokens, by version lag (NaN: the step had no token of that lag).",
    ["lag"],
)
STEP_SECONDS = Histogram(
    "etude_trainer_step_seconds",
    "Time per step by part (wait for data, compute, publish, checkpoint).",
    ["part"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800),
)


LAG_BUCKETS = ("0", "1", "2", "3+")
"""Version-lag buckets of trained tokens: the last holds every lag of 3 or more, so the
metric names and Prometheus labels stay a fixed, small set."""


def reward_metrics(rewards: Sequence[common_pb2.RewardParts]) -> dict[str, float]:
    """Mean of each reward part over the step's rollouts (behaviour parts by name)."""
    if not rewards:
        return {}
    count = len(rewards)
    metrics = {
        "reward_total_mean": sum(r.total for r in rewards) / count,
        "reward_task_mean": sum(r.task for r in rewards) / count,
        "reward_length_penalty_mean": sum(r.length_penalty for r in rewards) / count,
        "reward_behaviour_mean": sum(r.behaviour for r in rewards) / count,
    }
    names = sorted({name for r in rewards for name in r.behaviour_parts})
    for name in names:
        metrics[f"reward_behaviour_{name}_mean"] = (
            sum(r.behaviour_parts.get(name, 0.0) for r in rewards) / count
        )
    return metrics


def advantage_metrics(advantages: Sequence[float]) -> dict[str, float]:
    """Mean, standard deviation and mean magnitude of the trained rollouts' advantages."""
    if not advantages:
        return {"advantage_mean": 0.0, "advantage_std": 0.0, "advantage_abs_mean": 0.0}
    count = len(advantages)
    mean = sum(advantages) / count
    variance = sum((a - mean) ** 2 for a in advantages) / count
    return {
        "advantage_mean": mean,
        "advantage_std": variance**0.5,
        "advantage_abs_mean": sum(abs(a) for a in advantages) / count,
    }


def batch_metrics(batch: RLBatch, num_stale_dropped: int) -> dict[str, float]:
    """What an RL batch held: rewards by part, advantages, skips (also counted), weights."""
    for reason, count in batch.skipped.items():
        SKIPPED.labels(reason).inc(count)
    weights = batch.group_weights
    return {
        **reward_metrics(batch.rewards),
        **advantage_metrics(batch.advantages),
        **{f"skipped_{reason}": float(count) for reason, count in batch.skipped.items()},
        "groups_stale_dropped": float(num_stale_dropped),
        "groups_uniform_task_reward": float(batch.uniform_task_groups),
        "group_weight_mean": sum(weights) / len(weights) if weights else 0.0,
        "rollouts": float(batch.num_rollouts),
    }


def export(step: int, metrics: Mapping[str, float]) -> None:
    """Sets the Prometheus gauges from one step's metrics."""
    STEP.set(step)
    for name, value in metrics.items():
        STEP_METRIC.labels(name).set(value)


def export_lags(metrics: Mapping[str, float]) -> None:
    """Counts an RL step's trained tokens by version lag and sets its mean importance ratio
    by lag (``services.trainer.offpolicy.lag_metrics`` names them)."""
    for bucket in LAG_BUCKETS:
        num_tokens = metrics[f"tokens_lag{bucket}"]
        TRAINED_TOKENS.labels(bucket).inc(num_tokens)
        ratio = metrics[f"is_ratio_mean_lag{bucket}"] if num_tokens else math.nan
        IMPORTANCE_RATIO_BY_LAG.labels(bucket).set(ratio)
    TRAINED_TOKENS.labels("unknown").inc(metrics["tokens_lag_unknown"])


def append_record(path: Path, record: Mapping[str, Any]) -> None:
    """Appends one JSON line (the step's metrics and what it trained) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()
