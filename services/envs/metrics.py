"""Prometheus metrics of the rollout workers (training and eval rollouts alike).

Rewards are signed (the penalties are negative), which a Prometheus sum cannot carry (a
falling ``_sum`` reads as a counter reset), so each part is exported as its mean over the
process's last ``RECENT_ROLLOUTS`` graded rollouts. Labels take values from closed sets
only: a tool name the model made up is counted as ``unknown``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

from services.api.v1 import common_pb2
from services.envs.faults import InfraKind
from services.envs.tools import Tools
from services.reward_parts import reward_parts

ROLLOUTS = Counter(
    "etude_envs_rollouts",
    "Rollout attempts ended, by outcome (completed, failed, lease_lost, refused).",
    ["outcome"],
)
# Every outcome present from the start, so that rate() sees the first rollout of each too.
for _outcome in ("completed", "failed", "lease_lost", "refused"):
    ROLLOUTS.labels(_outcome)
IN_PROGRESS = Gauge("etude_envs_rollouts_in_progress", "Rollouts running in this process.")
DURATION = Histogram(
    "etude_envs_rollout_seconds",
    "From a claimed slot to its rollout record stored, per rollout.",
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600),
)
RECENT_ROLLOUTS = 100
REWARD_MEAN = Gauge(
    "etude_envs_reward_mean",
    f"Mean reward by part over the last {RECENT_ROLLOUTS} rollouts this process graded "
    "(total, task, length_penalty, behaviour, behaviour:<name>; a part a rollout lacks is 0).",
    ["part"],
)
FINISH_REASONS = Counter(
    "etude_envs_finish_reasons", "Why each rollout's agent loop ended.", ["reason"]
)
GRADING_FAILURES = Counter(
    "etude_envs_grading_failures",
    "Final gradings that did not run to the end, by reason (timeout, syntax_error, crash, ...).",
    ["reason"],
)
# The reasons services/envs/grading.py gives, present from the start so that increase()
# sees the first one too (and a dashboard shows 0, not "no data").
GRADING_FAILURE_REASONS = (
    "timeout",
    "syntax_error",
    "import_error",
    "crash",
    "no_result",
    "forged_result",
    "no_tests",
)
for _reason in GRADING_FAILURE_REASONS:
    GRADING_FAILURES.labels(_reason)
INFRA_FAULTS = Counter(
    "etude_envs_infra_faults",
    "Rollout attempts the infrastructure ended, by kind (sandbox_start, killed_outside, "
    "host_overloaded, inference, object_store, worker): each failed its slot as retryable "
    "and was never trained on; counted once per attempt.",
    ["kind"],
)
for _kind in InfraKind:
    INFRA_FAULTS.labels(_kind.value)
GRADING_TIMEOUTS = Counter(
    "etude_envs_grading_timeouts",
    "Gradings that ran out of wall time, by verdict: code_loop (it used its CPU: no re-run), "
    "host_overloaded (the sandbox was not even set up: retried), or rerun_<verdict> of the "
    "one re-run judged by CPU time (ran: the host had starved it; code_loop; code_stalled: "
    "it slept or blocked; host_overloaded, killed_outside, sandbox_start: retried).",
    ["verdict"],
)
ERRORS = Counter(
    "etude_envs_rollout_errors", "Rollout attempts that raised, by exception type.", ["error"]
)
# The types services.envs.faults.infra_kind tells apart; any other is a new series.
for _error in ("InfraFault", "AioRpcError", "ObjectStoreError"):
    ERRORS.labels(_error)
TOOL_CALLS = Counter("etude_envs_tool_calls", "Tool calls the agent made, by tool.", ["tool"])
TOKENS = Counter(
    "etude_envs_rollout_tokens",
    "Tokens of graded rollouts, by kind (generated, thinking, tool_call, tool_output, "
    "final_message).",
    ["kind"],
)


_recent_rewards: deque[dict[str, float]] = deque(maxlen=RECENT_ROLLOUTS)
_reward_parts: set[str] = set()


def observe(summary: common_pb2.RolloutSummary, tool_calls: Sequence[str]) -> None:
    """Counts one rollout that ran to its grade (before its completion is reported)."""
    DURATION.observe(summary.stats.wall_s)
    parts = reward_parts(summary.reward)
    _recent_rewards.append(parts)
    _reward_parts.update(parts)
    for part in _reward_parts:
        total = sum(rollout.get(part, 0.0) for rollout in _recent_rewards)
        REWARD_MEAN.labels(part).set(total / len(_recent_rewards))
    FINISH_REASONS.labels(summary.finish_reason or "unknown").inc()
    if summary.grade.failure_reason:
        GRADING_FAILURES.labels(summary.grade.failure_reason).inc()
    for name in tool_calls:
        if name == "<malformed>":
            TOOL_CALLS.labels("malformed").inc()
        else:
            TOOL_CALLS.labels(name if name in Tools.names else "unknown").inc()
    stats = summary.stats
    for kind, count in (
        ("generated", stats.num_generated_tokens),
        ("thinking", stats.num_thinking_tokens),
        ("tool_call", stats.num_tool_call_tokens),
        ("tool_output", stats.num_tool_output_tokens),
        ("final_message", stats.num_final_message_tokens),
    ):
        TOKENS.labels(kind).inc(count)
