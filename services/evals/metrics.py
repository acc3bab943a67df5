"""Prometheus metrics of the evals service.

The per-suite gauges hold the newest evaluated version's figures (an on-demand eval of
an older version does not move them back); ``etude_evals_version{suite}`` says which
version that is.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.evals.record import EvalRecord
from services.reward_parts import reward_parts

VERSION = Gauge("etude_evals_version", "Newest policy version scored on the suite.", ["suite"])
PASS_AT_1 = Gauge("etude_evals_pass_at_1", "pass@1 of the newest scored version.", ["suite"])
PASS_AT_1_INTERVAL = Gauge(
    "etude_evals_pass_at_1_interval",
    "95 % interval of pass@1 (bootstrap over tasks), newest scored version.",
    ["suite", "bound"],
)
PASS_AT_K = Gauge(
    "etude_evals_pass_at_k", "Unbiased pass@k of the newest scored version.", ["suite", "k"]
)
BEST_OF_K = Gauge(
    "etude_evals_best_of_k", "Mean best-of-K grader score, newest scored version.", ["suite"]
)
MEAN_REWARD = Gauge(
    "etude_evals_mean_reward", "Mean reward by part, newest scored version.", ["suite", "part"]
)
MEAN_TOKENS = Gauge("etude_evals_mean_tokens", "Generated tokens per rollout.", ["suite"])
MEAN_TURNS = Gauge("etude_evals_mean_turns", "Turns per rollout.", ["suite"])
MEAN_TOOL_CALLS = Gauge("etude_evals_mean_tool_calls", "Tool calls per rollout.", ["suite"])
MEAN_SUMMARIES = Gauge("etude_evals_mean_summaries", "Self-summaries per rollout.", ["suite"])
FAILURES = Gauge(
    "etude_evals_failures",
    "Incorrect samples of the newest scored version, by reason.",
    ["suite", "reason"],
)
DROPPED_TASKS = Gauge(
    "etude_evals_dropped_tasks", "Tasks left unscored (group dropped), newest version.", ["suite"]
)
RETRIED = Gauge(
    "etude_evals_retried",
    "Generations asked for again (another version sampled them), newest version.",
    ["suite"],
)
LEFT_OUT = Gauge(
    "etude_evals_left_out",
    "Generations left out (not the version's alone after retries), newest version.",
    ["suite"],
)
RUNS = Counter("etude_evals_runs_total", "Evals finished, by outcome.", ["suite", "state"])
BASE_SCORES_REUSED = Counter(
    "etude_evals_base_scores_reused_total",
    "Evals of version 0 answered by the score kept from another run of the same base model.",
    ["suite"],
)
RUNNING = Gauge("etude_evals_running", "Evals in progress in this process.")
DURATION = Histogram(
    "etude_evals_duration_seconds",
    "Submission to scored, per eval.",
    ["suite"],
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200),
)


# suite -> (version shown, failure reasons shown)
_shown: dict[str, tuple[int, set[str]]] = {}


def export(record: EvalRecord) -> None:
    """Sets the suite's gauges from `record` unless a newer version is already shown."""
    suite = record.suite
    version, old_reasons = _shown.get(suite, (-1, set()))
    if version > record.policy_version:
        return
    _shown[suite] = (record.policy_version, set(record.failure_reasons))
    VERSION.labels(suite).set(record.policy_version)
    PASS_AT_1.labels(suite).set(record.pass_at_1)
    interval = record.pass_at_1_interval
    if interval is not None:
        PASS_AT_1_INTERVAL.labels(suite, "low").set(interval.low)
        PASS_AT_1_INTERVAL.labels(suite, "high").set(interval.high)
    for k, value in record.pass_at_k.items():
        PASS_AT_K.labels(suite, str(k)).set(value)
    BEST_OF_K.labels(suite).set(record.best_of_k)
    for part, value in reward_parts(record.mean_reward).items():
        MEAN_REWARD.labels(suite, part).set(value)
    MEAN_TOKENS.labels(suite).set(record.mean_tokens)
    MEAN_TURNS.labels(suite).set(record.mean_turns)
    MEAN_TOOL_CALLS.labels(suite).set(record.mean_tool_calls)
    MEAN_SUMMARIES.labels(suite).set(record.mean_summaries)
    for reason in old_reasons - set(record.failure_reasons):
        FAILURES.labels(suite, reason).set(0)
    for reason, count in record.failure_reasons.items():
        FAILURES.labels(suite, reason).set(count)
    DROPPED_TASKS.labels(suite).set(len(record.dropped_tasks))
    RETRIED.labels(suite).set(record.num_retried)
    LEFT_OUT.labels(suite).set(record.num_left_out)
