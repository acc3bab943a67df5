"""Metrics of an eval from its ready groups: pass@1, unbiased pass@k, best-of-K, rewards,
lengths and failure reasons.

pass@k is the unbiased estimator of the Codex paper (Chen et al., 2021): with n samples
of which c are correct, ``1 - C(n - c, k) / C(n, k)``, computed as a running product so
it stays exact for large n. It is defined for k <= n; a k above the K of some task is
left out of the suite's figures rather than guessed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from statistics import fmean

from services.api.v1 import common_pb2, reconciler_pb2
from services.evals.intervals import mean_interval
from services.evals.record import EvalRecord, GeneratedBy, RewardMeans, TaskScore, eval_id

TESTS_FAILED = "tests_failed"


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement is correct."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(
            f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={num_samples} c={num_correct} k={k}"
        )
    if num_samples - num_correct < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    missing = 1.0
    for i in range(num_samples - num_correct + 1, num_samples + 1):
        missing *= 1.0 - k / i
    return 1.0 - missing


def failure_reason(rollout: common_pb2.RolloutSummary) -> str:
    """Why an incorrect sample failed: the grader's reason, a harness error, or its tests."""
    if rollout.grade.failure_reason:
        return rollout.grade.failure_reason
    if rollout.finish_reason.startswith("error:"):
        return rollout.finish_reason
    return TESTS_FAILED


def _mean(values: Sequence[float]) -> float:
    return fmean(values) if values else 0.0


def score(
    *,
    run: str,
    suite: str,
    family: str,
    version: int,
    num_samples: int,
    ks: Sequence[int],
    groups: Sequence[reconciler_pb2.Group],
    dropped_tasks: Sequence[str],
    is_correct: Callable[[common_pb2.RolloutSummary], bool],
    started_at: float,
    finished_at: float,
    num_retried: int = 0,
    left_out_by: Mapping[str, int] | None = None,
    left_out_tasks: Sequence[str] = (),
) -> EvalRecord:
    """The record of an eval whose ready groups are `groups` (one per task, in order).

    The groups hold only the samples the version generated alone (``services.evals.
    versions``); `num_retried`, `left_out_by` and `left_out_tasks` say what that took.
    """
    rollouts = [r for g in groups for r in g.rollouts]
    sizes = [len(g.rollouts) for g in groups]
    usable_ks = [k for k in ks if sizes and k <= min(sizes)]
    tasks = []
    for group in groups:
        samples = list(group.rollouts)
        correct = sum(map(is_correct, samples))
        tasks.append(
            TaskScore(
                task_id=group.task.task_id,
                group_id=group.group_id,
                num_samples=len(samples),
                num_correct=correct,
                pass_at_k={k: pass_at_k(len(samples), correct, k) for k in usable_ks},
                best_score=max((r.grade.score for r in samples), default=0.0),
                mean_reward=_mean([r.reward.total for r in samples]),
                mean_tokens=_mean([r.stats.num_generated_tokens for r in samples]),
            )
        )
    parts = Counter[str]()
    for rollout in rollouts:
        parts.update(dict(rollout.reward.behaviour_parts))
    # A rollout that generated no token was sampled by no version.
    versions = [
        v
        for r in rollouts
        if r.stats.num_generated_tokens
        for v in (r.min_policy_version, r.max_policy_version)
    ]
    pass_rates = [t.num_correct / t.num_samples for t in tasks if t.num_samples]
    left_out = dict(left_out_by or {})
    return EvalRecord(
        run=run,
        suite=suite,
        family=family,
        eval_id=eval_id(suite, version),
        policy_version=version,
        generated_by=GeneratedBy(
            min_version=min(versions, default=version), max_version=max(versions, default=version)
        ),
        num_tasks=len(tasks),
        num_samples=num_samples,
        num_rollouts=len(rollouts),
        pass_at_1=_mean(pass_rates),
        pass_at_1_interval=mean_interval(pass_rates) if pass_rates else None,
        pass_at_k={k: _mean([t.pass_at_k[k] for t in tasks]) for k in usable_ks},
        best_of_k=_mean([t.best_score for t in tasks]),
        mean_reward=RewardMeans(
            task=_mean([r.reward.task for r in rollouts]),
            length_penalty=_mean([r.reward.length_penalty for r in rollouts]),
            behaviour=_mean([r.reward.behaviour for r in rollouts]),
            behaviour_parts={name: total / len(rollouts) for name, total in parts.items()},
            total=_mean([r.reward.total for r in rollouts]),
        ),
        mean_tokens=_mean([r.stats.num_generated_tokens for r in rollouts]),
        mean_turns=_mean([r.stats.num_turns for r in rollouts]),
        mean_tool_calls=_mean([r.stats.num_tool_calls for r in rollouts]),
        mean_summaries=_mean([r.stats.num_summaries for r in rollouts]),
        failure_reasons=dict(Counter(failure_reason(r) for r in rollouts if not is_correct(r))),
        finish_reasons=dict(Counter(r.finish_reason for r in rollouts)),
        dropped_tasks=list(dropped_tasks),
        num_retried=num_retried,
        num_left_out=sum(left_out.values()),
        left_out_by=left_out,
        left_out_tasks=list(left_out_tasks),
        tasks=tasks,
        started_at=started_at,
        finished_at=finished_at,
    )
